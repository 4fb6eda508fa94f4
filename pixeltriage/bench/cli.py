"""`pixeltriage bench ...`: benchmark and cost-report subcommands."""
from __future__ import annotations

import argparse

# name -> help; `pixeltriage.bench.{name}` holds `add_{name}_arguments` and `run_{name}`
BENCHES: dict[str, str] = {
    "cost": "per-question TFLOP and visual tokens: System One + ours@k vs open-all prefill",
    "cpu": "engine vs transformers' eager forward on the same state, GEMM rate, stages",
    "latency": "System One latency over an episode stream vs the answering prefill, --profile, --plot",
    "load": "start-up time and peak memory: packed file vs directory vs transformers",
}


def int_at_least(minimum: int):
    """An argparse type: an integer of at least `minimum` (argparse reports anything else as a usage error)."""
    def check(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    check.__name__ = "int"            # argparse's word for a value int() rejects: "invalid int value"
    return check


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="CPU threads for every implementation timed (default: torch's, one per core)")


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads (which the native kernels use too) for a benchmark run; None leaves them."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def threads_label(threads: int) -> str:
    return f"{threads} thread{'s' * (threads != 1)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pixeltriage.cli import add_commands

    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    add_commands(sub, {name: (f"pixeltriage.bench.{name}", name, text) for name, text in BENCHES.items()},
                 "_bench_run")


def run(args: argparse.Namespace) -> int:
    return args._bench_run(args)
