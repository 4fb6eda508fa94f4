"""The CUDA path of the gated delta rule: flash-linear-attention's chunked Triton kernels.

fla itself is imported only inside these functions, which only a CUDA forward (or a CUDA load) calls: the CPU
path never imports fla or Triton. Under the registry's test switch (PIXELTRIAGE_EMULATE_CUDA=1 with
TRITON_INTERPRET=1) they run on CPU tensors in Triton's interpreter, in float32.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels import registry
from pixeltriage.kernels.conv import CONV1D
from pixeltriage.kernels.gated_delta.chunk import GATED_DELTA
from pixeltriage.kernels.gated_delta.shapes import check_projection

FLA_CHUNK = 64           # fla's chunk size for the gated delta rule and its conv's rows per program


FLA_MIN_VERSION = (0, 6)   # the first to take more value heads than key heads and a precomputed chunk table
FLA_REQUIREMENT = "flash-linear-attention>=0.6"


@functools.cache
def available() -> bool:
    """Whether flash-linear-attention's gated delta rule imports here, at FLA_MIN_VERSION or later (checked once
    per process; an older fla is reported by `registry.check_fast` as the requirement it misses)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or a Triton that cannot initialise
        return False
    return _version(getattr(fla, "__version__", "0")) >= FLA_MIN_VERSION


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def gated_delta_fla(qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int, cu_seqlens: list[int] | None,
                    cu_seqlens_device: torch.Tensor | None = None) -> torch.Tensor:
    """The "gated_delta" op on CUDA: fla's causal conv1d + SiLU, then fla's chunked rule with q and k L2-normalised
    inside it.

    qkv: [T, conv_dim] (conv_dim = 2 * Hk * k_dim + Hv * v_dim) in the model's dtype, bf16 or fp16 (float32 only
    under the test switch, where the interpreter runs it); conv_weight: [conv_dim, W]; g (log decay), beta:
    [T, Hv] float32. cu_seqlens: [0, t1, ..., T] of sequences packed along T, with cu_seqlens_device the same
    boundaries as a tensor on qkv's device (required when there are several sequences: fla reads them there).
    -> [T, Hv, v_dim] float32.

    q, k and v reach fla in qkv's dtype (the conv accumulates in float32 and rounds once), q and k with their Hk
    key heads as they are (fla takes Hv = G * Hk value heads and reads each key head for its G), g and beta in
    float32 as fla's own layer hands them. The chunk indices of the varlen kernels are built on the device from
    the boundaries tensor, their count from the list: no host sync.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    check_projection(qkv, conv_weight, g, beta, num_k_heads, k_dim, v_dim, num_v_heads)
    seq_len = qkv.shape[0]
    if qkv.device.type != "cuda" and not registry.emulating_cuda():
        raise BackendUnavailableError(f"fla's gated delta rule runs on CUDA, found {qkv.device}; on a CPU only in "
                                      f"Triton's interpreter, under the test switch PIXELTRIAGE_EMULATE_CUDA=1")
    varlen = cu_seqlens is not None and len(cu_seqlens) > 2
    if varlen and cu_seqlens_device is None:
        raise ValueError("fla's varlen kernels read the boundaries on the device: pass cu_seqlens_device (built "
                         "once per forward) with cu_seqlens")
    if seq_len == 0:
        return qkv.new_zeros(0, num_v_heads, v_dim, dtype=torch.float32)
    cu_device = cu_seqlens_device if varlen else None
    indices = varlen_chunk_indices(cu_seqlens, cu_device) if varlen else None
    dtype = qkv.dtype if qkv.dtype in (torch.bfloat16, torch.float16) else torch.float32
    # the "conv1d" op: fla's conv returns qkv's dtype (rounded once), the torch fallback float32: q, k, v reach fla
    # in `dtype`
    mixed = CONV1D(qkv, conv_weight, cu_seqlens if varlen else None, cu_device, chunk_indices=indices).to(dtype)
    q, k, v = mixed.split([num_k_heads * k_dim, num_k_heads * k_dim, num_v_heads * v_dim], dim=-1)
    o, _ = chunk_gated_delta_rule(
        q.unflatten(-1, (num_k_heads, k_dim))[None], k.unflatten(-1, (num_k_heads, k_dim))[None],
        v.unflatten(-1, (num_v_heads, v_dim))[None], g.float()[None], beta.float()[None], scale=k_dim ** -0.5,
        initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_device,
        chunk_indices=indices,
    )
    return o[0].float()


def varlen_chunk_indices(cu_seqlens: list[int], cu_seqlens_device: torch.Tensor,
                         chunk_size: int = FLA_CHUNK) -> torch.Tensor:
    """fla's varlen chunk table, [NT, 2] (sequence, chunk within it) for every chunk of the packed sequences, as
    `fla.ops.utils.index.prepare_chunk_indices` makes it, but built on the boundaries' device from the device
    tensor ([B + 1]) with NT counted from the list: no host sync, and fixed shapes for a given list."""
    num_chunks = sum(-(-(e - b) // chunk_size) for b, e in zip(cu_seqlens, cu_seqlens[1:]))
    bounds = cu_seqlens_device.long()
    chunks = (bounds[1:] - bounds[:-1] + chunk_size - 1).div(chunk_size, rounding_mode="floor")
    offsets = F.pad(chunks.cumsum(0), (1, 0))                     # [B + 1] first chunk of each sequence
    slots = torch.arange(num_chunks, device=bounds.device)
    sequence = torch.searchsorted(offsets, slots, right=True) - 1   # empty sequences own no slot
    return torch.stack([sequence, slots - offsets[sequence]], 1).to(cu_seqlens_device.dtype)


@functools.cache
def conv_available() -> bool:
    """Whether flash-linear-attention's causal conv1d imports here, fla being recent enough (checked once per
    process)."""
    if not available():
        return False
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
    except Exception:  # ImportError, or a Triton that cannot initialise
        return False
    return True


def causal_conv1d_silu_fla(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None,
                           cu_seqlens_device: torch.Tensor | None = None, *,
                           chunk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The "conv1d" op on CUDA: fla's Triton causal conv1d + SiLU. x: [T, C] bf16/fp16 (float32 under the test
    switch); weight: [C, W] -> [T, C] in x's dtype, accumulated in float32 and rounded once (what fla's gated delta
    rule reads). cu_seqlens with cu_seqlens_device: sequences packed along T, no window crossing a boundary;
    chunk_indices: the table `varlen_chunk_indices` builds for them (built here when not given)."""
    from fla.modules.causal_conv1d import causal_conv1d

    varlen = cu_seqlens is not None and len(cu_seqlens) > 2
    if varlen and cu_seqlens_device is None:
        raise ValueError("fla's conv reads the boundaries on the device: pass cu_seqlens_device with cu_seqlens")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x [T, C] and weight [C, W] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if varlen and chunk_indices is None:
        chunk_indices = varlen_chunk_indices(cu_seqlens, cu_seqlens_device)
    y, _ = causal_conv1d(x[None], weight, activation="silu", backend="triton",
                         cu_seqlens=cu_seqlens_device if varlen else None,
                         chunk_indices=chunk_indices if varlen else None)
    return y[0]


# bf16/fp16 on CUDA (float32 under the test switch, where the interpreter runs it): fla's rule, and its conv as the
# "conv1d" op's CUDA kernel (`kernels.conv`)
FLA_CONV = CONV1D.register("fla causal_conv1d", causal_conv1d_silu_fla, devices=("cuda",),
                           dtypes=(torch.bfloat16, torch.float16), available=lambda: conv_available(), priority=20,
                           package=FLA_REQUIREMENT)
FLA = GATED_DELTA.register("fla chunk_gated_delta_rule", gated_delta_fla, devices=("cuda",),
                           dtypes=(torch.bfloat16, torch.float16), available=lambda: available(), priority=20,
                           package=FLA_REQUIREMENT)
