"""Command line: thin argument parsing over the library. `pixeltriage --help` lists the commands.

Each subcommand lives in the module that owns its work and exposes
`add_arguments(parser)` and `run(args) -> int`; this file only routes.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {}


def _register(name: str, module: str, help_text: str) -> None:
    COMMANDS[name] = (module, help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pixeltriage", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from pixeltriage.errors import PixelTriageError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except PixelTriageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
