"""Chunked gated delta rule: in PyTorch and in C (the CPU path).

Within a chunk of C tokens the delta-rule updates are condensed with the UT transform
T = (I + tril(diag(beta) K K^T * decay, -1))^-1, so the chunk needs only matmuls; the recurrent
state [K, V] per head is carried across chunks. Intra-chunk work is batched over heads and chunks.

Registers (`kernels.registry`) the "gated_delta" op with its C pass (`pt_delta_chunked` in conv mode) and its chunked
composition (the "conv1d" op, then the "delta_rule" op), the "delta_rule" op (q, k, v already made: C
`pt_delta_chunked`, torch) and the "chunk_layout" op the torch rule gathers its chunks by (C `pt_chunk_gather`,
torch).
"""
from __future__ import annotations

import functools

import torch

from pixeltriage.kernels import native, registry
from pixeltriage.kernels.gated_delta.shapes import check_projection, check_value_heads

# Decays below e^-30 (~1e-13, far under float32's 6e-8 resolution of unit-scale terms) are set to exactly zero.
# Without the cut, strong decays (g of -10 to -40 per token is common) fill the chunk with subnormal floats, which
# x86 CPUs process ~10-100x slower: the layer ran 3.5x slower for no difference in the result.
LOG_DECAY_CUTOFF = -30.0
_TINY = 1e-18
L2NORM_EPS = 1e-6
# Chunk sizes. The C kernels run fastest at 32 (bench-small layer, 2296 tokens, 16 heads of 128: 46 ms at 32,
# 49 at 48, 52 at 64, 58 at 96, interleaved): the per-chunk products shrink with C while the recurrence's state
# products do not, and 16 gains nothing more. The torch path keeps 64 (transformers' size): fewer, larger
# batched matmuls and fewer Python iterations.
NATIVE_CHUNK = 32
TORCH_CHUNK = 64
# The part of the C passes' time (conv mode) a profiler sees apart, as its own stage: the conv + SiLU
CONV_PART = "delta_conv"


def _decay(log_decay: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
    """exp(log_decay), exactly 0 where log_decay < LOG_DECAY_CUTOFF (and where `dead`), in a new tensor.

    The exponent is clamped into [cut-off, 0] and the dead entries zeroed after: the CPU's vectorised exp takes a
    slow path for -inf (10x), for results that underflow (80x, measured on [36, 16, 64, 64]) and for ones that
    overflow (the dead upper triangle of a chunk's decay matrix holds large positive differences). Live entries
    are log decays, never positive (g = -exp(A_log) * softplus(.) <= 0), so the upper clamp changes none."""
    cut = log_decay < LOG_DECAY_CUTOFF
    if dead is not None:
        cut.logical_or_(dead)
    return log_decay.clamp(min=LOG_DECAY_CUTOFF, max=0.0).exp_().masked_fill_(cut, 0.0)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int | None = None,
    cu_seqlens: list[int] | None = None,
    qk_l2norm: bool = False,
) -> torch.Tensor:
    """Same contract as `naive.recurrent_gated_delta_rule`, by the "delta_rule" op's kernel (on the CPU the C
    kernel, `pt_delta_chunked`, where it takes the inputs; else the torch chunked rule).

    q, k: [T, H, K] L2-normalised; v: [T, H, V]; g (log decay, <= 0), beta: [T, H]. Returns [T, H, V] float32.
    cu_seqlens: [0, t1, t1 + t2, ..., T] to run several independent sequences packed along T (varlen): each is
    padded to whole chunks on its own and the state restarts from zero at each sequence's first chunk.
    qk_l2norm: q and k arrive unnormalised and are L2-normalised here (x * rsqrt(sum x^2 + 1e-6), as the layer's
    own norm), the scale multiplied in on the way into the chunk layout instead of in two passes of their own.
    chunk_size: None picks each kernel's own (NATIVE_CHUNK for the C kernel, TORCH_CHUNK for torch); the result is
    the same up to float32 rounding (the chunked form is exact algebra at any size).
    """
    seq_len, num_heads, _ = k.shape
    if (q.shape != k.shape or v.dim() != 3 or v.shape[:2] != (seq_len, num_heads)
            or g.shape != (seq_len, num_heads) or beta.shape != (seq_len, num_heads)):
        raise ValueError(f"q, k [T, H, K], v [T, H, V], g and beta [T, H] expected; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    return DELTA_RULE(q, k, v, g, beta, scale, chunk_size, cu_seqlens, qk_l2norm)


def _rule_c_accepts(q, k, v, g, beta, scale=None, chunk_size=None, cu_seqlens=None, qk_l2norm=False) -> str | None:
    if not all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (q, k, v)):
        return "q, k, v not float32 with unit last strides"
    return _c_refusal(k.shape[-1], v.shape[-1], chunk_size, beta, q, k, v, beta)


