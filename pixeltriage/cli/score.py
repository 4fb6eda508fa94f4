"""`pixeltriage score` (episode files -> delivery decisions) and `pixeltriage demo` (the built-in episode)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from pixeltriage.cli.common import (DEMO_PRESETS, add_checkpoint_arguments, add_device_arguments, cache_target,
                                    device_dtype, existing_file, fraction, input_file, int_at_least, new_file,
                                    positive_float, resolved_checkpoint)
from pixeltriage.delivery.profiles import (ANSWERING_MODEL_NAMES, DEFAULT_ANSWERING_MODEL, AnsweringModel,
                                           UnknownAnsweringModelError, answering_model)


# the fewest episodes for which `score` has the weights reordered for oneDNN (see where the Scorer is loaded)
REORDER_FROM = 4
BATCH_SIZE = 8            # --episodes: episodes packed into one forward


def answering_model_argument(value: str) -> AnsweringModel:
    """--answering-model: a name in the registry, or a directory holding the model's preprocessor_config.json."""
    try:
        return answering_model(value)
    except UnknownAnsweringModelError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--episode", type=input_file,
                        help="episode JSON file, one episode or a list of them ('-': standard input; docs/state.md)")
    source.add_argument("--episodes", metavar="FILE.jsonl", type=existing_file,
                        help="offline batch scoring: one episode per line, each with an 'id'; every decision is "
                             "appended to --out as one line keyed by its id, and a rerun skips the ids --out holds")
    p.add_argument("--k", type=int_at_least(0), default=2, help="open the k memories with the highest gain (default 2)")
    p.add_argument("--gate-rate", type=fraction, default=None,
                   help="open images only for questions whose p_vis ranks in this top fraction of the stream")
    p.add_argument("--answering-model", metavar="NAME|DIR", type=answering_model_argument,
                   default=DEFAULT_ANSWERING_MODEL,
                   help="whose visual tokens the report counts: " + ", ".join(ANSWERING_MODEL_NAMES) + ", or a "
                        f"directory holding its preprocessor_config.json (default {DEFAULT_ANSWERING_MODEL}; "
                        "docs/delivery.md)")
    add_device_arguments(p)
    p.add_argument("--cache", metavar="DB", type=cache_target, default=None,
                   help="write-time cache file or postgresql:// URL (pixeltriage cache put): memories may be given "
                        "by key, thumbnails are read from it and vision-tower outputs are stored in it for later "
                        "questions")
    p.add_argument("--json", action="store_true", help="print one JSON object per episode")
    p.add_argument("--threads", metavar="N", type=int_at_least(1), default=None,
                   help="torch threads of the forward (default: torch's, one per core; with --ray: "
                        "--cpus-per-actor's)")
    batch = p.add_argument_group("offline batch scoring (--episodes)")
    batch.add_argument("--out", metavar="FILE.jsonl", type=new_file, default=None,
                       help="where the decisions go, one JSON line per episode (appended: what it already holds "
                            "is not scored again)")
    batch.add_argument("--batch-size", metavar="N", type=int_at_least(1), default=BATCH_SIZE,
                       help=f"episodes per forward (default {BATCH_SIZE})")
    batch.add_argument("--ray", action="store_true",
                       help="score on Ray Data: a pool of actors, one Scorer each, across the Ray cluster "
                            "(pip install 'pixeltriage[ray]')")
    batch.add_argument("--ray-address", metavar="ADDR", default=None,
                       help="join this Ray cluster ('auto', or the head's HOST:6379; default: start a local one)")
    batch.add_argument("--actors", metavar="N", type=int_at_least(1), default=None,
                       help="scoring actors (default: as many as the cluster's CPUs hold at --cpus-per-actor)")
    batch.add_argument("--cpus-per-actor", metavar="X", type=positive_float, default=None,
                       help="CPUs Ray reserves per actor, and its torch threads (default 1)")
    p.add_argument("--verify", action="store_true",
                   help="read every weight of a packed checkpoint at load (NaN/Inf, fingerprint); directories "
                        "are always checked")


