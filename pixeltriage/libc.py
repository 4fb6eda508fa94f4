"""The C library's functions that torch does not call for us (malloc's settings and trim, madvise), typed."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)


@functools.cache
def libc_function(name: str, argtypes: tuple, restype):
    """`name` from the C library on Linux, typed; None where it is missing (not Linux; not glibc: musl has no
    mallopt or malloc_trim; no libc found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:                         # find_library runs ldconfig: only when needed
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
    except (OSError, AttributeError) as e:
        log.debug("%s unavailable: %s", name, e)
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function
