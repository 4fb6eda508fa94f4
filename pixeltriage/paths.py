"""Where PixelTriage keeps what it generates: demo checkpoints, packed files, built native kernels."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """$PIXELTRIAGE_CACHE, else ~/.cache/pixeltriage."""
    return Path(os.environ.get("PIXELTRIAGE_CACHE") or Path.home() / ".cache" / "pixeltriage")


def cached_directory(name: str, write: Callable[[Path], Path]) -> Path:
    """`cache_dir() / name`, made by `write(target)` on first use. Safe across processes: writers serialise on a lock
    file, `write` must make the directory appear by rename, and what a killed writer left (`.NAME.tmp-*`) is
    removed first."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if target.is_dir():
        return target
    with open(root / f".{name}.lock", "w") as lock, _locked(lock):
        if target.is_dir():
            return target
        for leftover in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return write(target)


@contextlib.contextmanager
def _locked(file):
    fcntl.flock(file, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(file, fcntl.LOCK_UN)
