"""`pixeltriage bench load`: how fast a scorer starts, and how much memory starting takes.

For one demo preset and dtype, in one run: the packed file (`pixeltriage pack`), the checkpoint directory, and
transformers' `Qwen3_5ForConditionalGeneration.from_pretrained` of the same directory; the engine's two loaded as
`pixeltriage score` loads for one question (`reorder_weights=False`), and the packed file once more as a server or
a many-question process loads it ("packed_reordered": its first forward reorders the weights for oneDNN where this
machine measured that faster, `kernels.prepack`, and pays for it). Each trial is a fresh
process (so nothing is reused but the OS page cache, which every method gets warm: one untimed trial each first),
and reports
    load_s    from the load call to the weights being usable (imports excluded; transformers' own import is
              reported apart as import_s); the packed file's default load checks its header and the values
              of its small tensors only, no matrix (`Scorer.load(..., verify=True)` reads them all);
    first_s   from the load call to the first score ready: a one-memory question (for transformers: its forward
              over the engine's packed state, with its lazily mapped weights paged in by it);
    peak_rss  the process's peak resident memory (ru_maxrss), minus nothing: imports included;
and the medians over `--repeats` trials. `weights_bytes` is the size of the weights at the dtype, for the
"peak RSS <= 1.3x weights" goal.
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


METHODS = ("packed", "directory", "transformers", "packed_reordered")


def _child(method: str, path: str, dtype_name: str) -> dict:
    t0 = time.perf_counter()
    import torch

    import pixeltriage.engine.scorer  # noqa: F401  (the engine's imports are not part of a load)
    from pixeltriage.bench.workloads import first_score_question
    from pixeltriage.engine.cpu_memory import tune_malloc

    tune_malloc()                      # as the command line does

    dtype = getattr(torch, dtype_name)
    out: dict = {"method": method, "import_s": time.perf_counter() - t0}
    question, memories = first_score_question()
    if method == "transformers":
        t0 = time.perf_counter()
        from transformers import Qwen3_5ForConditionalGeneration

        from pixeltriage.bench.transformers_baseline import (force_transformers_torch_path, state_packer,
                                                             transformers_hidden)

        out["import_s"] += time.perf_counter() - t0
        force_transformers_torch_path()
    # Importing torch leaves a full garbage collection due (~170k objects, ~0.1 s): whichever allocation comes next
    # pays it. It belongs to the imports, which are excluded, so it runs here, for every method alike.
    t0 = time.perf_counter()
    gc.collect()
    out["import_s"] += time.perf_counter() - t0
    if method == "transformers":
        t0 = time.perf_counter()
        model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()

        def first_score():
            transformers_hidden(model, state_packer(path).pack(question, memories))
    else:
        from pixeltriage import Scorer

        t0 = time.perf_counter()
        scorer = Scorer.load(path, dtype=dtype, reorder_weights=method == "packed_reordered")

        def first_score():
            scorer.score(question, memories)
    out["load_s"] = time.perf_counter() - t0
    first_score()
    out["first_s"] = time.perf_counter() - t0
    out["peak_rss"] = _peak_rss()
    return out


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that across exec from the parent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _trial(method: str, path: Path, dtype: str) -> dict:
    cmd = [sys.executable, "-m", "pixeltriage.bench.load", "--child", method, str(path), dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} trial failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def weights_bytes(directory: Path, itemsize: int) -> int:
    """The loaded weights' size: every loaded parameter (not lm_head / mtp) at `itemsize` bytes."""
    from pixeltriage.weights.reader import SKIPPED, tensor_numels

    return itemsize * sum(n for f in sorted(directory.glob("*.safetensors"))
                          for name, n in tensor_numels(f).items() if not SKIPPED.match(name))


def load_report(preset: str = "2b", dtype: str = "bfloat16", repeats: int = 3, progress=print) -> dict:
    from pixeltriage.weights.layout import parse_dtype
    from pixeltriage.paths import cache_dir
    from pixeltriage.weights.demo import demo_checkpoint
    from pixeltriage.weights.packed import pack_checkpoint

    torch_dtype = parse_dtype(dtype)

    directory = demo_checkpoint(preset)
    packed = cache_dir() / f"demo-{preset}-seed0.{dtype}.packed.safetensors"
    if not packed.is_file() or packed.stat().st_mtime < (directory / "config.json").stat().st_mtime:
        progress(f"packing {directory} -> {packed}")
        pack_checkpoint(directory, packed, dtype=torch_dtype)
    paths = {"packed": packed, "directory": directory, "transformers": directory, "packed_reordered": packed}
    trials: dict[str, list[dict]] = {m: [] for m in METHODS}
    for m in METHODS:                      # warm the page cache for every method; not timed
        progress(f"warm-up: {m}")
        _trial(m, paths[m], dtype)
    for r in range(repeats):               # interleaved, so drift hits every method alike
        for m in METHODS:
            progress(f"trial {r + 1}/{repeats}: {m}")
            trials[m].append(_trial(m, paths[m], dtype))
    wbytes = weights_bytes(directory, torch_dtype.itemsize)
    rows = {}
    for m, ts in trials.items():
        row = {"load_s": statistics.median(t["load_s"] for t in ts),
               "first_s": statistics.median(t["first_s"] for t in ts),
               "peak_rss": int(statistics.median(t["peak_rss"] for t in ts))}
        row["peak_rss_over_weights"] = row["peak_rss"] / wbytes
        rows[m] = row
    first = {m: rows[m]["first_s"] for m in METHODS}
    return {"preset": preset, "dtype": dtype, "repeats": repeats, "weights_bytes": wbytes,
            "packed_file": str(packed), "methods": rows,
            "first_score_speedup_vs_transformers": first["transformers"] / first["packed"],
            "first_score_speedup_vs_directory": first["directory"] / first["packed"],
            "load_speedup_vs_directory": rows["directory"]["load_s"] / rows["packed"]["load_s"],
            "load_speedup_vs_transformers": rows["transformers"]["load_s"] / rows["packed"]["load_s"]}


def print_table(report: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    gib = 2 ** 30
    print(f"load: preset {report['preset']}, {report['dtype']}, weights {report['weights_bytes'] / gib:.2f} GiB, "
          f"median of {report['repeats']} fresh processes (page cache warm)", file=out)
    print(f"{'method':<18} {'load s':>8} {'first score s':>14} {'peak RSS GiB':>13} {'RSS/weights':>12}", file=out)
    for m, row in report["methods"].items():
        print(f"{m:<18} {row['load_s']:8.2f} {row['first_s']:14.2f} {row['peak_rss'] / gib:13.2f} "
              f"{row['peak_rss_over_weights']:12.2f}", file=out)
    print(f"load, packed vs transformers: {report['load_speedup_vs_transformers']:.1f}x; vs directory: "
          f"{report['load_speedup_vs_directory']:.1f}x. time to first score, packed vs transformers: "
          f"{report['first_score_speedup_vs_transformers']:.1f}x; vs directory: "
          f"{report['first_score_speedup_vs_directory']:.1f}x. The packed file and transformers both map their "
          "weights lazily (their load excludes reading them, their first score includes it); the directory "
          "load reads, converts and checks every value; packed_reordered's first score includes reordering the "
          "weights for oneDNN, which makes every later forward faster", file=out)


def run_load(args: argparse.Namespace) -> int:
    report = load_report(args.preset, args.dtype, args.repeats,
                         progress=(lambda s: print(s, file=sys.stderr, flush=True)))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], sys.argv[4])))
    else:
        raise SystemExit("usage: python -m pixeltriage.bench.load --child METHOD PATH DTYPE (use `pixeltriage bench load`)")
