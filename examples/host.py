"""What a host does with PixelTriage: score the retrieved memories, choose which open as pixels, build the prompt.

    python examples/host.py                                  # the built-in demo checkpoint (random weights)
    python examples/host.py --checkpoint path/to/system-one  # a trained System One checkpoint

It scores examples/episode.json (a question and four retrieved memories), opens the top-k memories by gain,
and prints the answering model's messages (transformers chat format) for a host that delivers pixels, with each
image shown by its path.
"""
import argparse
import json
import sys
from pathlib import Path

from pixeltriage import PixelTriageError, Scorer, delivery_cost, load_episodes, pixel_host_messages, top_k
from pixeltriage.media.image import display_size

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="System One checkpoint (default: the demo checkpoint, built once)")
    p.add_argument("--episode", default=str(HERE / "episode.json"))
    p.add_argument("--k", type=int, default=1, help="memories to open as pixels (default 1)")
    args = p.parse_args()
    if args.k < 0:
        p.error("--k must be >= 0")
    try:
        run(args)
    except PixelTriageError as e:                              # a bad checkpoint or episode: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    if args.checkpoint is None:
        from pixeltriage.weights.demo import demo_checkpoint

        args.checkpoint = demo_checkpoint("tiny")

    question, memories = load_episodes(args.episode)[0]
    scorer = Scorer.load(args.checkpoint)                      # float32 on the CPU
    scores = scorer.score(question, memories)                  # one forward: p_vis, a gain per memory
    # the k highest gains open as pixels; a host that also gates by p_vis keeps one RateGate(rate) for its whole
    # stream of questions and opens nothing when gate.opens(scores.p_vis) is False (a fresh gate opens its first)
    delivery = top_k(scores, args.k)
    messages = pixel_host_messages(question, memories, delivery, seen_time=True)

    sizes = [display_size(m.image) for m in memories]
    print(f"p_vis {scores.p_vis:.3f}; gains " + ", ".join(f"{g:.3f}" for g in scores.gains))
    print(f"open as pixels: {[i + 1 for i, d in enumerate(delivery) if d]}; visual tokens (Qwen2.5-VL) "
          f"{delivery_cost(delivery, sizes)} of {delivery_cost([True] * len(sizes), sizes)} for open-all")
    print(json.dumps(messages, indent=2, default=str))


if __name__ == "__main__":
    main()
