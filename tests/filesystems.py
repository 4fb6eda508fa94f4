"""Faults of the file system for the store's tests: a small tmpfs that fills up, a directory made read-only (a
read-only bind mount over it). Both need mount(2): as root, with the mount capability (CI here has it); elsewhere
`unavailable()` says why and the tests that need them skip."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

_reason: list = []


def unavailable() -> str | None:
    """Why no tmpfs can be mounted here (None: it can)."""
    if not _reason:
        if os.geteuid() != 0:
            _reason.append("mounting a small tmpfs or a read-only bind mount needs root")
        else:
            probe = tempfile.mkdtemp(prefix="pixeltriage-mount-")
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True,
                                  text=True)
            if done.returncode == 0:
                subprocess.run(["umount", probe], check=True)
            os.rmdir(probe)
            _reason.append(None if done.returncode == 0 else f"mount(2) refused here: {done.stderr.strip()}")
    return _reason[0]


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def tmpfs(size: int) -> Iterator[Path]:
    """A fresh tmpfs of `size` bytes, unmounted (lazily, should a file still be open on it) and removed on exit."""
    path = Path(tempfile.mkdtemp(prefix="pixeltriage-tmpfs-"))
    _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        path.rmdir()


def fill(directory: Path) -> Path:
    """Write a file in `directory` until its file system is full; returns it (delete it to free the space)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for block in (65536, 512):            # then the last partial blocks
            try:
                while f.write(b"\0" * block):
                    pass
            except OSError:
                pass
    return filler


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """`directory` read-only (a read-only bind mount over it) until the block ends: new opens for writing fail with
    EROFS, as on a file system remounted read-only."""
    _run("mount", "--bind", str(directory), str(directory))
    try:
        _run("mount", "-o", "remount,bind,ro", str(directory))
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)
