"""The CUDA path of the gated delta rule: flash-linear-attention's chunked Triton kernels.

fla itself is imported only inside these functions, which only a CUDA forward (or a CUDA load) calls: the CPU
path never imports fla or Triton.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether flash-linear-attention's gated delta rule imports here (checked once per process)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or a Triton that cannot initialise
        return False
    return True


def chunk_gated_delta_rule_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               cu_seqlens: torch.Tensor | None = None, qk_l2norm: bool = False) -> torch.Tensor:
    """Same contract as `chunk.chunk_gated_delta_rule` (q, k L2-normalised, [T, H, K]; v [T, H, V]; g, beta
    [T, H]) -> [T, H, V] float32. `cu_seqlens` (int32/int64 [B + 1]) runs several sequences packed along T.
    qk_l2norm: q and k arrive unnormalised; fla's kernel normalises them (x / sqrt(sum x^2 + 1e-6))."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    o, _ = chunk_gated_delta_rule(
        q.to(dtype)[None], k.to(dtype)[None], v.to(dtype)[None], g.float()[None], beta.to(dtype)[None],
        scale=scale, initial_state=None, output_final_state=False, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=qk_l2norm,
    )
    return o[0].float()


def gated_delta_fla(qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int, cu_seqlens: list[int] | None,
                    cu_seqlens_device: torch.Tensor | None = None) -> torch.Tensor:
    """The "gated_delta" op on CUDA: the conv + SiLU, then fla's chunked rule with q and k L2-normalised inside.
    qkv: [T, conv_dim]; conv_weight: [conv_dim, W]; g, beta: [T, Hv] float32; cu_seqlens_device: the boundaries
    as a tensor on qkv's device -> [T, Hv, v_dim] float32."""
    from pixeltriage.kernels.gated_delta.chunk import conv_heads

    q, k, v = conv_heads(qkv, conv_weight, num_k_heads, k_dim, num_v_heads, v_dim, cu_seqlens)
    return chunk_gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens=cu_seqlens_device, qk_l2norm=True)
