"""glibc malloc settings for CPU inference: `tune_malloc()`, called by the process that owns its memory.

The forward allocates and frees many tensors of 1-100 MiB per layer. glibc serves a large block with a fresh
mmap and unmaps it on free, so every such tensor pays page faults on first touch, and returns heap memory to the
OS as soon as 128 KiB lie free at its top. Serving every block from the heap (no mmap: M_MMAP_MAX = 0, the
threshold at its 32 MiB ceiling for good measure) and keeping up to 1 GiB of freed heap makes the same buffers
come back warm: measured on the bench-small Gated DeltaNet layer, the delta rule 250 -> 200 ms and the conv
97 -> 60 ms; at the 2b shape the conv (56 MiB blocks, above any mmap threshold) 100 -> 44-65 ms.
The cost is that freed memory stays with the process (RSS holds its high-water mark, up to 1 GiB more).

The settings are process-wide and cannot be undone, so loading a Scorer never applies them: a host that embeds
the engine calls `pixeltriage.tune_malloc()` once if it wants them. The engine's own processes (the command
line, the server, the benchmarks) call it; PIXELTRIAGE_MALLOC_TUNING=0 turns it off there too (e.g. under
jemalloc, or where the host tunes malloc itself).

`trim_malloc()` gives the free memory back at a moment of the caller's choosing (glibc's `malloc_trim(0)`: the
free top of every arena, and every free page inside them). The server calls it once it has been idle for a second
after serving, after releasing its Scorer's workspace (`kernels.workspace`): the memory its requests freed (a 4 MiB
body parsed, thrown away as a 422) no longer stays with the process under the settings above, at the cost of a
colder first forward after the pause.
PIXELTRIAGE_MALLOC_TRIM=0 turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import logging

from pixeltriage import settings
from pixeltriage.libc import libc_function

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_THRESHOLD = 32 * 2 ** 20
TRIM_THRESHOLD = 2 ** 30


@functools.cache
def tune_malloc() -> bool:
    """Apply the settings once per process; True when they are in effect (glibc on Linux, not opted out)."""
    if not settings.current().malloc_tuning:
        log.debug("malloc tuning disabled by PIXELTRIAGE_MALLOC_TUNING")
        return False
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:
        return False
    applied = (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
               and bool(mallopt(M_MMAP_MAX, 0)))
    if applied:
        log.debug("malloc tuned: mmap threshold %d B, trim threshold %d B", MMAP_THRESHOLD, TRIM_THRESHOLD)
        from pixeltriage.kernels import tuning

        tuning.malloc_tuned = True          # part of the machine key: the choices this process measures and follows
    return applied


def can_trim() -> bool:
    """Whether `trim_malloc` gives memory back here (glibc on Linux, PIXELTRIAGE_MALLOC_TRIM not 0)."""
    return settings.current().malloc_trim and libc_function(
        "malloc_trim", (ctypes.c_size_t,), ctypes.c_int) is not None


def trim_malloc() -> bool:
    """Give malloc's free memory back to the OS now (glibc's `malloc_trim(0)`, every arena); False where there is
    no such call (not glibc on Linux) or PIXELTRIAGE_MALLOC_TRIM=0. Safe from any thread: glibc locks each arena
    while it trims it."""
    if not can_trim():
        return False
    libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)(0)
    return True
