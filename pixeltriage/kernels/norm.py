"""Norms used by Qwen3.5 (its RMSNorm variants, the ViT's LayerNorm), in float32, cast for the next matmul.

Registers the "add_norm" and "rms_norm_gated" ops (`kernels.registry`), chosen by the output's dtype: the C
kernels on the CPU where they are built, torch everywhere; for a bf16 "rms_norm_gated" on a CPU with AVX-512 BF16,
`kernels.simd`'s pass first.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pixeltriage.kernels import native as _native
from pixeltriage.kernels import registry, simd


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w): the decoder's norms (weights stored centred at zero).

    Output in `out_dtype` (default: x's dtype), so a float32 residual can feed low-precision matmuls.
    """
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(out_dtype or x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype, native: bool | None = None) -> torch.Tensor:
    """h += delta (in place, when given), then `rms_norm_zero_centred(h, weight, eps, out_dtype)`: the decoder's
    residual update and the next norm. h: the float32 residual stream [T, D], contiguous.

    native: on the CPU, one C pass over h (`kernels.native`) when it is built (None: whenever available; False:
    the torch ops, which it is tested against)."""
    return _add_norm_kernel(h, out_dtype, native).fn(h, delta, weight, None, eps, out_dtype)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, native: bool | None = None) -> torch.Tensor:
    """x += delta (in place, when given), then LayerNorm(x) in float32, cast to out_dtype: the ViT's residual update
    and the next norm. x: the float32 residual stream [T, D], contiguous.

    native: on the CPU, one C pass over x (`kernels.native`) when it is built (None: whenever available; False:
    the torch ops, which it is tested against)."""
    return _add_norm_kernel(x, out_dtype, native).fn(x, delta, weight, bias, eps, out_dtype)


def _add_norm_kernel(h: torch.Tensor, out_dtype: torch.dtype, native: bool | None) -> "registry.Kernel":
    return TORCH_ADD_NORM if native is False else registry.choose("add_norm", h.device, out_dtype)


def _add_norm_torch(h, delta, weight, bias, eps, out_dtype):
    """The "add_norm" op in torch: h += delta, then the zero-centred RMSNorm (bias None) or the LayerNorm of h.
    h: [T, D] float32; delta: [T, D] or None; weight, bias: [D] -> [T, D] out_dtype."""
    if delta is not None:
        h += delta
    if bias is None:
        return rms_norm_zero_centred(h, weight, eps, out_dtype)
    return F.layer_norm(h, h.shape[-1:], weight.float(), bias.float(), eps).to(out_dtype)


def _add_norm_c(h, delta, weight, bias, eps, out_dtype):
    """The "add_norm" op in one C pass, the torch ops where the C kernel declines (same contract)."""
    out = _native_add_norm(h, delta, out_dtype, weight, bias, eps)
    return out if out is not None else _add_norm_torch(h, delta, weight, bias, eps, out_dtype)


def _native_add_norm(h, delta, out_dtype, weight, bias, eps):
    """h += delta; out = norm(h) through the C kernel, or None where it does not apply (h untouched then).
    bias None: the decoder's zero-centred RMSNorm (weight + 1); else the ViT's LayerNorm."""
    from pixeltriage.kernels import native

    if (h.dtype != torch.float32 or h.dim() != 2 or not h.is_contiguous() or h.shape[1] == 0
            or weight.numel() != h.shape[1] or (bias is not None and bias.numel() != h.shape[1])
            or (delta is not None and (delta.shape != h.shape or delta.stride(-1) != 1))
            or not native.handles(h, out_dtype, *([] if delta is None else [delta]))):
        return None
    if bias is None:
        weight = 1.0 + weight.float()
    weight, bias = (None if t is None else t.float().contiguous() for t in (weight, bias))
    out = torch.empty(h.shape, dtype=out_dtype)
    args = native.struct("pt_add_norm_args", h=h.data_ptr(), delta=None if delta is None else delta.data_ptr(),
                         delta_t=0 if delta is None else delta.stride(0),
                         delta_bf16=0 if delta is None else native.is_bf16(delta), w=weight.data_ptr(),
                         b=None if bias is None else bias.data_ptr(), layer_norm=int(bias is not None), T=h.shape[0],
                         D=h.shape[1], eps=eps)
    return out if native.call("pt_add_norm", args, out.data_ptr(), native.is_bf16(out)) == 0 else None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   native: bool | None = None, vector: bool | None = None) -> torch.Tensor:
    """w * norm(x) * silu(gate): the Gated DeltaNet output norm (plain weight, norm before gate).

    Computed in float32 end to end and returned in the gate's dtype. x is the gated delta rule's output, often
    tiny (rms ~1e-2) and scaled up here by its reciprocal rms, so it should arrive unrounded (float32).
    torch's fused rms_norm and an in-place SiLU on the gate's float32 copy: 38 -> 23 ms at [2296, 16, 128], the
    same values as `rms_norm_gated_reference`. native: on the CPU, one C pass (`kernels.native`) when it is built
    (None: whenever available; False: the torch ops). In bf16 the AVX-512 pass (`kernels.simd`; vector=False: the
    C pass) comes first where it is built."""
    kernel = TORCH_NORM_GATED if native is False else registry.choose("rms_norm_gated", x.device, gate.dtype)
    if kernel is VECTOR_NORM_GATED and vector is False:
        return _rms_norm_gated_c(x, gate, weight, eps)
    return kernel.fn(x, gate, weight, eps)


