"""One prepared run that checks and times the CUDA path, for a short session on a fresh GPU machine:

    pip install ".[gpu,serve]" && python -m pixeltriage.bench.gpu_check --out DIR

(0) the compile report (`bench compile`, pixeltriage.bench.compile) for the device's own target (sm_80 for an A100,
    sm_90 for an H100/H200; on the CPU the target of --device-spec) at the timing preset and the device's dtype,
    first: a kernel that does not compile, or needs more shared memory than a block may have, fails here before
    any GPU time is spent on it; the configs the forward ran by default (--compile-configs all: every autotune
    config, minutes). Its static registers and shared memory are put beside the profiler's for each kernel (d);
(a) parity: the CUDA forward against the CPU float32 forward on the demo checkpoints (2b, bench-small, tiny): one
    realistic state each (10 memories; 4 at 2b, whose float32 CPU reference is the slow side), scores within
    PARITY_TOLERANCE (its reasons beside it);
(b) latency at the timing preset (2b) with 10 memories (~2.3k tokens): p50/p90 per question of 1, 4 and 16 questions
    packed into one score_states call, eager and with the decoder replayed from a CUDA graph (single questions: the
    engine replays only those), with the vision tower run and with its features cached (CUDA events, warm-up
    excluded);
(c) the service: `pixeltriage serve` started as a subprocess on loopback (ServerProcess, as `bench serve` does),
    driven by 8 client threads for a bounded time: questions/s and latency;
(d) the roofline (pixeltriage.bench.models.roofline) at the device's published peaks: measured against predicted for
    every timed case (and MFU), and stage by stage for one eager question from the engine's stage timers; the CUDA
    kernels one forward launches (profiler) against the roofline's estimate, and each Triton kernel's registers,
    shared memory and warps as the profiler saw them beside the compile report's static figures for the configs of
    that kernel with those warps (which config its autotuner picked on this GPU);
(e) the kernel each op runs (pixeltriage.kernels.registry.choices).

Everything goes to DIR/gpu_check.json and a short table to DIR/gpu_check.md (DIR defaults to $OUT). A time budget
(--budget-s, default 300 s) keeps the whole run well within 6 minutes: a part that would not fit in what is left is
skipped with the reason recorded (and listed in both files), never silently. Order: the compile report, the timed
preset's parity, the timings, the roofline comparison, the service, then the other presets' parity (what a short budget drops first).
Runs on the CPU too (`--device cpu --parity-presets tiny --timing-preset tiny --device-spec h100`, float32 timings),
which is how its logic is tested in CI; only a run on a GPU gives GPU figures.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from pixeltriage.bench import workloads
from pixeltriage.bench.models import roofline as rl
from pixeltriage.bench.models.flops import scorer_flops, state_shape, total
from pixeltriage.bench.timing import percentiles, timed_within
from pixeltriage.config import default_dtype

# Scores of the device's forward against the CPU float32 forward, max abs difference:
# - bfloat16 2e-2: the CPU bf16 path's bar against float32 (tests/engine/test_parity.py; the bf16 CUDA branch's gap to
#   float64 is held to transformers' own bf16 gap in tests/engine/test_cuda_branch.py);
# - float32 at tiny 1e-5: what the tests hold the CUDA branch to (tests/engine/test_cuda_branch.py, same size class);
# - float32 at bench-small and 2b 1e-4: 8 and 24 layers at ~2.3k tokens, where float32 rounding in another summation
#   order (cuBLAS, SDPA's CUDA kernels, the torch chunked rule's chunk products on the GPU) adds up over up to 12x the
#   tests' layers and 36x their tokens; no GPU run has measured it yet, and the measured difference is reported
#   beside the bar, so a first run shows how far inside it is.
PARITY_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
PARITY_TOLERANCE_BY_PRESET = {"tiny": {"float32": 1e-5, "bfloat16": 2e-2}}
# A replayed decoder against the eager one, both bf16 (the timing dtype), same kernels: the graph runs the state padded
# to its bucket, so fla's chunks and the attention's tiles see another length and round bf16 partial sums
# differently; 1e-3, 20x inside the bf16 parity bar (on the CPU, float32, the padded path differs by <= 1e-5: the
# test's bar).
GRAPH_TOLERANCE = 1e-3
PARITY_MEMORIES = {"2b": 4}                   # others: 10
# seconds a part is expected to need on a fresh GPU machine (checkpoint written, kernels compiled); a part starts only
# when at least this much of the budget is left
NEEDS_S = {"compile": 120, "parity/tiny": 10, "parity/bench-small": 30, "parity/2b": 75, "timing": 45, "serve": 45}
COMPILE_TARGETS = {"a100": "sm_80", "h100": "sm_90", "h200": "sm_90"}     # the roofline's device specs
SERVE_CLIENTS = 8
SERVE_MODULES = ("fastapi", "uvicorn", "httpx")     # the serve extra, which the gpu extra does not bring


def max_diff(a, b) -> float:
    """The largest absolute difference between two `Scores` of the same memories (p_vis, gains, relevance and the
    none share); ValueError where their memory counts differ."""
    pairs = [(a.p_vis, b.p_vis), (a.relevance_none, b.relevance_none), *zip(a.gains, b.gains, strict=True),
             *zip(a.relevance, b.relevance, strict=True)]
    return max(abs(x - y) for x, y in pairs)


class Budget:
    """Seconds left of the run's budget; `skip(needs)` is the recorded reason a part does not start, or None."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def skip(self, needs: float) -> str | None:
        left = self.left()
        if needs <= 0 or left >= needs:
            return None
        return f"time budget: {max(0.0, left):.0f} s of {self.seconds:.0f} s left, this part needs ~{needs:.0f} s"


