"""Fused decision head in Triton: one launch per batch, one program per packed state.

Each program computes its state's three decision vectors q_k = W_d norm(h_k) / sqrt(D) once, then folds them
through W_c (u_k = W_c^T q_k, [H]) so that every candidate logit is a dot product over H:
l_kj = (W_d h_k) . (W_c h_j) / sqrt(D) = norm(h_j) . u_k. That reads W_d and W_c once per state and costs
6 H D + 3 R H multiply-adds for R candidate rows instead of (3 + R) H D. The final norm is a per-row scalar,
so it is applied after the reductions: W (x * r * (1 + w)) = r * W (x * (1 + w)).

The relevance softmax runs online over tiles of candidate rows (any number of memories per state); the raw
marker logits are parked in the `relevance` output and rescaled by a second pass of the same program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels.head.reference import HeadOutput

# Candidate positions of a state: its fixed candidates first, then its memory markers.
NUM_FIXED = tl.constexpr(4)  # true, false, none of the gain question, none of the relevance question


@triton.jit
def decision_head_kernel(
    hidden,
    norm_weight,
    w_decision,
    w_candidate,
    decision_rows,
    binary_rows,
    none_rows,
    marker_rows,
    marker_offsets,
    p_vis,
    gains,
    relevance,
    relevance_none,
    stride_t,
    H,
    D,
    eps,
    scale,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D
    o_r = tl.arange(0, BLOCK_R)

    # Decision vectors of the three questions: q1 -> p_vis, q2 -> gains, q3 -> relevance.
    p_x1 = hidden + tl.load(decision_rows + i_b * 3 + 0) * stride_t
    p_x2 = hidden + tl.load(decision_rows + i_b * 3 + 1) * stride_t
    p_x3 = hidden + tl.load(decision_rows + i_b * 3 + 2) * stride_t
    b_q1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_q2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_q3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_ss1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_ss2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_ss3 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        b_g = 1.0 + tl.load(norm_weight + o_h, mask=m_h, other=0.0).to(tl.float32)
        p_w = w_decision + o_d[:, None] * H + o_h[None, :]
        b_w = tl.load(p_w, mask=m_d[:, None] & m_h[None, :], other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_H]
        b_x1 = tl.load(p_x1 + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_x2 = tl.load(p_x2 + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_x3 = tl.load(p_x3 + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_q1 += tl.sum(b_w * (b_x1 * b_g)[None, :], axis=1)
        b_q2 += tl.sum(b_w * (b_x2 * b_g)[None, :], axis=1)
        b_q3 += tl.sum(b_w * (b_x3 * b_g)[None, :], axis=1)
        b_ss1 += b_x1 * b_x1
        b_ss2 += b_x2 * b_x2
        b_ss3 += b_x3 * b_x3
    b_q1 *= tl.rsqrt(tl.sum(b_ss1) / H + eps) * scale
    b_q2 *= tl.rsqrt(tl.sum(b_ss2) / H + eps) * scale
    b_q3 *= tl.rsqrt(tl.sum(b_ss3) / H + eps) * scale

    marker_start = tl.load(marker_offsets + i_b)
    num_markers = tl.load(marker_offsets + i_b + 1) - marker_start
    b_true = tl.zeros([], dtype=tl.float32)
    b_false = tl.zeros([], dtype=tl.float32)
    b_none_gain = tl.zeros([], dtype=tl.float32)
    b_none_rel = tl.zeros([], dtype=tl.float32)
    # Online softmax of the relevance question over (markers, none): running max and running sum.
    b_max = tl.full([], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([], dtype=tl.float32)
    # The first tile holds the fixed candidates, so their logits are known before any marker needs them.
    for i_r in range(0, tl.cdiv(num_markers + NUM_FIXED, BLOCK_R)):
        o_c = i_r * BLOCK_R + o_r
        m_fixed = o_c < NUM_FIXED
        m_marker = (o_c >= NUM_FIXED) & (o_c < num_markers + NUM_FIXED)
        o_m = marker_start + o_c - NUM_FIXED
        b_row_binary = tl.load(binary_rows + i_b * 2 + o_c, mask=o_c < 2, other=0)
        b_row_none = tl.load(none_rows + i_b * 2 + o_c - 2, mask=(o_c >= 2) & m_fixed, other=0)
        b_row_marker = tl.load(marker_rows + o_m, mask=m_marker, other=0)
        b_rows = tl.where(o_c < 2, b_row_binary, tl.where(m_fixed, b_row_none, b_row_marker))
        m_row = m_fixed | m_marker

        b_a1 = tl.zeros([BLOCK_R], dtype=tl.float32)
        b_a2 = tl.zeros([BLOCK_R], dtype=tl.float32)
        b_a3 = tl.zeros([BLOCK_R], dtype=tl.float32)
        b_ss = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            o_h = h0 + tl.arange(0, BLOCK_H)
            m_h = o_h < H
            b_g = 1.0 + tl.load(norm_weight + o_h, mask=m_h, other=0.0).to(tl.float32)
            p_w = w_candidate + o_d[:, None] * H + o_h[None, :]
            b_w = tl.load(p_w, mask=m_d[:, None] & m_h[None, :], other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_H]
            b_u1 = tl.sum(b_w * b_q1[:, None], axis=0) * b_g
            b_u2 = tl.sum(b_w * b_q2[:, None], axis=0) * b_g
            b_u3 = tl.sum(b_w * b_q3[:, None], axis=0) * b_g
            p_x = hidden + b_rows[:, None] * stride_t + o_h[None, :]
            b_x = tl.load(p_x, mask=m_row[:, None] & m_h[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_H]
            b_a1 += tl.sum(b_x * b_u1[None, :], axis=1)
            b_a2 += tl.sum(b_x * b_u2[None, :], axis=1)
            b_a3 += tl.sum(b_x * b_u3[None, :], axis=1)
            b_ss += tl.sum(b_x * b_x, axis=1)
        b_r = tl.rsqrt(b_ss / H + eps)
        b_l1 = b_a1 * b_r
        b_l2 = b_a2 * b_r
        b_l3 = b_a3 * b_r

        # Non-zero in the first tile only.
        b_true += tl.sum(tl.where(o_c == 0, b_l1, 0.0))
        b_false += tl.sum(tl.where(o_c == 1, b_l1, 0.0))
        b_none_gain += tl.sum(tl.where(o_c == 2, b_l2, 0.0))
        b_none_rel += tl.sum(tl.where(o_c == 3, b_l3, 0.0))

        tl.store(gains + o_m, tl.sigmoid(b_l2 - b_none_gain), mask=m_marker)
        tl.store(relevance + o_m, b_l3, mask=m_marker)
        b_l_rel = tl.where(m_marker | (o_c == 3), b_l3, float("-inf"))
        b_max_new = tl.maximum(b_max, tl.max(b_l_rel, axis=0))
        b_sum = b_sum * tl.exp(b_max - b_max_new) + tl.sum(tl.exp(b_l_rel - b_max_new))
        b_max = b_max_new

    tl.store(p_vis + i_b, tl.sigmoid(b_true - b_false))
    tl.store(relevance_none + i_b, tl.exp(b_none_rel - b_max) / b_sum)
    # The raw logits were stored by other threads of this program.
    tl.debug_barrier()
    for i_r in range(0, tl.cdiv(num_markers, BLOCK_R)):
        o_k = i_r * BLOCK_R + o_r
        m_k = o_k < num_markers
        b_l = tl.load(relevance + marker_start + o_k, mask=m_k, other=0.0)
        tl.store(relevance + marker_start + o_k, tl.exp(b_l - b_max) / b_sum, mask=m_k)


def interpreter_ready() -> bool:
    """Whether kernels run in Triton's interpreter: TRITON_INTERPRET=1 was set before triton was first imported."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(decision_head_kernel, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"decision head: {name} expected shape {list(shape)}, found {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"decision head: {name} expected dtype in {[str(d) for d in dtypes]}, found {t.dtype}")
    if t.device != device:
        raise ValueError(f"decision head: {name} expected on {device} (where hidden is), found {t.device}")


