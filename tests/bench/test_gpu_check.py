"""The GPU check script's logic, run on the CPU with tiny shapes (its GPU figures come only from a GPU run)."""
import json

import pytest
import torch
from cli_inputs import used_cache

from pixeltriage.bench import gpu_check

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

SECTIONS = ["environment", "budget_s", "kernels", "compile", "parity", "timing", "roofline", "serve", "wall_s", "skipped",
            "failures"]
MARKDOWN_SECTIONS = ["# gpu_check: cpu", "## Compile report", "## Parity", "## Latency", "## Stages", "Kernels per forward", "## Service",
                     "## Kernels", "## Skipped", "## Failures"]


def test_gpu_check_runs_end_to_end_on_the_cpu(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    # a cache of the test's own with the tiny checkpoint (demo_checkpoint("tiny"): not rewritten) and the run's built
    # C kernels: the processes the check starts, the compile report's and the server, build nothing
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(used_cache(tmp_path / "cache", tiny_checkpoint)))
    rc = gpu_check.main(["--device", "cpu", "--parity-presets", "tiny", "--timing-preset", "tiny", "--iters", "3",
                         "--memories", "2", "--tokens", "300", "--batches", "1,2", "--serve-seconds", "1",
                         "--device-spec", "h100", "--budget-s", "600", "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert not r["failures"], r["failures"]
    assert rc == 0
    assert list(r) == SECTIONS and r["skipped"] == []
    assert all(section in md for section in MARKDOWN_SECTIONS), md
    assert "## Latency (tiny, 2 memories, " in md and "tokens, float32)" in md
    assert r["environment"]["spec"] == "h100" and r["environment"]["spec_matches_device"] is False

    p = r["parity"]["tiny"]
    assert p["float32"]["max_abs_diff"] == 0.0 and p["float32"]["ok"]          # CPU against itself: identical
    assert p["bfloat16"]["ok"] and p["memories"] == 2

    t = r["timing"]
    assert set(t["cases"]) == {f"{mode}/{vision}/{b}" for mode in ("eager", "cuda_graphs")
                               for vision in ("vision", "cached_vision") for b in (1, 2)}
    for case, c in t["cases"].items():
        if case.startswith("cuda_graphs/") and case.endswith("/2"):
            assert "not_applicable" in c
        else:
            assert c["iters"] >= 2 and 0 < c["p50_ms"] <= c["p90_ms"] and c["questions_per_s"] > 0
    assert t["cached_vision_counts"]["cached"] >= 2
    g = t["graphs"]                                              # on the CPU: the padded static path, eagerly
    assert g["ok"] and not g["captured"] and g["max_abs_diff_vs_eager"] <= 1e-5 and g["replays"]["graph"] >= 1

    roof = r["roofline"]
    assert roof["spec"] == "h100" and roof["peak_tflops"] == 989.0
    assert set(roof["cases"]) == {case for case, c in t["cases"].items() if "p50_ms" in c}
    for case, c in roof["cases"].items():
        assert c["measured_ms"] == t["cases"][case]["p50_ms"]
        assert c["predicted_ms"] > c["predicted_roofline_ms"] > 0
        assert c["measured_over_predicted"] == c["measured_ms"] / c["predicted_ms"]
        assert c["predicted_ms_per_question"] == c["predicted_ms"] / int(case.split("/")[2])
        assert set(c) >= {"within_2x", "mfu", "tflops"}
    assert roof["cases"]["eager/cached_vision/1"]["predicted_ms"] < roof["cases"]["eager/vision/1"]["predicted_ms"]
    stages = roof["stages"]
    assert {"vision", "gated_delta", "attention", "mlp", "head", "unattributed", "whole_forward"} <= set(stages)
    for name in ("vision", "gated_delta", "attention", "mlp", "head"):
        assert stages[name]["measured_ms"] > 0 and stages[name]["predicted_ms"] > 0
    assert roof["kernels"]["measured"] is None and roof["kernels"]["estimated"]["decoder"] > 0

    s = r["serve"]
    assert s["clients"] == 8 and s["statuses"].get("200", 0) >= 1 and s["wrong_id"] == 0
    assert s["questions_per_s"] > 0

    k = r["kernels"]
    assert k["source"] == "pixeltriage.kernels.registry.choices" and k["bfloat16"] and "native" in k

    c = r["compile"]                          # the --device-spec's target (h100: sm_90), first, the configs that ran
    assert c["target"] == "sm_90" and c["preset"] == "tiny" and c["dtype"] == "bfloat16" and c["configs"] == "ran"
    assert c["ok"] and c["failures"] == [] and c["headline"]["errors"] == 0
    assert {"chunk_fwd_kernel_o", "decision_head_kernel"} <= {e["kernel"] for e in c["compiled"]}
    assert all(e["ran"] and e["registers"] > 0 for e in c["compiled"])
    assert c["vs_profiler"] == [] and "a GPU gives them" in c["note"]
    assert "sm_90, tiny bfloat16, configs ran:" in md
    capsys.readouterr()


def test_an_exhausted_budget_skips_every_part_with_its_reason(tmp_path, capsys):
    rc = gpu_check.main(["--device", "cpu", "--budget-s", "0", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert rc == 0 and list(r) == SECTIONS
    skipped = {line.split(":")[0] for line in r["skipped"]}
    assert skipped == {"compile", "parity/tiny", "parity/bench-small", "parity/2b", "timing", "roofline", "serve"}
    assert all("time budget" in line for line in r["skipped"])
    assert "## Skipped" in md and "parity/2b: time budget" in md
    err = capsys.readouterr().err
    assert "INCOMPLETE: serve: time budget" in err
    order = [line.split("skipping ")[1].split(":")[0] for line in err.splitlines() if "] skipping " in line]
    assert order == ["compile", "2b", "timing", "roofline", "serve", "tiny", "bench-small"]    # compile first


def test_no_cuda_is_a_clear_exit(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_failed_capture_is_reported_and_the_scorers_left_eager():
    from pixeltriage.engine.types import Scores

    class Scorer:
        graphs = None

        def score_states(self, states):
            return [Scores(p_vis=0.5, gains=[0.1], relevance=[0.2], relevance_none=0.3)]

        def enable_cuda_graphs(self, buckets):
            self.graphs = "half-made"
            raise RuntimeError("capture failed")

        def disable_cuda_graphs(self):
            self.graphs = None

    scorer, cached = Scorer(), Scorer()
    out = gpu_check.enable_graphs(scorer, cached, state=None, bucket=512, progress=lambda msg: None)
    assert out["ok"] is False and "RuntimeError: capture failed" in out["error"]
    assert scorer.graphs is None and cached.graphs is None


def test_failures_name_what_failed():
    result = {"parity": {"2b": {"bfloat16": {"ok": False, "max_abs_diff": 0.05, "tolerance": 0.02},
                                "float32": {"ok": True, "max_abs_diff": 0.0, "tolerance": 1e-4}},
                         "tiny": {"error": "Traceback ..."}},
              "timing": {"graphs": {"ok": False, "error": "Traceback ..."}}, "serve": {"error": "Traceback ..."},
              "roofline": {"skipped": "time budget: 0 s of 240 s left, this part needs ~5 s"}}
    assert gpu_check.failures(result) == ["serve: error", "parity 2b bfloat16: 0.05 > 0.02", "parity tiny: error",
                                          "CUDA graphs: error"]
    assert gpu_check.skipped_parts(result) == ["roofline: time budget: 0 s of 240 s left, this part needs ~5 s"]


def test_the_service_part_names_a_missing_serve_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    out = gpu_check.service_throughput("tiny", torch.device("cpu"), 1, 1.0, gpu_check.Budget(60),
                                       progress=lambda msg: None)
    assert out == {"skipped": "the serve extra is not installed (uvicorn missing): pip install '.[gpu,serve]'"}
    assert gpu_check.skipped_parts({"serve": out}) == [f"serve: {out['skipped']}"]


def test_parity_fails_a_device_forward_that_differs(tiny_checkpoint, tmp_path, monkeypatch):
    """On the CPU the device forward is the reference itself (identical scores), so the comparison is checked here
    with a device scorer whose gains are off by 1e-3: outside float32's 1e-5 at tiny, inside bfloat16's 2e-2."""
    import dataclasses

    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(used_cache(tmp_path / "cache", tiny_checkpoint)))

    class Shifted(gpu_check.Scorers):
        calls = 0

        def get(self, preset, device, dtype):
            scorer = super().get(preset, device, dtype)
            Shifted.calls += 1
            if Shifted.calls == 1:                       # the CPU float32 reference stays as it is
                return scorer
            real = scorer.score_states

            def shifted(states):
                return [dataclasses.replace(s, gains=[g + 1e-3 for g in s.gains]) for s in real(states)]

            monkeypatch.setattr(scorer, "score_states", shifted)
            return scorer

    out = gpu_check.parity_preset("tiny", torch.device("cpu"), Shifted(), 2, 300, lambda *_: None)
    assert out["float32"]["ok"] is False and abs(out["float32"]["max_abs_diff"] - 1e-3) < 1e-6
    assert out["bfloat16"]["ok"] is True


def test_the_parity_bars_are_the_tests_where_the_sizes_are():
    assert gpu_check.PARITY_TOLERANCE_BY_PRESET["tiny"]["float32"] == 1e-5        # tests/engine/test_cuda_branch.py
    assert gpu_check.PARITY_TOLERANCE["bfloat16"] == gpu_check.PARITY_TOLERANCE_BY_PRESET["tiny"]["bfloat16"] == 2e-2


def test_compile_targets_follow_the_device():
    assert gpu_check.compile_target(torch.device("cpu"), "a100") == "sm_80"
    assert gpu_check.compile_target(torch.device("cpu"), "h200") == "sm_90"
    assert gpu_check.compile_target(torch.device("cpu"), None) is None
    assert "no compile target" in gpu_check.compile_check(None, "tiny", "bfloat16", "ran", print)["skipped"]


def test_profiled_kernel_resources_beside_the_static_ones():
    """The profiler's kernel events (a chrome trace's `args`, as Kineto writes them) -> per kernel its registers,
    shared memory and warps, matched against the compile report's configs with those warps."""
    def kernel(name, registers, shared, block):
        return {"ph": "X", "cat": "kernel", "name": name, "args": {"registers per thread": registers,
                                                                    "shared memory": shared, "block": block}}

    trace = {"traceEvents": [kernel("chunk_fwd_kernel_o", 152, 65536, [256, 1, 1]),
                             kernel("chunk_fwd_kernel_o", 152, 65536, [256, 1, 1]),
                             kernel("decision_head_kernel", 113, 2048, [256, 1, 1]),
                             kernel("ampere_bf16_gemm", 200, 0, [128, 1, 1]),
                             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "args": {}}]}
    profiled = gpu_check.kernel_resources(trace)
    assert profiled["chunk_fwd_kernel_o"] == {"launches": 2, "configs": [[152, 65536, 8]]}
    assert set(profiled) == {"chunk_fwd_kernel_o", "decision_head_kernel", "ampere_bf16_gemm"}

    def entry(name, config, warps, registers, shared):
        return {"kernel": name, "config": config, "num_warps": warps, "num_stages": 3, "registers": registers,
                "shared": shared, "error": None}

    compiled = [entry("chunk_fwd_kernel_o", 0, 8, 145, 65536), entry("chunk_fwd_kernel_o", 1, 8, 152, 65536),
                entry("chunk_fwd_kernel_o", 2, 4, 138, 24576), entry("decision_head_kernel", 0, 8, 120, 2048),
                entry("l2norm_fwd_kernel", 0, 1, 20, 0)]
    rows = gpu_check.static_vs_profiled(compiled, profiled)
    by_kernel = {row["kernel"]: row for row in rows}
    assert by_kernel["chunk_fwd_kernel_o"]["matches"] == [1]                     # the config the autotuner picked
    assert [e["config"] for e in by_kernel["chunk_fwd_kernel_o"]["static"]] == [0, 1]
    assert by_kernel["decision_head_kernel"]["matches"] == []                    # 113 measured, 120 static: shown
    assert by_kernel["l2norm_fwd_kernel"]["profiled"] is None
