"""Giving back the resident pages of file-mapped tensors nothing reads any more.

A checkpoint's tensors are views of its files, mapped into the process (safetensors' `safe_open`, a packed file's
`mapped()`); each page read stays resident, and counted in the process's RSS, for as long as the mapping lives, which
is as long as any tensor of the file does. Tensors the load replaced by copies (fused into one weight, cast to the
engine's dtype, moved to a GPU) and weights reordered into copies (`kernels.prepack`) would so keep their pages to
the end: at 2b, a directory load's 4.2 GiB of file pages next to its 2.0 GiB of fused copies, all of them still
resident after the first forward's reorder. `drop_file_pages` lets the OS take such pages back (madvise
MADV_DONTNEED over the whole pages inside each tensor's bytes). Pages of a file mapping are clean copies of the file
unless written, and nothing writes a checkpoint's tensors, so should anything read those bytes again they are read
from the file again, the same values; memory that is not a file's (the heap, anonymous mappings) is never touched,
since dropping it would zero it.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Iterable

import torch

from pixeltriage.libc import libc_function


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of each of this process's mappings of a file (/proc/self/maps: a path, not [heap], [stack] or
    an anonymous region); [] where there is no such table."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    spans.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return spans


def drop_file_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Drop this process's resident pages of `tensors` where they are views of a mapped file: the whole pages
    inside each one's bytes (pages it shares with its neighbours stay). CPU tensors in other memory, strided views
    (whose bytes interleave with others') and other devices' tensors are left alone. -> the bytes dropped."""
    madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    page, ranges = mmap.PAGESIZE, []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            continue
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        first, last = -(-begin // page) * page, end // page * page       # whole pages inside [begin, end)
        if last > first:
            ranges.append((begin, end, first, last))
    if madvise is None or not ranges:         # small tensors (norms, biases) hold no whole page: no table read
        return 0
    spans, dropped = file_mappings(), 0
    for begin, end, first, last in ranges:
        if any(start <= begin and end <= stop for start, stop in spans) and \
                madvise(first, last - first, mmap.MADV_DONTNEED) == 0:
            dropped += last - first
    return dropped
