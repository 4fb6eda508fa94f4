"""Frozen configs, parsed and validated once from a checkpoint's JSON files.

- `ModelConfig`  <- config.json (transformers' `Qwen3_5Config`, model_type `qwen3_5`)
- `ImageConfig`  <- preprocessor_config.json (Qwen image processor keys)
- `TriageConfig` <- pixeltriage.json (state template and head settings)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pixeltriage.errors import CheckpointError
from pixeltriage.media.policy import THUMBNAIL_SIDE


def default_dtype(device: str) -> str:
    """The forward's dtype when none is given: bfloat16 on CUDA, float32 on the CPU (where a CPU without bf16 matmul
    units would emulate them; docs/performance.md)."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"

LINEAR = "linear_attention"
FULL = "full_attention"


def read_json(path: str | os.PathLike, error: type[Exception] = CheckpointError,
              kind: type | tuple[type, ...] = dict) -> Any:
    """A JSON file's value, checked to be a `kind`; every failure (missing, a directory, unreadable, not JSON,
    the wrong kind) is an `error` naming the file."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, kind):
        names = {dict: "object", list: "array", str: "string"}
        expected = " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise error(f"{path}: expected a JSON {expected}, found {type(data).__name__}")
    return data


def _get(d: dict, key: str, source: str, default: Any = ..., kind: type | tuple = int) -> Any:
    if key not in d:
        if default is ...:
            raise CheckpointError(f"{source}: missing key '{key}'")
        return default
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CheckpointError(f"{source}: key '{key}' expected {kind}, found {value!r}")
    return value


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    attention_bias: bool = False

    def __post_init__(self):
        src = "config.json text_config"
        for kind in self.layer_types:
            if kind not in (LINEAR, FULL):
                raise CheckpointError(f"{src}: unknown layer type {kind!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"{src}: num_attention_heads {self.num_attention_heads} not a multiple of "
                                  f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CheckpointError(f"{src}: linear_num_value_heads {self.linear_num_value_heads} not a multiple of "
                                  f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise CheckpointError(f"{src}: rotary dim {self.rotary_dim} invalid for head_dim {self.head_dim}")
        if sum(self.mrope_section) != self.rotary_dim // 2:
            raise CheckpointError(f"{src}: mrope_section {list(self.mrope_section)} must sum to rotary_dim/2 = "
                                  f"{self.rotary_dim // 2}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        src = "config.json vision_config"
        if self.hidden_size % self.num_heads:
            raise CheckpointError(f"{src}: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise CheckpointError(f"{src}: num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu"):
            raise CheckpointError(f"{src}: unsupported hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if d.get("model_type") != "qwen3_5":
            raise CheckpointError(f"{source}: model_type must be 'qwen3_5', found {d.get('model_type')!r}")
        t = d.get("text_config")
        v = d.get("vision_config")
        if not isinstance(t, dict) or not isinstance(v, dict):
            raise CheckpointError(f"{source}: needs 'text_config' and 'vision_config' objects")
        ts, vs = f"{source} text_config", f"{source} vision_config"
        rope = t.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"{ts}: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        num_layers = _get(t, "num_hidden_layers", ts)
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = t.get("full_attention_interval", 4)
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise CheckpointError(f"{ts}: layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
        num_heads = _get(t, "num_attention_heads", ts)
        text = TextConfig(
            vocab_size=_get(t, "vocab_size", ts),
            hidden_size=_get(t, "hidden_size", ts),
            intermediate_size=_get(t, "intermediate_size", ts),
            layer_types=tuple(layer_types),
            num_attention_heads=num_heads,
            num_key_value_heads=_get(t, "num_key_value_heads", ts),
            head_dim=t.get("head_dim") or _get(t, "hidden_size", ts) // num_heads,
            rms_norm_eps=float(_get(t, "rms_norm_eps", ts, 1e-6, (int, float))),
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            max_position_embeddings=_get(t, "max_position_embeddings", ts, 32768),
            linear_conv_kernel_dim=_get(t, "linear_conv_kernel_dim", ts, 4),
            linear_key_head_dim=_get(t, "linear_key_head_dim", ts, 128),
            linear_value_head_dim=_get(t, "linear_value_head_dim", ts, 128),
            linear_num_key_heads=_get(t, "linear_num_key_heads", ts, 16),
            linear_num_value_heads=_get(t, "linear_num_value_heads", ts, 32),
            attention_bias=bool(t.get("attention_bias", False)),
        )
        if t.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{ts}: hidden_act must be 'silu', found {t.get('hidden_act')!r}")
        vrope = v.get("rope_parameters") or {}
        vision = VisionConfig(
            depth=_get(v, "depth", vs),
            hidden_size=_get(v, "hidden_size", vs),
            intermediate_size=_get(v, "intermediate_size", vs),
            num_heads=_get(v, "num_heads", vs),
            in_channels=_get(v, "in_channels", vs, 3),
            patch_size=_get(v, "patch_size", vs, 16),
            temporal_patch_size=_get(v, "temporal_patch_size", vs, 2),
            spatial_merge_size=_get(v, "spatial_merge_size", vs, 2),
            out_hidden_size=_get(v, "out_hidden_size", vs),
            num_position_embeddings=_get(v, "num_position_embeddings", vs, 2304),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        )
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"{vs}: out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}")
        return cls(
            text=text,
            vision=vision,
            image_token_id=_get(d, "image_token_id", source, 248056),
            vision_start_token_id=_get(d, "vision_start_token_id", source, 248053),
            vision_end_token_id=_get(d, "vision_end_token_id", source, 248054),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        return cls.from_dict(read_json(path), source=str(path))


@dataclass(frozen=True)
class ImageConfig:
    """The Qwen image rules: resize to multiples of patch*merge within [min_pixels, max_pixels]."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict, source: str = "preprocessor_config.json") -> "ImageConfig":
        size = d.get("size") or {}
        min_pixels = d.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        max_pixels = d.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        cfg = cls(
            patch_size=int(d.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(d.get("merge_size", cls.merge_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(x) for x in d.get("image_mean", cls.image_mean)),
            image_std=tuple(float(x) for x in d.get("image_std", cls.image_std)),
            rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)),
        )
        if cfg.min_pixels > cfg.max_pixels or cfg.min_pixels <= 0:
            raise CheckpointError(f"{source}: min_pixels {cfg.min_pixels} / max_pixels {cfg.max_pixels} invalid")
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
            raise CheckpointError(f"{source}: image_mean and image_std need 3 values")
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ImageConfig":
        return cls.from_dict(read_json(path), source=str(path))

    def to_dict(self) -> dict:
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "resample": 3,
        }


