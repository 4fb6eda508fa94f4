"""Loading a System One checkpoint directory into the engine's fused layout."""
from __future__ import annotations

from pathlib import Path

import torch

from pixeltriage.engine.config import ModelConfig
from pixeltriage.errors import CheckpointError
from pixeltriage.weights.layout import EngineWeights, build_engine_weights
from pixeltriage.weights.reader import TensorSource, weight_files

HEAD_FILE = "decision_head.safetensors"


def load_checkpoint(directory: Path, cfg: ModelConfig, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> EngineWeights:
    """Backbone shards (+ decision_head.safetensors when present) -> EngineWeights; all or nothing."""
    files = weight_files(directory)
    head = directory / HEAD_FILE
    if head.is_file():
        files.append(head)
    source = TensorSource(files)
    try:
        weights = build_engine_weights(source, cfg, head_dim, dtype, device)
    finally:
        source.close()
    check_finite(weights)
    return weights


def check_finite(weights: EngineWeights) -> None:
    """NaN/Inf anywhere in the weights is an error at load, not a silent mis-score later."""
    def walk(obj, name):
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and not torch.isfinite(obj).all():
                raise CheckpointError(f"tensor {name} contains NaN or Inf")
        elif isinstance(obj, list):
            for i, item in enumerate(obj):
                walk(item, f"{name}[{i}]")
        elif hasattr(obj, "__dataclass_fields__"):
            for field_name in obj.__dataclass_fields__:
                walk(getattr(obj, field_name), f"{name}.{field_name}")

    walk(weights, "weights")
