"""`pixeltriage bench workspace`: the CPU forward with and without the Scorer's workspace (`kernels.workspace`),
alternating in one process, as a host that embeds the engine runs it.

    pixeltriage bench workspace [--preset bench-small] [--dtype bfloat16] [--pairs 11] [--memories 10]
                                [--tokens 2300] [--tune-malloc] [--threads N] [--json]

One demo checkpoint, one packed state (`bench cpu`'s), two untimed forwards each way, then `--pairs` pairs of
forwards, the order alternating within the pairs. Per forward: its time, the process's minor page faults and its
system time across it (getrusage). Reported per way: the medians; then the paired ratio (with / without: its median
and quartiles), the bytes the workspace holds, and whether both ways scored the same bits. "Without" is the same
Scorer with a workspace that keeps nothing (`max_bytes=0`), so both follow the same measured kernel choices.

The process's malloc stays as glibc set it (the condition of a host that did not call `tune_malloc`) unless
--tune-malloc, which the machine line then says. No timing is asserted anywhere; the ratio is the measurement.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch

from pixeltriage.bench.timing import cpu_machine, emit, machine_line, progress_line, set_threads
from pixeltriage.bench.workloads import packed_episode


def _forward(scorer, state) -> tuple[float, int, float, object]:
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    scores = scorer.score_states([state])
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return seconds, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime, scores


def workspace_report(preset: str = "bench-small", dtype: str = "bfloat16", pairs: int = 11, memories: int = 10,
                     tokens: int = 2300, progress=lambda s: None) -> dict:
    """The measurement (see the module) as a dict: "with" and "without" ({"ms", "faults", "system_s"}: medians),
    "ratio" (median with/without of the pairs), "quartiles", "pairs", "workspace_bytes", "same_scores",
    "machine", "preset", "dtype", "tokens", "memories"."""
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.kernels.workspace import Workspace
    from pixeltriage.weights.demo import demo_checkpoint

    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    scorer = Scorer.load(demo_checkpoint(preset), dtype=getattr(torch, dtype))
    state = packed_episode(scorer.packer, memories, tokens).state
    ways = {"with": scorer.workspace, "without": Workspace(max_bytes=0)}
    progress(f"state: {state.num_tokens} tokens, {state.num_memories} memories; warm-up (untimed)")
    scores = {}
    for _ in range(2):
        for way, workspace in ways.items():
            scorer.workspace = workspace
            scores[way] = _forward(scorer, state)[3]
    progress(f"timing {pairs} pairs, alternating")
    runs: dict[str, list[tuple]] = {way: [] for way in ways}
    ratios = []
    for i in range(pairs):
        order = ("without", "with") if i % 2 == 0 else ("with", "without")
        seconds = {}
        for way in order:
            scorer.workspace = ways[way]
            run = _forward(scorer, state)[:3]
            runs[way].append(run)
            seconds[way] = run[0]
        ratios.append(seconds["with"] / seconds["without"])
    scorer.workspace = ways["with"]

    def medians(way: str) -> dict:
        return {"ms": round(1e3 * statistics.median(r[0] for r in runs[way]), 2),
                "faults": int(statistics.median(r[1] for r in runs[way])),
                "system_s": round(statistics.median(r[2] for r in runs[way]), 4)}

    ordered = sorted(ratios)
    return {"preset": preset, "dtype": dtype, "tokens": state.num_tokens, "memories": state.num_memories,
            "pairs": pairs, "with": medians("with"), "without": medians("without"),
            "ratio": round(statistics.median(ratios), 4),
            "quartiles": [round(ordered[len(ordered) // 4], 4), round(ordered[3 * len(ordered) // 4], 4)],
            "workspace_bytes": ways["with"].nbytes, "same_scores": scores["with"] == scores["without"],
            "machine": cpu_machine()}


def print_report(r: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    print(f"bench workspace: preset {r['preset']}, {r['dtype']}; state {r['tokens']} tokens, {r['memories']} "
          f"memories; {r['pairs']} pairs", file=out)
    print(f"  machine       {machine_line(r['machine'])}", file=out)
    for way in ("without", "with"):
        m = r[way]
        print(f"  {way:<13} median {m['ms']:9.1f} ms   minor faults {m['faults']:>8}   system {m['system_s']:.3f} s",
              file=out)
    print(f"  with/without  {r['ratio']:.3f}x (quartiles {r['quartiles'][0]:.3f}-{r['quartiles'][1]:.3f}); the "
          f"workspace holds {r['workspace_bytes'] / 2 ** 20:.1f} MiB; scores "
          f"{'the same bits' if r['same_scores'] else 'DIFFER'}", file=out)


def run_workspace(args: argparse.Namespace) -> int:
    if args.tune_malloc:
        from pixeltriage.engine.cpu_memory import tune_malloc

        tune_malloc()
    set_threads(args.threads)
    r = workspace_report(args.preset, args.dtype, args.pairs, args.memories, args.tokens,
                         progress=progress_line)
    emit(r, args.json, print_report)
    return 0 if r["same_scores"] else 1
