"""Depthwise causal conv1d + SiLU over a token sequence: a fast [T, C]-layout version and its reference.

Registers the "conv1d" op (`kernels.registry`), its kernels all fn(x [T, C], weight [C, W], cu_seqlens: list[int]
| None, cu_seqlens_device: torch.Tensor | None) -> [T, C]: the C kernel on the CPU and the torch shifted
multiply-adds everywhere (float32 out: they feed the float32 chunked rule); flash-linear-attention's Triton conv
on CUDA for bf16/fp16 (out in x's dtype, rounded once: it feeds fla's bf16 gated delta rule) is registered on it by
`kernels.gated_delta.fla`, beside fla's rule. `causal_conv1d_silu` is the op: a float32 result from the first two,
x's dtype from fla's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pixeltriage.kernels import native as _native
from pixeltriage.kernels import registry


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """x: [T, C]; weight: [C, W] -> silu(sum_j x[t - W + 1 + j] * w[:, j]): [T, C], by the "conv1d" op's kernel
    (float32 from the CPU's kernels; fla's on CUDA returns x's dtype, see the module).

    cu_seqlens: [0, t1, ..., T] for several sequences packed along T: no sequence sees another's tokens."""
    return CONV1D(x, weight, cu_seqlens)


def conv1d_silu_torch(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None,
                      cu_seqlens_device: torch.Tensor | None = None, *, chunk_indices: torch.Tensor | None = None,
                      block_rows: int = 64) -> torch.Tensor:
    """The "conv1d" op in torch: W shifted multiply-adds in the tokens-major layout the projection produced: no
    transposes, no padded copy (F.conv1d wants [C, T] and spent 2.4x longer on the layout changes than on the
    arithmetic). Accumulated and returned in float32: its outputs feed the L2 norms of q and k and the delta rule,
    all float32.
    On the CPU the rows go `block_rows` at a time (64 x 6144 float32 = 1.5 MiB, within a core's L2): each block's
    float32 copy of x (with the W - 1 rows before it) and its output stay in cache through the W passes, which made
    the bench-small conv 2.5x faster (60 -> 24 ms) than whole-sequence passes that stream 56 MiB from memory each.
    """
    if cu_seqlens is not None and len(cu_seqlens) > 2:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for b, e in zip(cu_seqlens, cu_seqlens[1:]):
            if e > b:
                out[b:e] = conv1d_silu_torch(x[b:e], weight, block_rows=block_rows)
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


def _conv_c_accepts(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None,
                    cu_seqlens_device: torch.Tensor | None = None, *, chunk_indices: torch.Tensor | None = None):
    if (x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1) or weight.dim() != 2
            or weight.shape[0] != x.shape[1]):
        return "x not [T, C] with contiguous rows, or weight not [C, W]"
    if not _native.handles(x):
        return "a device or dtype the C kernels do not take, or no C library"
    bounds = [0, x.shape[0]] if cu_seqlens is None else cu_seqlens
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(b > e for b, e in zip(bounds, bounds[1:])):
        return "boundaries that do not rise from 0 to T"
    return None


def _conv_c(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None,
            cu_seqlens_device: torch.Tensor | None = None, *, chunk_indices: torch.Tensor | None = None):
    """The "conv1d" op in C (`pt_causal_conv1d_silu`: the delta pass's own conv, 64 rows at a time; 2.3x faster than
    the torch kernel at bench-small)."""
    seq_len, channels = x.shape
    bounds = [0, seq_len] if cu_seqlens is None else list(cu_seqlens)
    taps = weight.float().t().contiguous()                            # [W, C]
    starts = torch.zeros(seq_len, dtype=torch.int64)                 # each row's sequence start
    for b, e in zip(bounds, bounds[1:]):
        starts[b:e] = b
    out = torch.empty(seq_len, channels, dtype=torch.float32)
    if seq_len == 0:
        return out
    args = _native.struct("pt_conv_args", x=x.data_ptr(), x_t=x.stride(0), x_bf16=_native.is_bf16(x),
                          taps=taps.data_ptr(), W=weight.shape[1], T=seq_len, C=channels, seg_start=starts.data_ptr())
    registry.c_call("pt_causal_conv1d_silu", args, out.data_ptr())
    return out


def causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same through F.conv1d with left padding (the textbook form), float32."""
    seq_len, channels = x.shape
    width = weight.shape[1]
    y = F.conv1d(x.float().t().unsqueeze(0), weight.float().unsqueeze(1), padding=width - 1, groups=channels)
    return F.silu(y[0, :, :seq_len]).t()


# The "conv1d" op's kernels share one signature: fn(x [T, C], weight [C, W], cu_seqlens, cu_seqlens_device=None, *,
# chunk_indices=None) -> [T, C]; the device boundaries and fla's chunk table are read by fla's kernel only.
CONV1D = registry.op("conv1d", lambda x, *args, **kwargs: (x.device, x.dtype))
NATIVE = CONV1D.register("native C pt_causal_conv1d_silu", _conv_c, accepts=_conv_c_accepts,
                         dtypes=(torch.float32, torch.bfloat16), available=lambda: _native.available(), priority=10,
                         entry="pt_causal_conv1d_silu")
TORCH = CONV1D.register("torch shifted multiply-adds", conv1d_silu_torch, devices=("cpu", "cuda"))
