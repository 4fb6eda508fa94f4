"""One script that checks and times the CUDA path, for a short session on a GPU machine:

    python -m pixeltriage.bench.gpu_check [--out DIR]

(a) correctness: the CUDA forward against the CPU float32 forward on the tiny and bench-small demo checkpoints,
    one realistic 10-memory state each: bfloat16 scores within 2e-2, float32 scores within 1e-4;
(b) speed on the 2b preset with 10 memories (~2.3k tokens): per-question p50/p99 at batch 1 with the vision tower
    run, with the decoder replayed from a CUDA graph (its scores against the eager ones, capture time), and with
    cached vision features, and questions/s at batch 32 (CUDA events, warm-up excluded);
(c) MFU: the analytic FLOPs of those forwards against a bf16 GEMM rate measured in the same run, and against the
    device's dense bf16 peak (A100 312, H100/H200 989 TFLOP/s).

Writes everything as JSON to DIR/gpu_check.json (DIR defaults to $OUT when set) and prints a summary. Runs on the
CPU too (`--device cpu --parity-presets tiny --timing-preset tiny`), which is how its logic is tested in CI;
only a run on a GPU gives GPU figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pixeltriage.bench.timing import device_peak_tflops, flop_rate, gemm_tflops, percentiles, timed

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
GRAPH_TOLERANCE = 1e-3     # a replayed decoder against the eager one: same dtype and kernels, padded length


def max_diff(a, b) -> float:
    pairs = [(a.p_vis, b.p_vis), (a.relevance_none, b.relevance_none), *zip(a.gains, b.gains),
             *zip(a.relevance, b.relevance)]
    return max(abs(x - y) for x, y in pairs)


def parity(presets, device: torch.device, progress) -> dict:
    from pixeltriage.bench.cpu import bench_episode
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.weights.demo import demo_checkpoint

    out = {}
    for preset in presets:
        path = demo_checkpoint(preset)
        reference = Scorer.load(path, dtype=torch.float32)
        state = bench_episode(reference.packer).state                  # one state, scored by every scorer
        expected = reference.score_states([state])[0]
        for name, tol in TOLERANCE.items():
            progress(f"parity {preset} {name} on {device}")
            got = Scorer.load(path, device=device, dtype=name).score_states([state])[0]
            diff = max_diff(got, expected)
            out[f"{preset}/{name}"] = {"max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol}
    return out


def timing(preset: str, device: torch.device, iters: int, batch: int, progress) -> dict:
    from pixeltriage.bench.cpu import bench_episode
    from pixeltriage.bench.flops import scorer_flops, total
    from pixeltriage.engine.cache import Cache
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.weights.demo import demo_checkpoint

    dtype = torch.bfloat16
    path = demo_checkpoint(preset)
    progress(f"timing {preset} on {device}: loading")
    scorer = Scorer.load(path, device=device, dtype=dtype)
    episode = bench_episode(scorer.packer)
    question, memories, state = episode.question, episode.memories, episode.state
    per_q = timed(lambda: scorer.score_states([state]), iters, warmup=3, device=device)
    end_to_end = timed(lambda: scorer.score(question, memories), max(3, iters // 3), warmup=3, device=device)
    graphs = graph_timing(scorer, state, iters, device, progress)

    with tempfile.TemporaryDirectory() as tmp, Cache(Path(tmp) / "cache.db") as cache:
        cached = scorer.with_cache(cache)                                   # the same weights, not a reload
        cstate = cached.pack(question, memories)
        cached.score_states([cstate])                                      # stores the vision features
        per_q_cached = timed(lambda: cached.score_states([cstate]), iters, warmup=3, device=device)
        cached_share = cached.vision_counts

    states = [scorer.packer.pack(f"{question} ({i})", memories, images=episode.images) for i in range(batch)]
    batch_times = timed(lambda: scorer.score_states(states), max(2, iters // 5), warmup=1, device=device)

    flops = total(scorer_flops(scorer, state)).total
    flops_cached = total(scorer_flops(scorer, state, cached_vision=True)).total
    progress("measuring the GEMM rate")
    # the CPU runs only check this script's logic: a small GEMM (a CPU without bf16 matmul units takes
    # minutes over the full-size one)
    gemm = gemm_tflops(device, dtype, n=None if device.type == "cuda" else 256)
    peak = device_peak_tflops(device)
    p50, p50c = statistics.median(per_q), statistics.median(per_q_cached)
    batch_s = statistics.median(batch_times)

    def rate(f, s):
        return flop_rate(f, s, gemm, peak)
    return {
        "preset": preset, "dtype": str(dtype).removeprefix("torch."), "tokens": state.num_tokens, "memories": state.num_memories,
        "batch_1": {"p50_ms": p50 * 1e3, "p99_ms": percentiles(per_q)["p99"] * 1e3, "iters": iters,
                    **rate(flops, p50)},
        "batch_1_end_to_end": {"p50_ms": statistics.median(end_to_end) * 1e3},
        # a replay runs the whole padded bucket; its rate counts the state's own FLOPs (useful work, not work done)
        "batch_1_cuda_graphs": graphs if "error" in graphs else {**graphs, **rate(flops, graphs["p50_ms"] / 1e3)},
        "batch_1_cached_vision": {"p50_ms": p50c * 1e3, "p99_ms": percentiles(per_q_cached)["p99"] * 1e3,
                                  "vision_counts": cached_share, **rate(flops_cached, p50c)},
        f"batch_{batch}": {"seconds": batch_s, "questions_per_s": batch / batch_s, **rate(flops * batch, batch_s)},
        "tflop_per_question": flops / 1e12, "tflop_per_question_cached": flops_cached / 1e12,
        "gemm_tflops": gemm, "peak_tflops": peak,
    }


def graph_timing(scorer, state, iters: int, device: torch.device, progress) -> dict:
    """Batch 1 with the decoder replayed from a CUDA graph (on the CPU: the same padded static path, eagerly),
    against the eager scores of the same state. A failure is reported, not fatal; the scorer is left eager."""
    import traceback

    bucket = -(-state.num_tokens // 256) * 256                      # one bucket, the state rounded up
    try:
        eager = scorer.score_states([state])[0]
        progress(f"capturing the decoder (bucket {bucket} tokens)")
        t0 = time.perf_counter()
        scorer.enable_cuda_graphs(buckets=(bucket,))
        capture_s = time.perf_counter() - t0
        diff = max_diff(scorer.score_states([state])[0], eager)
        times = timed(lambda: scorer.score_states([state]), iters, warmup=3, device=device)
        return {"p50_ms": statistics.median(times) * 1e3, "p99_ms": percentiles(times)["p99"] * 1e3,
                "bucket": bucket, "captured": scorer.graphs.capture, "capture_s": capture_s,
                "max_abs_diff_vs_eager": diff, "tolerance": GRAPH_TOLERANCE, "ok": diff <= GRAPH_TOLERANCE,
                "replays": scorer.graphs.replays}
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the rest of the check still runs
        progress(f"CUDA graphs failed: {type(e).__name__}: {e}")
        return {"error": traceback.format_exc(), "ok": False}
    finally:
        scorer.disable_cuda_graphs()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pixeltriage.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default: $OUT)")
    p.add_argument("--parity-presets", default="tiny,bench-small")
    p.add_argument("--timing-preset", default="2b")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args(argv)
    from pixeltriage.engine.cpu_memory import tune_malloc

    tune_malloc()                      # as the command line does
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2

    def progress(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__}
    for mod in ("triton", "fla"):
        try:
            result[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            result[mod] = f"unavailable ({type(e).__name__}: {e})"
    t0 = time.perf_counter()
    try:
        result["parity"] = parity([x for x in args.parity_presets.split(",") if x], device, progress)
        result["timing"] = timing(args.timing_preset, device, args.iters, args.batch, progress)
    except Exception as e:  # noqa: BLE001 - a partial result is still written
        import traceback

        result["error"] = traceback.format_exc()
        progress(f"failed: {type(e).__name__}: {e}")
    result["wall_s"] = time.perf_counter() - t0
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(text)
    print(text)
    ok = ("error" not in result and all(v["ok"] for v in result.get("parity", {}).values())
          and result.get("timing", {}).get("batch_1_cuda_graphs", {}).get("ok", True))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
