"""Demo SigLIP 2 checkpoints: transformers' layout and shapes, seeded random weights, a small Gemma-style tokenizer.

    config.json                  SiglipConfig / Siglip2Config.save_pretrained
    model.safetensors            every tensor of SiglipModel / Siglip2Model, drawn in float32
    preprocessor_config.json     SiglipImageProcessor / Siglip2ImageProcessor keys, as the releases ship them
    tokenizer.json, tokenizer_config.json
                                 transformers' GemmaTokenizer (byte-fallback BPE trained on the System One demo
                                 corpus, lower-cased); no BOS, EOS appended, padded on the right, input ids only,
                                 as in the released SigLIP 2 checkpoints

Presets: "tiny" (fixed resolution, 32 px, D=32: tests and the demo), "tiny-naflex" (the NaFlex variant) and
"base" (the shapes of siglip2-base-patch16-224, D=768, with the demo's 1k vocabulary: write-time benchmarks).
Each tensor comes from a generator seeded by (seed, tensor name) and is written as it is drawn, so a seed gives
the same checkpoint in any write order and memory stays at one tensor. The scores of a random encoder mean
nothing; the shapes, the files and every code path are those of a real one.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pixeltriage.paths import cached_directory, write_directory
from pixeltriage.retrieval.encoder import quiet_transformers
from pixeltriage.weights.reader import safetensors_header

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")        # Gemma's ids 0-4
VOCAB_SIZE = 1024


@dataclass(frozen=True)
class EncoderPreset:
    model_type: str                            # "siglip" (fixed resolution) or "siglip2" (NaFlex)
    text: dict = field(repr=False)             # text_config keyword arguments
    vision: dict = field(repr=False)           # vision_config keyword arguments
    image: dict = field(repr=False)            # preprocessor_config.json keys


def _tower(hidden: int, layers: int, heads: int, intermediate: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=intermediate)


_HALF = [0.5, 0.5, 0.5]
_TEXT_IDS = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)

PRESETS: dict[str, EncoderPreset] = {
    "tiny": EncoderPreset(
        "siglip", text=dict(_tower(32, 2, 2, 64), **_TEXT_IDS),
        vision=dict(_tower(32, 2, 2, 64), image_size=32, patch_size=8),
        image=dict(image_processor_type="SiglipImageProcessor", processor_class="SiglipProcessor",
                   do_resize=True, size={"height": 32, "width": 32}, resample=2, do_rescale=True,
                   rescale_factor=1 / 255, do_normalize=True, image_mean=_HALF, image_std=_HALF)),
    "tiny-naflex": EncoderPreset(
        "siglip2", text=dict(_tower(32, 2, 2, 64), **_TEXT_IDS),
        # the released NaFlex patching (16 px, up to 256 patches): transformers' Siglip2Processor substitutes
        # these two for the image processor's own when a call leaves them out
        vision=dict(_tower(32, 2, 2, 64), patch_size=16, num_patches=256),
        image=dict(image_processor_type="Siglip2ImageProcessor", processor_class="Siglip2Processor",
                   do_resize=True, patch_size=16, max_num_patches=256, resample=2, do_rescale=True,
                   rescale_factor=1 / 255, do_normalize=True, image_mean=_HALF, image_std=_HALF)),
    "base": EncoderPreset(
        "siglip", text=dict(_tower(768, 12, 12, 3072), **_TEXT_IDS),
        vision=dict(_tower(768, 12, 12, 3072), image_size=224, patch_size=16),
        image=dict(image_processor_type="SiglipImageProcessor", processor_class="SiglipProcessor",
                   do_resize=True, size={"height": 224, "width": 224}, resample=2, do_rescale=True,
                   rescale_factor=1 / 255, do_normalize=True, image_mean=_HALF, image_std=_HALF)),
}


def get_preset(name: str) -> EncoderPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown encoder demo preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def hf_config(preset: str | EncoderPreset):
    """The transformers config of a preset, as written to config.json."""
    from transformers import Siglip2Config, SiglipConfig

    p = get_preset(preset) if isinstance(preset, str) else preset
    cls = SiglipConfig if p.model_type == "siglip" else Siglip2Config
    return cls(text_config=copy.deepcopy(p.text), vision_config=copy.deepcopy(p.vision), dtype=torch.float32)


def build_tokenizer():
    """transformers' GemmaTokenizer with a byte-fallback BPE of VOCAB_SIZE ids trained on the demo corpus
    (deterministic: a fixed corpus, no randomness)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    from pixeltriage.weights.tokenizer import corpus

    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Gemma's pipeline as transformers builds it: spaces become "▁", no pre-tokenization split
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[*SPECIAL_TOKENS, *byte_tokens],
                                  show_progress=False)
    bpe.train_from_iterator([text.lower() for text in corpus()], trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return GemmaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=False, add_eos_token=True,
                          padding_side="right", model_input_names=["input_ids"],
                          model_max_length=_TEXT_IDS["max_position_embeddings"])


# -- tensors -----------------------------------------------------------------------------------------------------

def tensor_specs(config) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the model's state dict; kind picks the initialiser."""
    from torch import nn
    from transformers import Siglip2Model, SiglipModel

    cls = SiglipModel if config.model_type == "siglip" else Siglip2Model
    with torch.device("meta"):
        model = cls(config)
    kinds = {}
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            is_norm = isinstance(module, nn.LayerNorm) and name == "weight"
            kinds[f"{prefix}.{name}" if prefix else name] = (
                "norm" if is_norm else "small" if param.dim() < 2 else "fan_in")
    return [(name, tuple(t.shape), kinds.get(name, "small")) for name, t in model.state_dict().items()]


def _draw(name: str, shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    out = torch.empty(shape, dtype=torch.float32)
    if kind == "norm":
        return out.normal_(1.0, 0.1, generator=gen)
    if kind == "small":
        return out.normal_(0.0, 0.02, generator=gen)
    # unit-variance rows through every projection, so the towers neither vanish nor blow up
    return out.normal_(0.0, math.prod(shape[1:]) ** -0.5, generator=gen)


def _write_weights(path: Path, specs: list[tuple[str, tuple[int, ...], str]], seed: int) -> None:
    prefix, _ = safetensors_header([(name, torch.float32, shape) for name, shape, _ in specs], {"format": "pt"})
    with open(path, "wb") as f:
        f.write(prefix)
        for name, shape, kind in specs:
            f.write(_draw(name, shape, kind, seed).numpy().tobytes())


def _write_files(directory: Path, preset: EncoderPreset, seed: int) -> None:
    config = hf_config(preset)
    config.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    with open(directory / "preprocessor_config.json", "w", encoding="utf-8") as f:
        json.dump(preset.image, f, indent=2)
        f.write("\n")
    _write_weights(directory / "model.safetensors", tensor_specs(config), seed)


def write_demo_encoder(path: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a demo SigLIP 2 checkpoint to `path` (absent or an empty directory) and return it. Written into a
    temporary sibling renamed onto `path` at the end: `path` never holds half a checkpoint."""
    p = get_preset(preset)

    def write(staging: Path) -> None:
        with quiet_transformers():
            _write_files(staging, p, seed)

    return write_directory(path, write)


def demo_encoder(preset: str = "tiny", seed: int = 0) -> Path:
    """The cached demo encoder for (preset, seed) under `pixeltriage.paths.cache_dir()`, written on first use;
    safe across processes (a lock file, and the directory appears by rename)."""
    get_preset(preset)
    return cached_directory(f"siglip2-demo-{preset}-seed{seed}",
                            lambda target: write_demo_encoder(target, preset, seed))