class Scorers:
    """Loaded scorers by (preset, device, dtype), so that parity and timing share a load."""

    def __init__(self):
        self.loaded: dict[tuple, object] = {}

    def get(self, preset: str, device: torch.device, dtype: str):
        from pixeltriage.engine.scorer import Scorer
        from pixeltriage.weights.demo import demo_checkpoint

        key = (preset, str(device), dtype)
        if key not in self.loaded:
            self.loaded[key] = Scorer.load(demo_checkpoint(preset), device=device, dtype=dtype)
        return self.loaded[key]

    def drop(self, preset: str, device: torch.device, dtype: str) -> None:
        self.loaded.pop((preset, str(device), dtype), None)


# ---- (0) the compile report ----------------------------------------------------------------------------------------

def compile_target(device: torch.device, spec_key: str | None) -> str | None:
    """The compile report's target for this run: the GPU's own (sm_80, sm_90), or on the CPU the --device-spec's."""
    if device.type == "cuda":
        return {(8, 0): "sm_80", (9, 0): "sm_90"}.get(tuple(torch.cuda.get_device_capability(device)))
    return COMPILE_TARGETS.get(spec_key)


def compile_check(target: str | None, preset: str, dtype: str, configs: str, progress) -> dict:
    """`bench compile` for one target at the timing preset and dtype: its headline, failures, accepted spills and each
    compiled kernel config's static figures (for the profiler's, `static_vs_profiled`)."""
    from pixeltriage.bench.compile import compile_report

    if target is None:
        return {"skipped": "no compile target for this device (bench compile knows sm_80 and sm_90)"}
    report = compile_report([target], preset, dtype, configs, progress=progress)
    r = report["results"][0]
    keep = ("kernel", "config", "configs", "ran", "num_warps", "num_stages", "registers", "spill_stores",
            "spill_loads", "stack_frame", "shared", "occupancy", "limited_by", "error")
    return {"target": target, "preset": preset, "dtype": dtype, "configs": configs, "versions": report["versions"],
            "ok": report["ok"], "headline": r["headline"], "failures": r["failures"],
            "allowed_spills": r["allowed_spills"], "compiled": [{k: e.get(k) for k in keep} for e in r["compiled"]]}