class UsageError(Exception):
    """A combination of flags that cannot work (the parser reports it: exit 2)."""


def check_score_arguments(args: argparse.Namespace) -> None:
    """The checks that span several flags, before anything is read or loaded: a usage error (exit 2)."""
    try:
        _check_flags(args)
    except UsageError as e:
        args._parser.error(str(e))


def _check_flags(args: argparse.Namespace) -> None:
    if args.episodes is None:
        given = next((flag for flag, name in (("--out", "out"), ("--ray", "ray"), ("--ray-address", "ray_address"),
                                              ("--actors", "actors"), ("--cpus-per-actor", "cpus_per_actor"))
                      if getattr(args, name) not in (None, False)), None)
        if given is not None:
            raise UsageError(f"{given} is for offline batch scoring: give the episodes with --episodes FILE.jsonl")
        return
    if args.out is None:
        raise UsageError("--episodes needs --out FILE.jsonl, where the decisions go")
    if os.path.abspath(args.out) == os.path.abspath(args.episodes):
        raise UsageError("--out is the --episodes file itself; give another file")
    if args.gate_rate is not None:
        raise UsageError("--gate-rate ranks a stream's questions in order; offline batch scoring scores them in any "
                         "order: leave it out (each line holds p_vis, for a gate of your own)")
    if args.json:
        raise UsageError("--json is for --episode: --episodes always writes JSON lines to --out")
    if not args.ray:
        given = next((flag for flag, name in (("--ray-address", "ray_address"), ("--actors", "actors"),
                                              ("--cpus-per-actor", "cpus_per_actor"))
                      if getattr(args, name) is not None), None)
        if given is not None:
            raise UsageError(f"{given} needs --ray")
    elif args.threads is not None:
        raise UsageError("--threads is for in-process scoring: with --ray each actor runs --cpus-per-actor threads")


def run_score(args: argparse.Namespace) -> int:
    check_score_arguments(args)
    if args.episodes is not None:
        return run_score_batch(args)
    from pixeltriage.episode import load_episodes          # torch-free: a bad episode is reported at once
    from pixeltriage.errors import PixelTriageError

    episodes = load_episodes(sys.stdin if args.episode == "-" else args.episode)   # all checked before loading
    if args.cache is None:
        for number, (_, memories) in enumerate(episodes, start=1):
            keyed = next((i for i, m in enumerate(memories, start=1) if m.key is not None), None)
            if keyed is not None:
                where = f", episode {number} of {len(episodes)}" if len(episodes) > 1 else ""
                raise PixelTriageError(f"{_episode_name(args.episode)}{where}: memory {keyed} is given by cache "
                                       "key; pass the cache that holds it with --cache DB")
    from pixeltriage.store.cache import Cache
    from pixeltriage.engine.cpu_memory import tune_malloc
    from pixeltriage.delivery.policy import RateGate
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.delivery.report import decision_report, print_report

    gate = RateGate(args.gate_rate) if args.gate_rate is not None else None
    tune_malloc()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    with Cache(args.cache) if args.cache else contextlib.nullcontext() as cache:
        # the weights reordered for oneDNN (kernels.prepack) pay for their reorder only over several questions
        # (docs/api.md, `reorder_weights`)
        scorer = Scorer.load(resolved_checkpoint(args), device=args.device, dtype=device_dtype(args), cache=cache,
                             verify=args.verify or None, reorder_weights=len(episodes) >= REORDER_FROM)
        for number, (question, memories) in enumerate(episodes, start=1):
            try:
                scores = scorer.score(question, memories)
            except PixelTriageError as e:
                where = f", episode {number} of {len(episodes)}" if len(episodes) > 1 else ""
                print(f"error: {_episode_name(args.episode)}{where}: {e}", file=sys.stderr)
                return 2
            report = decision_report(question, memories, scores, args.k, gate, args.answering_model, cache=cache)
            if args.json:
                print(json.dumps(report), flush=True)
            else:
                print_report(report)
                print(flush=True)
    return 0


