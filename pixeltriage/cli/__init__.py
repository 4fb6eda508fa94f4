"""Command line: thin argument parsing over the library. `pixeltriage --help` lists the commands.

Every command lives in one module of this package, which holds `add_{name}_arguments(parser)` and
`run_{name}(args)` (`add_arguments` / `run` where the table's name is empty). Building the parser
imports only these modules, which import nothing heavy at module level: torch, transformers and
the engine are imported by a run function, so `--help` and every usage error answer at once.

Exit codes: 0 done, 2 a usage error or a problem with the input (one line on stderr naming it),
1 an internal error, 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pixeltriage.cli.common import VERBOSITY, version

# name -> (module, function name, help): the module holds `add_{name}_arguments` and `run_{name}`
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("pixeltriage.cli.score", "demo", "score the built-in sample episode on the demo checkpoint"),
    "score": ("pixeltriage.cli.score", "score", "score episode files and print the delivery decision"),
    "cache": ("pixeltriage.cli.cache", "", "write-time cache: put images with notes, show stats"),
    "pack": ("pixeltriage.cli.checkpoint", "pack", "write a checkpoint as one packed safetensors file (adapter merged)"),
    "verify": ("pixeltriage.cli.checkpoint", "verify", "read every weight of a packed file or checkpoint directory: "
               "NaN/Inf, and a packed file's bytes against its fingerprint"),
    "init-demo": ("pixeltriage.cli.checkpoint", "init_demo", "write a demo checkpoint with seeded random weights"),
    "bench": ("pixeltriage.cli.bench", "", "benchmarks and cost reports"),
    "retrieve": ("pixeltriage.cli.retrieve", "retrieve", "rank cached images for a question by their best region"),
    "init-encoder-demo": ("pixeltriage.cli.retrieve", "init_encoder_demo",
                          "write a demo SigLIP 2 encoder with seeded random weights"),
    "serve": ("pixeltriage.cli.serve", "serve", "an HTTP scoring service: dynamic batching, backpressure, metrics"),
}


class _Commands(argparse._SubParsersAction):
    """Subcommands that record the chosen (innermost) parser as `_parser`: what names an unknown argument."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace._parser = self._name_parser_map.get(values[0], parser)   # a nested choice overwrites it
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """argparse with a usage error as one line naming the command, the problem and where help is (argparse prints
    its whole usage block first)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pixeltriage", parents=[VERBOSITY],
                                     description="PixelTriage: decide which retrieved memories deserve pixels.",
                                     epilog="'pixeltriage COMMAND --help' shows a command's options; "
                                            "docs/cli.md has them all.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_commands(sub, COMMANDS, "_run")
    return parser


def add_commands(sub, table: dict[str, tuple[str, str, str]], run_attr: str) -> None:
    """One subparser per `table` entry (name -> (module, function name, help), as COMMANDS), its run function
    stored in the parsed arguments as `run_attr`. Each takes the global options too (`score ... -v`)."""
    for name, (module, function, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[VERBOSITY])
        mod = importlib.import_module(module)
        suffix = f"_{function}" if function else ""
        p.set_defaults(**{run_attr: getattr(mod, f"run{suffix}")})
        getattr(mod, f"add{suffix}_arguments")(p)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# a module only an optional extra installs -> the extra that brings it
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "httptools": "serve", "httpx": "serve", "pydantic": "serve",
          "prometheus_client": "serve", "ray": "ray", "pandas": "ray", "pyarrow": "ray", "faiss": "retrieval", "triton": "gpu", "fla": "gpu",
          "matplotlib": "plot"}


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:            # named by the command they were given to, not by the top-level parser
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    verbose = getattr(args, "verbose", 0) or 0
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(levelname)s %(name)s: %(message)s")
    # PIL's debug lines quote image metadata (TIFF tags, EXIF text): never part of our logs, -vv included
    logging.getLogger("PIL").setLevel(logging.INFO)
    from pixeltriage.errors import PixelTriageError

    try:
        return int(args._run(args) or 0)
    except PixelTriageError as e:
        return _fail(str(e), verbose)
    except OSError as e:
        if isinstance(e, BrokenPipeError):      # `pixeltriage ... | head`: the reader left; not an error
            _silence_stdout()
            return 0
        return _fail(_os_error(e), verbose)
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            return _fail(f"{type(e).__name__}: {e}", verbose, code=1)
        return _fail(f"'{args._parser.prog}' needs the {extra} extra ({e}): pip install 'pixeltriage[{extra}]' "
                     "(from a clone: pip install \".[" + extra + "]\")", verbose)
    except (ImportError, MemoryError) as e:
        return _fail(f"{type(e).__name__}: {e}", verbose, code=1)
    except Exception as e:                      # a bug: one line, the traceback on request
        if verbose >= 2:
            raise
        return _fail(f"internal error ({type(e).__name__}: {e}); rerun with -vv for the traceback and report it",
                     verbose, code=1)


def _fail(message: str, verbose: int, code: int = 2) -> int:
    if verbose >= 2:
        logging.getLogger("pixeltriage").exception("traceback")
    print(f"error: {message}", file=sys.stderr)
    return code


def _os_error(e: OSError) -> str:
    """An OSError as one line naming the file(s) and the reason."""
    reason = e.strerror or str(e)
    names = [n for n in (e.filename, e.filename2) if n is not None]
    return f"{' -> '.join(map(str, names))}: {reason}" if names else reason


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
