"""Command line: thin argument parsing over the library. `pixeltriage --help` lists the commands.

Each subcommand lives in the module that owns its work, which exposes a function that adds its
arguments and one that runs it; this file only routes.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, prefix, help): the module holds `add_{prefix}_arguments` and `run_{prefix}`
# (`add_arguments` and `run` when the prefix is empty).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("pixeltriage.app", "demo", "score the built-in sample episode on the demo checkpoint"),
    "score": ("pixeltriage.app", "score", "score an episode file and print the delivery decision"),
    "init-demo": ("pixeltriage.weights.demo", "", "write a demo checkpoint with seeded random weights"),
    "pack": ("pixeltriage.weights.packed", "", "write a checkpoint as one packed safetensors file (adapter merged)"),
    "verify": ("pixeltriage.weights.packed", "verify", "read every weight of a packed file or checkpoint directory: "
               "NaN/Inf, and a packed file's bytes against its fingerprint"),
    "cache": ("pixeltriage.engine.cache", "", "write-time cache: put images with notes, show stats"),
    "bench": ("pixeltriage.bench.cli", "", "benchmarks and cost reports"),
}


def _functions(module: str, prefix: str):
    mod = importlib.import_module(module)
    if prefix:
        return getattr(mod, f"add_{prefix}_arguments"), getattr(mod, f"run_{prefix}")
    return mod.add_arguments, mod.run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pixeltriage", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_commands(sub, COMMANDS, "_run")
    return parser


def add_commands(sub, table: dict[str, tuple[str, str, str]], run_attr: str) -> None:
    """One subparser per `table` entry (name -> (module, prefix, help), as COMMANDS), its run function stored in
    the parsed arguments as `run_attr`."""
    for name, (module, prefix, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add, run = _functions(module, prefix)
        p.set_defaults(**{run_attr: run})
        add(p)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from pixeltriage.errors import PixelTriageError

    try:
        return int(args._run(args) or 0)
    except PixelTriageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