def run_score_batch(args: argparse.Namespace) -> int:
    """`score --episodes FILE.jsonl --out FILE.jsonl [--ray]` (pixeltriage.cli.batch)."""
    from pixeltriage.cli.batch import Settings, read_episodes, run_batch
    from pixeltriage.errors import PixelTriageError

    episodes = read_episodes(args.episodes)                 # all checked before anything loads
    if args.cache is None:
        keyed = next((e for e in episodes if any(m["key"] is not None for m in e.episode["memories"])), None)
        if keyed is not None:
            raise PixelTriageError(f"{args.episodes}, line {keyed.line}: a memory is given by cache key; pass the "
                                   "cache that holds it with --cache DB")
    settings = Settings(checkpoint=resolved_checkpoint(args), device=args.device, dtype=device_dtype(args),
                        cache=args.cache, k=args.k, answering_model=args.answering_model.name, verify=args.verify,
                        threads=args.threads, reorder_weights=len(episodes) >= REORDER_FROM)
    summary = run_batch(episodes, args.out, settings, batch_size=args.batch_size, use_ray=args.ray,
                        ray_address=args.ray_address, actors=args.actors, cpus_per_actor=args.cpus_per_actor or 1.0)
    timing = ""
    if summary.busy_from is not None:
        timing = (f" in {summary.seconds:.1f} s, of which {summary.scoring_seconds:.1f} s scoring "
                  f"({summary.rate:.2f} questions/s)")
    if summary.nodes:
        timing += (f" on {len(summary.nodes)} Ray node{'s' if len(summary.nodes) > 1 else ''} ("
                   + ", ".join(f"{node}: {n}" for node, n in sorted(summary.nodes.items())) + ")")
    print(f"score: {summary.scored} scored, {summary.failed} failed, {summary.skipped} already in {args.out}{timing}",
          file=sys.stderr)
    failed = summary.failed + summary.failed_before
    if failed:
        print(f"error: {failed} episodes could not be scored: their lines in {args.out} hold the error (a rerun "
              "skips them; remove their lines to score them again)", file=sys.stderr)
        return 2
    return 0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=DEMO_PRESETS,
                   help="demo checkpoint shape (default: tiny; built once and cached)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo weights and the sample episode (default 0)")
    add_device_arguments(p)


def run_demo(args: argparse.Namespace) -> int:
    from pixeltriage.engine.cpu_memory import tune_malloc
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.episode import sample_episode
    from pixeltriage.delivery.report import decision_report, print_report
    from pixeltriage.weights.demo import demo_checkpoint

    t0 = time.perf_counter()
    path = demo_checkpoint(args.preset, args.seed)
    print(f"demo checkpoint ({args.preset}, seed {args.seed}): {path} (ready in {time.perf_counter() - t0:.1f} s)")
    tune_malloc()
    dtype = device_dtype(args)
    scorer = Scorer.load(path, device=args.device, dtype=dtype)
    question, memories = sample_episode(args.seed)
    t1 = time.perf_counter()
    state = scorer.pack(question, memories)
    scores = scorer.score_states([state])[0]
    t2 = time.perf_counter()
    print(f"state: {state.num_tokens} tokens, {state.num_memories} memories, "
          f"{int(state.image_grid_thw.prod(-1).sum()) if state.num_memories else 0} patches; "
          f"packed and scored in {1000 * (t2 - t1):.0f} ms ({dtype}, {args.device})\n")
    for k in (1, 2):
        report = decision_report(question, memories, scores, k, None)
        if k == 1:
            print_report(report)
        opened = [m["index"] for m in report["memories"] if m["open"]]
        print(f"k={k} opens memories {opened}; visual tokens {report['visual_tokens']['delivery']} of "
              f"{report['visual_tokens']['open_all']} (open-all)")
    print("\nThis demo checkpoint has random weights: its scores are meaningless; they show the pipeline.\n"
          "Score your own episodes with:\n"
          "  pixeltriage score --checkpoint DIR --episode FILE.json [--k 2]\n"
          "(episode format: docs/state.md; a runnable host: examples/host.py).")
    return 0


def _episode_name(episode: str) -> str:
    return "standard input" if episode == "-" else episode

