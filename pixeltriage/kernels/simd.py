"""AVX-512 passes for the SiLU-gated products between the decoder's matmuls in bf16: SwiGLU's silu(gate) * up
and the Gated DeltaNet's output norm (RMSNorm times silu(z)).

Both are compute-bound (the SiLU's e^x and division) on this engine's CPUs, not memory-bound: the C kernels
(`kernels.native`, auto-vectorised) spend ~1.2-1.4 ns per element of pt_silu_mul at one thread where a copy of the
same bytes takes ~0.3 ns. Written with AVX-512 intrinsics (e^x as 2^n * p(r), the reciprocal as rcp14 and one Newton
step instead of a division, the bf16 rounding by `vcvtneps2bf16`) the same arithmetic takes ~0.9 ns. Against the C
kernels (paired medians of 40 interleaved runs at one thread, 60 at two, load 7-8): the bench-small MLP's
[2296, 6144] -> [2296, 3072] 0.66x at one thread, 0.61x at two; the output norm at [2296, 16, 128] 0.70x and 0.66x.

The source (`kernels/native/simd.c`) is built on first use by `kernels.native.build`, like `cpu_kernels.c`, with the
same compiler, flags and switch (`PIXELTRIAGE_NATIVE=0` turns it off too), into its own library beside theirs. Where the compiler does not target
AVX512-F/BW/VL/BF16 (`-march=native` on another CPU) the library builds without them and the kernel declines:
`available()` is False and the op keeps its other kernels (its emulated build, `native.emulated_isa()`, has them on
any CPU, for the tests). The result is float32 arithmetic rounded once to bf16,
within a few float32 ulps of the exact value before that rounding, so it differs from a correctly rounded result
only where the exact value sits next to a rounding boundary (against the C kernels, by one bf16 ulp in 6.8e-6 of
SwiGLU's elements and 9.1e-6 of the norm's).
"""
from __future__ import annotations

import ctypes

import torch

from pixeltriage.kernels import native, registry

SOURCE = native.SOURCE.with_name("simd.c")


@native.per_isa
def library(emulated: bool) -> ctypes.CDLL | None:
    """The loaded library, or None (disabled, no compiler, not Linux, or the build failed); the emulated build where
    `native.isa_emulated()`."""
    lib = native.build(SOURCE, "pixeltriage_simd", "AVX-512 activation kernels", "the C or torch kernels",
                       emulated=emulated)
    if lib is None:
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.pt_simd_available.argtypes, lib.pt_simd_available.restype = [], i32
    lib.pt_simd_silu_mul.argtypes, lib.pt_simd_silu_mul.restype = [ptr, i64, i64, i64, ptr, i32], i32
    lib.pt_simd_rms_norm_gated.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_float, ptr, i32]
    lib.pt_simd_rms_norm_gated.restype = i32
    lib.pt_simd_sigmoid_gate.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i32]
    lib.pt_simd_sigmoid_gate.restype = i32
    return lib


@native.per_isa
def available(emulated: bool) -> bool:
    """Built, and built for a CPU with AVX512-F/BW/VL/BF16 or emulating them (otherwise its functions decline
    everything)."""
    lib = library.of(emulated)
    return lib is not None and lib.pt_simd_available() == 1


def status() -> str:
    lib = library()
    status = native.build_status(SOURCE)
    return status + (" (no AVX-512 BF16: declines)" if lib is not None and not available() else "")


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
    registry.c_call("pt_simd_silu_mul", gate_up.data_ptr(), gate_up.stride(0), rows, inner, out.data_ptr(),
                    lib=library())
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
    registry.c_call("pt_simd_rms_norm_gated", x.data_ptr(), x.stride(0), x.stride(1), gate.data_ptr(),
                    gate.stride(0), gate.stride(1), w.data_ptr(), rows, heads, dim, eps, out.data_ptr(), lib=library())
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
    registry.c_call("pt_simd_sigmoid_gate", o.data_ptr(), o.stride(0), o.stride(1), gate.data_ptr(), gate.stride(0),
                    gate.stride(1), rows, heads, dim, lib=library())
    return o
