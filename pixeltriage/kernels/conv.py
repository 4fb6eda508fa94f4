"""Depthwise causal conv1d + SiLU over a token sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, C]; weight: [C, W] -> silu(sum_j x[t - W + 1 + j] * w[:, j]): [T, C], in x's dtype."""
    seq_len, channels = x.shape
    width = weight.shape[1]
    y = F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1).to(x.dtype), padding=width - 1, groups=channels)
    return F.silu(y[0, :, :seq_len]).t()