# The state template. Strings may contain the tokenizer's special tokens (e.g. "<|im_start|>"),
# which are emitted as control tokens; placeholders ({question}, {date}, ...) are filled with
# user text, which is always tokenized as plain text.
DEFAULT_TEMPLATE: dict[str, str] = {
    "prefix": "<|im_start|>system\nYou decide which retrieved memories the answering model should see "
              "as pixels.<|im_end|>\n<|im_start|>user\n",
    "question": "Question: {question}\n",
    "memory": "\nMemory {index}\nDate: {date}\nDialogue: {dialogue}\nNote: {note}\nThumbnail: ",
    "marker": "\n[memory {index}]",
    "q1": "\n\nQ1. Does answering need the pixels of any memory? Candidates:",
    "q1_true": " true",
    "q1_false": " false",
    "q2": "\nQ2. Which memories gain from their pixels? Candidates: the memories above, or",
    "q2_none": " none",
    "q3": "\nQ3. Which memory does the question refer to? Candidates: the memories above, or",
    "q3_none": " none",
    "suffix": "<|im_end|>\n<|im_start|>assistant\n",
    "decision_1": "Q1:",
    "decision_2": "\nQ2:",
    "decision_3": "\nQ3:",
}
TEMPLATE_PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "question": ("question",),
    "memory": ("index", "date", "dialogue", "note"),
    "marker": ("index",),
}


