"""`pixeltriage bench ...`: benchmark and cost-report subcommands."""
from __future__ import annotations

import argparse

# name -> (module, prefix, help): the module holds `add_{prefix}_arguments` and `run_{prefix}`, as for COMMANDS
BENCHES: dict[str, tuple[str, str, str]] = {
    "cost": ("pixeltriage.bench.cost", "cost",
             "per-question TFLOP and visual tokens: System One + ours@k vs open-all prefill"),
    "cpu": ("pixeltriage.bench.cpu", "cpu", "engine vs transformers' eager forward on the same state, GEMM rate, stages"),
    "latency": ("pixeltriage.bench.latency", "latency",
                "System One latency over an episode stream vs the answering prefill, --profile, --plot"),
    "load": ("pixeltriage.bench.load", "load",
             "start-up time and peak memory: packed file vs directory vs transformers"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pixeltriage.cli import _functions

    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    for name, (module, prefix, help_text) in BENCHES.items():
        add, run_bench = _functions(module, prefix)
        p = sub.add_parser(name, help=help_text)
        add(p)
        p.set_defaults(_bench_run=run_bench)


def run(args: argparse.Namespace) -> int:
    return args._bench_run(args)
