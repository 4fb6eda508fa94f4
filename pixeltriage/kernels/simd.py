"""AVX-512 passes for the SiLU-gated products between the decoder's matmuls in bf16: SwiGLU's silu(gate) * up
and the Gated DeltaNet's output norm (RMSNorm times silu(z)).

Both are compute-bound (the SiLU's e^x and division) on this engine's CPUs, not memory-bound: the C kernels
(`kernels.native`, auto-vectorised) spend ~1.2-1.4 ns per element of pt_silu_mul at one thread where a copy of the
same bytes takes ~0.3 ns. Written with AVX-512 intrinsics (e^x as 2^n * p(r), the reciprocal as rcp14 and one Newton
step instead of a division, the bf16 rounding by `vcvtneps2bf16`) the same arithmetic takes ~0.9 ns. Against the C
kernels (paired medians of 40 interleaved runs at one thread, 60 at two, load 7-8): the bench-small MLP's
[2296, 6144] -> [2296, 3072] 0.66x at one thread, 0.61x at two; the output norm at [2296, 16, 128] 0.70x and 0.66x.

The source (`kernels/native/norm_act_avx512.c`) is part of `kernels.native`'s library, called through `native.call`
like the others (`PIXELTRIAGE_NATIVE=0` turns it off too). Where the library is built without AVX512-F/BW/VL/BF16
its functions decline: `available()` is False and the op keeps its other kernels (its emulated build,
`native.emulated_isa()`, has them on any CPU, for the tests). The result is float32 arithmetic rounded once to bf16,
within a few float32 ulps of the exact value before that rounding, so it differs from a correctly rounded result
only where the exact value sits next to a rounding boundary (against the C kernels, by one bf16 ulp in 6.8e-6 of
SwiGLU's elements and 9.1e-6 of the norm's).
"""
from __future__ import annotations

import torch

from pixeltriage.kernels import native, registry

# the instruction sets the passes need (`native.build_features`)
NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})


def available() -> bool:
    """The library is loaded, built for a CPU with AVX512-F/BW/VL/BF16 or emulating them (otherwise its functions
    decline everything)."""
    return native.library() is not None and NEEDS <= native.build_features()


def status() -> str:
    status = native.status()
    return status + (" (no AVX-512 BF16: declines)" if native.available() and not available() else "")


# The passes, each a kernel function of the registry (`kernels.activation`, `kernels.norm` register them) beside its
# `accepts`: the checks the pass needs, or why it declines the call.

def silu_mul_accepts(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    if (gate_up.device.type != "cpu" or gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2
            or gate_up.stride(1) != 1 or gate_up.shape[1] % 2):
        return "gate_up not a bf16 CPU [T, 2I] with contiguous rows"
    return None if available() else "no AVX-512 BF16 build"


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: bf16 [T, 2I] (gate columns first, rows contiguous) -> silu(gate) * up, bf16 [T, I] (into `out`,
    contiguous [T, I] bf16, where given)."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(rows, inner, dtype=gate_up.dtype)
    native.checked_out(out, (rows, inner), gate_up)
    registry.c_call("pt_simd_silu_mul", gate_up.data_ptr(), gate_up.stride(0), rows, inner, out.data_ptr())
    return out


def rms_norm_gated_accepts(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if (x.device.type != "cpu" or x.dtype != torch.float32 or gate.dtype != torch.bfloat16 or x.dim() != 3
            or gate.shape != x.shape or x.stride(-1) != 1 or gate.stride(-1) != 1 or x.shape[-1] == 0
            or weight.numel() != x.shape[-1]):
        return "not float32 x and a bf16 gate [R, H, D] on the CPU with unit last strides, weight [D]"
    return None if available() else "no AVX-512 BF16 build"


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps) * silu(gate) over the last dim, rounded once to bf16. x: float32 [R, H, D];
    gate: bf16 [R, H, D] (each with a unit last stride); weight: [D] -> bf16 [R, H, D]."""
    rows, heads, dim = x.shape
    w = weight.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    args = native.struct("pt_norm_gated_args", x=x.data_ptr(), x_r=x.stride(0), x_h=x.stride(1), z=gate.data_ptr(),
                         z_r=gate.stride(0), z_h=gate.stride(1), z_bf16=1, w=w.data_ptr(), R=rows, H=heads, D=dim,
                         eps=eps)
    registry.c_call("pt_simd_rms_norm_gated", args, out.data_ptr())
    return out


def sigmoid_gate_accepts(o: torch.Tensor, gate: torch.Tensor) -> str | None:
    if (o.device.type != "cpu" or o.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16 or o.dim() != 3
            or gate.shape != o.shape or o.stride(-1) != 1 or gate.stride(-1) != 1):
        return "not bf16 [R, H, D] o and gate on the CPU with unit last strides"
    return None if available() else "no AVX-512 BF16 build"


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o *= sigmoid(gate) in place, the sigmoid rounded to bf16 and then the product, as torch's two ops round them.
    o, gate: bf16 [R, H, D] with unit last strides -> o."""
    rows, heads, dim = o.shape
    args = native.struct("pt_gate_args", o=o.data_ptr(), o_r=o.stride(0), o_h=o.stride(1), g=gate.data_ptr(),
                         g_r=gate.stride(0), g_h=gate.stride(1), R=rows, H=heads, D=dim)
    registry.c_call("pt_simd_sigmoid_gate", args)
    return o