@dataclass(frozen=True)
class TriageConfig:
    """pixeltriage.json: the state template, thumbnail and text budgets, head dimension."""

    head_dim: int = 256
    thumbnail_size: int = THUMBNAIL_SIDE
    max_question_tokens: int = 512
    max_memory_text_tokens: int = 256
    max_state_tokens: int = 16384
    template: tuple[tuple[str, str], ...] = field(default_factory=lambda: tuple(DEFAULT_TEMPLATE.items()))
    source: str = field(default="pixeltriage.json", compare=False, repr=False)   # named in error messages

    def __post_init__(self):
        src = self.source
        tpl = dict(self.template)
        missing = sorted(set(DEFAULT_TEMPLATE) - set(tpl))
        unknown = sorted(set(tpl) - set(DEFAULT_TEMPLATE))
        if missing or unknown:
            raise CheckpointError(f"{src}: template keys missing {missing}, unknown {unknown}")
        for key, value in tpl.items():
            if not isinstance(value, str):
                raise CheckpointError(f"{src}: template['{key}'] must be a string")
            allowed = TEMPLATE_PLACEHOLDERS.get(key, ())
            try:
                value.format(**{name: "" for name in allowed})
            except (KeyError, IndexError, ValueError) as e:
                raise CheckpointError(f"{src}: template['{key}'] has a bad placeholder ({e}); "
                                      f"allowed: {list(allowed)}") from None
        for key in ("marker", "q1_true", "q1_false", "q2_none", "q3_none", "decision_1", "decision_2", "decision_3"):
            if not tpl[key]:
                raise CheckpointError(f"{src}: template['{key}'] must not be empty (its last token is scored)")
        for name in ("head_dim", "thumbnail_size", "max_question_tokens", "max_memory_text_tokens", "max_state_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise CheckpointError(f"{src}: {name} must be a positive integer")

    @property
    def templates(self) -> dict[str, str]:
        return dict(self.template)

    @classmethod
    def from_dict(cls, d: dict, source: str = "pixeltriage.json") -> "TriageConfig":
        version = d.get("format_version", 1)
        if version != 1:
            raise CheckpointError(f"{source}: unsupported format_version {version}")
        head = d.get("head", {})
        state = d.get("state", {})
        shape = _DEFAULT_TRIAGE.to_dict()              # the keys a file may hold are those to_dict writes
        for where, value, known in (("", d, set(shape)), ("head.", head, set(shape["head"])),
                                    ("state.", state, set(shape["state"]))):
            if not isinstance(value, dict):
                raise CheckpointError(f"{source}: '{where.rstrip('.')}' must be an object")
            unknown = sorted(set(value) - known)
            if unknown:                   # a misspelt budget would otherwise be ignored without a word
                raise CheckpointError(f"{source}: unknown keys {[where + k for k in unknown]}; known: "
                                      f"{sorted(where + k for k in known)}")
        template = dict(DEFAULT_TEMPLATE)
        template.update(d.get("template", {}))
        default = _DEFAULT_TRIAGE
        return cls(
            head_dim=head.get("dim", default.head_dim),
            thumbnail_size=state.get("thumbnail_size", default.thumbnail_size),
            max_question_tokens=state.get("max_question_tokens", default.max_question_tokens),
            max_memory_text_tokens=state.get("max_memory_text_tokens", default.max_memory_text_tokens),
            max_state_tokens=state.get("max_state_tokens", default.max_state_tokens),
            template=tuple(template.items()),
            source=source,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TriageConfig":
        return cls.from_dict(read_json(path), source=str(path))

    def to_dict(self) -> dict:
        return {
            "format_version": 1,
            "head": {"dim": self.head_dim},
            "state": {
                "thumbnail_size": self.thumbnail_size,
                "max_question_tokens": self.max_question_tokens,
                "max_memory_text_tokens": self.max_memory_text_tokens,
                "max_state_tokens": self.max_state_tokens,
            },
            "template": self.templates,
        }


_DEFAULT_TRIAGE = TriageConfig()

