"""Plain PyTorch decision head: the ground truth for the fused kernels."""
from __future__ import annotations

from typing import NamedTuple

import torch


class HeadOutput(NamedTuple):
    p_vis: torch.Tensor           # [B] float32
    gains: torch.Tensor           # [M] float32, memories of all states concatenated
    relevance: torch.Tensor       # [M] float32
    relevance_none: torch.Tensor  # [B] float32


def final_norm_rows(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Zero-centred RMSNorm of the selected rows, in float32 (float64 when tests ask for it).

    hidden: [T, H] last decoder output (before the final norm); rows: [R] long -> [R, H] compute_dtype.
    """
    x = hidden.index_select(0, rows).to(compute_dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * (1.0 + norm_weight.to(compute_dtype))


def decision_head_reference(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_decision: torch.Tensor,
    w_candidate: torch.Tensor,
    decision_rows: torch.Tensor,
    binary_rows: torch.Tensor,
    none_rows: torch.Tensor,
    marker_rows: torch.Tensor,
    marker_offsets: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> HeadOutput:
    """Bilinear decision head over a batch of packed states.

    hidden: [T, H] last decoder output of all states packed along T (before the final norm).
    w_decision, w_candidate: [D, H]. Logits l_j = (W_d h_d) . (W_c h_j) / sqrt(D), in float32.
    decision_rows: [B, 3] rows of the decision positions (q1 p_vis, q2 gains, q3 relevance).
    binary_rows: [B, 2] rows of the `true` and `false` candidates.
    none_rows: [B, 2] rows of the gain question's and the relevance question's `none` candidates.
    marker_rows: [M] rows of every memory marker; state b owns marker_rows[marker_offsets[b]:marker_offsets[b+1]].
    compute_dtype: float32 (the engine's semantics); tests pass float64 to get the exact value the kernels
    approximate. The outputs are in compute_dtype.
    """
    num_states = decision_rows.shape[0]
    dim = w_decision.shape[0]
    scale = dim ** -0.5
    wd, wc = w_decision.to(compute_dtype), w_candidate.to(compute_dtype)

    def normed(rows: torch.Tensor) -> torch.Tensor:
        return final_norm_rows(hidden, rows, norm_weight, eps, compute_dtype)

    dec = normed(decision_rows.reshape(-1)) @ wd.t()                                        # [B*3, D]
    dec = dec.view(num_states, 3, dim)
    binary = (normed(binary_rows.reshape(-1)) @ wc.t()).view(num_states, 2, dim)
    none = (normed(none_rows.reshape(-1)) @ wc.t()).view(num_states, 2, dim)
    markers = normed(marker_rows) @ wc.t()                                                  # [M, D]

    l_binary = (dec[:, 0:1] * binary).sum(-1) * scale                                      # [B, 2]
    p_vis = torch.softmax(l_binary, dim=-1)[:, 0]
    l_none_gain = (dec[:, 1] * none[:, 0]).sum(-1) * scale                                 # [B]
    l_none_rel = (dec[:, 2] * none[:, 1]).sum(-1) * scale                                  # [B]

    counts = (marker_offsets[1:] - marker_offsets[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(num_states, device=hidden.device), counts)  # [M]
    l_gain = (dec[owner, 1] * markers).sum(-1) * scale
    l_rel = (dec[owner, 2] * markers).sum(-1) * scale
    gains = torch.sigmoid(l_gain - l_none_gain[owner])

    # Softmax over (markers of state b, none of state b), stabilised by the per-state max.
    neg_inf = torch.full((num_states,), float("-inf"), dtype=compute_dtype, device=hidden.device)
    state_max = neg_inf.scatter_reduce(0, owner, l_rel, reduce="amax", include_self=True)
    state_max = torch.maximum(state_max, l_none_rel)
    e_rel = torch.exp(l_rel - state_max[owner])
    e_none = torch.exp(l_none_rel - state_max)
    denom = e_none.scatter_add(0, owner, e_rel)
    return HeadOutput(p_vis, gains, e_rel / denom[owner], e_none / denom)
