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

from pixeltriage.kernels import native

# the instruction sets the passes need (`native.build_features`)
NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})


def available() -> bool:
    """The library is loaded, built for a CPU with AVX512-F/BW/VL/BF16 or emulating them (otherwise its functions
    decline everything)."""
    return native.library() is not None and NEEDS <= native.build_features()


def status() -> str:
    status = native.status()
    return status + (" (no AVX-512 BF16: declines)" if native.available() and not available() else "")


def _takes(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1 and available()


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """gate_up: bf16 [T, 2I] (gate columns first, rows contiguous) -> silu(gate) * up, bf16 [T, I] (into `out`,
    contiguous [T, I] bf16, where given); None where the kernel does not apply (another dtype or layout, or no
    AVX-512 BF16)."""
    if not _takes(gate_up) or gate_up.shape[1] % 2:
        return None
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(rows, inner, dtype=gate_up.dtype)
    native.checked_out(out, (rows, inner), gate_up)
    ran = native.call("pt_simd_silu_mul", gate_up.data_ptr(), gate_up.stride(0), rows, inner, out.data_ptr()) == 0
    return out if ran else None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """w * x / sqrt(mean(x^2) + eps) * silu(gate) over the last dim, rounded once to bf16. x: float32 [R, H, D];
    gate: bf16 [R, H, D] (each with a unit last stride); weight: [D] -> bf16 [R, H, D]; None where the kernel does
    not apply (other dtypes or layouts, or no AVX-512 BF16)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or gate.dtype != torch.bfloat16 or x.dim() != 3
            or gate.shape != x.shape or x.stride(-1) != 1 or gate.stride(-1) != 1 or x.shape[-1] == 0
            or weight.numel() != x.shape[-1] or not available()):
        return None
    rows, heads, dim = x.shape
    w = weight.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    args = native.struct("pt_norm_gated_args", x=x.data_ptr(), x_r=x.stride(0), x_h=x.stride(1), z=gate.data_ptr(),
                         z_r=gate.stride(0), z_h=gate.stride(1), z_bf16=1, w=w.data_ptr(), R=rows, H=heads, D=dim,
                         eps=eps)
    return out if native.call("pt_simd_rms_norm_gated", args, out.data_ptr()) == 0 else None


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor) -> bool:
    """o *= sigmoid(gate) in place, the sigmoid rounded to bf16 and then the product, as torch's two ops round them.
    o, gate: bf16 [R, H, D] with unit last strides. False (o untouched) where the kernel does not apply."""
    if (o.device.type != "cpu" or o.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16 or o.dim() != 3
            or gate.shape != o.shape or o.stride(-1) != 1 or gate.stride(-1) != 1 or not available()):
        return False
    rows, heads, dim = o.shape
    args = native.struct("pt_gate_args", o=o.data_ptr(), o_r=o.stride(0), o_h=o.stride(1), g=gate.data_ptr(),
                         g_r=gate.stride(0), g_h=gate.stride(1), R=rows, H=heads, D=dim)
    return native.call("pt_simd_sigmoid_gate", args) == 0
