"""Rotary position embeddings: the text decoder's interleaved M-RoPE and the ViT's 2-D rotary.

Registers the "norm_rotary" (the decoder attention's q/k norm + partial rotary) and "rotary" (the ViT's) ops
(`kernels.registry`): the C kernel on the CPU where it is built, torch everywhere.
"""
from __future__ import annotations

import math

import torch

from pixeltriage.kernels import native as _native
from pixeltriage.kernels import registry
from pixeltriage.kernels.norm import rms_norm_zero_centred


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def mrope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int]):
    """Interleaved 3-D M-RoPE tables.

    position_ids: [3, T] (temporal, height, width). Frequency j takes its angle from axis
    (1 if j % 3 == 1 and j < 3*sec_h, 2 if j % 3 == 2 and j < 3*sec_w, else 0).
    Returns cos, sin: [T, rotary_dim] float32.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=position_ids.device) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = position_ids.float()[..., None] * inv_freq                # [3, T, rotary_dim/2]
    index = torch.arange(rotary_dim // 2, device=position_ids.device)
    # torch.where, not a boolean-mask assignment: that counts the mask on the host (a device sync, and no CUDA
    # graph can capture it)
    axis = torch.where((index % 3 == 1) & (index < 3 * mrope_section[1]), 1,
                       torch.where((index % 3 == 2) & (index < 3 * mrope_section[2]), 2, 0))
    freqs = freqs.gather(0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of each head. x: [T, heads, head_dim]; cos/sin: [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def norm_partial_rotary(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """`apply_partial_rotary(rms_norm_zero_centred(x, weight, eps), cos, sin)`: the decoder attention's q and k, by
    the "norm_rotary" op's kernel. x: [T, heads, head_dim]; cos/sin: [T, rotary_dim] -> x's dtype.

    On the CPU the C kernel makes it one pass per row in float32, rounded once, where the torch kernel rounds the
    normed x and then each rotary product (transformers' order; the two agree within those roundings), reading q
    straight from its strided [query | gate] projection."""
    return NORM_ROTARY(x, weight, eps, cos, sin)


def norm_partial_rotary_torch(x, weight, eps, cos, sin):
    """The "norm_rotary" op in torch."""
    return apply_partial_rotary(rms_norm_zero_centred(x, weight, eps), cos, sin)


def _norm_rotary_c_accepts(x, weight, eps, cos, sin) -> str | None:
    if (x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] == 0 or weight.numel() != x.shape[-1]
            or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[0] or cos.shape[1] > x.shape[-1]):
        return "x not [T, H, D] with a unit last stride, weight not [D], or cos/sin not [T, R <= D]"
    return None if _native.handles(x, weight, cos, sin) else \
        "a device or dtype the C kernels do not take, or no C library"


def _norm_rotary_c(x, weight, eps, cos, sin):
    """The "norm_rotary" op in one C pass (`pt_rotary` with the norm)."""
    n, heads, dim = x.shape
    w = (1.0 + weight.float()).contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    args = _native.struct("pt_rotary_args", x=x.data_ptr(), x_n=x.stride(0), x_g=x.stride(1),
                          x_bf16=_native.is_bf16(x), w=w.data_ptr(), eps=eps, cos=cos.data_ptr(), sin=sin.data_ptr(),
                          N=n, G=heads, D=dim, R=cos.shape[1])
    registry.c_call("pt_rotary", args, out.data_ptr())
    return out


def vision_rotary_cos_sin(hw_ids: torch.Tensor, head_dim: int, theta: float):
    """2-D rotary for the ViT. hw_ids: [N, 2] (row, col) -> cos, sin: [N, head_dim] float32."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=hw_ids.device) / spatial))
    freqs = hw_ids.float()[..., None] * inv_freq                      # [N, 2, head_dim/4]
    freqs = freqs.flatten(1)                                          # [N, head_dim/2] = (h freqs, w freqs)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Full-width rotary in float32, cast back: x * cos + rotate_half(x) * sin, by the "rotary" op's kernel.
    x: [N, ..., head_dim] (e.g. [N, heads, head_dim], or q and k together as [N, 2, heads, head_dim]);
    cos/sin: [N, head_dim], broadcast over x's middle dimensions."""
    return ROTARY(x, cos, sin)


def apply_rotary_float_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The "rotary" op in torch: rotate_half's negated concatenation is never built: each half takes its partner
    half times the matching half of sin, negated for the first, with one multiply-add in place (3 passes over x
    instead of 6)."""
    half = x.shape[-1] // 2
    cos, sin = (t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1]) for t in (cos, sin))
    xf = x.float()
    out = xf * cos
    out[..., :half].addcmul_(xf[..., half:], sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(xf[..., :half], sin[..., half:])
    return out.to(x.dtype)


def apply_rotary_float_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' formula: (x * cos + rotate_half(x) * sin) in float32, cast back."""
    cos, sin = (t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1]) for t in (cos, sin))
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def _group_stride(x: torch.Tensor) -> int | None:
    """The stride of x's middle dimensions merged into one ([N, G, D]), or None where their strides do not allow it."""
    groups, group_stride = 1, x.shape[-1]
    for size, stride in zip(reversed(x.shape[1:-1]), reversed(x.stride()[1:-1])):  # innermost middle dim first
        if size == 1:
            continue
        if groups == 1:
            group_stride = stride
        elif stride != groups * group_stride:
            return None                                                 # not one evenly strided group dim
        groups *= size
    return group_stride


def _rotary_c_accepts(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    if x.dim() < 2 or x.stride(-1) != 1 or x.shape[-1] % 2:
        return "x not [N, ..., D] with an even D and a unit last stride"
    if cos.shape != (x.shape[0], x.shape[-1]) or sin.shape != cos.shape:
        return "cos/sin broadcast, not [N, D]"
    if _group_stride(x) is None:
        return "x's middle dimensions not one evenly strided group"
    return None if _native.handles(x, cos, sin) else "a device or dtype the C kernels do not take, or no C library"


def _rotary_c(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The "rotary" op in one C pass (`pt_rotary`), x viewed as [N, G, D] (its middle dimensions merged)."""
    n, d = x.shape[0], x.shape[-1]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    args = _native.struct("pt_rotary_args", x=x.data_ptr(), x_n=x.stride(0), x_g=_group_stride(x),
                          x_bf16=_native.is_bf16(x), w=None, eps=0.0, cos=cos.data_ptr(), sin=sin.data_ptr(), N=n,
                          G=math.prod(x.shape[1:-1]), D=d, R=d)
    registry.c_call("pt_rotary", args, out.data_ptr())
    return out


_C_DTYPES = (torch.float32, torch.bfloat16)
NORM_ROTARY = registry.op("norm_rotary", lambda x, *args: (x.device, x.dtype))
NATIVE_NORM_ROTARY = NORM_ROTARY.register("native C pt_rotary (with the norm)", _norm_rotary_c,
                                          accepts=_norm_rotary_c_accepts, dtypes=_C_DTYPES,
                                          available=lambda: _native.available(), priority=10, entry="pt_rotary")
TORCH_NORM_ROTARY = NORM_ROTARY.register("torch", norm_partial_rotary_torch, devices=("cpu", "cuda"))
ROTARY = registry.op("rotary", lambda x, *args: (x.device, x.dtype))
NATIVE_ROTARY = ROTARY.register("native C pt_rotary", _rotary_c, accepts=_rotary_c_accepts, dtypes=_C_DTYPES,
                                available=lambda: _native.available(), priority=10, entry="pt_rotary")
TORCH_ROTARY = ROTARY.register("torch", apply_rotary_float_torch, devices=("cpu", "cuda"))
