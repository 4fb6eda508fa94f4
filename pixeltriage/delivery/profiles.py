"""Answering models: the one registry of the models a delivery is priced for, each with its visual-token rule and
where that rule comes from (docs/delivery.md).

The budget policy, the decision report, the scoring service's `answering_model` field, the command line and the FLOP
model's answering side all read `ANSWERING_MODELS`. A model the registry lacks is given by its processor config
directory (`from_processor_config`): the preprocessor_config.json's image processor class picks the rule family and
its size fields fill it in.

This module imports nothing heavy: the command line's --help reads the names.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pixeltriage.delivery.rules import (AnyResRule, AreaRule, CanvasTileRule, DynamicHDRule, FixedRule,
                                        GeminiTileRule, GridRule, InternVLRule, OpenAITileRule, Rule, SplitRule)
from pixeltriage.errors import PixelTriageError


class UnknownAnsweringModelError(PixelTriageError, ValueError):
    """An answering model that is neither in the registry nor a processor config directory this engine can read."""


@dataclass(frozen=True)
class AnsweringModel:
    """One answering model: its visual-token rule and the source the rule follows.

    checkpoints: the sized checkpoints of this model whose prefill the FLOP model counts
    (pixeltriage.bench.models.flops).
    """

    name: str
    rule: Rule
    source: str
    checkpoints: tuple[str, ...] = ()

    def tokens(self, image_size: tuple[int, int]) -> int:
        return self.rule.tokens(image_size)


_QWEN2_VL = "transformers' Qwen2VLImageProcessor (models/qwen2_vl/image_processing_pil_qwen2_vl.py)"
_QWEN3 = GridRule(patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216)
_INTERNVL = InternVLRule(tile_size=448, min_tiles=1, max_tiles=12, tokens_per_tile=256)
_INTERNVL_SOURCE = ("transformers' GotOcr2ImageProcessor (crop_to_patches, 448-px tiles, 1 to 12 plus a thumbnail) "
                    "and InternVLProcessor (image_seq_length 256, <img> ... </img>)")

_REGISTRY = (
    AnsweringModel("qwen2.5-vl", GridRule(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056),
                   f"{_QWEN2_VL} with Qwen2.5-VL-Instruct's preprocessor_config.json: 14-px patches merged 2x2, "
                   "min_pixels 3136, max_pixels 12845056", checkpoints=("qwen2.5-vl-7b",)),
    AnsweringModel("qwen3-vl", _QWEN3, f"{_QWEN2_VL} with Qwen3-VL's preprocessor_config.json: 16-px patches "
                                       "merged 2x2, size shortest_edge 65536, longest_edge 16777216"),
    AnsweringModel("qwen3.5", _QWEN3, f"{_QWEN2_VL} with Qwen3.5's preprocessor_config.json: 16-px patches merged "
                                      "2x2, size shortest_edge 65536, longest_edge 16777216",
                   checkpoints=("qwen3.5-27b", "qwen3.5-397b")),
    AnsweringModel("internvl2.5", _INTERNVL, _INTERNVL_SOURCE),
    AnsweringModel("internvl3", _INTERNVL, _INTERNVL_SOURCE),
    AnsweringModel("llava-onevision", AnyResRule(),
                   "transformers' LlavaOnevisionImageProcessor (384-px base, the 6 x 6 grid of 384-px canvases) and "
                   "LlavaOnevisionProcessor (729 features per tile, anyres_max_9, vision_feature_select_strategy "
                   "'full')"),
    AnsweringModel("gemma-3", FixedRule(),
                   "transformers' Gemma3Processor (image_seq_length 256, <start_of_image> ... <end_of_image>, "
                   "do_pan_and_scan False)"),
    AnsweringModel("gemma-3-pan-and-scan", FixedRule(pan_and_scan=True),
                   "transformers' Gemma3Processor and Gemma3ImageProcessor.pan_and_scan (min crop 256 px, at most 4 "
                   "crops, from aspect ratio 1.2)"),
    AnsweringModel("llama-3.2-vision", CanvasTileRule(tile_size=560, max_tiles=4, patch_size=14),
                   "transformers' MllamaImageProcessor (560-px tiles, max_image_tiles 4) and the vision model's "
                   "14-px patches (40 x 40 + 1 states per tile)"),
    AnsweringModel("idefics3", SplitRule(longest_edge=4 * 364, tile_size=364, tokens_per_tile=169),
                   "transformers' Idefics3ImageProcessor (longest_edge 1456, 364-px tiles) and Idefics3Processor "
                   "(image_seq_len 169)"),
    AnsweringModel("smolvlm", SplitRule(longest_edge=4 * 512, tile_size=512, tokens_per_tile=64),
                   "transformers' SmolVLMImageProcessor with SmolVLM-256M/500M-Instruct's configs (longest_edge "
                   "2048, 512-px tiles) and SmolVLMProcessor (image_seq_len 64)"),
    AnsweringModel("phi-4-multimodal", DynamicHDRule(crop_size=448, patch_size=14, max_crops=36),
                   "transformers' Phi4MultimodalImageProcessor (448-px crops, dynamic_hd 36); checked against the "
                   "source formula (the processor needs torchvision)"),
    AnsweringModel("gpt-4o", OpenAITileRule(detail="high"),
                   "https://platform.openai.com/docs/guides/images-vision#calculating-costs (detail high)"),
    AnsweringModel("gpt-4o-low", OpenAITileRule(detail="low"),
                   "https://platform.openai.com/docs/guides/images-vision#calculating-costs (detail low)"),
    AnsweringModel("claude", AreaRule(),
                   "https://docs.anthropic.com/en/docs/build-with-claude/vision (tokens = width * height / 750, long "
                   "edge 1568 px, about 1600 tokens)"),
    AnsweringModel("gemini", GeminiTileRule(),
                   "https://ai.google.dev/gemini-api/docs/tokens (Gemini 2.x: 258 tokens, or 258 per 768-px tile)"),
)

ANSWERING_MODELS: dict[str, AnsweringModel] = {m.name: m for m in _REGISTRY}
ANSWERING_MODEL_NAMES: tuple[str, ...] = tuple(ANSWERING_MODELS)
DEFAULT_ANSWERING_MODEL = "qwen2.5-vl"

# the sized checkpoints the FLOP model counts -> their answering model; the first is the default
CHECKPOINTS: dict[str, str] = {c: m.name for m in _REGISTRY for c in m.checkpoints}
DEFAULT_CHECKPOINT = "qwen2.5-vl-7b"
assert DEFAULT_ANSWERING_MODEL in ANSWERING_MODELS and CHECKPOINTS[DEFAULT_CHECKPOINT] == DEFAULT_ANSWERING_MODEL


def answering_model(model: str | os.PathLike | AnsweringModel | Rule = DEFAULT_ANSWERING_MODEL) -> AnsweringModel:
    """The answering model named `model` in the registry, or read from a processor config directory (a path, or a
    name that is an existing directory); an AnsweringModel is returned as it is, a bare Rule is wrapped."""
    if isinstance(model, AnsweringModel):
        return model
    if isinstance(model, Rule):
        return AnsweringModel(type(model).__name__, model, "given as a rule")
    if isinstance(model, str) and model in ANSWERING_MODELS:
        return ANSWERING_MODELS[model]
    if isinstance(model, os.PathLike) or (isinstance(model, str) and os.path.isdir(model)):
        return from_processor_config(model)
    raise UnknownAnsweringModelError(f"unknown answering model {model!r}; known: {', '.join(ANSWERING_MODEL_NAMES)}, "
                                     "or a directory holding the model's preprocessor_config.json")


# ---- profiles from a processor config directory -------------------------------------------------------------------


def from_processor_config(directory: str | os.PathLike) -> AnsweringModel:
    """An answering model from `directory`'s preprocessor_config.json (and processor_config.json beside it, when
    there, for the processing class's token counts): the image processor class picks the rule family, its size
    fields the parameters; a field the file leaves out takes the transformers class default."""
    folder = Path(directory)
    path = folder / "preprocessor_config.json"
    config = _read_json(path)
    processor = _read_json(folder / "processor_config.json") if (folder / "processor_config.json").is_file() else {}
    kind = config.get("image_processor_type")
    if not isinstance(kind, str):
        raise UnknownAnsweringModelError(f"{path}: no image_processor_type")
    family = kind.removesuffix("Fast").removesuffix("Pil")
    if family not in _FAMILIES:
        raise UnknownAnsweringModelError(f"{path}: image processor {kind!r} has no visual-token rule here; known: "
                                         f"{', '.join(sorted(_FAMILIES))}")
    try:
        rule = _FAMILIES[family](config, processor)
    except (KeyError, TypeError, ValueError) as e:
        raise UnknownAnsweringModelError(f"{path}: cannot read {family}'s size fields: {e}") from None
    return AnsweringModel(folder.resolve().name, rule, f"{path} ({kind})")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UnknownAnsweringModelError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnknownAnsweringModelError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise UnknownAnsweringModelError(f"{path}: expected a JSON object")
    return data


def _get(config: dict, processor: dict, key: str, default):
    """A field from the processor config, else the image processor config, else the class default (null counts as
    absent, as transformers reads it)."""
    for source in (processor, config):
        if source.get(key) is not None:
            return source[key]
    return default


def _square(size: dict, default: int) -> int:
    if not size:
        return default
    if "height" in size and "width" in size:
        if size["height"] != size["width"]:
            raise ValueError(f"tiles must be square, found {size}")
        return int(size["height"])
    for key in ("shortest_edge", "longest_edge"):
        if key in size:
            return int(size[key])
    raise ValueError(f"unreadable size {size}")


def _grid(config: dict, processor: dict) -> Rule:
    size = config.get("size") or {}
    min_pixels = config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    max_pixels = config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    return GridRule(patch_size=int(config.get("patch_size") or 14), merge_size=int(config.get("merge_size") or 2),
                    min_pixels=int(min_pixels), max_pixels=int(max_pixels))


def _internvl(config: dict, processor: dict) -> Rule:
    owner = _get(config, processor, "processor_class", "InternVLProcessor")
    if owner != "InternVLProcessor":      # GotOcr2ImageProcessor also serves GOT-OCR 2, whose prompt differs
        raise ValueError(f"GotOcr2ImageProcessor is read for InternVLProcessor only, found {owner!r}")
    return InternVLRule(tile_size=_square(config.get("size"), 384), min_tiles=int(config.get("min_patches") or 1),
                        max_tiles=int(config.get("max_patches") or 12),
                        tokens_per_tile=int(_get(config, processor, "image_seq_length", 256)))


def _anyres(config: dict, processor: dict) -> Rule:
    pinpoints = config.get("image_grid_pinpoints") or _ANYRES_DEFAULT.pinpoints
    crop = config.get("crop_size") or {}
    base = crop.get("height") or _square(config.get("size"), 384)
    tokens = int(_get(config, processor, "num_image_tokens", 729))
    side = int(tokens ** 0.5)
    aspect = str(_get(config, processor, "vision_aspect_ratio", "anyres_max_9"))
    strategy = _get(config, processor, "vision_feature_select_strategy", "full")
    return AnyResRule(base_size=int(base), features_per_side=side,
                      pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
                      max_tiles=int(aspect.removeprefix("anyres_max_")), drop_cls=strategy == "default")


def _fixed(config: dict, processor: dict) -> Rule:
    default = FixedRule()
    return FixedRule(tokens_per_view=int(_get(config, processor, "image_seq_length", 256)),
                     pan_and_scan=bool(_get(config, processor, "do_pan_and_scan", False)),
                     min_crop_size=int(_get(config, processor, "pan_and_scan_min_crop_size", default.min_crop_size)),
                     max_crops=int(_get(config, processor, "pan_and_scan_max_num_crops", default.max_crops)),
                     min_ratio=float(_get(config, processor, "pan_and_scan_min_ratio_to_activate",
                                          default.min_ratio)))


def _canvas(config: dict, processor: dict) -> Rule:
    return CanvasTileRule(tile_size=_square(config.get("size"), 224), max_tiles=int(config.get("max_image_tiles") or 4),
                          patch_size=int(_get(config, processor, "patch_size", 14)))


def _split(default: SplitRule):
    def read(config: dict, processor: dict) -> Rule:
        size = config.get("size") or {}
        tile = config.get("max_image_size") or {}
        return SplitRule(longest_edge=int(size.get("longest_edge", default.longest_edge)),
                         tile_size=int(tile.get("longest_edge", default.tile_size)),
                         tokens_per_tile=int(_get(config, processor, "image_seq_len", default.tokens_per_tile)),
                         split=bool(config.get("do_image_splitting", True)))
    return read


def _dynamic_hd(config: dict, processor: dict) -> Rule:
    return DynamicHDRule(crop_size=_square(config.get("size"), 448), patch_size=int(config.get("patch_size") or 14),
                         max_crops=int(config.get("dynamic_hd") or 36))


_ANYRES_DEFAULT = AnyResRule()
_FAMILIES = {
    "Qwen2VLImageProcessor": _grid,
    "Qwen2_5_VLImageProcessor": _grid,
    "GotOcr2ImageProcessor": _internvl,
    "LlavaOnevisionImageProcessor": _anyres,
    "Gemma3ImageProcessor": _fixed,
    "MllamaImageProcessor": _canvas,
    "Idefics3ImageProcessor": _split(SplitRule(longest_edge=4 * 364, tile_size=364, tokens_per_tile=169)),
    "SmolVLMImageProcessor": _split(SplitRule(longest_edge=4 * 364, tile_size=364, tokens_per_tile=169)),
    "Phi4MultimodalImageProcessor": _dynamic_hd,
}
