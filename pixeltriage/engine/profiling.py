"""Per-stage wall-clock timing of the forward, off unless a caller records.

    with profiling.record() as stages:
        scorer.score(question, memories)
    stages  # {"vision": s, "gated_delta": s, "delta_rule": s, "attention": s, "mlp": s, "head": s, "pack": s, ...}

Stages cost one global check when nothing records. A stage inside another is exclusive: its time counts to itself
and not to the one around it (the Gated DeltaNet layer's "gated_delta" holds its norms, projections and gates,
the "delta_rule" inside it the kernel's conv + recurrence), so the stages of a run add up to the time they cover.
A kernel may report a part of its call it measured inside it (the C delta passes: their conv + SiLU, "delta_conv",
as its share of the threads' time in the pass): a stage of its own, out of the stage around the call.
Timings are wall clock on the CPU; on CUDA a stage would need a synchronize, which `record(sync=...)` applies.

While torch.profiler records, every kernel call the registry makes is a range named for it ("gated_delta: fla
chunk_gated_delta_rule", `kernels.registry`), so a trace says which implementation each range is.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

from pixeltriage.kernels import native

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
    around = _local.nested          # time of the stages already nested in the enclosing one
    _local.nested = 0.0
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - t0
        sink[name] += elapsed - _local.nested
        _local.nested = around + elapsed


def _part(name: str, seconds: float) -> None:
    """A part of a kernel's call that the kernel measured inside it (`native.part_recorder`): its own stage, and
    out of the stage around the call, as a nested stage would be."""
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink[name] += seconds
        _local.nested += seconds


@contextmanager
def _recording(sink: dict[str, float] | None, sync: Callable[[], None] | None) -> Iterator[None]:
    """This thread's stages (and its kernels' parts) go to `sink` (None: nowhere) inside the block; the previous
    recording after it."""
    previous = getattr(_local, "sink", None), getattr(_local, "sync", None), getattr(_local, "nested", 0.0)
    _local.sink, _local.sync, _local.nested = sink, sync, 0.0
    try:
        with native.recording_parts(None if sink is None else _part):
            yield
    finally:
        _local.sink, _local.sync, _local.nested = previous


@contextmanager
def record(sync: Callable[[], None] | None = None) -> Iterator[dict[str, float]]:
    """Collect stage times of this thread's work inside the block into the yielded dict (seconds)."""
    sink: dict[str, float] = defaultdict(float)
    with _recording(sink, sync):
        yield sink


def paused():
    """No stage of this thread records inside the block (e.g. while a CUDA graph captures: no synchronize)."""
    return _recording(None, None)
