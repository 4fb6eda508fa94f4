"""Decision head: gather rows, final norm, bilinear logits, p_vis / gains / relevance.

`reference` is the plain PyTorch ground truth (and the CPU path); `triton` is the fused kernel, imported only
when the Triton backend is chosen, so the CPU path never imports Triton.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels.head.reference import HeadOutput, decision_head_reference, final_norm_rows

__all__ = ["HeadOutput", "decision_head", "decision_head_reference", "final_norm_rows", "resolve_head_backend"]

HEAD_BACKENDS = ("auto", "triton", "torch")


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def resolve_head_backend(name: str, device: torch.device) -> str:
    """"auto" | "triton" | "torch" -> "triton" or "torch" for tensors on `device`.

    auto: Triton on CUDA when it is installed, else torch. triton: CUDA, or a CPU under TRITON_INTERPRET=1 (the
    interpreter, for tests); anything else raises BackendUnavailableError.
    """
    if name not in HEAD_BACKENDS:
        raise ValueError(f"head backend {name!r} unknown; expected one of {list(HEAD_BACKENDS)}")
    device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if not _triton_installed():
        raise BackendUnavailableError("head backend 'triton' requested but triton is not installed "
                                      "(pip install 'pixeltriage[gpu]')")
    if device.type == "cuda" or (device.type == "cpu" and _triton_interpreting()):
        return "triton"
    raise BackendUnavailableError(f"head backend 'triton' needs a CUDA device, found {device}; on a CPU it runs "
                                  f"only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")


def decision_head(backend: str, *args) -> HeadOutput:
    """Run the decision head on `backend` ("auto" | "triton" | "torch"); args as `decision_head_reference`."""
    if resolve_head_backend(backend, args[0].device) == "torch":
        return decision_head_reference(*args)
    try:
        from pixeltriage.kernels.head.triton import decision_head_triton
    except ImportError as e:
        raise BackendUnavailableError(f"head backend 'triton': importing the kernel failed ({e})") from e
    return decision_head_triton(*args)


def __getattr__(name: str):
    # `decision_head_triton` is exported lazily: importing this package must not import Triton.
    if name == "decision_head_triton":
        from pixeltriage.kernels.head.triton import decision_head_triton
        return decision_head_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