def _c_refusal(k_dim: int, v_dim: int, chunk_size: int | None, beta: torch.Tensor, *tensors) -> str | None:
    """What `pt_delta_chunked` declines of every call: head dims not multiples of 16, a chunk not a multiple of 16 up
    to 256, beta not float32, a device or dtype the C kernels do not take (or no library)."""
    if k_dim % 16 or v_dim % 16:
        return "head dims not multiples of 16"
    chunk = NATIVE_CHUNK if chunk_size is None else chunk_size
    if chunk % 16 or chunk > 256:
        return "a chunk not a multiple of 16 up to 256"
    if beta.dtype != torch.float32:
        return "beta not float32"
    return None if native.handles(*tensors) else "a device or dtype the C kernels do not take, or no C library"


def _rule_c(q, k, v, g, beta, scale=None, chunk_size=None, cu_seqlens=None, qk_l2norm=False) -> torch.Tensor:
    """The "delta_rule" op in C (`pt_delta_chunked`): the chunk layout, the per-chunk matrices and the recurrence in
    one pass per head."""
    seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    plan = _plan(seq_len, cu_seqlens, chunk_size, True)
    if plan.num_chunks == 0:
        return q.new_zeros(seq_len, num_heads, v_dim, dtype=torch.float32)
    out = _c_pass(plan, (q, k, v), beta, plan.gamma(g), qk_l2norm, k_dim ** -0.5 if scale is None else scale)
    return plan.unpad(out.view(plan.num_chunks * plan.c, num_heads, v_dim))


def delta_rule_torch(q, k, v, g, beta, scale=None, chunk_size=None, cu_seqlens=None, qk_l2norm=False) -> torch.Tensor:
    """The "delta_rule" op in torch: the chunk layout (the "chunk_layout" op: gathered in C where it can be), then
    everything but the carried state batched over chunks and heads (u, w: the UT transform's outputs; the causal
    intra-chunk scores; q decayed from its chunk's start, k decayed to its chunk's end, transposed; each chunk's
    total decay), then the loop over chunks."""
    seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    plan = _plan(seq_len, cu_seqlens, chunk_size, False)
    if plan.num_chunks == 0:
        return q.new_zeros(seq_len, num_heads, v_dim, dtype=torch.float32)
    gamma = plan.gamma(g)
    laid_out = CHUNK_LAYOUT(q, k, v, beta, qk_l2norm, plan)
    out = _torch_loop(*_torch_prep(*laid_out, gamma, k_dim ** -0.5 if scale is None else scale), plan.restart)
    return plan.unpad(out.view(plan.num_chunks * plan.c, num_heads, v_dim))


def _layout_torch(q, k, v, beta, qk_l2norm, plan):
    """(q, k, k * beta, v * beta) in the chunk layout [N, H, C, K|V], q and k L2-normalised if asked."""
    q_mult = k_mult = None
    if qk_l2norm:
        # vector_norm reads strided rows 3x faster than vecdot or (x * x).sum; squaring its sqrt back costs ~1 ulp in
        # the scale
        q_mult = torch.linalg.vector_norm(q, dim=-1).square_().add_(L2NORM_EPS).rsqrt_()   # [T, H]
        k_mult = torch.linalg.vector_norm(k, dim=-1).square_().add_(L2NORM_EPS).rsqrt_()
    k_beta = plan.chunked(k, beta if k_mult is None else k_mult * beta)   # [N, H, C, K]
    v_beta = plan.chunked(v, beta)                                         # [N, H, C, V]
    return plan.chunked(q, q_mult), plan.chunked(k, k_mult), k_beta, v_beta


