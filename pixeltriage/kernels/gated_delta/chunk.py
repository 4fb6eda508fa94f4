"""Chunked gated delta rule in PyTorch (the CPU path).

Within a chunk of C tokens the delta-rule updates are condensed with the UT transform
T = (I + tril(diag(beta) K K^T * decay, -1))^-1, so the chunk needs only matmuls; the recurrent
state [K, V] per head is carried across chunks. Intra-chunk work is batched over heads and chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Same contract as `naive.recurrent_gated_delta_rule`.

    q, k: [T, H, K] L2-normalised; v: [T, H, V]; g (log decay), beta: [T, H]. Returns [T, H, V] float32.
    """
    seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    scale = k_dim ** -0.5 if scale is None else scale
    c = chunk_size
    pad = (-seq_len) % c
    num_chunks = (seq_len + pad) // c

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [T, H, ...] -> [H, N, C, ...] float32; zero padding leaves the state untouched (k = 0, beta = 0, g = 0).
        x = x.float().transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(num_heads, num_chunks, c, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    gamma = g.cumsum(-1)                                              # [H, N, C] log decay from chunk start
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]

    k_beta = k * beta[..., None]
    strictly_lower = (k_beta @ k.transpose(-1, -2)) * decay
    strictly_lower = strictly_lower.tril(-1)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    ut = torch.linalg.solve_triangular(
        eye + strictly_lower, torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], dim=-1),
        upper=False, unitriangular=True,
    )
    u, w = ut.split([v_dim, k_dim], dim=-1)                           # [H, N, C, V], [H, N, C, K]
    q = q * scale
    intra = (q @ k.transpose(-1, -2)) * decay                         # [H, N, C, C], causal incl. diagonal
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]               # [H, N, 1, 1]

    out = torch.empty(num_heads, num_chunks, c, v_dim, dtype=q.dtype, device=q.device)
    state = q.new_zeros(num_heads, k_dim, v_dim)
    for n in range(num_chunks):
        v_new = u[:, n] - w[:, n] @ state
        out[:, n] = q_decayed[:, n] @ state + intra[:, n] @ v_new
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ v_new
    return out.reshape(num_heads, -1, v_dim)[:, :seq_len].transpose(0, 1)