def kernel_resources(trace: dict) -> dict:
    """kernel name -> the distinct (registers per thread, shared memory per block, warps per block) its launches had,
    and its launch count, from a torch profiler chrome trace (Kineto's kernel events carry them in `args`)."""
    out: dict = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel":
            continue
        args = event.get("args", {})
        block = args.get("block") or [0]
        threads = 1
        for b in block:
            threads *= int(b)
        row = out.setdefault(event["name"], {"launches": 0, "configs": []})
        row["launches"] += 1
        config = [args.get("registers per thread"), args.get("shared memory"), threads // 32]
        if config not in row["configs"]:
            row["configs"].append(config)
    return out


def static_vs_profiled(compiled: list[dict], profiled: dict) -> list[dict]:
    """Per Triton kernel the profiler saw: each (registers, shared memory, warps) it measured beside the compile
    report's configs of that kernel with those warps, and which of them it matches (the config the autotuner
    picked, where it had several)."""
    rows = []
    for name in sorted({e["kernel"] for e in compiled}):
        if name not in profiled:
            rows.append({"kernel": name, "profiled": None, "note": "not in the profiled forward"})
            continue
        for registers, shared, warps in profiled[name]["configs"]:
            same_warps = [e for e in compiled if e["kernel"] == name and e["num_warps"] == warps and not e["error"]]
            rows.append({"kernel": name, "profiled": {"registers": registers, "shared": shared, "warps": warps},
                         "static": [{"config": e["config"], "stages": e["num_stages"], "registers": e["registers"],
                                     "shared": e["shared"]} for e in same_warps],
                         "matches": [e["config"] for e in same_warps
                                     if e["registers"] == registers and e["shared"] == shared]})
    return rows


# ---- (a) parity ----------------------------------------------------------------------------------------------------

def parity_preset(preset: str, device: torch.device, scorers: Scorers, memories: int, tokens: int, progress) -> dict:
    """One state of `memories` memories and ~`tokens` tokens (PARITY_MEMORIES and as many tokens per memory where it
    names the preset) scored on the CPU in float32 and on `device` in bfloat16 and float32."""
    progress(f"parity {preset}: CPU float32 reference")
    reference = scorers.get(preset, torch.device("cpu"), "float32")
    if preset in PARITY_MEMORIES:
        tokens, memories = tokens * PARITY_MEMORIES[preset] // max(1, memories), PARITY_MEMORIES[preset]
    state = workloads.packed_episode(reference.packer, memories, tokens).state   # scored by all
    expected = reference.score_states([state])[0]
    scorers.drop(preset, torch.device("cpu"), "float32")
    out = {"memories": memories, "tokens": state.num_tokens}
    for name, tol in PARITY_TOLERANCE_BY_PRESET.get(preset, PARITY_TOLERANCE).items():
        progress(f"parity {preset} {name} on {device}")
        got = scorers.get(preset, device, name).score_states([state])[0]
        if name == "float32":
            scorers.drop(preset, device, name)                  # only the bf16 one is timed
        diff = max_diff(got, expected)
        out[name] = {"max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol}
    return out


# ---- (b) latency ---------------------------------------------------------------------------------------------------

def _measure(fn: Callable, questions: int, iters: int, seconds: float, device: torch.device) -> dict:
    times = timed_within(fn, iters, seconds, warmup=2 if device.type == "cuda" else 1, device=device)
    p = percentiles(times)
    return {"questions": questions, "iters": len(times), "p50_ms": p["p50"] * 1e3, "p90_ms": p["p90"] * 1e3,
            "p50_ms_per_question": p["p50"] * 1e3 / questions, "p90_ms_per_question": p["p90"] * 1e3 / questions,
            "questions_per_s": questions / p["p50"]}


def time_cases(preset: str, device: torch.device, scorers: Scorers, memories: int, tokens: int, batches: list[int],
           iters: int, budget: Budget, progress) -> dict:
    """Every (mode, vision, batch) case; cases that no longer fit the budget are recorded as skipped."""
    from pixeltriage.store.cache import Cache

    dtype = default_dtype(device)
    progress(f"timing {preset} {dtype} on {device}: loading")
    scorer = scorers.get(preset, device, dtype)
    episode = workloads.packed_episode(scorer.packer, memories, tokens)
    question, memories, state = episode.question, episode.memories, episode.state
    bucket = -(-state.num_tokens // 256) * 256                      # one graph bucket: the state rounded up
    out: dict = {"preset": preset, "dtype": dtype, "tokens": state.num_tokens, "memories": state.num_memories,
                 "graph_bucket": bucket, "cases": {}}
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        cached = scorer.with_cache(stack.enter_context(Cache(Path(tmp) / "cache.db")))   # same weights, no reload
        states = {"vision": [scorer.packer.pack(f"{question} ({i})", memories, images=episode.images)
                             for i in range(max(batches))],
                  "cached_vision": [cached.pack(f"{question} ({i})", memories) for i in range(max(batches))]}
        cached.score_states(states["cached_vision"][:1])           # stores the vision features
        runners = {"vision": scorer, "cached_vision": cached}
        for mode in ("eager", "cuda_graphs"):
            if mode == "cuda_graphs":
                graphs = enable_graphs(scorer, cached, state, bucket, progress)
                out["graphs"] = graphs
                if not graphs["ok"]:
                    out["cases"].update({f"cuda_graphs/{vision}/{b}": {"skipped": "the graph check failed (timing "
                                                                                  "graphs)"}
                                         for vision in runners for b in batches})
                    break
            for vision, runner in runners.items():
                for b in batches:
                    case = f"{mode}/{vision}/{b}"
                    if mode == "cuda_graphs" and b > 1:
                        out["cases"][case] = {"not_applicable": "CUDA graphs replay single-question forwards only "
                                                                "(engine/graphs.py); batches run eagerly"}
                        continue
                    seconds = min(8.0, budget.left() - 5)
                    if seconds < 1.0:
                        out["cases"][case] = {"skipped": budget.skip(6.0) or "time budget"}
                        continue
                    progress(f"timing {case}")
                    batch = states[vision][:b]
                    out["cases"][case] = _measure(lambda: runner.score_states(batch), b, max(3, iters // b), seconds,
                                                  device)
        out["cached_vision_counts"] = dict(cached.vision_counts)
        scorer.disable_cuda_graphs()
        cached.graphs = None
    return out


def enable_graphs(scorer, cached, state, bucket: int, progress) -> dict:
    """Capture the decoder for one bucket (on the CPU: the same padded static path, eagerly) and check a replay
    against the eager scores of the same state. A failure is reported, not fatal; the scorers are left eager."""
    try:
        eager = scorer.score_states([state])[0]
        progress(f"capturing the decoder (bucket {bucket} tokens)")
        t0 = time.perf_counter()
        scorer.enable_cuda_graphs(buckets=(bucket,))
        capture_s = time.perf_counter() - t0
        cached.graphs = scorer.graphs                  # the same weights and decoder: one capture serves both
        diff = max_diff(scorer.score_states([state])[0], eager)
        return {"ok": diff <= GRAPH_TOLERANCE, "captured": scorer.graphs.capture, "bucket": bucket,
                "capture_s": capture_s, "max_abs_diff_vs_eager": diff, "tolerance": GRAPH_TOLERANCE,
                "replays": scorer.graphs.replays}
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the rest of the check still runs
        progress(f"CUDA graphs failed: {type(e).__name__}: {e}")
        scorer.disable_cuda_graphs()
        cached.graphs = None
        return {"ok": False, "error": traceback.format_exc()}


# ---- (c) the service -----------------------------------------------------------------------------------------------

def service_throughput(preset: str, device: torch.device, memories: int, seconds: float, budget: Budget,
                       progress) -> dict:
    """`pixeltriage serve` in a subprocess, SERVE_CLIENTS closed-loop clients for `seconds` after a warm-up, each
    question with `memories` memories (JPEG photos of varied sizes, as `bench serve` sends)."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"the serve extra is not installed ({', '.join(missing)} missing): pip install "
                           "'.[gpu,serve]'"}
    import httpx

    from pixeltriage.serve.process import ServerProcess
    from pixeltriage.weights.demo import demo_checkpoint

    dtype = default_dtype(device)
    eps = workloads.episodes(SERVE_CLIENTS, memories, jpeg=True)
    bodies = [workloads.request_body(q, m, "") for q, m in eps]
    progress(f"serve {preset} on {device}: starting the server")
    t0 = time.perf_counter()
    argv = ["--checkpoint", str(demo_checkpoint(preset)), "--device", device.type, "--dtype", dtype]
    if device.type == "cpu":                   # the dry run: a smaller batch budget, so a shorter warm-up forward
        argv += ["--max-batch-tokens", "1024"]
    server = ServerProcess(argv)
    try:
        server.wait_ready(timeout=max(5.0, budget.left() - seconds - 10))
        ready_s = time.perf_counter() - t0
        http = httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=SERVE_CLIENTS))
        latencies, statuses, wrong_id, lock = [], {}, 0, threading.Lock()

        def send(i: int, request_id: str) -> tuple[int, float, bool]:
            body = bodies[i].replace(b'"id": ""', f'"id": "{request_id}"'.encode(), 1)
            start = time.perf_counter()
            response = http.post("/v1/score", content=body, headers={"content-type": "application/json"})
            elapsed = time.perf_counter() - start
            ok = response.status_code == 200 and response.json().get("id") == request_id
            return response.status_code, elapsed, ok

        for i in range(SERVE_CLIENTS):                               # warm-up, untimed
            send(i, f"warm-{i}")
        stop_at = time.perf_counter() + seconds

        def client(c: int) -> None:
            nonlocal wrong_id
            n = 0
            while time.perf_counter() < stop_at:
                status, elapsed, ok = send(c, f"{c}-{n}")
                with lock:
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                    if status == 200:
                        latencies.append(elapsed)
                        wrong_id += not ok
                n += 1

        progress(f"serve: {SERVE_CLIENTS} clients for {seconds:g} s")
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(SERVE_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        http.close()
        lat = percentiles(latencies)
        return {"preset": preset, "dtype": dtype, "clients": SERVE_CLIENTS, "memories": memories, "seconds": wall,
                "ready_s": ready_s, "statuses": statuses, "wrong_id": wrong_id,
                "questions_per_s": len(latencies) / wall, "p50_ms": lat["p50"] * 1e3, "p90_ms": lat["p90"] * 1e3}
    finally:
        server.stop()


# ---- (d) the roofline ----------------------------------------------------------------------------------------------

def roofline_comparison(scorer, state, spec_key: str, spec_matches: bool, timing_result: dict, device: torch.device,
                        progress) -> dict:
    """Every timed case against its prediction; one eager question's stages against the roofline's stages; the
    CUDA kernels of one forward against the estimate."""
    from pixeltriage.engine import profiling

    spec = rl.device_spec(spec_key)
    model, head_dim = scorer.model_config, scorer.triage_config.head_dim
    shape = state_shape(state, model.vision.merge_unit)
    out = {"spec": spec_key, "spec_matches_device": spec_matches, "peak_tflops": spec.bf16_tflops,
           "hbm_tb_s": spec.hbm_tb_s, "cases": {}}
    flop = {False: total(scorer_flops(scorer, state)).total, True: total(scorer_flops(scorer, state, True)).total}
    for case, measured in timing_result.get("cases", {}).items():
        if "p50_ms" not in measured:
            continue
        mode, vision, b = case.split("/")
        cached = vision == "cached_vision"
        predicted = rl.predict(model, shape, spec, head_dim, int(b), cached, mode == "cuda_graphs",
                               max_batch_tokens=scorer.max_batch_tokens, bucket=timing_result["graph_bucket"])
        ratio = rl.ratio(measured["p50_ms"], predicted["ms"])
        achieved = flop[cached] * int(b) / (measured["p50_ms"] / 1e3) / 1e12
        out["cases"][case] = {"measured_ms": measured["p50_ms"], "predicted_ms": predicted["ms"],
                              "predicted_ms_per_question": predicted["ms_per_question"],
                              "predicted_roofline_ms": predicted["roofline_ms"], "measured_over_predicted": ratio,
                              "within_2x": ratio is not None and ratio <= 2.0, "tflops": achieved,
                              "mfu": achieved / spec.bf16_tflops}
    progress("stage timers: one eager question")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        with profiling.record(sync=sync) as stages:
            scorer.score_states([state])
        if sync:
            sync()
        runs.append((time.perf_counter() - t0, dict(stages)))
    predicted = rl.forward_stages(model, shape, spec, head_dim)
    by_profiler = {}
    for name, p in predicted.items():
        by_profiler.setdefault(p["stage"], 0.0)
        by_profiler[p["stage"]] += p["roofline_ms"]
    whole_s, stages = sorted(runs, key=lambda run: run[0])[len(runs) // 2]      # the median run: parts add up
    # the stages timed inside others (exclusive of them) back into the ones the roofline predicts
    for inner, outer in (("delta_conv", "gated_delta"), ("delta_rule", "gated_delta"), ("vision_attention", "vision")):
        stages[outer] = stages.get(outer, 0.0) + stages.pop(inner, 0.0)
    whole = whole_s * 1e3
    rows = {}
    for stage in sorted(stages):
        measured_ms = stages[stage] * 1e3
        pred = by_profiler.get(stage)
        rows[stage] = {"measured_ms": measured_ms, "predicted_ms": pred,
                       "measured_over_predicted": rl.ratio(measured_ms, pred)}
    rows["unattributed"] = {"measured_ms": whole - sum(r["measured_ms"] for r in rows.values()),
                            "predicted_ms": sum(v for k, v in by_profiler.items() if k not in rows),
                            "measured_over_predicted": None, "note": "embedding, copies and host work outside the "
                            "stage timers (predicted: the roofline's embed and host_to_device)"}
    rows["whole_forward"] = {"measured_ms": whole, "predicted_ms": sum(by_profiler.values()),
                             "measured_over_predicted": rl.ratio(whole, sum(by_profiler.values())),
                             "note": "timed with a device synchronize around every stage"}
    out["stages"] = rows
    out["kernels"] = count_kernels(scorer, state, device) | {"estimated": rl.kernel_count(model)}
    return out


def count_kernels(scorer, state, device: torch.device) -> dict:
    """CUDA kernels one eager forward launches, from the profiler (a GPU only)."""
    if device.type != "cuda":
        return {"measured": None, "reason": "CUDA kernels are counted on a GPU only"}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    repeats = 2
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                scorer.score_states([state])
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
            resources = kernel_resources(json.loads((Path(tmp) / "trace.json").read_text()))
    except Exception as e:  # noqa: BLE001 - the count is a side figure: its failure is reported, the rest kept
        return {"measured": None, "reason": f"profiler failed: {type(e).__name__}: {e}"}
    return {"measured": len(kernels) / repeats, "resources": resources}


# ---- (e) kernels ---------------------------------------------------------------------------------------------------

def kernel_choices(device: torch.device) -> dict:
    from pixeltriage.kernels import registry

    out = {"source": "pixeltriage.kernels.registry.choices",
           "bfloat16": registry.choices(device, torch.bfloat16), "float32": registry.choices(device, torch.float32)}
    if device.type == "cpu":
        from pixeltriage.kernels import native

        out["native"] = native.status()
    return out


# ---- the run -------------------------------------------------------------------------------------------------------

def run_part(result: dict, name: str, needs: float, budget: Budget, fn: Callable[[], dict], progress) -> None:
    """result[name] = fn(), or {"skipped": reason} when the budget cannot hold `needs` s, or {"error": traceback}."""
    reason = budget.skip(needs)
    if reason:
        progress(f"skipping {name}: {reason}")
        result[name] = {"skipped": reason}
        return
    try:
        result[name] = fn()
    except Exception as e:  # noqa: BLE001 - a partial result is still written
        progress(f"{name} failed: {type(e).__name__}: {e}")
        result[name] = {"error": traceback.format_exc()}


def skipped_parts(result: dict, prefix: str = "") -> list[str]:
    """Every `skipped` reason anywhere in the result, as 'path: reason'."""
    found = []
    for key, value in result.items():
        if isinstance(value, dict):
            if "skipped" in value:
                found.append(f"{prefix}{key}: {value['skipped']}")
            found += skipped_parts(value, f"{prefix}{key}/")
    return found


def failures(result: dict) -> list[str]:
    out = [f"{k}: error" for k, v in result.items() if isinstance(v, dict) and "error" in v]
    out += [f"compile: {f}" for f in result.get("compile", {}).get("failures", [])]
    for preset, p in result.get("parity", {}).items():
        for dtype in ("bfloat16", "float32"):
            if dtype in p and not p[dtype]["ok"]:
                out.append(f"parity {preset} {dtype}: {p[dtype]['max_abs_diff']:.3g} > {p[dtype]['tolerance']:g}")
        if "error" in p:
            out.append(f"parity {preset}: error")
    graphs = result.get("timing", {}).get("graphs")
    if graphs is not None and not graphs["ok"]:
        out.append("CUDA graphs: " + ("error" if "error" in graphs else "replay differs from eager"))
    return out


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# gpu_check: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, fla {env['fla']}; budget {result['budget_s']:.0f} s, "
             f"wall {result['wall_s']:.1f} s", "", "## Parity (against the CPU float32 forward)", "",
             "| preset | memories | tokens | dtype | max abs diff | tolerance | ok |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for preset, p in result["parity"].items():
        if "skipped" in p or "error" in p:
            lines.append(f"| {preset} | | | | {'skipped' if 'skipped' in p else 'error'} | | no |")
            continue
        for dtype in ("bfloat16", "float32"):
            d = p[dtype]
            lines.append(f"| {preset} | {p['memories']} | {p['tokens']} | {dtype} | {d['max_abs_diff']:.3g} | "
                         f"{d['tolerance']:g} | {'yes' if d['ok'] else 'NO'} |")
    c = result["compile"]
    lines += ["", "## Compile report", ""]
    if "headline" in c:
        h = c["headline"]
        lines.append(f"{c['target']}, {c['preset']} {c['dtype']}, configs {c['configs']}: {h['kernels']} kernels, "
                     f"{h['configs']} compiled configs ({h['errors']} errors), max registers {h['max_registers'][0]} "
                     f"({h['max_registers'][1]}), max shared memory {h['max_shared'][0]} of {h['smem_limit']} bytes "
                     f"({h['max_shared'][1]}), {h['spilling_configs']} spilling configs; ok {c['ok']}")
        for row in c.get("vs_profiler", []):
            if row.get("profiled"):
                p = row["profiled"]
                lines.append(f"- {row['kernel']}: profiled {p['registers']} registers, {p['shared']} B shared, "
                             f"{p['warps']} warps; static configs with those warps "
                             f"{[(e['registers'], e['shared']) for e in row['static']]}; matches {row['matches']}")
    else:
        lines.append(c.get("skipped") or c.get("note") or "error (see gpu_check.json)")
    t, cmp_ = result["timing"], result["roofline"]
    lines += ["", f"## Latency ({t.get('preset', '?')}, {t.get('memories', '?')} memories, {t.get('tokens', '?')} "
                  f"tokens, {t.get('dtype', '?')})", "",
              "| case (mode/vision/questions) | p50 ms/question | p90 ms/question | questions/s | predicted "
              "ms/question | measured/predicted | MFU |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for case, c in t.get("cases", {}).items():
        if "p50_ms" not in c:
            lines.append(f"| {case} | {c.get('skipped') or c.get('not_applicable')} | | | | | |")
            continue
        r = cmp_.get("cases", {}).get(case, {})
        lines.append(f"| {case} | {c['p50_ms_per_question']:.2f} | {c['p90_ms_per_question']:.2f} | "
                     f"{c['questions_per_s']:.1f} | {_fmt(r.get('predicted_ms_per_question'))} | "
                     f"{_fmt(r.get('measured_over_predicted'))} | {_fmt(r.get('mfu'), '.1%')} |")
    if "graphs" in t:
        g = t["graphs"]
        lines += ["", f"CUDA graphs: captured {g.get('captured')}, bucket {g.get('bucket')}, replay vs eager "
                      f"{_fmt(g.get('max_abs_diff_vs_eager'), '.2g')} (tolerance {GRAPH_TOLERANCE:g}), ok {g['ok']}"]
    if "stages" in cmp_:
        lines += ["", f"## Stages of one eager question against the roofline ({cmp_['spec']}; spec matches the "
                      f"device: {cmp_['spec_matches_device']})", "",
                  "| stage | measured ms | predicted ms | measured/predicted |", "| --- | --- | --- | --- |"]
        for stage, s in cmp_["stages"].items():
            lines.append(f"| {stage} | {s['measured_ms']:.3f} | {_fmt(s['predicted_ms'], '.3f')} | "
                         f"{_fmt(s['measured_over_predicted'])} |")
        k = cmp_["kernels"]
        lines += ["", f"Kernels per forward: measured {_fmt(k.get('measured'), '.0f')} "
                      f"({k.get('reason', 'profiler')}), estimated {k['estimated']}"]
    s = result["serve"]
    lines += ["", "## Service", ""]
    if "questions_per_s" in s:
        lines.append(f"{s['clients']} clients, {s['memories']} memories, {s['seconds']:.1f} s: "
                     f"{s['questions_per_s']:.2f} questions/s, p50 {s['p50_ms']:.1f} ms, p90 {s['p90_ms']:.1f} ms, "
                     f"statuses {s['statuses']}, wrong ids {s['wrong_id']} (server ready in {s['ready_s']:.1f} s)")
    else:
        lines.append(s.get("skipped") or "error (see gpu_check.json)")
    lines += ["", "## Kernels", ""]
    for dtype, names in result["kernels"].items():
        if isinstance(names, dict):
            lines.append(f"- {dtype}: " + ", ".join(f"{op} = {name}" for op, name in names.items()))
        else:
            lines.append(f"- {dtype}: {names}")
    lines += ["", "## Skipped", ""] + ([f"- {s}" for s in result["skipped"]] or ["- nothing"])
    lines += ["", "## Failures", ""] + ([f"- {f}" for f in result["failures"]] or ["- none"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pixeltriage.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json and gpu_check.md "
                                                                 "(default: $OUT)")
    p.add_argument("--parity-presets", default="tiny,bench-small,2b")
    p.add_argument("--timing-preset", default="2b")
    p.add_argument("--memories", type=int, default=10, help="memories per question (default 10)")
    p.add_argument("--tokens", type=int, default=2300, help="state length at --memories memories (default 2300)")
    p.add_argument("--batches", default="1,4,16", help="questions packed per timed call (default 1,4,16)")
    p.add_argument("--iters", type=int, default=30, help="timed calls of one question; B questions: iters / B")
    p.add_argument("--serve-seconds", type=float, default=15.0, help="the service's timed load (default 15 s)")
    p.add_argument("--device-spec", default="auto", choices=["auto", *rl.DEVICE_SPECS],
                   help="the roofline's peaks (default: from the GPU's name)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting parts past this (default 300 s)")
    p.add_argument("--compile-configs", default="ran", choices=["ran", "all"],
                   help="the compile report's configs: those the forward ran (default) or every autotune config")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    if not args.out:
        p.error("--out DIR is needed (or $OUT)")
    from pixeltriage.engine.cpu_memory import tune_malloc

    tune_malloc()                      # as the command line does
    budget = Budget(args.budget_s)
    t0 = time.perf_counter()

    def progress(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec_key = rl.spec_key_for_gpu(gpu_name) if args.device_spec == "auto" else args.device_spec
    env = {"device": gpu_name, "torch": torch.__version__, "spec": spec_key,
           "spec_matches_device": spec_key is not None and rl.spec_key_for_gpu(gpu_name) == spec_key}
    for key, dist in (("triton", "triton"), ("fla", "flash-linear-attention")):
        try:                        # the installed version, without importing it (fla's import alone takes seconds)
            env[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[key] = "not installed"
    result: dict = {"environment": env, "budget_s": args.budget_s}
    run_part(result, "kernels", 0, budget, lambda: kernel_choices(device), progress)
    # the compiler's verdict on the device's own target before any GPU time is spent on the forward
    target = compile_target(device, spec_key)
    run_part(result, "compile", NEEDS_S["compile"], budget,
             lambda: compile_check(target, args.timing_preset, "bfloat16", args.compile_configs, progress), progress)
    scorers = Scorers()
    result["parity"] = {}

    def parity(presets: list[str]) -> None:
        for preset in presets:
            run_part(result["parity"], preset, NEEDS_S.get(f"parity/{preset}", 30), budget,
                     lambda: parity_preset(preset, device, scorers, args.memories, args.tokens, progress), progress)

    # the timed shape's parity first, the other presets' after the service: what a short budget drops first
    presets = [x for x in args.parity_presets.split(",") if x]
    parity([x for x in presets if x == args.timing_preset])
    batches = sorted({int(b) for b in args.batches.split(",") if b})
    run_part(result, "timing", NEEDS_S["timing"], budget,
             lambda: time_cases(args.timing_preset, device, scorers, args.memories, args.tokens, batches, args.iters,
                            budget, progress), progress)

    def compare() -> dict:
        if spec_key is None:
            return {"skipped": f"no published peaks for {gpu_name!r} in the roofline's table "
                               f"({sorted(rl.DEVICE_SPECS)}); pass --device-spec"}
        if "cases" not in result["timing"]:
            return {"skipped": "no timing to compare"}
        scorer = scorers.get(args.timing_preset, device, default_dtype(device))
        state = workloads.packed_episode(scorer.packer, args.memories, args.tokens).state
        return roofline_comparison(scorer, state, spec_key, env["spec_matches_device"],
                                   result["timing"], device, progress)

    run_part(result, "roofline", 5, budget, compare, progress)
    resources = result["roofline"].get("kernels", {}).get("resources")
    if "compiled" in result["compile"]:
        result["compile"]["vs_profiler"] = (static_vs_profiled(result["compile"]["compiled"], resources)
                                            if resources else [])
        if not resources:
            result["compile"]["note"] = "no profiler figures to put beside the static ones (a GPU gives them)"
    scorers.loaded.clear()                                   # the server loads its own copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run_part(result, "serve", NEEDS_S["serve"] + args.serve_seconds, budget,
             lambda: service_throughput(args.timing_preset, device, args.memories, args.serve_seconds, budget,
                                        progress), progress)
    parity([x for x in presets if x != args.timing_preset])
    result["wall_s"] = time.perf_counter() - t0
    result["skipped"] = skipped_parts({k: v for k, v in result.items() if k != "environment"})
    result["failures"] = failures(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    for line in result["skipped"]:
        progress(f"INCOMPLETE: {line}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
