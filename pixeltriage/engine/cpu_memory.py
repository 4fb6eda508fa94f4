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
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_THRESHOLD = 32 * 2 ** 20
TRIM_THRESHOLD = 2 ** 30


@functools.cache
def tune_malloc() -> bool:
    """Apply the settings once per process; True when they are in effect (glibc on Linux, not opted out)."""
    if os.environ.get("PIXELTRIAGE_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "off", "no"):
        log.debug("malloc tuning disabled by PIXELTRIAGE_MALLOC_TUNING")
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:                         # find_library runs ldconfig: only when needed
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        applied = (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                   and bool(mallopt(M_MMAP_MAX, 0)))
    except (OSError, AttributeError) as e:     # not glibc (musl has no mallopt), or no libc found
        log.debug("malloc tuning unavailable: %s", e)
        return False
    if applied:
        log.debug("malloc tuned: mmap threshold %d B, trim threshold %d B", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return applied
