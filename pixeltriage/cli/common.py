"""What the commands share: argument types that check values at parse time, and the choices they offer.

Everything here is stdlib: building the parser must not import torch. The choice lists name what the
library's tables hold (`tests/test_cli.py` checks that they agree).
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

DTYPE_NAMES = ("bfloat16", "float16", "float32")          # pixeltriage.weights.layout.DTYPES
DEMO_PRESETS = ("2b", "bench-small", "tiny")               # pixeltriage.weights.demo.PRESETS
DEVICES = ("cpu", "cuda")

VERBOSITY = argparse.ArgumentParser(add_help=False)
VERBOSITY.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                       help="more logging (-vv: debug, and tracebacks)")


def version() -> str:
    from pixeltriage import __version__

    return __version__


def int_at_least(minimum: int):
    """An argparse type: an integer of at least `minimum` (argparse reports anything else as a usage error)."""
    def check(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    check.__name__ = "int"            # argparse's word for a value int() rejects: "invalid int value"
    return check


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:        # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


fraction.__name__ = "float"


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


positive_float.__name__ = "float"


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = float(text)
    if not (value >= 0 and value != float("inf")):     # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


non_negative_float.__name__ = "float"


def int_list(minimum: int):
    """An argparse type: comma-separated integers, each at least `minimum`."""
    def check(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"every value must be at least {minimum}, found {text!r}")
        return values

    check.__name__ = "list"
    return check


def existing_directory(text: str) -> str:
    """An argparse type: a directory that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: no such directory" + (" (it is a file)" if os.path.exists(text)
                                                                         else ""))
    return text


def existing_path(text: str) -> str:
    """An argparse type: a file or directory that exists."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return text


def checkpoint_source(text: str) -> str:
    """An argparse type: an existing checkpoint path or a Hugging Face hub id (org/name[@revision]); nothing is
    looked up here (the command resolves it once --revision and --allow-download are known)."""
    from pixeltriage.errors import CheckpointError
    from pixeltriage.hub import check_checkpoint

    try:
        return check_checkpoint(text)
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_checkpoint_arguments(p: argparse.ArgumentParser, name: str = "--checkpoint",
                             what: str = "a directory, a packed file") -> None:
    """NAME PATH|ORG/NAME[@REV] (an option or, without dashes, a positional), --revision, --allow-download
    (pixeltriage.hub)."""
    required = {"required": True} if name.startswith("-") else {}
    p.add_argument(name, type=checkpoint_source, **required,
                   help=f"System One checkpoint: {what}, or a Hugging Face hub id read from the local hub cache")
    p.add_argument("--revision", default=None, help="the hub id's branch, tag or commit (default: main)")
    p.add_argument("--allow-download", action="store_true",
                   help="download a hub id that is not cached (safetensors and JSON files only; never while "
                        "HF_HUB_OFFLINE=1)")


def resolved_checkpoint(args: argparse.Namespace, name: str = "checkpoint") -> str:
    """The local path of the checkpoint argument `name` (a hub id resolved from the hub cache, or downloaded when
    allowed)."""
    from pixeltriage.hub import resolve_checkpoint

    return str(resolve_checkpoint(getattr(args, name), args.revision, allow_download=args.allow_download))


def existing_file(text: str) -> str:
    """An argparse type: a readable regular file."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (it is a directory)" if os.path.isdir(text)
                                                                     else ""))
    return text


def input_file(text: str) -> str:
    """An argparse type: `-` (standard input) or an existing regular file."""
    return text if text == "-" else existing_file(text)


def cache_target(text: str) -> str:
    """An argparse type: a write-time cache, a `postgresql://` URL (checked when opened) or a new or existing file
    (as `new_file`)."""
    from pixeltriage.store.backend import is_url

    return text if is_url(text) else new_file(text)


def existing_cache(text: str) -> str:
    """An argparse type: a `postgresql://` URL or an existing cache file."""
    from pixeltriage.store.backend import is_url

    return text if is_url(text) else existing_file(text)


def new_file(text: str) -> str:
    """An argparse type: a path a file can be created at (or is): not a directory, in a directory that exists (a
    misspelt folder is an error, not a new folder)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir():
        found = next((p for p in parent.parents if p.exists()), None)
        if parent.exists() or (found is not None and not found.is_dir()):
            raise argparse.ArgumentTypeError(f"{text}: {found if not parent.exists() else parent} is not a "
                                             "directory")
        raise argparse.ArgumentTypeError(f"{text}: no such directory {parent}; create it first")
    return text


def new_directory(text: str) -> str:
    """An argparse type: a directory to create: absent or empty, and not under a file."""
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(f"{text}: already exists and is not an empty directory")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a directory")
    return text


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="CPU threads for every implementation timed (default: torch's, one per core)")


def add_device_arguments(p: argparse.ArgumentParser, dtype_default: str | None = None) -> None:
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the model runs (default: cpu)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=dtype_default,
                   help=f"weights and activations (default: {dtype_default or 'float32 on the CPU, bfloat16 on CUDA'})")


def device_dtype(args: argparse.Namespace) -> str:
    """The dtype name `add_device_arguments` resolves to."""
    from pixeltriage.config import default_dtype

    return args.dtype or default_dtype(args.device)