def _rms_norm_gated_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The "rms_norm_gated" op in torch (see `rms_norm_gated`)."""
    normed = F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps)
    act = F.silu(gate.float(), inplace=gate.dtype != torch.float32)   # never in place on the caller's tensor
    return normed.mul_(act).to(gate.dtype)


def rms_norm_gated_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = gate.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * F.silu(gate.float())).to(dtype)


def _native_rms_norm_gated(x, gate, weight, eps):
    from pixeltriage.kernels import native

    if (x.dim() != 3 or x.dtype != torch.float32 or gate.shape != x.shape or x.stride(-1) != 1
            or gate.stride(-1) != 1 or x.shape[-1] == 0 or weight.numel() != x.shape[-1]
            or not native.handles(x, gate)):
        return None
    rows, heads, dim = x.shape
    w = weight.float().contiguous()
    out = torch.empty(x.shape, dtype=gate.dtype)
    args = native.struct("pt_norm_gated_args", x=x.data_ptr(), x_r=x.stride(0), x_h=x.stride(1), z=gate.data_ptr(),
                         z_r=gate.stride(0), z_h=gate.stride(1), z_bf16=native.is_bf16(gate), w=w.data_ptr(), R=rows,
                         H=heads, D=dim, eps=eps)
    return out if native.call("pt_rms_norm_gated", args, out.data_ptr()) == 0 else None


def _rms_norm_gated_c(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The "rms_norm_gated" op in one C pass, torch where the C kernel declines."""
    out = _native_rms_norm_gated(x, gate, weight, eps)
    return out if out is not None else _rms_norm_gated_torch(x, gate, weight, eps)


def _rms_norm_gated_simd(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The "rms_norm_gated" op in one AVX-512 pass (bf16 gate and output), the C pass where it declines."""
    out = simd.rms_norm_gated(x, gate, weight, eps)
    return out if out is not None else _rms_norm_gated_c(x, gate, weight, eps)


_C_DTYPES = (torch.float32, torch.bfloat16)
registry.register("add_norm", "native C pt_add_norm", _add_norm_c, devices=("cpu",), dtypes=_C_DTYPES,
                  available=lambda: _native.available(), priority=10)
TORCH_ADD_NORM = registry.register("add_norm", "torch", _add_norm_torch, devices=("cpu", "cuda"))
VECTOR_NORM_GATED = registry.register("rms_norm_gated", "AVX-512 pt_simd_rms_norm_gated", _rms_norm_gated_simd,
                                      devices=("cpu",), dtypes=(torch.bfloat16,), available=lambda: simd.available(),
                                      priority=20)
registry.register("rms_norm_gated", "native C pt_rms_norm_gated", _rms_norm_gated_c, devices=("cpu",),
                  dtypes=_C_DTYPES, available=lambda: _native.available(), priority=10)
TORCH_NORM_GATED = registry.register("rms_norm_gated", "torch fused rms_norm", _rms_norm_gated_torch,
                                     devices=("cpu", "cuda"))