def conv_chunk_gated_delta_rule(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_k_heads: int,
    k_dim: int,
    v_dim: int,
    chunk_size: int | None = None,
    cu_seqlens: list[int] | None = None,
) -> torch.Tensor:
    """The float32 pass: the "gated_delta" op's C kernel (`pt_delta_chunked` in conv mode), through
    `registry.run`, `registry.Declined` where it declines the inputs. x: [T, conv_dim] (conv_dim = 2 * num_k_heads
    * k_dim + Hv * v_dim); conv_weight [conv_dim, W]; g, beta [T, Hv] -> [T, Hv, v_dim] float32 (see
    `gated_delta_native`)."""
    num_v_heads = check_projection(x, conv_weight, g, beta, num_k_heads, k_dim, v_dim)
    return registry.run(NATIVE, x, conv_weight, g, beta, num_k_heads, k_dim, num_v_heads, v_dim, cu_seqlens,
                        chunk_size=chunk_size)


def _gated_delta_c_accepts(qkv, conv_weight, g, beta, num_k_heads, k_dim, num_v_heads, v_dim, cu_seqlens,
                           cu_seqlens_device=None, *, chunk_size=None) -> str | None:
    if qkv.dtype not in (torch.float32, torch.bfloat16) or qkv.stride(-1) != 1:
        return "projection not float32 or bf16 with a unit last stride"
    return _c_refusal(k_dim, v_dim, chunk_size, beta, qkv, conv_weight, beta)


def gated_delta_native(qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int, cu_seqlens: list[int] | None,
                       cu_seqlens_device: torch.Tensor | None = None, *, chunk_size: int | None = None) -> torch.Tensor:
    """The "gated_delta" op on the CPU's C kernel (`pt_delta_chunked` in conv mode): the Gated DeltaNet's causal
    conv1d + SiLU over its projection, q and k L2-normalised, the chunked rule, all in one pass per head: each
    chunk's q, k and v rows are made from qkv where they are used, so the conv's [T, conv_dim] float32 output (56 MB
    at bench-small) is never written or read back. qkv: [T, conv_dim]; conv_weight: [conv_dim, W]; g, beta: [T, Hv]
    float32 -> [T, Hv, v_dim] float32. cu_seqlens_device is not used (the boundaries are read from the list)."""
    check_value_heads(beta, num_v_heads)
    check_projection(qkv, conv_weight, g, beta, num_k_heads, k_dim, v_dim, num_v_heads)
    seq_len = qkv.shape[0]
    plan = _plan(seq_len, cu_seqlens, chunk_size, True)
    if plan.num_chunks == 0:
        return qkv.new_zeros(seq_len, num_v_heads, v_dim, dtype=torch.float32)
    out = _c_pass(plan, (qkv, conv_weight, num_v_heads // num_k_heads, k_dim, v_dim), beta, plan.gamma(g), True,
                  k_dim ** -0.5)
    return plan.unpad(out.view(plan.num_chunks * plan.c, num_v_heads, v_dim))


def gated_delta_torch(qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int, cu_seqlens: list[int] | None,
                      cu_seqlens_device: torch.Tensor | None = None, *, chunk_size: int | None = None) -> torch.Tensor:
    """The "gated_delta" op as the "conv1d" op's conv + SiLU, split into heads, then the "delta_rule" op with q and
    k L2-normalised: the same contract as `gated_delta_native`, on any device; float32 throughout."""
    check_value_heads(beta, num_v_heads)
    check_projection(qkv, conv_weight, g, beta, num_k_heads, k_dim, v_dim, num_v_heads)
    q, k, v = conv_heads(qkv, conv_weight, num_k_heads, k_dim, num_v_heads, v_dim, cu_seqlens)
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, cu_seqlens=cu_seqlens, qk_l2norm=True)


