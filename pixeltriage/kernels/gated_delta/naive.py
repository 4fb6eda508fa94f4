"""Plain recurrent gated delta rule in float32: the ground truth for the chunked paths."""
from __future__ import annotations

import torch


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One token at a time: S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T, o_t = S_t^T q_t scale.

    q, k: [T, H, K] (already L2-normalised; H = value heads, key heads repeated by the caller);
    v: [T, H, V]; g (log decay, <= 0), beta: [T, H]. Returns o: [T, H, V] float32 (compute_dtype: tests pass
    float64 to get the exact value the kernels approximate).
    """
    seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    scale = k_dim ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    state = q.new_zeros(num_heads, k_dim, v_dim)
    out = q.new_empty(seq_len, num_heads, v_dim)
    for t in range(seq_len):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, state)
    return out
