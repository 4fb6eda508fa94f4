"""Depthwise causal conv1d + SiLU over a token sequence: a fast [T, C]-layout version and its reference.

Registers the "conv1d" op (`kernels.registry`), its kernels all fn(x [T, C], weight [C, W], cu_seqlens: list[int]
| None, cu_seqlens_device: torch.Tensor | None) -> [T, C]: the C kernel on the CPU and the torch shifted
multiply-adds everywhere (float32 out: they feed the float32 chunked rule), flash-linear-attention's Triton conv
on CUDA for bf16/fp16 (out in x's dtype, rounded once: it feeds fla's bf16 gated delta rule). `causal_conv1d_silu`
chooses between the first two only: its contract is a float32 result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pixeltriage.kernels import native as _native
from pixeltriage.kernels import registry


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None,
                       block_rows: int = 64, native: bool | None = None) -> torch.Tensor:
    """x: [T, C]; weight: [C, W] -> silu(sum_j x[t - W + 1 + j] * w[:, j]): [T, C] float32.

    cu_seqlens: [0, t1, ..., T] for several sequences packed along T: no sequence sees another's tokens.
    native: on the CPU, the C kernel (`kernels.native`: the delta pass's own conv, 64 rows at a time; 2.3x faster at
    bench-small) when it is built (None: whenever available; False: the torch path below, which it is tested
    against).

    W shifted multiply-adds in the tokens-major layout the projection produced: no transposes, no padded copy
    (F.conv1d wants [C, T] and spent 2.4x longer on the layout changes than on the arithmetic). Accumulated and
    returned in float32: its outputs feed the L2 norms of q and k and the delta rule, all float32.
    On the CPU the rows go `block_rows` at a time (64 x 6144 float32 = 1.5 MiB, within a core's L2): each block's float32
    copy of x (with the W - 1 rows before it) and its output stay in cache through the W passes, which made the
    bench-small conv 2.5x faster (60 -> 24 ms) than whole-sequence passes that stream 56 MiB from memory each.
    """
    if native is not False and registry.choose("conv1d", x.device, x.dtype) is NATIVE:
        out = _native_conv1d_silu(x, weight, cu_seqlens)
        if out is not None:
            return out
    if cu_seqlens is not None and len(cu_seqlens) > 2:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for b, e in zip(cu_seqlens, cu_seqlens[1:]):
            if e > b:
                out[b:e] = causal_conv1d_silu(x[b:e], weight, block_rows=block_rows, native=False)
        return out
    seq_len, channels = x.shape
    width = weight.shape[1]
    if x.device.type != "cpu":                # blocks pay for caches; on a GPU they would only add launches
        block_rows = max(seq_len, 1)
    taps = weight.float().t().contiguous()                            # [W, C]: tap j's weights contiguous
    out = torch.empty(seq_len, channels, dtype=torch.float32, device=x.device)
    window = torch.empty(min(block_rows, seq_len) + width - 1, channels, dtype=torch.float32, device=x.device)
    for b in range(0, seq_len, block_rows):
        e = min(seq_len, b + block_rows)
        n, halo = e - b, min(b, width - 1)                            # halo: rows before the block it reads
        rows = window[:halo + n]
        rows.copy_(x[b - halo:e])
        y = torch.mul(rows[halo:], taps[width - 1], out=out[b:e])
        for j in range(width - 1):                                    # y[t] += x[t - shift] * w[:, j]
            lag = width - 1 - j - halo                                # > 0: the first `lag` rows read before
            if lag <= 0:                                              # the sequence (zero padding): skipped
                y.addcmul_(rows[-lag:n - lag], taps[j])
            elif lag < n:
                y[lag:].addcmul_(rows[:n - lag], taps[j])
        F.silu(y, inplace=True)
    return out


def _native_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None) -> torch.Tensor | None:
    """The C kernel's result, or None where it does not apply (no library, other dtypes, strided columns)."""
    from pixeltriage.kernels import native

    if (x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1) or weight.dim() != 2 or weight.shape[0] != x.shape[1]
            or not native.handles(x)):
        return None
    seq_len, channels = x.shape
    bounds = [0, seq_len] if cu_seqlens is None else list(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b > e for b, e in zip(bounds, bounds[1:])):
        return None                                                   # the torch path's behaviour, not ours
    taps = weight.float().t().contiguous()                            # [W, C]
    starts = torch.zeros(seq_len, dtype=torch.int64)                 # each row's sequence start
    for b, e in zip(bounds, bounds[1:]):
        starts[b:e] = b
    out = torch.empty(seq_len, channels, dtype=torch.float32)
    if seq_len == 0:
        return out
    args = native.struct("pt_conv_args", x=x.data_ptr(), x_t=x.stride(0), x_bf16=native.is_bf16(x),
                         taps=taps.data_ptr(), W=weight.shape[1], T=seq_len, C=channels, seg_start=starts.data_ptr())
    return out if native.call("pt_causal_conv1d_silu", args, out.data_ptr()) == 0 else None


def causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same through F.conv1d with left padding (the textbook form), float32."""
    seq_len, channels = x.shape
    width = weight.shape[1]
    y = F.conv1d(x.float().t().unsqueeze(0), weight.float().unsqueeze(1), padding=width - 1, groups=channels)
    return F.silu(y[0, :, :seq_len]).t()


# The "conv1d" op's kernels share one signature: fn(x [T, C], weight [C, W], cu_seqlens, cu_seqlens_device=None, *,
# chunk_indices=None) -> [T, C]; the device boundaries and fla's chunk table are read by fla's kernel only.
def _conv_native(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None,
                 cu_seqlens_device: torch.Tensor | None = None, *, chunk_indices: torch.Tensor | None = None):
    return causal_conv1d_silu(x, weight, cu_seqlens)


def _conv_torch(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None,
                cu_seqlens_device: torch.Tensor | None = None, *, chunk_indices: torch.Tensor | None = None):
    return causal_conv1d_silu(x, weight, cu_seqlens, native=False)


NATIVE = registry.register("conv1d", "native C pt_causal_conv1d_silu", _conv_native, devices=("cpu",),
                           dtypes=(torch.float32, torch.bfloat16), available=lambda: _native.available(),
                           priority=10)
TORCH = registry.register("conv1d", "torch shifted multiply-adds", _conv_torch, devices=("cpu", "cuda"))


def _fla_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None,
              cu_seqlens_device: torch.Tensor | None = None, *, chunk_indices: torch.Tensor | None = None):
    from pixeltriage.kernels.gated_delta.fla import causal_conv1d_silu_fla

    return causal_conv1d_silu_fla(x, weight, cu_seqlens, cu_seqlens_device, chunk_indices=chunk_indices)


def _fla_conv_available() -> bool:
    from pixeltriage.kernels.gated_delta.fla import conv_available

    return conv_available()


FLA_CONV = registry.register("conv1d", "fla causal_conv1d", _fla_conv, devices=("cuda",),
                             dtypes=(torch.bfloat16, torch.float16), available=_fla_conv_available, priority=20,
                             package="flash-linear-attention>=0.6")
