"""The main job: score an episode and print the delivery decision (`pixeltriage score`, `pixeltriage demo`)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from pixeltriage.engine.cost import delivery_cost
from pixeltriage.engine.image import display_size
from pixeltriage.engine.policy import RateGate, top_k
from pixeltriage.engine.scorer import DTYPES, Scorer
from pixeltriage.engine.types import Memory, Scores
from pixeltriage.episode import load_episodes, sample_episode


def image_size(memory: Memory, index: int, cache=None) -> tuple[int, int] | None:
    """The original image's displayed (width, height), from its header or, for a cache-key memory, from the
    cache; None when unknown."""
    if memory.image is None:
        if cache is None:
            return None
        from pixeltriage.engine.cache import CacheMissError

        try:
            return cache.size(memory.key)
        except CacheMissError:
            return None
    return display_size(memory.image, index)


def decision_report(question: str, memories: list[Memory], scores: Scores, k: int, gate: RateGate | None,
                    answering: str = "qwen2.5-vl", cache=None) -> dict:
    opened = top_k(scores, k)
    gate_open = gate.opens(scores.p_vis) if gate is not None else True
    if not gate_open:
        opened = [False] * len(opened)
    sizes = [image_size(m, i, cache) for i, m in enumerate(memories)]
    known = [s for s in sizes if s is not None]
    report = {
        "question": question,
        "p_vis": scores.p_vis,
        "gate_open": gate_open,
        "k": k,
        "memories": [
            {"index": i + 1, "gain": g, "relevance": r, "open": o, "date": m.date, "note": m.note or ""}
            for i, (m, g, r, o) in enumerate(zip(memories, scores.gains, scores.relevance, opened))
        ],
        "relevance_none": scores.relevance_none,
    }
    if len(known) == len(sizes):
        report["visual_tokens"] = {
            "model": answering,
            "open_all": delivery_cost([True] * len(sizes), sizes, answering),
            "delivery": delivery_cost(opened, sizes, answering),
        }
    return report


def print_report(report: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    print(f"question: {report['question']}", file=out)
    gate = "" if report["gate_open"] else "   (rate gate closed: answer from text)"
    print(f"p_vis = {report['p_vis']:.4f}{gate}", file=out)
    print(f"{'#':>3}  {'gain':>7}  {'relev.':>7}  {'open@' + str(report['k']):>7}  {'date':<11} note", file=out)
    for m in report["memories"]:
        note = m["note"] if len(m["note"]) <= 48 else m["note"][:45] + "..."
        print(f"{m['index']:>3}  {m['gain']:7.4f}  {m['relevance']:7.4f}  {'pixels' if m['open'] else 'text':>7}  "
              f"{m['date']:<11} {note}", file=out)
    print(f"none (relevance) = {report['relevance_none']:.4f}", file=out)
    if "visual_tokens" in report:
        vt = report["visual_tokens"]
        share = vt["delivery"] / vt["open_all"] if vt["open_all"] else 0.0
        print(f"visual tokens ({vt['model']}): open-all {vt['open_all']}, this delivery {vt['delivery']} "
              f"({100 * share:.1f}%)", file=out)


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="System One checkpoint directory or packed file")
    p.add_argument("--episode", required=True, help="episode JSON file (see README)")
    p.add_argument("--k", type=int, default=2, help="open the k memories with the highest gain (default 2)")
    p.add_argument("--gate-rate", type=float, default=None,
                   help="open images only for questions whose p_vis ranks in this top fraction of the stream")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--cache", metavar="DB", default=None,
                   help="write-time cache file (pixeltriage cache put): memories may be given by key, thumbnails "
                        "are read from it and vision-tower outputs are stored in it for later questions")
    p.add_argument("--json", action="store_true", help="print one JSON object per episode")
    p.add_argument("--verify", action="store_true",
                   help="read every weight of a packed checkpoint at load (NaN/Inf, fingerprint); directories "
                        "are always checked")


def run_score(args: argparse.Namespace) -> int:
    from pixeltriage.engine.cache import Cache

    episodes = load_episodes(args.episode)
    gate = RateGate(args.gate_rate) if args.gate_rate is not None else None
    cache = Cache(args.cache) if args.cache else None
    try:
        scorer = Scorer.load(args.checkpoint, dtype=args.dtype, cache=cache, verify=args.verify or None)
        for question, memories in episodes:
            report = decision_report(question, memories, scorer.score(question, memories), args.k, gate, cache=cache)
            if args.json:
                print(json.dumps(report))
            else:
                print_report(report)
                print()
    finally:
        if cache is not None:
            cache.close()
    return 0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench-small", "2b"],
                   help="demo checkpoint shape (default: tiny; built once and cached)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


def run_demo(args: argparse.Namespace) -> int:
    from pixeltriage.weights.demo import demo_checkpoint

    t0 = time.perf_counter()
    path = demo_checkpoint(args.preset, args.seed)
    print(f"demo checkpoint ({args.preset}, seed {args.seed}): {path} (ready in {time.perf_counter() - t0:.1f} s)")
    scorer = Scorer.load(path, dtype=args.dtype)
    question, memories = sample_episode(args.seed)
    t1 = time.perf_counter()
    state = scorer.pack(question, memories)
    scores = scorer.score_states([state])[0]
    t2 = time.perf_counter()
    print(f"state: {state.num_tokens} tokens, {state.num_memories} memories, "
          f"{int(state.image_grid_thw.prod(-1).sum()) if state.num_memories else 0} patches; "
          f"packed and scored in {1000 * (t2 - t1):.0f} ms ({args.dtype}, CPU)\n")
    for k in (1, 2):
        report = decision_report(question, memories, scores, k, None)
        if k == 1:
            print_report(report)
        opened = [m["index"] for m in report["memories"] if m["open"]]
        print(f"k={k} opens memories {opened}; visual tokens {report['visual_tokens']['delivery']} of "
              f"{report['visual_tokens']['open_all']} (open-all)")
    print("\nThis demo checkpoint has random weights: its scores are meaningless; they show the pipeline.\n"
          "Score a real System One checkpoint with:\n"
          "  pixeltriage score --checkpoint DIR --episode FILE.json [--k 2]\n"
          "(episode format: README, 'Episode files').")
    return 0
