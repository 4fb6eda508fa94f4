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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pixeltriage.cli import add_commands

    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    add_commands(sub, {name: (f"pixeltriage.bench.{name}", name, text) for name, text in BENCHES.items()},
                 "_bench_run")


def run(args: argparse.Namespace) -> int:
    return args._bench_run(args)