def conv_heads(x: torch.Tensor, conv_weight: torch.Tensor, num_k_heads: int, k_dim: int, num_v_heads: int,
               v_dim: int, cu_seqlens: list[int] | None = None):
    """The Gated DeltaNet's conv1d + SiLU (the "conv1d" op) over its projection x [T, conv_dim], split into heads:
    q, k [T, Hv, k_dim] (each key head repeated for its Hv / num_k_heads value heads) and v [T, Hv, v_dim],
    float32."""
    from pixeltriage.kernels.conv import causal_conv1d_silu

    seq_len = x.shape[0]
    qkv = causal_conv1d_silu(x, conv_weight, cu_seqlens).float()
    q, k, v = qkv.split([num_k_heads * k_dim, num_k_heads * k_dim, num_v_heads * v_dim], dim=-1)
    q, k = q.view(seq_len, num_k_heads, k_dim), k.view(seq_len, num_k_heads, k_dim)
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    return q, k, v.view(seq_len, num_v_heads, v_dim)


def _plan(seq_len: int, cu_seqlens: list[int] | None, chunk_size: int | None, c_kernel: bool) -> "_Plan":
    """The chunk plan of these packed sequences, made once per distinct layout: every Gated DeltaNet layer of a
    forward asks for the same one (6 layers at bench-small, 18 at 2b; 0.1-0.5 ms of Python each to build)."""
    return _cached_plan(seq_len, None if cu_seqlens is None else tuple(map(int, cu_seqlens)), chunk_size, c_kernel)


@functools.lru_cache(maxsize=32)
def _cached_plan(seq_len: int, bounds: tuple[int, ...] | None, chunk_size: int | None, c_kernel: bool) -> "_Plan":
    return _Plan(seq_len, None if bounds is None else list(bounds), chunk_size, c_kernel)


