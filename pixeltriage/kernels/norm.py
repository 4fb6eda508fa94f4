"""Norms used by Qwen3.5 (its RMSNorm variants, the ViT's LayerNorm), computed in float32 and cast for the next matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    if native is not False and h.device.type == "cpu":
        out = _native_add_norm(h, delta, out_dtype, (1.0 + weight.float()).contiguous(), None, eps)
        if out is not None:
            return out
    if delta is not None:
        h += delta
    return rms_norm_zero_centred(h, weight, eps, out_dtype)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, native: bool | None = None) -> torch.Tensor:
    """x += delta (in place, when given), then LayerNorm(x) in float32, cast to out_dtype: the ViT's residual update
    and the next norm. x: the float32 residual stream [T, D], contiguous.

    native: on the CPU, one C pass over x (`kernels.native`) when it is built (None: whenever available; False:
    the torch ops, which it is tested against)."""
    if native is not False and x.device.type == "cpu":
        out = _native_add_norm(x, delta, out_dtype, weight.float().contiguous(), bias.float().contiguous(), eps)
        if out is not None:
            return out
    if delta is not None:
        x += delta
    return F.layer_norm(x, x.shape[-1:], weight.float(), bias.float(), eps).to(out_dtype)


def _native_add_norm(h, delta, out_dtype, weight, bias, eps):
    """h += delta; out = norm(h) through the C kernel (bias None: RMSNorm, else LayerNorm; float32 contiguous
    weight and bias), or None where it does not apply."""
    from pixeltriage.kernels import native

    if (h.dtype != torch.float32 or h.dim() != 2 or not h.is_contiguous() or h.shape[1] == 0
            or out_dtype not in _NATIVE_DTYPES or weight.numel() != h.shape[1]
            or (bias is not None and bias.numel() != h.shape[1])
            or (delta is not None and (delta.dtype not in _NATIVE_DTYPES or delta.shape != h.shape
                                       or delta.stride(-1) != 1))):
        return None
    lib = native.library()
    if lib is None:
        return None
    out = torch.empty(h.shape, dtype=out_dtype)
    code = lib.pt_add_norm(h.data_ptr(), None if delta is None else delta.data_ptr(),
                           int(delta is not None and delta.dtype == torch.bfloat16),
                           0 if delta is None else delta.stride(0), weight.data_ptr(),
                           None if bias is None else bias.data_ptr(), int(bias is not None), h.shape[0], h.shape[1],
                           eps, out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"pt_add_norm failed with code {code}")    # h may be updated already: no silent retry
    return out


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   native: bool | None = None) -> torch.Tensor:
    """w * norm(x) * silu(gate): the Gated DeltaNet output norm (plain weight, norm before gate).

    Computed in float32 end to end and returned in the gate's dtype. x is the gated delta rule's output, often
    tiny (rms ~1e-2) and scaled up here by its reciprocal rms, so it should arrive unrounded (float32).
    torch's fused rms_norm and an in-place SiLU on the gate's float32 copy: 38 -> 23 ms at [2296, 16, 128], the
    same values as `rms_norm_gated_reference`. native: on the CPU, one C pass (`kernels.native`) when it is built
    (None: whenever available; False: the torch ops)."""
    if native is not False and x.device.type == "cpu":
        out = _native_rms_norm_gated(x, gate, weight, eps)
        if out is not None:
            return out
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

    if (x.dim() != 3 or x.dtype != torch.float32 or gate.shape != x.shape or gate.dtype not in _NATIVE_DTYPES
            or x.stride(-1) != 1 or gate.stride(-1) != 1 or x.shape[-1] == 0 or weight.numel() != x.shape[-1]):
        return None
    lib = native.library()
    if lib is None:
        return None
    rows, heads, dim = x.shape
    w = weight.float().contiguous()
    out = torch.empty(x.shape, dtype=gate.dtype)
    code = lib.pt_rms_norm_gated(x.data_ptr(), x.stride(0), x.stride(1), gate.data_ptr(),
                                 int(gate.dtype == torch.bfloat16), gate.stride(0), gate.stride(1), w.data_ptr(),
                                 rows, heads, dim, eps, out.data_ptr(), int(gate.dtype == torch.bfloat16),
                                 torch.get_num_threads())
    return out if code == 0 else None
