"""Depthwise causal conv1d + SiLU over a token sequence: a fast [T, C]-layout version and its reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """x: [T, C]; weight: [C, W] -> silu(sum_j x[t - W + 1 + j] * w[:, j]): [T, C] float32.

    cu_seqlens: [0, t1, ..., T] for several sequences packed along T: no sequence sees another's tokens.

    W shifted multiply-adds in the tokens-major layout the projection produced: no transposes, no padded copy
    (F.conv1d wants [C, T] and spent 2.4x longer on the layout changes than on the arithmetic). Accumulated and
    returned in float32: its outputs feed the L2 norms of q and k and the delta rule, all float32.
    """
    if cu_seqlens is not None and len(cu_seqlens) > 2:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for b, e in zip(cu_seqlens, cu_seqlens[1:]):
            if e > b:
                out[b:e] = causal_conv1d_silu(x[b:e], weight)
        return out
    width = weight.shape[1]
    xf, w = x.float(), weight.float()
    y = xf * w[:, width - 1]
    for j in range(width - 1):
        shift = width - 1 - j
        if shift < xf.shape[0]:
            y[shift:].addcmul_(xf[:-shift], w[:, j])
    return F.silu(y, inplace=True)


def causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same through F.conv1d with left padding (the textbook form), float32."""
    seq_len, channels = x.shape
    width = weight.shape[1]
    y = F.conv1d(x.float().t().unsqueeze(0), weight.float().unsqueeze(1), padding=width - 1, groups=channels)
    return F.silu(y[0, :, :seq_len]).t()