class _Plan:
    """How T tokens of packed sequences (cu_seqlens) fall into chunks of c: each sequence is padded to whole chunks
    on its own (zero rows leave the state untouched: k = 0, beta = 0, g = 0) and the state restarts at its first.
    Read-only once made: `_plan` hands the same one to every layer."""

    def __init__(self, seq_len: int, cu_seqlens: list[int] | None, chunk_size: int | None, c_kernel: bool):
        """c_kernel: whether `pt_delta_chunked` will take these inputs (picks the default chunk size)."""
        if chunk_size is None:
            chunk_size = NATIVE_CHUNK if c_kernel else TORCH_CHUNK
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        bounds = [0, seq_len] if cu_seqlens is None else list(cu_seqlens)
        if bounds[0] != 0 or bounds[-1] != seq_len or any(b > e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to {seq_len}, got {bounds}")
        self.seq_len, self.c = seq_len, chunk_size
        self.segments = [(b, e) for b, e in zip(bounds, bounds[1:]) if e > b]
        self.seg_chunks = [-(-(e - b) // chunk_size) for b, e in self.segments]
        self.num_chunks = sum(self.seg_chunks)
        self.restart = torch.zeros(self.num_chunks, dtype=torch.uint8)   # 1 at each sequence's first chunk
        starts, lengths, seg_start, n0 = [], [], [], 0                    # per chunk: first token, tokens, sequence
        for (b, e), n in zip(self.segments, self.seg_chunks):
            self.restart[n0] = 1
            for j in range(n):
                starts.append(b + j * chunk_size)
                lengths.append(min(chunk_size, e - b - j * chunk_size))
                seg_start.append(b)
            n0 += n
        self.chunk_start = torch.tensor(starts, dtype=torch.int64)
        self.chunk_len = torch.tensor(lengths, dtype=torch.int64)
        self.seg_start = torch.tensor(seg_start, dtype=torch.int64)

    def chunked(self, x: torch.Tensor, mult: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H, ...] -> a new [N, H, C, ...] float32 tensor, chunk-major so that each chunk's slice is contiguous,
        with `mult` ([T, H]) multiplied in on the way (one pass); zero rows pad each sequence's last chunk."""
        c, num_heads = self.c, x.shape[1]
        buf = torch.empty(self.num_chunks, num_heads, c, *x.shape[2:], dtype=torch.float32, device=x.device)
        n0 = 0
        for (b, e), n in zip(self.segments, self.seg_chunks):
            full, rem = divmod(e - b, c)
            parts = [(buf[n0:n0 + full], b, b + full * c, full)] if full else []
            if rem:
                parts.append((buf[n0 + full:n0 + full + 1, :, :rem], b + full * c, e, 1))
                buf[n0 + full, :, rem:].zero_()
            for dst, lo, hi, m in parts:
                src = x[lo:hi].reshape(m, -1, *x.shape[1:]).transpose(1, 2)        # [m, H, rows, ...]
                if mult is None:
                    dst.copy_(src)
                else:
                    torch.mul(src, mult[lo:hi].reshape(m, -1, num_heads).transpose(1, 2)[..., None], out=dst)
            n0 += n
        return buf

    def gamma(self, g: torch.Tensor) -> torch.Tensor:
        """[T, H] log decays -> [N, H, C] cumulated from each chunk's start. One token's g below the cut-off already
        zeroes every decay across it, so g is floored at twice the cut-off: the same result, and a -inf g (A_log
        overflowing exp) gives no -inf - -inf = NaN in the differences taken from it."""
        return self.chunked(g).clamp_(min=2 * LOG_DECAY_CUTOFF).cumsum_(-1)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[N * C, H, V] chunk rows -> [T, H, V] token rows."""
        if len(self.segments) == 1 and self.segments[0] == (0, self.seq_len):
            return out[:self.seq_len]
        result = out.new_empty(self.seq_len, *out.shape[1:])        # the segments cover every row
        n0 = 0
        for (b, e), n in zip(self.segments, self.seg_chunks):
            result[b:e] = out[n0 * self.c:n0 * self.c + (e - b)]
            n0 += n
        return result


def _torch_prep(q, k, k_beta, v_beta, gamma, scale):
    """(u, w, intra, q_start, k_end_t, chunk_decay) from the chunk layout ([N, H, C, K|V], gamma [N, H, C]) in
    torch; q, k and k_beta are scaled in place. The reference of `pt_delta_chunked`'s per-chunk part."""
    c = q.shape[-2]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = _decay(gamma[..., :, None] - gamma[..., None, :], ~causal)  # [N, H, C, C], causal incl. diagonal
    gamma_exp = _decay(gamma)
    # T = (I + tril(diag(beta) K K^T * decay, -1))^-1, explicitly: solving against the C-column identity and then
    # two batched matmuls is ~2.5x cheaper on the CPU than solving against the 2K columns of [u | w]
    a = torch.matmul(k_beta, k.transpose(-1, -2)).mul_(decay).tril_(-1)
    a.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    eye = torch.eye(c, dtype=torch.float32, device=q.device)
    t_inv = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)
    t_inv = torch.nn.functional.hardshrink(t_inv, _TINY)  # products of decays underflow: zero, not subnormal
    u = torch.matmul(t_inv, v_beta)                                   # [N, H, C, V]
    w = torch.matmul(t_inv, k_beta.mul_(gamma_exp[..., None]))        # [N, H, C, K]
    intra = torch.matmul(q, k.transpose(-1, -2)).mul_(decay.mul_(scale))   # [N, H, C, C] scaled, causal
    k_end = k.mul_(_decay(gamma[..., -1:] - gamma)[..., None])        # k decayed to its chunk's end
    q_start = q.mul_((gamma_exp * scale)[..., None])                  # q decayed from its chunk's start, scaled
    return u, w, intra, q_start, k_end.transpose(-1, -2), gamma_exp[..., -1].contiguous()


def _torch_loop(u, w, intra, q_start, k_end_t, chunk_decay, restart):
    """The recurrence over chunks (the reference of `pt_delta_chunked`'s), with S_n the state entering chunk n:
    v_new_n = u_n - w_n S_n, out_n = q_start_n S_n + intra_n v_new_n, S_n+1 = decay_n S_n + k_end_n^T v_new_n.
    Four small matmuls per chunk, batched over heads and written in place; each chunk's output goes straight
    into the token-major layout while its state is in cache. u is overwritten by v_new. -> [N * C, H, V]"""
    num_chunks, num_heads, c, v_dim = u.shape
    state = u.new_zeros(num_heads, k_end_t.shape[-2], v_dim)
    out = u.new_empty(num_chunks, c, num_heads, v_dim)
    head_major = u.new_empty(num_heads, c, v_dim)
    for n in range(num_chunks):
        if restart[n]:
            state.zero_()                                             # a new sequence starts from no memory
        v_new = u[n].baddbmm_(w[n], state, beta=1, alpha=-1)           # in place: u_n is read once
        torch.bmm(q_start[n], state, out=head_major).baddbmm_(intra[n], v_new)
        out[n].copy_(head_major.transpose(0, 1))
        state.mul_(chunk_decay[n][:, None, None]).baddbmm_(k_end_t[n], v_new)
    return out.view(num_chunks * c, num_heads, v_dim)


def _layout_c_accepts(q, k, v, beta, qk_l2norm, plan) -> str | None:
    if any(t.dtype != torch.float32 for t in (q, k, v, beta)) or any(t.stride(-1) != 1 for t in (q, k, v)):
        return "q, k, v, beta not float32 with unit last strides"
    return None if native.handles(q, k, v, beta) else "a device or dtype the C kernels do not take, or no C library"


def _layout_c(q, k, v, beta, qk_l2norm, plan):
    """`_layout_torch` in C (`pt_chunk_gather`): one pass per input (k and k * beta from the same read)."""
    seq_len, num_heads = k.shape[:2]
    c = plan.c
    rows = torch.empty(seq_len, dtype=torch.int64)                   # each token's row in the chunk layout
    pads, n0 = [], 0
    for (b, e), n in zip(plan.segments, plan.seg_chunks):
        torch.arange(n0 * c, n0 * c + (e - b), out=rows[b:e])
        if (e - b) % c:
            pads.append((n0 + n - 1, (e - b) % c))                     # (chunk, first padding row)
        n0 += n
    beta = beta.contiguous()

    def gather(x, l2norm, mult=None, mult2=None):
        out = [torch.empty(plan.num_chunks, num_heads, c, x.shape[-1]) for _ in range(1 if mult2 is None else 2)]
        for buf in out:
            for n, first in pads:
                buf[n, :, first:].zero_()
        args = native.struct("pt_gather_args", src=x.data_ptr(), src_t=x.stride(0), src_h=x.stride(1), T=seq_len,
                             H=num_heads, D=x.shape[-1], row=rows.data_ptr(), C=c,
                             mult=None if mult is None else mult.data_ptr(),
                             mult2=None if mult2 is None else mult2.data_ptr(), l2norm=int(l2norm), eps=L2NORM_EPS)
        registry.c_call("pt_chunk_gather", args, out[0].data_ptr(), None if mult2 is None else out[1].data_ptr())
        return out

    k_pair, q_c, v_beta = gather(k, qk_l2norm, None, beta), gather(q, qk_l2norm), gather(v, False, beta)
    return q_c[0], k_pair[0], k_pair[1], v_beta[0]


def _c_pass(plan, inputs, beta, gamma, qk_l2norm, scale):
    """`_torch_prep` then `_torch_loop`, in C (`pt_delta_chunked`): heads split over threads, each running through
    its chunks with the state and the chunk's matrices in cache (rows gathered and L2-normalised on the way in;
    triangular products over their nonzero blocks). inputs: (q, k, v) token-major [T, H, K|V] float32, last dim
    contiguous; or (x, conv_weight, group, k_dim, v_dim) for conv mode (see `gated_delta_native`), which the
    kernel's `accepts` took -> [N * C, H, V] token-major."""
    num_chunks, num_heads, c = gamma.shape
    if len(inputs) == 5:
        x, conv_weight, group, k_dim, v_dim = inputs
        taps = conv_weight.float().t().contiguous()                  # [W, conv_dim]
        q = k = v = x.new_empty(0, 0, 0, dtype=torch.float32)
        conv_args = dict(x=x.data_ptr(), x_t=x.stride(0), x_bf16=native.is_bf16(x), taps=taps.data_ptr(),
                         W=taps.shape[0], conv_dim=x.shape[1], group=group, seg_start=plan.seg_start.data_ptr())
    else:
        q, k, v = inputs
        k_dim, v_dim = k.shape[-1], v.shape[-1]
        conv_args = dict(x=None, x_t=0, x_bf16=0, taps=None, W=0, conv_dim=0, group=1, seg_start=None)
    beta = beta.contiguous()
    out = gamma.new_empty(num_chunks * c, num_heads, v_dim)
    state = gamma.new_empty(num_heads, k_dim, v_dim)
    # per thread: the decay matrix and T (2 C^2), q_start, w, normalised k (C K each), u (C V), intra (C^2),
    # k_end^T (K C)
    scratch = gamma.new_empty(torch.get_num_threads(), 3 * c * c + 4 * c * k_dim + c * v_dim)
    args = native.struct("pt_delta_args", q=q.data_ptr(), q_t=q.stride(0), q_h=q.stride(1), k=k.data_ptr(),
                         k_t=k.stride(0), k_h=k.stride(1), v=v.data_ptr(), v_t=v.stride(0), v_h=v.stride(1),
                         beta=beta.data_ptr(), gamma=gamma.data_ptr(), chunk_start=plan.chunk_start.data_ptr(),
                         chunk_len=plan.chunk_len.data_ptr(), restart=plan.restart.data_ptr(), N=num_chunks,
                         H=num_heads, C=c, K=k_dim, V=v_dim, l2norm=int(qk_l2norm), eps=L2NORM_EPS, scale=scale,
                         cutoff=LOG_DECAY_CUTOFF, tiny=_TINY, **conv_args)
    with native.part_of_pass(CONV_PART if len(inputs) == 5 else None) as prof:    # a profiler's split of the conv
        registry.c_call("pt_delta_chunked", args, out.data_ptr(), state.data_ptr(), scratch.data_ptr(), prof)
    return out


_C_DTYPES = (torch.float32, torch.bfloat16)
# fn(q, k, v, g, beta, scale, chunk_size, cu_seqlens, qk_l2norm) -> [T, H, V] float32
DELTA_RULE = registry.op("delta_rule", lambda q, *args: (q.device, q.dtype))
NATIVE_RULE = DELTA_RULE.register("native C pt_delta_chunked", _rule_c, accepts=_rule_c_accepts,
                                  dtypes=(torch.float32,), available=lambda: native.available(), priority=10,
                                  entry="pt_delta_chunked")
TORCH_RULE = DELTA_RULE.register("torch chunked", delta_rule_torch, devices=("cpu", "cuda"))
# fn(q, k, v, beta, qk_l2norm, plan) -> (q, k, k * beta, v * beta) in the chunk layout
CHUNK_LAYOUT = registry.op("chunk_layout", lambda q, *args: (q.device, q.dtype))
NATIVE_LAYOUT = CHUNK_LAYOUT.register("native C pt_chunk_gather", _layout_c, accepts=_layout_c_accepts,
                                      dtypes=(torch.float32,), available=lambda: native.available(), priority=10,
                                      entry="pt_chunk_gather")
TORCH_LAYOUT = CHUNK_LAYOUT.register("torch", _layout_torch, devices=("cpu", "cuda"))
# The "gated_delta" op (the Gated DeltaNet's token mixing), its kernels all fn(qkv [T, conv_dim], conv_weight
# [conv_dim, W], g [T, Hv] f32, beta [T, Hv] f32, hk, dk, hv, dv, cu_seqlens: list[int] | None, cu_seqlens_device:
# torch.Tensor | None) -> o [T, Hv, dv] float32: the C pass and the chunked composition here, the bf16 pass in
# `bf16.py`, flash-linear-attention's in `fla.py`
GATED_DELTA = registry.op("gated_delta", lambda qkv, *args, **kwargs: (qkv.device, qkv.dtype))
NATIVE = GATED_DELTA.register("native C pt_delta_chunked", gated_delta_native, accepts=_gated_delta_c_accepts,
                              dtypes=_C_DTYPES, available=lambda: native.available(), priority=10,
                              entry="pt_delta_chunked")
TORCH = GATED_DELTA.register("chunked (conv1d, then delta_rule)", gated_delta_torch, devices=("cpu",))
# fla's kernels take bf16/fp16 (their fp32 dots may run as TF32): a float32 forward on CUDA stays on the exact
# chunked path, so float32 remains the reference on every device; other dtypes on CUDA without fla run it slowly
GATED_DELTA.register("chunked (conv1d, then delta_rule)", gated_delta_torch, devices=("cuda",), dtypes=(torch.float32,))
GATED_DELTA.register("chunked (conv1d, then delta_rule; slow)", gated_delta_torch, devices=("cuda",), priority=-10,
                     slow=True)
