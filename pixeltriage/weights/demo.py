"""Demo checkpoints: a Qwen3.5 backbone of a chosen shape with seeded random weights.

A demo checkpoint has the exact layout of a real one (transformers' config.json and tensor names,
tokenizer, image rules, decision head), so everything downstream of the loader runs on it:

    config.json                  Qwen3_5Config.save_pretrained
    model.safetensors            or model-0000i-of-0000N.safetensors + model.safetensors.index.json
    decision_head.safetensors    head.decision.weight, head.candidate.weight: [D, hidden]
    tokenizer.json, tokenizer_config.json, preprocessor_config.json, pixeltriage.json

Tensors are drawn one at a time in float32 from a generator seeded by (seed, tensor name), then
cast, so a seed gives the same values in every dtype and in any write order, and memory stays at
one tensor however large the model.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from pixeltriage.config import FULL, LINEAR, ImageConfig, TriageConfig
from pixeltriage.errors import CheckpointError
from pixeltriage.paths import cached_directory, write_directory
from pixeltriage.weights.reader import safetensors_header, tensor_numels
from pixeltriage.weights.tokenizer import (QWEN_FIRST_SPECIAL_ID, SPECIAL_TOKENS, build_tokenizer, save_tokenizer,
                                           special_token_ids)

if TYPE_CHECKING:        # transformers is imported where a checkpoint is written: loading one never needs it
    from torch import nn
    from transformers import Qwen3_5Config

TIED_KEY = "lm_head.weight"
HEAD_KEYS = ("head.decision.weight", "head.candidate.weight")
MAX_SHARD_BYTES = 2 * 1024 ** 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# 352 is the first multiple of patch*merge (32) above 336: a 336-px thumbnail is never shrunk.
_MAX_PIXELS = 352 * 352


def _every_fourth_full(num_layers: int) -> list[str]:
    return [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(num_layers)]


def _rope(theta: float, mrope_section: list[int]) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
            "mrope_section": mrope_section, "mrope_interleaved": True}


@dataclass(frozen=True)
class Preset:
    text: dict = field(repr=False)    # Qwen3_5TextConfig keyword arguments
    vision: dict = field(repr=False)  # Qwen3_5VisionConfig keyword arguments
    head_dim: int                     # D of the decision head
    bpe_vocab_size: int               # requested; the built-in corpus saturates near 1.2k tokens
    first_special_id: int
    dtype: torch.dtype
    tie_word_embeddings: bool = False

    def special_ids(self) -> dict[str, int]:
        return {token: self.first_special_id + i for i, token in enumerate(SPECIAL_TOKENS)}


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        text=dict(vocab_size=1024, hidden_size=64, intermediate_size=128, layer_types=[LINEAR] * 3 + [FULL],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4,
                  # A low theta so every rotary pair turns visibly within a short test sequence.
                  rope_parameters=_rope(100.0, [2, 1, 1])),
        vision=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64, out_hidden_size=64),
        head_dim=16, bpe_vocab_size=1024 - len(SPECIAL_TOKENS), first_special_id=1024 - len(SPECIAL_TOKENS),
        dtype=torch.float32),
    "bench-small": Preset(
        text=dict(vocab_size=248320, hidden_size=1024, intermediate_size=3072, layer_types=_every_fourth_full(8),
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  rope_parameters=_rope(10_000_000.0, [11, 11, 10])),
        vision=dict(depth=4, hidden_size=512, num_heads=8, intermediate_size=2048, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, out_hidden_size=1024),
        head_dim=256, bpe_vocab_size=4096, first_special_id=QWEN_FIRST_SPECIAL_ID, dtype=torch.bfloat16),
    "2b": Preset(
        text=dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, layer_types=_every_fourth_full(24),
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  rope_parameters=_rope(10_000_000.0, [11, 11, 10])),
        vision=dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, out_hidden_size=2048),
        head_dim=256, bpe_vocab_size=4096, first_special_id=QWEN_FIRST_SPECIAL_ID, dtype=torch.bfloat16,
        tie_word_embeddings=True),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown demo preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def _resolve_dtype(preset: Preset, dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return preset.dtype
    resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return resolved


def hf_config(preset: str | Preset, dtype: str | torch.dtype | None = None) -> "Qwen3_5Config":
    """The transformers config of a preset, as written to config.json."""
    from transformers import Qwen3_5Config

    p = get_preset(preset) if isinstance(preset, str) else preset
    ids = p.special_ids()
    # Deep copies: the config classes may complete nested dicts (rope parameters) in place.
    text = dict(copy.deepcopy(p.text), num_hidden_layers=len(p.text["layer_types"]),
                tie_word_embeddings=p.tie_word_embeddings)
    return Qwen3_5Config(
        text_config=text, vision_config=copy.deepcopy(p.vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=p.tie_word_embeddings, dtype=_resolve_dtype(p, dtype),
    )


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    init: Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # fills a float32 tensor in place

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def _normal(mean: float, std: float):
    return lambda out, gen: out.normal_(mean, std, generator=gen)


def _log_uniform(low: float, high: float):
    return lambda out, gen: out.uniform_(low, high, generator=gen).log_()


def _initializer(module: "nn.Module", param_name: str):
    """Values that keep activations sane and make norm-formula mistakes visible."""
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5GatedDeltaNet, Qwen3_5RMSNorm,
                                                              Qwen3_5RMSNormGated)

    if isinstance(module, Qwen3_5GatedDeltaNet) and param_name == "A_log":
        return _log_uniform(1.0, 16.0)
    if isinstance(module, Qwen3_5GatedDeltaNet) and param_name == "dt_bias":
        return _normal(1.0, 0.05)
    if isinstance(module, Qwen3_5RMSNorm):
        return _normal(0.0, 0.1)  # zero-centred: the text model computes x * (1 + w)
    if isinstance(module, (Qwen3_5RMSNormGated, nn.LayerNorm)) and param_name == "weight":
        return _normal(1.0, 0.1)  # plain scale: x * w
    if isinstance(module, nn.Conv1d):
        return _normal(0.0, 0.2)
    return _normal(0.0, 0.02)  # Linear, Embedding and patch Conv3d weights; every bias


def backbone_specs(config: "Qwen3_5Config") -> list[TensorSpec]:
    """Every tensor of model.safetensors, named and shaped as transformers' model has them."""
    from transformers import Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    init_of = {}
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            init_of[f"{prefix}.{name}" if prefix else name] = _initializer(module, name)
    state = model.state_dict()
    return [TensorSpec(key, tuple(tensor.shape), init_of[key]) for key, tensor in state.items()
            if not (config.tie_word_embeddings and key == TIED_KEY)]


