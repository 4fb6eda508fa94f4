"""Per-stage wall-clock timing of the forward, off unless a caller records.

    with profiling.record() as stages:
        scorer.score(question, memories)
    stages  # {"vision": s, "gated_delta": s, "attention": s, "mlp": s, "head": s, "pack": s, ...}

Stages are flat (never nested) and cost one global check when nothing records. Timings are wall clock on the
CPU; on CUDA a stage would need a synchronize, which `record(sync=...)` applies.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

_local = threading.local()


@contextmanager
def stage(name: str) -> Iterator[None]:
    sink = getattr(_local, "sink", None)
    if sink is None:
        yield
        return
    sync = _local.sync
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if sync is not None:
            sync()
        sink[name] += time.perf_counter() - t0


@contextmanager
def record(sync: Callable[[], None] | None = None) -> Iterator[dict[str, float]]:
    """Collect stage times of this thread's work inside the block into the yielded dict (seconds)."""
    previous = getattr(_local, "sink", None), getattr(_local, "sync", None)
    sink: dict[str, float] = defaultdict(float)
    _local.sink, _local.sync = sink, sync
    try:
        yield sink
    finally:
        _local.sink, _local.sync = previous


@contextmanager
def paused() -> Iterator[None]:
    """No stage of this thread records inside the block (e.g. while a CUDA graph captures: no synchronize)."""
    previous = getattr(_local, "sink", None), getattr(_local, "sync", None)
    _local.sink, _local.sync = None, None
    try:
        yield
    finally:
        _local.sink, _local.sync = previous
