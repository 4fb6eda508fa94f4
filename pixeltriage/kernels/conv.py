"""Depthwise causal conv1d + SiLU over a token sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, C]; weight: [C, W] -> silu(sum_j x[t - W + 1 + j] * w[:, j]): [T, C] float32.

    Accumulated and returned in float32: its outputs feed the L2 norms of q and k and the delta rule, all
    float32, so rounding them to a low-precision dtype would only add error."""
    seq_len, channels = x.shape
    width = weight.shape[1]
    y = F.conv1d(x.float().t().unsqueeze(0), weight.float().unsqueeze(1), padding=width - 1, groups=channels)
    return F.silu(y[0, :, :seq_len]).t()
