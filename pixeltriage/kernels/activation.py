"""SwiGLU's gated product silu(gate) * up, from the fused gate/up projection's output; the gated attention's
output gate, o * sigmoid(gate); the ViT's tanh-approximated GELU, in place.

Registers the "silu_mul" op (`kernels.registry`): in bf16 on a CPU with AVX-512 BF16 the intrinsics kernel
(`kernels.simd`), else the C kernel on the CPU where it is built, torch everywhere. Registers the "sigmoid_gate" op:
the AVX-512 pass in bf16 on such a CPU, torch everywhere. Registers the "gelu_tanh" op: the C kernel in float32 on
the CPU, torch everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pixeltriage.kernels import native as _native
from pixeltriage.kernels import registry, simd, workspace


def silu_mul(gate_up: torch.Tensor, into: str | None = None) -> torch.Tensor:
    """gate_up: [T, 2I] (gate columns first) -> silu(gate) * up: [T, I] in gate_up's dtype, by the "silu_mul" op's
    kernel; into: a workspace role (`kernels.workspace`) whose buffer, where a workspace is active, holds and is the
    result.

    The torch kernel rounds twice in bf16 (the SiLU, then the product), as transformers' MLP does; the C kernel
    (`pt_silu_mul`) computes in float32 and rounds once, so in bf16 the two differ by at most one bf16 ulp of the
    product, in float32 by float32 rounding only. The AVX-512 kernel (`kernels.simd`, bf16) rounds once too, from
    float32 arithmetic a few ulps from the C kernel's."""
    out = None if into is None else workspace.take(into, (*gate_up.shape[:-1], gate_up.shape[-1] // 2),
                                                   gate_up.dtype, gate_up.device)
    return SILU_MUL(gate_up, out)


def silu_mul_torch(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The "silu_mul" op in torch (into `out` where given)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up if out is None else torch.mul(F.silu(gate), up, out=out)


def _silu_mul_c_accepts(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        return "gate_up not [T, 2I] with contiguous rows"
    return None if _native.handles(gate_up) else "a device or dtype the C kernels do not take, or no C library"


def _silu_mul_c(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The "silu_mul" op in one C pass (`pt_silu_mul`)."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(rows, inner, dtype=gate_up.dtype)
    _native.checked_out(out, (rows, inner), gate_up)
    registry.c_call("pt_silu_mul", gate_up.data_ptr(), _native.is_bf16(gate_up), gate_up.stride(0), rows, inner,
                    out.data_ptr())
    return out


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o *= sigmoid(gate), in place, by the "sigmoid_gate" op's kernel; o, gate: [R, H, D] (any strides) -> o.

    The torch kernel rounds twice in bf16 (the sigmoid, then the product), as transformers' attention does; so does
    the AVX-512 pass (`kernels.simd`, bf16 on the CPU), in one pass over o. Rounding once instead (the sigmoid kept
    in float32) moved the "mixed" parity checkpoint's bf16 scores from within transformers' bf16 distance of float32
    (0.011) to 0.019: tests/engine/test_parity.py failed. On the bench-small attention's [2296, 8, 256] with the gate
    a strided half of the projection: the same values as torch's, in 0.66x its time at one thread, 0.58x at two
    (paired medians of 40 and 60 interleaved runs, load 4-5)."""
    return SIGMOID_GATE(o, gate)


def sigmoid_gate_torch(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The "sigmoid_gate" op in torch, in place -> o."""
    return o.mul_(torch.sigmoid(gate))


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """x <- gelu(x, approximate="tanh"), in place -> x, by the "gelu_tanh" op's kernel. In float32 on the CPU
    (contiguous x), the C kernel (`pt_gelu_tanh`: x / (1 + e^(-2u)), the same function as 0.5 x (1 + tanh(u))
    without its cancellation for negative x; within 1.3e-6 of float64 per value of magnitude over 1e-3, where
    torch's is within 5e-5, and within 3.2e-8 of the largest value; the ViT's [4000, 2048]: 9 against torch's 17-22
    ms at 2 threads on an AVX2 EPYC); elsewhere torch's, in place too."""
    return GELU_TANH(x)


def gelu_tanh_torch(x: torch.Tensor) -> torch.Tensor:
    """The "gelu_tanh" op in torch, in place -> x."""
    torch.ops.aten.gelu_(x, approximate="tanh")
    return x


def _gelu_c_accepts(x: torch.Tensor) -> str | None:
    if x.dtype != torch.float32 or not x.is_contiguous():
        return "x not contiguous float32"
    return None if _native.handles(x) else "a device or dtype the C kernels do not take, or no C library"


def _gelu_c(x: torch.Tensor) -> torch.Tensor:
    registry.c_call("pt_gelu_tanh", x.data_ptr(), x.numel())
    return x


def _device_dtype(t: torch.Tensor, *rest) -> tuple[torch.device, torch.dtype]:
    return t.device, t.dtype


_C_DTYPES = (torch.float32, torch.bfloat16)
SILU_MUL = registry.op("silu_mul", _device_dtype)
VECTOR = SILU_MUL.register("AVX-512 pt_simd_silu_mul", simd.silu_mul, accepts=simd.silu_mul_accepts,
                           dtypes=(torch.bfloat16,), available=lambda: simd.available(), priority=20,
                           entry="pt_simd_silu_mul")
NATIVE = SILU_MUL.register("native C pt_silu_mul", _silu_mul_c, accepts=_silu_mul_c_accepts, dtypes=_C_DTYPES,
                           available=lambda: _native.available(), priority=10, entry="pt_silu_mul")
TORCH = SILU_MUL.register("torch", silu_mul_torch, devices=("cpu", "cuda"))
SIGMOID_GATE = registry.op("sigmoid_gate", _device_dtype)
VECTOR_GATE = SIGMOID_GATE.register("AVX-512 pt_simd_sigmoid_gate", simd.sigmoid_gate_,
                                    accepts=simd.sigmoid_gate_accepts, dtypes=(torch.bfloat16,),
                                    available=lambda: simd.available(), priority=20, entry="pt_simd_sigmoid_gate")
TORCH_GATE = SIGMOID_GATE.register("torch", sigmoid_gate_torch, devices=("cpu", "cuda"))
GELU_TANH = registry.op("gelu_tanh", _device_dtype)
NATIVE_GELU = GELU_TANH.register("native C pt_gelu_tanh", _gelu_c, accepts=_gelu_c_accepts, dtypes=(torch.float32,),
                                 available=lambda: _native.available(), priority=10, entry="pt_gelu_tanh")
TORCH_GELU = GELU_TANH.register("torch", gelu_tanh_torch, devices=("cpu", "cuda"))
