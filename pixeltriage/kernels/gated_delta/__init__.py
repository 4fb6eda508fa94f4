"""Gated delta rule: `naive` (recurrent, float32 ground truth), `chunk` (chunked: torch, and the C kernel on the
CPU), `bf16` (the C kernel's bf16 pass for bf16 forwards on the CPU's matrix units) and `fla`
(flash-linear-attention's Triton kernels on CUDA).

Importing the package registers the kernels of the "gated_delta" op (`kernels.registry`; the op and the C and
chunked kernels in `chunk`, the others beside their code), all with one signature:
    fn(qkv [T, conv_dim], conv_weight [conv_dim, W], g [T, Hv] f32, beta [T, Hv] f32, hk, dk, hv, dv,
       cu_seqlens: list[int] | None, cu_seqlens_device: torch.Tensor | None) -> o [T, Hv, dv] float32
(the conv + SiLU, the L2 norms of q and k, and the delta rule), and those of the "delta_rule" and "chunk_layout"
ops the chunked kernel runs (`chunk`).
"""
from pixeltriage.kernels.gated_delta import bf16, fla
from pixeltriage.kernels.gated_delta.bf16 import BF16
from pixeltriage.kernels.gated_delta.chunk import (GATED_DELTA, NATIVE, TORCH, chunk_gated_delta_rule,
                                                   conv_chunk_gated_delta_rule, conv_heads, delta_rule_torch,
                                                   gated_delta_native, gated_delta_torch)
from pixeltriage.kernels.gated_delta.fla import FLA
from pixeltriage.kernels.gated_delta.naive import recurrent_gated_delta_rule

__all__ = ["BF16", "FLA", "GATED_DELTA", "NATIVE", "TORCH", "bf16", "chunk_gated_delta_rule",
           "conv_chunk_gated_delta_rule", "conv_heads", "delta_rule_torch", "fla", "gated_delta_native",
           "gated_delta_torch", "recurrent_gated_delta_rule"]