def _block_sizes(dim: int, hidden_size: int) -> tuple[int, int, int]:
    """BLOCK_D covers D; BLOCK_H keeps a [BLOCK_D, BLOCK_H] weight tile at <= 8K elements (32 at D = 256)."""
    block_d = triton.next_power_of_2(dim)
    block_h = max(16, min(64, 8192 // block_d, triton.next_power_of_2(hidden_size)))
    return block_d, block_h, 64


def decision_head_triton(
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
    *,
    out: HeadOutput | None = None,
) -> HeadOutput:
    """Fused decision head; the same contract as `decision_head_reference`, in one launch.

    hidden: [T, H] bf16/fp16/fp32 with unit stride along H; norm_weight: [H]; w_decision, w_candidate: [D, H]
    contiguous. decision_rows: [B, 3], binary_rows: [B, 2], none_rows: [B, 2], marker_rows: [M],
    marker_offsets: [B + 1], all int64 with marker_offsets[0] = 0, marker_offsets[B] = M, non-decreasing, and every
    row in [0, T): the values are not checked, that would need a host sync.
    out: optional preallocated HeadOutput (float32, contiguous, [B], [M], [M], [B]) written in place, e.g. the
    static buffers of a captured graph. Returns HeadOutput(p_vis [B], gains [M], relevance [M], relevance_none [B]).
    """
    if hidden.dim() != 2:
        raise ValueError(f"decision head: hidden expected [T, H], found shape {list(hidden.shape)}")
    device = hidden.device
    num_rows, hidden_size = hidden.shape
    dim = w_decision.shape[0]
    num_states = decision_rows.shape[0]
    num_markers = marker_rows.shape[0]
    floats = (torch.bfloat16, torch.float16, torch.float32)
    _check_tensor("hidden", hidden, (num_rows, hidden_size), floats, device)
    _check_tensor("norm_weight", norm_weight, (hidden_size,), floats, device)
    _check_tensor("w_decision", w_decision, (dim, hidden_size), floats, device)
    _check_tensor("w_candidate", w_candidate, (dim, hidden_size), floats, device)
    _check_tensor("decision_rows", decision_rows, (num_states, 3), (torch.int64,), device)
    _check_tensor("binary_rows", binary_rows, (num_states, 2), (torch.int64,), device)
    _check_tensor("none_rows", none_rows, (num_states, 2), (torch.int64,), device)
    _check_tensor("marker_rows", marker_rows, (num_markers,), (torch.int64,), device)
    _check_tensor("marker_offsets", marker_offsets, (num_states + 1,), (torch.int64,), device)
    if dim == 0 or hidden_size == 0:
        raise ValueError(f"decision head: empty projection, D = {dim}, H = {hidden_size}")
    # Copying hidden or a weight every call would hide a layout bug upstream: those must arrive dense.
    if hidden.stride(1) != 1:
        raise ValueError(f"decision head: hidden must have unit stride along H, found strides {hidden.stride()}")
    for name, t in (("norm_weight", norm_weight), ("w_decision", w_decision), ("w_candidate", w_candidate)):
        if not t.is_contiguous():
            raise ValueError(f"decision head: {name} must be contiguous, found strides {t.stride()}")
    # The index tensors are a few hundred bytes: a copy is cheaper than a caller's bug.
    decision_rows, binary_rows, none_rows = decision_rows.contiguous(), binary_rows.contiguous(), none_rows.contiguous()
    marker_rows, marker_offsets = marker_rows.contiguous(), marker_offsets.contiguous()

    shapes = {"p_vis": (num_states,), "gains": (num_markers,), "relevance": (num_markers,),
              "relevance_none": (num_states,)}
    if out is None:
        out = HeadOutput(*(torch.empty(s, dtype=torch.float32, device=device) for s in shapes.values()))
    for (name, shape), t in zip(shapes.items(), out):
        _check_tensor(f"out.{name}", t, shape, (torch.float32,), device)
        if not t.is_contiguous():
            raise ValueError(f"decision head: out.{name} must be contiguous, found strides {t.stride()}")
    if num_states == 0:
        return out
    if device.type != "cuda" and not interpreter_ready():
        raise BackendUnavailableError(f"decision head: the Triton kernel runs on CUDA, found {device}; on a CPU it runs "
                                      f"only in Triton's interpreter, and TRITON_INTERPRET=1 must be set before "
                                      f"triton is first imported")

    block_d, block_h, block_r = _block_sizes(dim, hidden_size)
    decision_head_kernel[(num_states,)](
        hidden, norm_weight, w_decision, w_candidate,
        decision_rows, binary_rows, none_rows, marker_rows, marker_offsets,
        out.p_vis, out.gains, out.relevance, out.relevance_none,
        hidden.stride(0), hidden_size, dim, float(eps), dim ** -0.5,
        BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_R=block_r,
        num_warps=8,
    )
    return out
