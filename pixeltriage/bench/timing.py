"""Timing shared by the benchmarks: wall or CUDA-event timings with warm-up, percentiles, the GEMM rate."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

CPU = torch.device("cpu")


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1, device: torch.device = CPU) -> list[float]:
    """Seconds of each of `repeats` calls after `warmup` untimed ones: CUDA events on a GPU (what the device
    spent), perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return times


def percentiles(xs: list[float]) -> dict[str, float]:
    """Nearest-rank p50 / p90 / p99 and the mean (NaN for no samples)."""
    xs = sorted(xs)

    def pct(p: float) -> float:
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]
    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": statistics.fmean(xs) if xs else float("nan")}


def gemm_tflops(device: torch.device = CPU, dtype: torch.dtype = torch.bfloat16) -> float:
    """The achieved TFLOP/s of a square matmul in `dtype` (8192 on a GPU, 2048 on the CPU), median."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    t = statistics.median(timed(lambda: a @ a, 10 if device.type == "cuda" else 5, warmup=2, device=device))
    return 2 * n ** 3 / t / 1e12
