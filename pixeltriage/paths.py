"""Where PixelTriage keeps what it generates: demo checkpoints, packed files, built native kernels."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from pixeltriage import settings
from pixeltriage.errors import CheckpointError


def cache_dir() -> Path:
    """$PIXELTRIAGE_CACHE (`pixeltriage.settings`), else ~/.cache/pixeltriage."""
    return settings.current().cache or Path.home() / ".cache" / "pixeltriage"


def cached_directory(name: str, write: Callable[[Path], Path], root: Path | None = None) -> Path:
    """`root / name` (`root`: `cache_dir()` by default), made by `write(target)` on first use. Safe across
    processes: writers serialise on a lock file, `write` must make the directory appear by rename, and what a killed
    writer left (`.NAME.tmp-*`) is removed first."""
    root = cache_dir() if root is None else Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if target.is_dir():
        return target
    with locked(root / f".{name}.lock"):
        if target.is_dir():
            return target
        for leftover in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return write(target)


def write_directory(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Make the directory `path` (absent or empty) by `write(staging)` into a temporary sibling renamed onto it at
    the end: `path` never holds half of what `write` writes, and a failed write leaves nothing. -> the absolute path."""
    path = Path(path).absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{path}: already exists and is not an empty directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        staging.chmod(0o755)        # mkdtemp makes it private; what it becomes is an ordinary directory
        write(staging)
        os.rename(staging, path)    # atomic; replaces an empty directory
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


@contextlib.contextmanager
def locked(lock_path: str | os.PathLike):
    """Hold an exclusive lock on the file `lock_path` (made if absent) for the block: writers of one cached thing
    in several processes take turns."""
    with open(lock_path, "w") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)
