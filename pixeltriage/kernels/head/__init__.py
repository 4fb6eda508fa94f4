"""Decision head: gather rows, final norm, bilinear logits, p_vis / gains / relevance.

`reference` is the plain PyTorch ground truth (and the CPU path); `triton` is the fused kernel, imported only
when the Triton backend is chosen, so the CPU path never imports Triton.

Registers the "head" op (`kernels.registry`), its kernels fn(*args of `decision_head_reference`) -> HeadOutput:
"triton fused head" on CUDA when triton is installed, "torch reference" everywhere (a slow fallback on CUDA).
"""
from __future__ import annotations

import importlib.util

import torch

from pixeltriage import settings
from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels import registry
from pixeltriage.kernels.head.reference import HeadOutput, decision_head_reference, final_norm_rows

__all__ = ["HeadOutput", "decision_head", "decision_head_reference", "final_norm_rows", "resolve_head_backend"]

HEAD_BACKENDS = ("auto", "triton", "torch")


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    return settings.current().triton_interpret


def _run_triton(*args) -> HeadOutput:
    try:
        from pixeltriage.kernels.head.triton import decision_head_triton
    except ImportError as e:
        raise BackendUnavailableError(f"head backend 'triton': importing the kernel failed ({e})") from e
    return decision_head_triton(*args)


HEAD = registry.op("head", lambda hidden, *args: (hidden.device, hidden.dtype))
TRITON = HEAD.register("triton fused head", _run_triton, devices=("cuda",), available=lambda: _triton_installed(),
                       priority=10, package="triton")
TORCH = HEAD.register("torch reference", decision_head_reference, devices=("cpu",))
TORCH_CUDA = HEAD.register("torch reference", decision_head_reference, devices=("cuda",), slow=True)


def resolve_head_backend(name: str, device: torch.device) -> str:
    """"auto" | "triton" | "torch" -> "triton" or "torch" for tensors on `device`.

    auto: the registry's choice (`kernels.registry`): Triton on CUDA when it is installed (and on the CPU under the
    test switch PIXELTRIAGE_EMULATE_CUDA=1 with TRITON_INTERPRET=1), else torch. triton: CUDA, or a CPU under
    TRITON_INTERPRET=1 (the interpreter, for tests); anything else raises BackendUnavailableError.
    """
    if name not in HEAD_BACKENDS:
        raise ValueError(f"head backend {name!r} unknown; expected one of {list(HEAD_BACKENDS)}")
    device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if registry.choose("head", device, torch.float32).name == TRITON.name else "torch"
    if not _triton_installed():
        raise BackendUnavailableError("head backend 'triton' requested but triton is not installed "
                                      "(pip install 'pixeltriage[gpu]')")
    if device.type == "cuda" or (device.type == "cpu" and _triton_interpreting()):
        return "triton"
    raise BackendUnavailableError(f"head backend 'triton' needs a CUDA device, found {device}; on a CPU it runs "
                                  f"only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")


def decision_head(backend: str, *args) -> HeadOutput:
    """Run the decision head on `backend` ("auto": the "head" op's kernel; "triton" | "torch": that kernel, through
    `registry.run`); args as `decision_head_reference` (hidden [T, H] first) -> HeadOutput(p_vis [B], gains [M],
    relevance [M], relevance_none [B])."""
    if backend == "auto":
        return HEAD(*args)
    chosen = resolve_head_backend(backend, args[0].device)
    return registry.run(TRITON if chosen == "triton" else TORCH, *args)


def __getattr__(name: str):
    # `decision_head_triton` is exported lazily: importing this package must not import Triton.
    if name == "decision_head_triton":
        from pixeltriage.kernels.head.triton import decision_head_triton
        return decision_head_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
