"""Norms used by Qwen3.5 (its RMSNorm variants, the ViT's LayerNorm), in float32, cast for the next matmul.

Registers the "add_norm" and "rms_norm_gated" ops (`kernels.registry`): the C kernels on the CPU where they are
built, torch everywhere; for a bf16 "rms_norm_gated" on a CPU with AVX-512 BF16, `kernels.simd`'s pass first.
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
                 out_dtype: torch.dtype) -> torch.Tensor:
    """h += delta (in place, when given), then `rms_norm_zero_centred(h, weight, eps, out_dtype)`: the decoder's
    residual update and the next norm, by the "add_norm" op's kernel (on the CPU one C pass over h where it is
    built). h: the float32 residual stream [T, D], contiguous."""
    return ADD_NORM(h, delta, weight, None, eps, out_dtype)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """x += delta (in place, when given), then LayerNorm(x) in float32, cast to out_dtype: the ViT's residual update
    and the next norm, by the "add_norm" op's kernel. x: the float32 residual stream [T, D], contiguous."""
    return ADD_NORM(x, delta, weight, bias, eps, out_dtype)


def add_norm_torch(h, delta, weight, bias, eps, out_dtype):
    """The "add_norm" op in torch: h += delta, then the zero-centred RMSNorm (bias None) or the LayerNorm of h.
    h: [T, D] float32; delta: [T, D] or None; weight, bias: [D] -> [T, D] out_dtype."""
    if delta is not None:
        h += delta
    if bias is None:
        return rms_norm_zero_centred(h, weight, eps, out_dtype)
    return F.layer_norm(h, h.shape[-1:], weight.float(), bias.float(), eps).to(out_dtype)


def _add_norm_c_accepts(h, delta, weight, bias, eps, out_dtype) -> str | None:
    if h.dtype != torch.float32 or h.dim() != 2 or not h.is_contiguous() or h.shape[1] == 0:
        return "h not a contiguous float32 [T, D] with D > 0"
    if weight.numel() != h.shape[1] or (bias is not None and bias.numel() != h.shape[1]):
        return "weight or bias not of h's width"
    if delta is not None and (delta.shape != h.shape or delta.stride(-1) != 1):
        return "delta not of h's shape with a unit last stride"
    if not _native.handles(h, out_dtype, *([] if delta is None else [delta])):
        return "a device or dtype the C kernels do not take, or no C library"
    return None


def _add_norm_c(h, delta, weight, bias, eps, out_dtype):
    """The "add_norm" op in one C pass (`pt_add_norm`): h += delta; out = norm(h). bias None: the decoder's
    zero-centred RMSNorm (weight + 1); else the ViT's LayerNorm. A decline leaves h untouched."""
    if bias is None:
        weight = 1.0 + weight.float()
    weight, bias = (None if t is None else t.float().contiguous() for t in (weight, bias))
    out = torch.empty(h.shape, dtype=out_dtype)
    args = _native.struct("pt_add_norm_args", h=h.data_ptr(), delta=None if delta is None else delta.data_ptr(),
                          delta_t=0 if delta is None else delta.stride(0),
                          delta_bf16=0 if delta is None else _native.is_bf16(delta), w=weight.data_ptr(),
                          b=None if bias is None else bias.data_ptr(), layer_norm=int(bias is not None),
                          T=h.shape[0], D=h.shape[1], eps=eps)
    registry.c_call("pt_add_norm", args, out.data_ptr(), _native.is_bf16(out))
    return out


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * norm(x) * silu(gate): the Gated DeltaNet output norm (plain weight, norm before gate), by the
    "rms_norm_gated" op's kernel (on the CPU in bf16 the AVX-512 pass where it is built, else one C pass, else
    torch's fused rms_norm).

    Computed in float32 end to end and returned in the gate's dtype. x is the gated delta rule's output, often
    tiny (rms ~1e-2) and scaled up here by its reciprocal rms, so it should arrive unrounded (float32)."""
    return RMS_NORM_GATED(x, gate, weight, eps)


def rms_norm_gated_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The "rms_norm_gated" op in torch: its fused rms_norm and an in-place SiLU on the gate's float32 copy (38 ->
    23 ms at [2296, 16, 128] against the formula), the same values as `rms_norm_gated_reference`."""
    normed = F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps)
    act = F.silu(gate.float(), inplace=gate.dtype != torch.float32)   # never in place on the caller's tensor
    return normed.mul_(act).to(gate.dtype)


def rms_norm_gated_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = gate.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * F.silu(gate.float())).to(dtype)


def _norm_gated_c_accepts(x, gate, weight, eps) -> str | None:
    if (x.dim() != 3 or x.dtype != torch.float32 or gate.shape != x.shape or x.stride(-1) != 1
            or gate.stride(-1) != 1 or x.shape[-1] == 0 or weight.numel() != x.shape[-1]):
        return "x not float32 [R, H, D] like the gate with unit last strides, or weight not [D]"
    if not _native.handles(x, gate):
        return "a device or dtype the C kernels do not take, or no C library"
    return None


def _norm_gated_c(x, gate, weight, eps):
    """The "rms_norm_gated" op in one C pass (`pt_rms_norm_gated`)."""
    rows, heads, dim = x.shape
    w = weight.float().contiguous()
    out = torch.empty(x.shape, dtype=gate.dtype)
    args = _native.struct("pt_norm_gated_args", x=x.data_ptr(), x_r=x.stride(0), x_h=x.stride(1),
                          z=gate.data_ptr(), z_r=gate.stride(0), z_h=gate.stride(1), z_bf16=_native.is_bf16(gate),
                          w=w.data_ptr(), R=rows, H=heads, D=dim, eps=eps)
    registry.c_call("pt_rms_norm_gated", args, out.data_ptr())
    return out


_C_DTYPES = (torch.float32, torch.bfloat16)
# the call's device and the dtype its kernels are chosen by: the output's (add_norm), the gate's (rms_norm_gated)
ADD_NORM = registry.op("add_norm", lambda h, delta, weight, bias, eps, out_dtype: (h.device, out_dtype))
NATIVE_ADD_NORM = ADD_NORM.register("native C pt_add_norm", _add_norm_c, accepts=_add_norm_c_accepts,
                                    dtypes=_C_DTYPES, available=lambda: _native.available(), priority=10,
                                    entry="pt_add_norm")
TORCH_ADD_NORM = ADD_NORM.register("torch", add_norm_torch, devices=("cpu", "cuda"))
RMS_NORM_GATED = registry.op("rms_norm_gated", lambda x, gate, weight, eps: (x.device, gate.dtype))
VECTOR_NORM_GATED = RMS_NORM_GATED.register("AVX-512 pt_simd_rms_norm_gated", simd.rms_norm_gated,
                                            accepts=simd.rms_norm_gated_accepts, dtypes=(torch.bfloat16,),
                                            available=lambda: simd.available(), priority=20,
                                            entry="pt_simd_rms_norm_gated")
NATIVE_NORM_GATED = RMS_NORM_GATED.register("native C pt_rms_norm_gated", _norm_gated_c,
                                            accepts=_norm_gated_c_accepts, dtypes=_C_DTYPES,
                                            available=lambda: _native.available(), priority=10,
                                            entry="pt_rms_norm_gated")
TORCH_NORM_GATED = RMS_NORM_GATED.register("torch fused rms_norm", rms_norm_gated_torch, devices=("cpu", "cuda"))
