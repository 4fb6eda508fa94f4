"""Buffers the CPU forward writes its largest intermediates into, kept from one layer and one forward to the next.

A decoder layer's widest outputs (the Gated DeltaNet's in_proj, attention's qkv, the MLP's gate_up and its SwiGLU
product: 14-56 MB each at 2296 tokens) are allocated and freed once per layer. glibc maps a block over its mmap
threshold (at most 32 MiB) afresh every time and hands freed heap back to the OS past its trim threshold, so each of
them meets new pages: page faults and the kernel's zeroing on first touch. `tune_malloc()` stops that process-wide;
a host that embeds the engine need not call it. A Workspace keeps one buffer per role instead, so the same pages
come back warm in every layer and forward whatever malloc does (as llama.cpp's graph allocator reuses one compute
buffer).

The kernels take a role where they can write into a buffer (`linear(..., into="qkv")`, `silu_mul(..., into=)`):
torch's product (not oneDNN's primitive, which has no output argument) and the SwiGLU passes. The Scorer makes its
workspace active around each forward:

    with scorer.workspace.active():
        qkv = linear(x, w, into="qkv")          # the role's buffer, or a new tensor where none is active

`take` returns None outside an active workspace, on a device other than the CPU (CUDA has its caching allocator),
or with `PIXELTRIAGE_WORKSPACE=0`; the kernels then allocate as before. A role's buffer is overwritten by the next
take of that role: each role's tensor must be consumed before its next take (one layer at a time does). A Workspace
serves one forward at a time: another thread's forward meanwhile runs without it (allocating as before), so a
thread-safe Scorer stays thread-safe. The buffers hold the largest size each role has seen, up to `max_bytes` in
all (256 MiB by default), until `release()`, which waits for a forward in flight.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from typing import Iterator, Sequence

import torch

from pixeltriage import settings

SWITCH = "PIXELTRIAGE_WORKSPACE"
# What a workspace holds at most: the CPU's 4096-token forwards need ~180 MiB at bench-small's widths (in_proj 64,
# gate_up 48, qkv 40, the SwiGLU product 24), ~250 MiB at 2b's with its MLP whole (gate_up 96, the product 48; ~140
# in 1024-row blocks). A role's buffer that would take the total past it is not kept: that forward allocates it as
# it would without a workspace.
MAX_BYTES = 256 * 2 ** 20

_ACTIVE: contextvars.ContextVar["Workspace | None"] = contextvars.ContextVar("pixeltriage_workspace", default=None)


def enabled() -> bool:
    """Whether forwards use a workspace (PIXELTRIAGE_WORKSPACE, `pixeltriage.settings`: unless off), asked at each
    forward."""
    return settings.current().workspace


class Workspace:
    """One buffer per role, grown to the largest request, for one forward at a time (see the module); at most
    `max_bytes` in all (settable)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def active(self) -> Iterator[bool]:
        """Make this workspace the one `take` serves in this thread (and context) for the block; yields whether it
        is. False (switched off, or another forward holds it, which then keeps it, a forward of this thread's
        included): no workspace serves the block, so a forward nested in another never takes the outer one's
        buffers."""
        acquired = enabled() and self._lock.acquire(blocking=False)
        token = _ACTIVE.set(self if acquired else None)
        try:
            yield acquired
        finally:
            _ACTIVE.reset(token)
            if acquired:
                self._lock.release()

    def take(self, role: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype` on `role`'s buffer (grown if smaller), or
        None where growing it would hold more than `max_bytes` in all (the role's buffer stays as it was)."""
        if any(n < 0 for n in shape):
            raise ValueError(f"workspace role {role!r}: negative size in shape {tuple(shape)}")
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < nbytes:
            if self.nbytes - (0 if buf is None else buf.numel()) + nbytes > self.max_bytes:
                return None
            self._buffers.pop(role, None)             # the old buffer's memory goes before the new one is taken
            buf = self._buffers[role] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(tuple(shape))

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        return sum(b.numel() for b in self._buffers.values())

    def release(self) -> int:
        """Drop every buffer (after a forward in flight, if any); returns the bytes dropped. The next forward takes
        them anew."""
        with self._lock:
            freed = self.nbytes
            self._buffers.clear()
        return freed


def take(role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """The active workspace's buffer for `role` (`Workspace.take`), or None: no workspace active in this context,
    `device` is not the CPU (CUDA has its caching allocator), or the buffer would take the workspace past its
    `max_bytes`."""
    workspace = _ACTIVE.get()
    if workspace is None or torch.device(device).type != "cpu":
        return None
    return workspace.take(role, shape, dtype)
