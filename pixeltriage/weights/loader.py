"""Loading a System One checkpoint directory into the engine's fused layout."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pixeltriage.config import ImageConfig, ModelConfig, TriageConfig
from pixeltriage.errors import CheckpointError
from pixeltriage.weights.adapter import LoraAdapter, is_adapter_dir
from pixeltriage.weights.layout import LAYOUTS, EngineWeights, build_engine_weights, detect_layout, flatten
from pixeltriage.weights.reader import TensorSource, weight_files

HEAD_FILE = "decision_head.safetensors"


@dataclass(frozen=True)
class CheckpointDirectory:
    """A checkpoint directory as loaded: its three configs, the tokenizer file and the engine weights."""

    path: Path
    model_config: ModelConfig
    image_config: ImageConfig
    triage_config: TriageConfig
    tokenizer_file: Path
    weights: EngineWeights


def load_directory(path: Path, dtype: torch.dtype, device: torch.device, adapter: Path | None = None,
                   verify: bool = True) -> CheckpointDirectory:
    """Read a checkpoint directory (see docs/checkpoints.md): configs first (a bad one fails before any tensor is
    read), then the weights with the adapter merged; `adapter=None` takes one inside the directory itself."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint not found (a directory, or a file written by `pixeltriage pack`)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a checkpoint directory (no config.json); a System One checkpoint is a "
                              "directory in transformers' layout or a file written by `pixeltriage pack` "
                              "(docs/checkpoints.md)")
    model_cfg = ModelConfig.from_file(path / "config.json")
    image_cfg = ImageConfig.from_file(path / "preprocessor_config.json")
    triage_cfg = TriageConfig.from_file(path / "pixeltriage.json")
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{tokenizer}: file not found")
    if adapter is None and is_adapter_dir(path):
        adapter = path
    weights = load_checkpoint(path, model_cfg, triage_cfg.head_dim, dtype, device, adapter, verify)
    return CheckpointDirectory(path, model_cfg, image_cfg, triage_cfg, tokenizer, weights)


def load_checkpoint(directory: Path, cfg: ModelConfig, head_dim: int, dtype: torch.dtype,
                    device: torch.device, adapter: Path | None = None, verify: bool = True) -> EngineWeights:
    """Backbone shards (+ decision_head.safetensors when present, + a LoRA adapter merged at read) ->
    EngineWeights in the engine's fused layout; all or nothing. verify: NaN/Inf anywhere is an error."""
    files = weight_files(directory)
    head = directory / HEAD_FILE
    if head.is_file():
        files.append(head)
    lora = LoraAdapter(adapter) if adapter is not None else None
    source = TensorSource(files, adapter=lora)
    try:
        text_prefix, vision_prefix = LAYOUTS[detect_layout(source.names(), directory)]
        if lora is not None:
            lora.bind(source.names())
        weights = build_engine_weights(source, cfg, head_dim, dtype, device, text_prefix, vision_prefix)
    finally:
        source.close()
    if verify:
        check_finite(weights, directory)
    return weights


def check_finite(weights: EngineWeights, source: str | Path, max_numel: int | None = None) -> None:
    """NaN/Inf anywhere in the weights is an error at load, not a silent mis-score later. With `max_numel`, only
    tensors of at most that many elements are read (norms, A_log, dt_bias, conv taps, biases, the head)."""
    checked = [(name, t) for name, t in flatten(weights)[0].items()
               if t.is_floating_point() and t.numel() and (max_numel is None or t.numel() <= max_numel)]
    if not checked:
        return
    # aminmax propagates NaN and exposes +-Inf in one pass without temporaries (isfinite is ~15x slower on bf16
    # and allocates a mask the size of the tensor); every tensor's extremes are judged together, one device sync
    extremes = torch.stack([torch.stack(torch.aminmax(t)).float() for _, t in checked])
    if torch.isfinite(extremes).all():
        return
    name = next(name for (name, _), row in zip(checked, extremes) if not torch.isfinite(row).all())
    raise CheckpointError(f"{source}: tensor {name} contains NaN or Inf")