def head_specs(config: "Qwen3_5Config", head_dim: int) -> list[TensorSpec]:
    hidden = config.text_config.hidden_size
    # std 1/sqrt(hidden) on unit-RMS rows gives O(1) logits, so demo scores are not all 0.5.
    return [TensorSpec(key, (head_dim, hidden), _normal(0.0, hidden ** -0.5)) for key in HEAD_KEYS]


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class _Scratch:
    """Reused buffers for the largest tensor: a float32 draw and its cast."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.draw = torch.empty(numel, dtype=torch.float32)
        self.cast = self.draw if dtype == torch.float32 else torch.empty(numel, dtype=dtype)

    def tensor_bytes(self, spec: TensorSpec, seed: int):
        values = self.draw[:spec.numel]
        spec.init(values, _generator(seed, spec.name))
        out = self.cast[:spec.numel]
        if out is not values:
            out.copy_(values)
        return out.view(torch.uint8).numpy()


def _write_safetensors(path: Path, specs: list[TensorSpec], dtype: torch.dtype, seed: int, scratch: _Scratch) -> None:
    """Stream tensors into one safetensors file: header first, then each tensor as it is drawn."""
    prefix, _ = safetensors_header([(spec.name, dtype, spec.shape) for spec in specs], {"format": "pt"})
    with open(path, "wb") as f:
        f.write(prefix)
        for spec in specs:
            f.write(scratch.tensor_bytes(spec, seed))


def _shard(specs: list[TensorSpec], dtype: torch.dtype, max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _write_backbone(directory: Path, specs: list[TensorSpec], dtype: torch.dtype, seed: int, scratch: _Scratch,
                    progress: bool) -> None:
    shards = _shard(specs, dtype, MAX_SHARD_BYTES)
    if progress:
        total = sum(s.numel for s in specs)
        print(f"writing {total:,} backbone parameters ({dtype}) in {len(shards)} file(s)", file=sys.stderr, flush=True)
    if len(shards) == 1:
        _write_safetensors(directory / "model.safetensors", specs, dtype, seed, scratch)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(directory / filename, shard, dtype, seed, scratch)
        weight_map.update({spec.name: filename for spec in shard})
        if progress:
            print(f"  {filename}: {len(shard)} tensors", file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": sum(s.numel for s in specs) * dtype.itemsize}, "weight_map": weight_map}
    _write_json(directory / "model.safetensors.index.json", index)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _write_files(directory: Path, preset: Preset, seed: int, dtype: torch.dtype, progress: bool) -> None:
    tokenizer = build_tokenizer(preset.bpe_vocab_size, preset.first_special_id)
    if special_token_ids(tokenizer) != preset.special_ids():
        raise CheckpointError(f"{directory}: tokenizer special ids {special_token_ids(tokenizer)} differ from the "
                              f"preset's {preset.special_ids()}")
    config = hf_config(preset, dtype)
    save_tokenizer(tokenizer, directory, model_max_length=config.text_config.max_position_embeddings)
    config.save_pretrained(directory)
    image = ImageConfig(patch_size=config.vision_config.patch_size,
                        temporal_patch_size=config.vision_config.temporal_patch_size,
                        merge_size=config.vision_config.spatial_merge_size, max_pixels=_MAX_PIXELS)
    _write_json(directory / "preprocessor_config.json", image.to_dict())
    _write_json(directory / "pixeltriage.json", TriageConfig(head_dim=preset.head_dim).to_dict())

    backbone, head = backbone_specs(config), head_specs(config, preset.head_dim)
    scratch = _Scratch(max(spec.numel for spec in backbone + head), dtype)
    _write_backbone(directory, backbone, dtype, seed, scratch, progress)
    _write_safetensors(directory / "decision_head.safetensors", head, dtype, seed, scratch)


def write_demo_checkpoint(path: str | os.PathLike, preset: str = "tiny", seed: int = 0,
                          dtype: str | torch.dtype | None = None, progress: bool = False) -> Path:
    """Write a demo checkpoint to `path` (absent or an empty directory) and return it.

    The files are written into a temporary sibling directory that is renamed onto `path` at the end,
    so `path` never holds a half-written checkpoint.
    """
    p = get_preset(preset)
    resolved = _resolve_dtype(p, dtype)
    return write_directory(path, lambda staging: _write_files(staging, p, seed, resolved, progress))


def demo_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The cached demo checkpoint for (preset, seed), written on first use.

    Safe across processes: writers serialise on a lock file and the checkpoint appears by rename.
    """
    get_preset(preset)
    return cached_directory(f"demo-{preset}-seed{seed}", lambda target: write_demo_checkpoint(target, preset, seed))


def count_parameters(path: str | os.PathLike) -> dict[str, int]:
    """Parameters stored in a checkpoint directory, from the safetensors headers."""
    counts = {"backbone": 0, "head": 0}
    for file in sorted(Path(path).glob("*.safetensors")):
        part = "head" if file.name == "decision_head.safetensors" else "backbone"
        counts[part] += sum(tensor_numels(file).values())
    return counts

