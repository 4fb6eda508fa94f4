"""A linear layer with its activation fused into the GEMM's epilogue (the ViT's fc1 + GELU), and its reference.

On the CPU, oneDNN's linear primitive applies the activation to each output tile while it is still in cache,
in float32 before the output's rounding: `F.gelu(F.linear(...))` instead writes the [N, 4 x hidden] output,
reads it back and writes it again (for bf16, a second rounding). Measured on the bench-small ViT's fc1
([4000, 512] x [512, 2048], bf16): 27 -> 15.5 ms. Elsewhere (CUDA, other dtypes, activations oneDNN has no
post-op for, a torch build without oneDNN) it is the reference.

Registers the "linear" op (`kernels.registry`): oneDNN where the CPU's build has its primitive for the dtype, torch
everywhere; and the "projection" op (a layer without a bias or an activation): oneDNN in float32 where
`plain_onednn` says (below), torch everywhere.

`linear` (no activation) takes the same primitive for a layer with a bias: `F.linear` runs addmm, which first
copies the bias into every output row and then accumulates onto it, where oneDNN adds the bias in the epilogue.
Bit-identical outputs; measured on the bench-small ViT (bf16, [4000, 512] x [512, 1536]): 10.1 -> 7.6 ms.

In float32, on an AMD CPU, it takes the primitive without a bias too (the decoder's projections): torch's float32
matmul is MKL's sgemm, which on the AVX2 AMD EPYC measured ran the decoder's shapes ([2296, 1024] x [1024, 8192]
and the like) at 77-100% of oneDNN's rate (most 80-90%) and its 2048^3 GEMM at 88%; the bench-small float32
forward took 0.91x its time. MKL keeps its best code paths for Intel's CPUs, where (unmeasured) it stays: the
choice is by vendor, and only where measured. A bf16 matmul is oneDNN's already.

There too, in float32, the activation runs after the primitive instead of in its epilogue: oneDNN's GELU
epilogues cost more than the pass that replaces them (fc1 + tanh-GELU [4000, 512] x [512, 2048]: 115 -> 85-88 ms;
2b's [4000, 1024] x [1024, 4096]: 405-408 -> 368-389 ms; the merger's erf-GELU [1000, 4096] x [4096, 4096]:
322 -> 273-275 ms; the same values to 4.8e-7, erf's bit-identical). The tanh GELU is then the C kernel's, in place
on the primitive's output (`activation.gelu_tanh_`).

`PIXELTRIAGE_ONEDNN`: 0 turns the primitive off (F.linear everywhere), 1 takes it for every float32 layer whatever
the CPU (as on AMD), auto (the default) as above.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from pixeltriage.kernels import native, registry
from pixeltriage.kernels.activation import gelu_tanh_

log = logging.getLogger(__name__)

# activation name (transformers' hidden_act) -> oneDNN post-op (attr, algorithm)
_POST_OPS = {"gelu_pytorch_tanh": ("gelu", "tanh"), "gelu": ("gelu", "none"), "silu": ("swish", "")}
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu}
# activations that overwrite their input (a C kernel's pass), for outputs no one else holds
_IN_PLACE = {"gelu_pytorch_tanh": gelu_tanh_}
_STATE: dict[str, bool] = {}
ONEDNN_SWITCH = "PIXELTRIAGE_ONEDNN"


def activation(name: str, in_place: bool = False):
    """The activation transformers calls `name`; in_place: one that may overwrite its input where there is one
    (`_IN_PLACE`), for a tensor no one else holds. ValueError for a name not known."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _IN_PLACE.get(name, _ACTIVATIONS[name]) if in_place else _ACTIVATIONS[name]


