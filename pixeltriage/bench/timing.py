"""Timing shared by the benchmarks: wall or CUDA-event timings with warm-up, percentiles, the GEMM rate, the machine."""
from __future__ import annotations

import json
import os
import sys
import platform
import random
import statistics
import time
from typing import Callable

import torch

from pixeltriage.bench.models.roofline import DEVICE_SPECS, spec_key_for_gpu
from pixeltriage.kernels import native
from pixeltriage.kernels.linear import linear, plain_onednn

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


def timed_within(fn: Callable[[], object], repeats: int, seconds: float, warmup: int = 1,
                 device: torch.device = CPU, minimum: int = 2) -> list[float]:
    """`timed`, stopping early once `seconds` of wall clock have passed since the first timed call (and at least
    `minimum` calls are timed): a benchmark under a time budget."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < repeats and (len(times) < minimum or time.perf_counter() < deadline):
        times += timed(fn, 1, warmup=0, device=device)
    return times


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 as the sample at the rounded index p * (n - 1) of the sorted samples (no interpolation),
    and the mean (NaN for no samples)."""
    xs = sorted(xs)

    def pct(p: float) -> float:
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]
    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": statistics.fmean(xs) if xs else float("nan")}


def median_interval(xs: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap `level` confidence interval of the median of `xs` (seeded: the same samples give the
    same interval); (nan, nan) for no samples."""
    if not xs:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[round((1 - tail) * (resamples - 1))]


def gemm_tflops(device: torch.device = CPU, dtype: torch.dtype = torch.bfloat16, n: int | None = None) -> float:
    """The achieved TFLOP/s of a square n x n matmul in `dtype` (default n: 8192 on a GPU, 2048 on the CPU), median.
    On the CPU, where the engine's projections run oneDNN's primitive instead of torch's matmul (float32:
    `kernels.linear`), the faster of the two, timed alternately: the machine's GEMM rate, not one library's."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    gemms = [lambda: a @ a]
    if device.type == "cpu" and plain_onednn(device, dtype):
        gemms.append(lambda: linear(a, a))
    repeats = 10 if device.type == "cuda" else 5
    for gemm in gemms:
        timed(gemm, 0, warmup=2, device=device)
    times: list[list[float]] = [[] for _ in gemms]
    for _ in range(repeats):
        for gemm, ts in zip(gemms, times):
            ts += timed(gemm, 1, warmup=0, device=device)
    return 2 * n ** 3 / min(statistics.median(ts) for ts in times) / 1e12


def device_peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (pixeltriage.bench.models.roofline.DEVICE_SPECS, by the GPU's name); None on the
    CPU or a GPU whose peaks that table does not hold (PCIe and NVL boards, the 40 GB A100)."""
    if device.type != "cuda":
        return None
    key = spec_key_for_gpu(torch.cuda.get_device_name(device))
    return DEVICE_SPECS[key].bf16_tflops if key else None


def flop_rate(flop: float, seconds: float, gemm_tflops: float | None, peak_tflops: float | None = None) -> dict:
    """`flop` FLOPs done in `seconds`: achieved TFLOP/s, its fraction of the measured GEMM rate and of the
    device's peak (MFU); a fraction is None when its reference is unknown."""
    tflops = flop / seconds / 1e12 if seconds and flop else 0.0
    return {"tflops": tflops, "of_gemm": tflops / gemm_tflops if gemm_tflops else None,
            "mfu": tflops / peak_tflops if peak_tflops else None}


# the CPU flags that say a machine multiplies bf16 on its own units (without them bf16 matmuls are emulated, slower
# than float32, and a bf16 GEMM rate means little), as /proc/cpuinfo lists them: x86's AMX and AVX-512 BF16 (lscpu's
# names), aarch64's BF16 instructions
BF16_UNITS = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_machine(cpuinfo: str | None = None) -> dict:
    """Which machine a CPU figure comes from: the CPU's model name, the logical CPUs this process may use, the bf16
    units its flags show (`BF16_UNITS`), torch's version and the threads torch runs, whether this process's malloc
    was tuned (`tune_malloc`: without it, and before the Scorer's workspace, a bench-small bf16 forward took ~100,000
    page faults and its Gated DeltaNet stage ~1.4x the time; a float32 forward whose layers run oneDNN's primitive
    still faults) and whether the Scorer's forwards use their workspace (`tuning.workspace_condition`,
    PIXELTRIAGE_WORKSPACE). cpuinfo: /proc/cpuinfo's text (read here when None; where it cannot be read, the
    platform's processor name and no units)."""
    from pixeltriage.kernels import tuning

    fields = native.cpuinfo_fields(cpuinfo)
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    affinity = getattr(os, "sched_getaffinity", None)
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "logical_cpus": len(affinity(0)) if affinity else os.cpu_count(),
            "bf16_units": [unit for unit in BF16_UNITS if unit in flags],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "malloc": tuning.malloc_condition(),
            "workspace": tuning.workspace_condition()}


def machine_line(m: dict) -> str:
    """`cpu_machine`'s record (with "gpu" where a run added the GPU's name) as one line of a report."""
    units = ", ".join(m["bf16_units"]) or "none (bf16 matmuls emulated)"
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    conditions = "".join(f"; {m[key]}" for key in ("malloc", "workspace") if m.get(key))
    return f"{m['cpu']}, {m['logical_cpus']} logical CPUs; bf16 units: {units}; torch {m['torch']}{conditions}{gpu}"


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads (which the native kernels use too) for a benchmark run; None leaves them."""
    if threads is not None:
        torch.set_num_threads(threads)


def threads_label(threads: int) -> str:
    return f"{threads} thread{'s' * (threads != 1)}"


def progress_line(line: str) -> None:
    """A measuring command's progress: one line to stderr, flushed (stdout carries its report alone)."""
    print(line, file=sys.stderr, flush=True)


def emit(report: dict, as_json: bool, print_text: Callable[[dict], None]) -> None:
    """A measuring command's report to stdout: JSON (values JSON lacks as their str) or its text form."""
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_text(report)
