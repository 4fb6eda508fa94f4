"""Chunked gated delta rule in PyTorch (the CPU path).

Within a chunk of C tokens the delta-rule updates are condensed with the UT transform
T = (I + tril(diag(beta) K K^T * decay, -1))^-1, so the chunk needs only matmuls; the recurrent
state [K, V] per head is carried across chunks. Intra-chunk work is batched over heads and chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Decays below e^-30 (~1e-13, far under float32's 6e-8 resolution of unit-scale terms) are set to exactly zero.
# Without the cut, strong decays (g of -10 to -40 per token is common) fill the chunk with subnormal floats, which
# x86 CPUs process ~10-100x slower: the layer ran 3.5x slower for no difference in the result.
LOG_DECAY_CUTOFF = -30.0
_TINY = 1e-18


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), exactly 0 where log_decay < LOG_DECAY_CUTOFF (and where it is -inf)."""
    return log_decay.masked_fill(log_decay < LOG_DECAY_CUTOFF, float("-inf")).exp()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    cu_seqlens: list[int] | None = None,
) -> torch.Tensor:
    """Same contract as `naive.recurrent_gated_delta_rule`.

    q, k: [T, H, K] L2-normalised; v: [T, H, V]; g (log decay), beta: [T, H]. Returns [T, H, V] float32.
    cu_seqlens: [0, t1, t1 + t2, ..., T] to run several independent sequences packed along T (varlen): each is
    padded to whole chunks on its own and the state restarts from zero at each sequence's first chunk.
    """
    seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    scale = k_dim ** -0.5 if scale is None else scale
    c = chunk_size
    bounds = [0, seq_len] if cu_seqlens is None else list(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {seq_len}, got {bounds}")
    segments = [(b, e) for b, e in zip(bounds, bounds[1:]) if e > b]
    seg_chunks = [-(-(e - b) // c) for b, e in segments]
    num_chunks = sum(seg_chunks)
    starts = set()
    n0 = 0
    for n in seg_chunks:
        starts.add(n0)
        n0 += n

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [T, H, ...] -> [N, H, C, ...] float32, chunk-major so that each chunk's slice is contiguous; each
        # sequence is zero-padded to whole chunks, which leaves the state untouched (k = 0, beta = 0, g = 0).
        x = x.float()
        pieces = []
        for (b, e), n in zip(segments, seg_chunks):
            piece, pad = x[b:e], n * c - (e - b)
            pieces.append(F.pad(piece, (0, 0, 0, 0, 0, pad) if x.dim() == 3 else (0, 0, 0, pad)) if pad else piece)
        x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        x = x.reshape(num_chunks, c, num_heads, *x.shape[2:]).transpose(1, 2)
        return x.contiguous()

    if num_chunks == 0:
        return q.new_zeros(seq_len, num_heads, v_dim, dtype=torch.float32)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    gamma = g.cumsum(-1)                                              # [N, H, C] log decay from chunk start
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = diff.masked_fill_(~causal | (diff < LOG_DECAY_CUTOFF), float("-inf")).exp_()   # [N, H, C, C]
    gamma_exp = _decay(gamma)

    k_beta = k * beta[..., None]
    strictly_lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril_(-1)
    # T = (I + strictly_lower)^-1, explicitly: solving against the 64-column identity and then two batched
    # matmuls is ~2.5x cheaper on the CPU than solving against the 256 columns [v * beta | k_beta * decay]
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + strictly_lower, eye.expand_as(strictly_lower), upper=False,
                                          unitriangular=True)
    t_inv.masked_fill_(t_inv.abs() < _TINY, 0.0)  # products of decays underflow: zero, not subnormal
    u = t_inv @ (v * beta[..., None])                                 # [N, H, C, V]
    w = t_inv @ (k_beta * gamma_exp[..., None])                       # [N, H, C, K]
    q = q * scale
    intra = (q @ k.transpose(-1, -2)) * decay                         # [N, H, C, C], causal incl. diagonal
    k_to_end_t = (k * _decay(gamma[..., -1:] - gamma)[..., None]).transpose(-1, -2).contiguous()  # [N, H, K, C]
    chunk_decay = gamma_exp[..., -1][..., None, None]                 # [N, H, 1, 1]
    # out_n = q_n' S_n + intra_n (u_n - w_n S_n) = (q_n' - intra_n w_n) S_n + intra_n u_n, with S_n the state
    # entering chunk n: everything but S_n is batched over chunks, and the sequential loop keeps two small
    # matmuls per chunk (the new values and the state update, written in place into the states buffer); the
    # outputs come from one batched matmul after it.
    q_state = q * gamma_exp[..., None] - intra @ w                    # [N, H, C, K]
    q_state.masked_fill_(q_state.abs() < _TINY, 0.0)                  # the difference can cancel into subnormals
    out = intra @ u                                                   # [N, H, C, V]
    states = q.new_empty(num_chunks + 1, num_heads, k_dim, v_dim)     # states[n]: the state entering chunk n
    for n in range(num_chunks):
        if n in starts:
            states[n].zero_()                                         # a new sequence starts from no memory
        v_new = torch.baddbmm(u[n], w[n], states[n], beta=1, alpha=-1)
        torch.mul(states[n], chunk_decay[n], out=states[n + 1])
        states[n + 1].baddbmm_(k_to_end_t[n], v_new)
    out += q_state @ states[:num_chunks]
    out = out.transpose(1, 2).reshape(num_chunks * c, num_heads, v_dim)
    if len(segments) == 1 and segments[0] == (0, seq_len):
        return out[:seq_len]
    result = out.new_empty(seq_len, num_heads, v_dim)        # the segments cover every row
    n0 = 0
    for (b, e), n in zip(segments, seg_chunks):
        result[b:e] = out[n0 * c:n0 * c + (e - b)]
        n0 += n
    return result
