"""`pixeltriage bench ...`: benchmark and cost-report subcommands."""
from __future__ import annotations

import argparse

from pixeltriage.bench import cost, cpu, latency, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    p = sub.add_parser("cost", help="per-question TFLOP and visual tokens: System One + ours@k vs open-all prefill")
    cost.add_cost_arguments(p)
    p.set_defaults(_bench_run=cost.run_cost)
    p = sub.add_parser("cpu", help="engine vs transformers' eager forward on the same state, GEMM rate, stages")
    cpu.add_cpu_arguments(p)
    p.set_defaults(_bench_run=cpu.run_cpu)
    p = sub.add_parser("latency", help="System One latency over an episode stream vs the answering prefill, "
                                       "--profile, --plot")
    latency.add_latency_arguments(p)
    p.set_defaults(_bench_run=latency.run_latency)
    p = sub.add_parser("load", help="start-up time and peak memory: packed file vs directory vs transformers")
    load.add_load_arguments(p)
    p.set_defaults(_bench_run=load.run_load)


def run(args: argparse.Namespace) -> int:
    return args._bench_run(args)
