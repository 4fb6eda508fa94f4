"""`pixeltriage bench compile`: the CUDA forward's Triton kernels compiled for sm_80 and sm_90 without a GPU.

The tiny report (one target, the configs the forward ran) runs here; the 2b report, every config each autotuner would
time on both targets, is marked slow (minutes). The checks and the occupancy model are tested on figures made here.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pixeltriage.bench import compile as report_module
from pixeltriage.bench.compile import LIMITS, headline, occupancy, problems

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

FLA_GATED_DELTA = {"chunk_gated_delta_rule_fwd_kkt_solve_kernel", "recompute_w_u_fwd_kernel",
                   "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o",
                   "chunk_local_cumsum_scalar_kernel", "l2norm_fwd_kernel"}
HEAD = "decision_head_kernel"


def test_occupancy_follows_registers_shared_memory_and_warps():
    # 128 registers x 32 threads = 4096 per warp: 16 warps of 64 fit the register file, 4 blocks of 4 warps
    assert occupancy("sm_90", 128, 0, 4) == {"blocks_per_sm": 4, "warps_per_sm": 16, "occupancy": 0.25,
                                             "limited_by": "registers"}
    # 32 registers: 64 warps by registers, 16 blocks of 4 by the warp limit
    assert occupancy("sm_90", 32, 0, 4)["occupancy"] == 1.0
    # 100 KiB of shared memory: 2 blocks on sm_90 (228 KiB per SM), 1 on sm_80 (164 KiB)
    big = 100 * 1024
    assert occupancy("sm_90", 32, big, 4)["blocks_per_sm"] == 2
    assert occupancy("sm_80", 32, big, 4) == {"blocks_per_sm": 1, "warps_per_sm": 4, "occupancy": 0.0625,
                                              "limited_by": "shared memory"}
    # registers round up to the 256-per-warp allocation unit: 129 registers cost as many as 136
    assert occupancy("sm_80", 129, 0, 1) == occupancy("sm_80", 136, 0, 1)
    # one-warp blocks: at most 32 resident blocks
    assert occupancy("sm_80", 16, 0, 1) == {"blocks_per_sm": 32, "warps_per_sm": 32, "occupancy": 0.5,
                                            "limited_by": "blocks"}


def entry(**overrides):
    e = {"kernel": "k", "config": 0, "configs": 3, "ran": False, "options": {"num_warps": 4, "num_stages": 2},
         "error": None, "registers": 96, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0, "shared": 1024,
         "occupancy": 0.5}
    return {**e, **overrides}


def test_the_checks_fail_on_errors_shared_memory_and_spills(monkeypatch):
    limit = LIMITS["sm_80"]["smem_per_block"]
    compiled = [entry(), entry(kernel="broken", error="CompilationError: at 1:2: bad dot shape"),
                entry(kernel="fat", shared=limit + 1), entry(kernel="fat", shared=limit),
                entry(kernel="spilling", spill_stores=8, spill_loads=8),
                entry(kernel="spilling_ran", ran=True, spill_loads=4)]
    failures, allowed = problems({"target": "sm_80", "compiled": compiled})
    assert allowed == [] and len(failures) == 4
    assert "broken config 1/3 (warps 4, stages 2): does not compile: CompilationError" in failures[0]
    assert f"{limit + 1} bytes of shared memory, over the {limit}" in failures[1]
    assert "spills 8 bytes stored, 8 loaded (a config its autotuner could pick)" in failures[2]
    assert "(the config the forward ran)" in failures[3]

    monkeypatch.setitem(report_module.ALLOWED_SPILLS, ("spilling", "sm_80", 4), (16, "the reason it may"))
    failures, allowed = problems({"target": "sm_80", "compiled": compiled})
    assert len(failures) == 3 and len(allowed) == 1 and allowed[0].endswith("allowed: the reason it may")
    # an accepted spill that grows past its bytes fails again
    monkeypatch.setitem(report_module.ALLOWED_SPILLS, ("spilling", "sm_80", 4), (15, "the reason it may"))
    assert any("over the 15 bytes accepted" in f for f in problems({"target": "sm_80", "compiled": compiled})[0])
    # the allowance names its target and warps: the same kernel spilling on sm_90 still fails
    assert any(f.startswith("sm_90 spilling config") for f in problems({"target": "sm_90", "compiled": compiled})[0])
    h = headline({"target": "sm_80", "compiled": compiled})
    assert h["errors"] == 1 and h["max_shared"] == [limit + 1, "fat"] and h["spilling_configs"] == 2


def test_recording_without_running_records_what_a_run_launches(tiny_checkpoint):
    """The report records the forward's launches without running them (outputs stay as allocated); that records the
    same launches, specializations and grids as running them, since the CUDA forward reads nothing back."""
    from triton.backends.compiler import GPUTarget

    from pixeltriage import Scorer
    from pixeltriage.bench import emulation

    if not emulation.interpreting():
        pytest.skip("Triton is not interpreting here (a GPU machine)")
    recorded = {}
    with emulation.cuda_emulation():
        scorer = Scorer.load(tiny_checkpoint, dtype=torch.bfloat16)
        state = scorer.pack("Is a picture needed?", [])
        for execute in (True, False):
            with emulation.record_launches(GPUTarget("cuda", 90, 32), execute=execute) as launches:
                hidden = scorer.last_hidden_packed([state], state.head_positions())
            recorded[execute] = [(l.name, l.specialization, l.options, l.grid, l.config, l.configs, l.ran)
                                 for l in launches]
            assert torch.isfinite(hidden).all() or not execute
    assert recorded[True] == recorded[False]
    names = {r[0] for r in recorded[True]}
    assert FLA_GATED_DELTA <= names and "causal_conv1d_fwd_kernel" in names
    # every autotuned kernel: each of its configs recorded once per launch, the first one run
    ran = [r for r in recorded[True] if r[6]]
    assert all(r[4] == 0 for r in ran)
    assert len(recorded[True]) == sum(r[5] for r in ran)


def run_cli(*args: str, timeout: float):
    return subprocess.run([sys.executable, "-m", "pixeltriage", "bench", "compile", *args, "--json"],
                          capture_output=True, text=True, timeout=timeout)


def check_report(report: dict, targets: list[str]) -> None:
    assert report["versions"]["triton"] == "3.9.0" and report["versions"]["flash-linear-attention"] == "0.6.0"
    assert [r["target"] for r in report["results"]] == targets
    for r in report["results"]:
        names = {e["kernel"] for e in r["compiled"]}
        assert FLA_GATED_DELTA | {HEAD, "causal_conv1d_fwd_kernel"} <= names, names
        assert r["kernels_by_op"]["gated_delta"] == "fla chunk_gated_delta_rule"
        assert r["fla_sees"]["device"] == "cuda" and r["fla_sees"]["hopper"] == (r["target"] == "sm_90")
        for e in r["compiled"]:
            assert e["error"] is None, e
            assert 0 < e["registers"] <= 255 and 0 < e["occupancy"] <= 1
            assert e["shared"] <= LIMITS[r["target"]]["smem_per_block"]
        assert r["headline"]["kernels"] == len(names)


def test_tiny_report_for_sm_80():
    """The tiny bf16 forward's kernels, the configs it ran, compiled for sm_80: fla's chunked gated delta rule, its
    conv and the head among them, every one compiled within the target's limits; the report passes."""
    done = run_cli("--target", "sm_80", "--preset", "tiny", "--configs", "ran", timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["configs"] == "ran"
    check_report(report, ["sm_80"])
    assert all(e["ran"] for e in report["results"][0]["compiled"])


@pytest.mark.slow
def test_2b_report_passes_on_both_targets():
    """`bench compile --target sm_80,sm_90 --preset 2b` (bf16, every autotune config) passes: the issue's bar."""
    done = run_cli("--target", "sm_80,sm_90", "--preset", "2b", timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["configs"] == "all"
    check_report(report, ["sm_80", "sm_90"])
    assert any(not e["ran"] for r in report["results"] for e in r["compiled"])
