"""What GET /info and GET /metrics show of a `Service`: its version, status, limits, model, kernels, cache, region
index and rate gates; the metrics registry with what it reads off the scorer brought up to date. Both are built here
and nowhere else (Ray Serve's deployment-wide views call these too).
"""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.serve.service import Service


def info(service: "Service") -> dict:
    """GET /info's body."""
    from pixeltriage import __version__

    out = {"version": __version__, "status": service.status, **service.describe,
           "instance": {"host": socket.gethostname(), "pid": os.getpid()}, "limits": service.config.limits()}
    scorer, index, config = service.scorer, service.index, service.config
    if scorer is None:
        return out
    text, vision = scorer.model_config.text, scorer.model_config.vision
    out["limits"]["max_batch_tokens"] = scorer.max_batch_tokens
    out["limits"]["max_state_tokens"] = scorer.packer.max_tokens
    out.update({
        "checkpoint_fingerprint": scorer.checkpoint_fingerprint,
        "vision_fingerprint": scorer.vision_fingerprint,
        "device": str(scorer.device),
        "dtype": str(scorer.dtype).removeprefix("torch."),
        "model": {"hidden_size": text.hidden_size, "layers": len(text.layer_types),
                  "full_attention_layers": sum(t == "full_attention" for t in text.layer_types),
                  "attention_heads": text.num_attention_heads, "kv_heads": text.num_key_value_heads,
                  "vocab_size": text.vocab_size, "vision_depth": vision.depth,
                  "vision_hidden_size": vision.hidden_size, "patch_size": vision.patch_size,
                  "head_dim": scorer.triage_config.head_dim,
                  "thumbnail_size": scorer.triage_config.thumbnail_size},
        "kernels": kernels(scorer),
        "kernels_ran": scorer.kernel_counts().to_dict(),
        "cache": scorer.cache is not None,
        "region_index": None if index is None else {"images": _indexed_images(index), "fingerprint": index.fingerprint},
        "gates": {"active": len(service.infer.gates), "window": config.gate_window, "max": config.max_gates},
    })
    return out


def _indexed_images(index) -> int:
    index.refresh()                                # rows written since the last search, by any process
    return len(index)


def build_info(service: "Service") -> dict:
    """The `pixeltriage_build_info` metric's labels."""
    from pixeltriage import __version__

    scorer = service.scorer
    return {"version": __version__, "checkpoint": service.describe.get("checkpoint", ""),
            "device": str(scorer.device) if scorer else "", "dtype": str(scorer.dtype).removeprefix("torch.")
            if scorer else ""}


def exposition(service: "Service") -> tuple[bytes, str]:
    """GET /metrics: the metrics in Prometheus text format and its content type, the scorer's brought up to date
    first."""
    update_scorer_metrics(service)
    return service.metrics.expose()


def update_scorer_metrics(service: "Service") -> None:
    """Bring what the metrics read off the loaded scorer up to date: the build (`build_info`), the vision tower's
    counters and the kernels' calls and declines (`Metrics.vision_counts` and `Metrics.kernel_counts` add what they
    gained since their last call) and the workspace's bytes."""
    if service.scorer is not None:
        service.metrics.build.info({k: str(v) for k, v in build_info(service).items()})
        service.metrics.vision_counts(service.scorer.vision_counts)
        service.metrics.kernel_counts(service.scorer.kernel_counts())
        service.metrics.workspace_bytes.set(service.scorer.workspace.nbytes)


def kernels(scorer: "Scorer") -> dict[str, str]:
    """Which kernel a call of each op of the forward starts with on this scorer's device and dtype (`Scorer.kernels`,
    from the kernel registry; on the CPU "native" names the C library's build in use), and on the CPU whether the C
    kernels are loaded (or why not). What ran: /info's "kernels_ran" (`Scorer.kernel_counts`)."""
    from pixeltriage.kernels import native, registry

    names = scorer.kernels()
    if registry.kernel_device(scorer.device) == "cpu":
        names["native_kernels"] = "available" if native.available() else native.status()
    return names
