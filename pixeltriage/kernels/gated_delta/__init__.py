"""Gated delta rule: `naive` (recurrent, float32 ground truth), `chunk` (chunked: torch, and the C kernel on the
CPU), `bf16` (the C kernel's bf16 pass for bf16 forwards on the CPU's matrix units) and `fla`
(flash-linear-attention's Triton kernels on CUDA).

Importing the package registers the "gated_delta" op's kernels (`kernels.registry`), all with one signature:
    fn(qkv [T, conv_dim], conv_weight [conv_dim, W], g [T, Hv] f32, beta [T, Hv] f32, hk, dk, hv, dv,
       cu_seqlens: list[int] | None, cu_seqlens_device: torch.Tensor | None) -> o [T, Hv, dv] float32
(the conv + SiLU, the L2 norms of q and k, and the delta rule).
"""
import torch

from pixeltriage.kernels import native as _native
from pixeltriage.kernels import registry as _registry
from pixeltriage.kernels.gated_delta import bf16, fla
from pixeltriage.kernels.gated_delta.chunk import (chunk_gated_delta_rule, conv_chunk_gated_delta_rule, conv_heads,
                                                   gated_delta_native, gated_delta_torch)
from pixeltriage.kernels.gated_delta.naive import recurrent_gated_delta_rule

__all__ = ["BF16", "FLA", "NATIVE", "TORCH", "bf16", "chunk_gated_delta_rule", "conv_chunk_gated_delta_rule",
           "conv_heads", "fla", "gated_delta_native", "gated_delta_torch", "recurrent_gated_delta_rule"]

# fla's kernels take bf16/fp16 (their fp32 dots may run as TF32): a float32 forward on CUDA stays on the exact
# torch chunked path, so float32 remains the reference on every device (under the interpreter, float32 stands in)
FLA = _registry.register("gated_delta", "fla chunk_gated_delta_rule", fla.gated_delta_fla, devices=("cuda",),
                         dtypes=(torch.bfloat16, torch.float16), available=lambda: fla.available(), priority=20,
                         package=fla.FLA_REQUIREMENT)
NATIVE = _registry.register("gated_delta", "native C pt_delta_chunked", gated_delta_native, devices=("cpu",),
                            dtypes=(torch.float32, torch.bfloat16), available=lambda: _native.available(), priority=10)
# a bf16 forward on a CPU with AMX or AVX512-BF16 (unless PIXELTRIAGE_DELTA_BF16=0, `bf16.SWITCH`, which says what
# its error is): the chunk's products as bf16 matmuls on those units, float32 state; float32 forwards and CPUs
# without them keep the float32 pass
BF16 = _registry.register("gated_delta", "native C pt_delta_chunked_bf16", bf16.gated_delta_bf16, devices=("cpu",),
                          dtypes=(torch.bfloat16,), available=bf16.available, priority=15)
TORCH = _registry.register("gated_delta", "torch chunked", gated_delta_torch, devices=("cpu",))
_registry.register("gated_delta", "torch chunked", gated_delta_torch, devices=("cuda",), dtypes=(torch.float32,))
_registry.register("gated_delta", "torch chunked (slow)", gated_delta_torch, devices=("cuda",), priority=-10,
                   slow=True)
