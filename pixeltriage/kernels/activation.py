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


def silu_mul(gate_up: torch.Tensor, native: bool | None = None, vector: bool | None = None,
             into: str | None = None) -> torch.Tensor:
    """gate_up: [T, 2I] (gate columns first) -> silu(gate) * up: [T, I] in gate_up's dtype; into: a workspace role
    (`kernels.workspace`) whose buffer, where a workspace is active, holds and is the result.

    The torch path rounds twice in bf16 (the SiLU, then the product), as transformers' MLP does; the C kernel
    (`kernels.native`, on the CPU when it is built; native=False: torch) computes in float32 and rounds once, so
    in bf16 the two differ by at most one bf16 ulp of the product, in float32 by float32 rounding only. The AVX-512
    kernel (`kernels.simd`, bf16; vector=False: skip it) rounds once too, from float32 arithmetic a few ulps from
    the C kernel's."""
    out = None if into is None else workspace.take(into, (*gate_up.shape[:-1], gate_up.shape[-1] // 2),
                                                   gate_up.dtype, gate_up.device)
    chosen = None if native is False else registry.choose("silu_mul", gate_up.device, gate_up.dtype)
    if chosen is VECTOR and vector is not False:
        result = simd.silu_mul(gate_up, out)
        if result is not None:
            return result
    if chosen in (VECTOR, NATIVE):
        result = _native_silu_mul(gate_up, out)
        if result is not None:
            return result
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up if out is None else torch.mul(F.silu(gate), up, out=out)


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor, vector: bool | None = None) -> torch.Tensor:
    """o *= sigmoid(gate), in place; o, gate: [R, H, D] (any strides) -> o.

    The torch path rounds twice in bf16 (the sigmoid, then the product), as transformers' attention does; so does the
    AVX-512 pass (`kernels.simd`, bf16 on the CPU; vector=False: torch), in one pass over o. Rounding once instead
    (the sigmoid kept in float32) moved the "mixed" parity checkpoint's bf16 scores from within transformers' bf16
    distance of float32 (0.011) to 0.019: tests/engine/test_parity.py failed. On the bench-small attention's
    [2296, 8, 256] with the gate a strided half of the projection: the same values as torch's, in 0.66x its time at
    one thread, 0.58x at two (paired medians of 40 and 60 interleaved runs, load 4-5)."""
    if (vector is not False and registry.choose("sigmoid_gate", o.device, o.dtype) is VECTOR_GATE
            and simd.sigmoid_gate_(o, gate)):
        return o
    return o.mul_(torch.sigmoid(gate))


def gelu_tanh_(x: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """x <- gelu(x, approximate="tanh"), in place -> x. In float32 on the CPU (contiguous x), the C kernel
    (`pt_gelu_tanh`: x / (1 + e^(-2u)), the same function as 0.5 x (1 + tanh(u)) without its cancellation for
    negative x; within 1.3e-6 of float64 per value of magnitude over 1e-3, where torch's is within 5e-5, and within
    3.2e-8 of the largest value; the ViT's [4000, 2048]: 9 against torch's 17-22 ms at 2 threads on an AVX2 EPYC);
    elsewhere (or native=False) torch's, in place too."""
    if (native is not False and registry.choose("gelu_tanh", x.device, x.dtype) is NATIVE_GELU and x.is_contiguous()
            and _native.call("pt_gelu_tanh", x.data_ptr(), x.numel()) == 0):
        return x
    torch.ops.aten.gelu_(x, approximate="tanh")
    return x


def _native_silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    from pixeltriage.kernels import native

    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1 or not native.handles(gate_up):
        return None
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(rows, inner, dtype=gate_up.dtype)
    native.checked_out(out, (rows, inner), gate_up)
    ran = native.call("pt_silu_mul", gate_up.data_ptr(), native.is_bf16(gate_up), gate_up.stride(0), rows, inner,
                      out.data_ptr()) == 0
    return out if ran else None


VECTOR = registry.register("silu_mul", "AVX-512 pt_simd_silu_mul", silu_mul, devices=("cpu",),
                           dtypes=(torch.bfloat16,), available=lambda: simd.available(), priority=20)
NATIVE = registry.register("silu_mul", "native C pt_silu_mul", silu_mul, devices=("cpu",),
                           dtypes=(torch.float32, torch.bfloat16), available=lambda: _native.available(), priority=10)
registry.register("silu_mul", "torch", lambda gate_up: silu_mul(gate_up, native=False), devices=("cpu", "cuda"))
VECTOR_GATE = registry.register("sigmoid_gate", "AVX-512 pt_simd_sigmoid_gate", sigmoid_gate_, devices=("cpu",),
                                dtypes=(torch.bfloat16,), available=lambda: simd.available(), priority=20)
registry.register("sigmoid_gate", "torch", lambda o, gate: sigmoid_gate_(o, gate, vector=False),
                  devices=("cpu", "cuda"))
NATIVE_GELU = registry.register("gelu_tanh", "native C pt_gelu_tanh", gelu_tanh_, devices=("cpu",),
                                dtypes=(torch.float32,), available=lambda: _native.available(), priority=10)
registry.register("gelu_tanh", "torch", lambda x: gelu_tanh_(x, native=False), devices=("cpu", "cuda"))