def _switch() -> str:
    value = os.environ.get(ONEDNN_SWITCH, "auto").strip().lower() or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{ONEDNN_SWITCH}={os.environ[ONEDNN_SWITCH]!r}: expected auto (the default: oneDNN's linear "
                         f"primitive for layers with a bias or an activation, and for every float32 layer on an AMD "
                         f"CPU), 1 (for every float32 layer on any CPU too) or 0 (F.linear everywhere)")
    return value


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The x86 CPU's vendor_id from /proc/cpuinfo (or `cpuinfo`'s text): "GenuineIntel", "AuthenticAMD", ...; ""
    where there is none (another architecture, no /proc)."""
    return native.cpuinfo_fields(cpuinfo).get("vendor_id", "")


def _fused_available(dtype: torch.dtype = torch.float32) -> bool:
    if "ok" not in _STATE:
        switch = _switch()
        _STATE["plain"] = switch == "1" or (switch == "auto" and cpu_vendor() == "AuthenticAMD")
        if switch == "0":
            _STATE["ok"] = _STATE["bf16"] = False
            return False
        try:
            _STATE["ok"] = bool(torch.backends.mkldnn.is_available()) and \
                hasattr(torch.ops.mkldnn, "_linear_pointwise")
            # oneDNN builds bf16 primitives only on CPUs with bf16 support (AVX-512 BF16 / AMX, some aarch64)
            _STATE["bf16"] = _STATE["ok"] and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _STATE["ok"] = _STATE["bf16"] = False
    return _STATE["ok"] and (dtype != torch.bfloat16 or _STATE.get("bf16", False))


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str,
                   algorithm: str) -> torch.Tensor | None:
    """oneDNN's linear primitive with post-op `attr` where it applies (CPU, float32/bf16, one dtype throughout),
    else None. A oneDNN build without the primitive for this CPU/dtype raises once: logged, and the callers take
    their torch path from then on (which differs by at most one rounding of the output)."""
    if registry.choose("linear", x.device, x.dtype) not in ONEDNN:
        return None
    return _call_onednn(x, weight, bias, attr, algorithm)


def _call_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str,
                 algorithm: str) -> torch.Tensor | None:
    """`_onednn_linear` once the registry has chosen oneDNN."""
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    except RuntimeError as e:
        _STATE["ok"] = False
        log.warning("oneDNN linear (post-op %s) unavailable (%s); using F.linear from now on", attr, e)
        return None


def _projection_onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = _call_onednn(x, weight, None, "none", "")             # the registry chose this kernel: no second lookup
    return out if out is not None else F.linear(x, weight)


def _projection_available() -> bool:
    return _fused_available(torch.float32) and _STATE.get("plain", False)


def plain_onednn(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `linear` without a bias runs oneDNN's primitive for `dtype` tensors on `device` (else F.linear): in
    float32 where the primitive is available and the CPU's vendor (or PIXELTRIAGE_ONEDNN=1) says so."""
    return registry.choose("projection", device, dtype) is ONEDNN_PROJECTION


def _epilogue_available(dtype: torch.dtype) -> bool:
    return _fused_available(dtype) and not (dtype == torch.float32 and _STATE.get("plain", False))


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """act(x @ weight^T + bias); x: [..., in], weight: [out, in] -> [..., out] in x's dtype."""
    kernel = registry.choose("linear", x.device, x.dtype)
    if kernel is ONEDNN_THEN_ACTIVATION:
        return activation(act, in_place=True)(linear(x, weight, bias))   # the primitive's output is ours
    out = _call_onednn(x, weight, bias, *_POST_OPS[act]) if kernel in ONEDNN and act in _POST_OPS else None
    return out if out is not None else linear_act_reference(x, weight, bias, act)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias, as `F.linear`; on the CPU with a bias, or in float32 where `plain_onednn` says, oneDNN's
    linear primitive (see the module)."""
    if bias is None:
        return registry.choose("projection", x.device, x.dtype).fn(x, weight)
    out = _onednn_linear(x, weight, bias, "none", "")
    return out if out is not None else F.linear(x, weight, bias)


def linear_act_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    return activation(act)(F.linear(x, weight, bias))


# oneDNN builds bf16 primitives only on some CPUs: one registration per dtype, each asking for its own; in float32
# where the projections take oneDNN (AMD), the activation after the primitive instead of in its epilogue
ONEDNN_THEN_ACTIVATION = registry.register(
    "linear", "oneDNN linear, then the activation", linear_act, devices=("cpu",), dtypes=(torch.float32,),
    available=_projection_available, priority=10)
ONEDNN = (*(registry.register("linear", "oneDNN linear with fused post-ops", linear_act, devices=("cpu",),
                              dtypes=(dtype,), available=lambda dtype=dtype: _epilogue_available(dtype), priority=10)
            for dtype in (torch.float32, torch.bfloat16)), ONEDNN_THEN_ACTIVATION)
registry.register("linear", "torch linear", linear_act_reference, devices=("cpu", "cuda"))
ONEDNN_PROJECTION = registry.register("projection", "oneDNN linear", _projection_onednn, devices=("cpu",),
                                      dtypes=(torch.float32,), available=_projection_available, priority=10)
registry.register("projection", "torch linear", F.linear, devices=("cpu", "cuda"))
