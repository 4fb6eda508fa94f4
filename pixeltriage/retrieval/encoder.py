"""Image and text encoders for region retrieval: the `Encoder` protocol and SigLIP 2 through transformers.

`SiglipEncoder.load(directory)` reads a local SigLIP 2 checkpoint (safetensors only, no network, no remote
code) with transformers' own model classes: `SiglipModel` for the fixed-resolution releases (config
`model_type: siglip`, e.g. siglip2-base-patch16-224) and `Siglip2Model` for the NaFlex ones (`siglip2`).

Images: `preprocess_images` reproduces transformers' PIL image processor of the checkpoint
(`SiglipImageProcessorPil`, `Siglip2ImageProcessorPil`) bit for bit on RGB images: PIL resize of the uint8
image (to the fixed size, or NaFlex's aspect-kept size of at most `max_num_patches` patches), rescale in
float64 then cast to float32, normalize in float32; NaFlex patches are zero-padded to `max_num_patches`.
Texts: the checkpoint's tokenizer as transformers loads it, lower-cased first (SigLIP 2 was trained on
lower-cased text; transformers' `Siglip2Tokenizer` lower-cases for NaFlex checkpoints, the fixed-resolution
ones load a plain Gemma tokenizer), padded to the text model's `max_position_embeddings` (64) and truncated
to it, since the text tower pools the last position. The model gets what the tokenizer returns (the
released checkpoints return no attention mask: SigLIP's text tower was trained attending to the padding).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from PIL import Image

from pixeltriage.config import read_json
from pixeltriage.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

MODEL_TYPES = ("siglip", "siglip2")        # fixed resolution, NaFlex
_PIL_FILTERS = {int(f): f for f in Image.Resampling}
_DEFAULTS = {                              # transformers' class defaults for keys a preprocessor file leaves out
    "siglip": {"resample": int(Image.Resampling.BICUBIC), "size": {"height": 224, "width": 224}},
    "siglip2": {"resample": int(Image.Resampling.BILINEAR), "patch_size": 16, "max_num_patches": 256},
}


@runtime_checkable
class Encoder(Protocol):
    """What the region index needs from an encoder."""

    @property
    def fingerprint(self) -> str:
        """Names everything that decides the embeddings (weights, preprocessing, tokenization): vectors stored
        under one fingerprint are never compared with another's."""
        ...

    @property
    def dim(self) -> int:
        """D, the embedding width."""
        ...

    def encode_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """RGB images -> float32 [n, D] on the CPU, one row per image, L2-normalised."""
        ...

    def encode_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """Texts -> float32 [m, D] on the CPU, L2-normalised."""
        ...


@dataclass(frozen=True)
class ImageRules:
    """The image processor of a checkpoint, from its preprocessor_config.json."""

    naflex: bool
    resample: int
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_rescale: bool = True
    do_normalize: bool = True
    height: int = 0                        # fixed resolution
    width: int = 0
    patch_size: int = 0                    # NaFlex
    max_num_patches: int = 0

    @classmethod
    def from_file(cls, path: str | Path, model_type: str) -> "ImageRules":
        data = read_json(path)
        merged = {**_DEFAULTS[model_type], **{k: v for k, v in data.items() if v is not None}}
        if merged.get("do_resize", True) is not True:
            raise CheckpointError(f"{path}: do_resize must be true (images of every size are resized to batch them)")
        resample = merged["resample"]
        if isinstance(resample, bool) or resample not in _PIL_FILTERS:
            raise CheckpointError(f"{path}: resample {resample!r} is not a PIL filter number")
        common = dict(resample=int(resample), rescale_factor=_number(merged, "rescale_factor", path, 1 / 255),
                      image_mean=_triple(merged, "image_mean", path), image_std=_triple(merged, "image_std", path),
                      do_rescale=_flag(merged, "do_rescale", path), do_normalize=_flag(merged, "do_normalize", path))
        if model_type == "siglip2":
            return cls(naflex=True, patch_size=_positive(merged, "patch_size", path),
                       max_num_patches=_positive(merged, "max_num_patches", path), **common)
        size = merged["size"]
        if not isinstance(size, dict) or not {"height", "width"} <= set(size):
            raise CheckpointError(f"{path}: size must be {{'height': H, 'width': W}}, found {size!r}")
        return cls(naflex=False, height=_positive(size, "height", path), width=_positive(size, "width", path),
                   **common)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TextRules:
    max_length: int                        # the text model's max_position_embeddings
    lowercase: bool = True


def _number(d: dict, key: str, path, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{path}: {key} must be a positive number, found {value!r}")
    return float(value)


def _positive(d: dict, key: str, path) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{path}: {key} must be a positive integer, found {value!r}")
    return value


def _flag(d: dict, key: str, path) -> bool:
    value = d.get(key, True)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: {key} must be true or false, found {value!r}")
    return value


def _triple(d: dict, key: str, path) -> tuple[float, float, float]:
    value = d.get(key, 0.5)
    values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(values, list) or len(values) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise CheckpointError(f"{path}: {key} must be a number or three numbers, found {value!r}")
    if key == "image_std" and min(values) <= 0:
        raise CheckpointError(f"{path}: image_std must be positive, found {value!r}")
    return tuple(float(v) for v in values)


# -- preprocessing ------------------------------------------------------------------------------------------------

def preprocess_images(images: Sequence[Image.Image], rules: ImageRules) -> dict[str, torch.Tensor]:
    """RGB images -> the model's image inputs, as transformers' PIL processor makes them.

    Fixed resolution: {"pixel_values": float32 [n, 3, H, W]}. NaFlex: {"pixel_values": float32
    [n, max_num_patches, patch**2 * 3], "pixel_attention_mask": int32 [n, max_num_patches], "spatial_shapes":
    int64 [n, 2] (patch rows, patch columns)}.
    """
    for i, img in enumerate(images):
        if img.mode != "RGB":
            raise ValueError(f"image {i + 1}: preprocess_images needs RGB images, got mode {img.mode!r}")
    if not rules.naflex:
        pixels = [_pixels(img, rules.width, rules.height, rules) for img in images]
        return {"pixel_values": torch.from_numpy(np.stack(pixels)) if pixels
                else torch.zeros(0, 3, rules.height, rules.width)}
    patches, masks, shapes = [], [], []
    for img in images:
        height, width = naflex_size(img.height, img.width, rules.patch_size, rules.max_num_patches)
        rows, mask = _padded_patches(_pixels(img, width, height, rules), rules)
        patches.append(rows)
        masks.append(mask)
        shapes.append((height // rules.patch_size, width // rules.patch_size))
    if not patches:
        return {"pixel_values": torch.zeros(0, rules.max_num_patches, rules.patch_size ** 2 * 3),
                "pixel_attention_mask": torch.zeros(0, rules.max_num_patches, dtype=torch.int32),
                "spatial_shapes": torch.zeros(0, 2, dtype=torch.int64)}
    return {"pixel_values": torch.from_numpy(np.stack(patches)),
            "pixel_attention_mask": torch.from_numpy(np.stack(masks)),
            "spatial_shapes": torch.tensor(shapes, dtype=torch.int64)}


def _pixels(img: Image.Image, width: int, height: int, rules: ImageRules) -> np.ndarray:
    """Resize, rescale, normalize: float32 [3, height, width]."""
    resized = img.resize((width, height), resample=_PIL_FILTERS[rules.resample])
    pixels = np.asarray(resized).transpose(2, 0, 1)
    if rules.do_rescale:
        pixels = (pixels.astype(np.float64) * rules.rescale_factor).astype(np.float32)
    if rules.do_normalize:
        pixels = pixels.astype(np.float32, copy=False)
        mean = np.asarray(rules.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(rules.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels, dtype=np.float32)


def _padded_patches(pixels: np.ndarray, rules: ImageRules) -> tuple[np.ndarray, np.ndarray]:
    """[3, H, W] -> ([max_num_patches, p * p * 3] rows in reading order, each [p, p, C]; int32 mask)."""
    channels, height, width = pixels.shape
    p = rules.patch_size
    rows = pixels.reshape(channels, height // p, p, width // p, p).transpose(1, 3, 2, 4, 0)
    rows = rows.reshape((height // p) * (width // p), p * p * channels)
    padded = np.zeros((rules.max_num_patches, rows.shape[1]), dtype=np.float32)
    padded[:len(rows)] = rows
    mask = np.zeros(rules.max_num_patches, dtype=np.int32)
    mask[:len(rows)] = 1
    return padded, mask


def naflex_size(height: int, width: int, patch_size: int, max_num_patches: int,
                eps: float = 1e-5) -> tuple[int, int]:
    """NaFlex's resize target: both sides multiples of patch_size, at most max_num_patches patches, the aspect
    ratio kept as far as that allows. The binary search of transformers' `get_image_size_for_max_num_patches`,
    step for step (its float arithmetic decides the result)."""
    def scaled(scale: float, side: int) -> int:
        return int(max(patch_size, math.ceil(side * scale / patch_size) * patch_size))

    low, high = eps / 10, 100.0
    while high - low >= eps:
        scale = (low + high) / 2
        if (scaled(scale, height) / patch_size) * (scaled(scale, width) / patch_size) <= max_num_patches:
            low = scale
        else:
            high = scale
    return scaled(low, height), scaled(low, width)


# -- SigLIP 2 ----------------------------------------------------------------------------------------------------

class SiglipEncoder:
    """A SigLIP 2 checkpoint as an `Encoder`: batched, under `torch.inference_mode`, float32 by default.

    batch_size: images (crops) per vision forward; texts go 64 at a time.
    """

    def __init__(self, model: "nn.Module", tokenizer, model_type: str, image_rules: ImageRules,
                 text_rules: TextRules, directory: str | Path, batch_size: int = 32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_type = model_type
        self.image_rules = image_rules
        self.text_rules = text_rules
        self.directory = Path(directory)
        self.batch_size = batch_size
        self._fingerprint: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
             batch_size: int = 32, *, revision: str | None = None, allow_download: bool = False) -> "SiglipEncoder":
        """Load a SigLIP 2 checkpoint directory (config.json, model.safetensors, preprocessor_config.json,
        tokenizer files), or a Hugging Face hub id ("org/name[@revision]", when no local path of that name exists)
        read from the local hub cache, downloaded only with allow_download (`pixeltriage.hub`); dtype None:
        bfloat16 on CUDA, float32 on the CPU. Every problem is a CheckpointError naming the file."""
        from pixeltriage.hub import resolve_checkpoint
        from pixeltriage.weights.reader import weight_files

        directory = resolve_checkpoint(path, revision, allow_download=allow_download)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: not a checkpoint directory")
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CheckpointError(f"{directory}: cannot load onto {device}: CUDA is not available here")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = read_json(directory / "config.json")
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"{directory / 'config.json'}: model_type {model_type!r} is not a SigLIP 2 "
                                  f"checkpoint (expected 'siglip' for fixed resolution or 'siglip2' for NaFlex)")
        weight_files(directory)                          # safetensors present (never a pickle fallback)
        image_rules = ImageRules.from_file(directory / "preprocessor_config.json", model_type)
        model = _load_model(directory, model_type, device, dtype)
        tokenizer = _load_tokenizer(directory)
        text_rules = TextRules(max_length=int(model.config.text_config.max_position_embeddings))
        return cls(model, tokenizer, model_type, image_rules, text_rules, directory, batch_size)

    @property
    def dim(self) -> int:
        return int(self.model.config.text_config.projection_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def fingerprint(self) -> str:
        """SHA-256 over what makes the model and its inputs: the weight files' bytes, config.json (less the
        transformers version that wrote it), the tokenizer files and the image and text rules. Not the device or
        the dtype it runs in: those change rounding, not the model, and an index written by a bf16 server on a GPU
        must stay readable by a float32 command on a CPU. Computed once, on first use (it reads the weights)."""
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = checkpoint_digest(self.directory, self.image_rules, self.text_rules,
                                                      list(self.tokenizer.model_input_names))
            return self._fingerprint

    def describe(self) -> str:
        kind = "NaFlex" if self.image_rules.naflex else f"{self.image_rules.height}x{self.image_rules.width}"
        return f"SigLIP 2 ({self.model_type}, {kind}, D={self.dim}) from {self.directory}"

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """RGB images -> float32 [n, D], L2-normalised; `batch_size` images per forward."""
        out = [self._image_batch(images[i:i + self.batch_size]) for i in range(0, len(images), self.batch_size)]
        return torch.cat(out) if out else torch.zeros(0, self.dim)

    def _image_batch(self, images: Sequence[Image.Image]) -> torch.Tensor:
        inputs = preprocess_images(images, self.image_rules)
        inputs = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        pooled = self.model.get_image_features(**inputs).pooler_output
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()

    @torch.inference_mode()
    def encode_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """Texts -> float32 [m, D], L2-normalised."""
        out = [self._text_batch(texts[i:i + 64]) for i in range(0, len(texts), 64)]
        return torch.cat(out) if out else torch.zeros(0, self.dim)

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Texts -> the text model's inputs ({"input_ids": int64 [m, max_length]}, plus "attention_mask" where the
        tokenizer returns one)."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"text {i + 1} must be a str, found {type(text).__name__}")
        rules = self.text_rules
        prepared = [t.lower() for t in texts] if rules.lowercase else list(texts)
        encoded = self.tokenizer(prepared, padding="max_length", max_length=rules.max_length, truncation=True,
                                 return_tensors="pt")
        return {k: encoded[k] for k in self.tokenizer.model_input_names if k in encoded}

    def _text_batch(self, texts: Sequence[str]) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in self.tokenize(texts).items()}
        pooled = self.model.get_text_features(**inputs).pooler_output
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()

    def __repr__(self) -> str:
        return f"SiglipEncoder({self.describe()})"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "spiece.model")


def checkpoint_digest(directory: Path, image_rules: ImageRules, text_rules: TextRules,
                      input_names: list[str]) -> str:
    """The encoder fingerprint of a checkpoint directory (see `SiglipEncoder.fingerprint`)."""
    from pixeltriage.weights.reader import weight_files

    config = read_json(directory / "config.json")
    h = hashlib.sha256(b"pixeltriage-siglip-encoder-v1")
    meta = {"config": {k: v for k, v in config.items() if k != "transformers_version"},
            "image": image_rules.to_dict(), "text": asdict(text_rules), "inputs": input_names}
    h.update(json.dumps(meta, sort_keys=True).encode())
    files = [directory / name for name in _TOKENIZER_FILES if (directory / name).is_file()]
    for path in [*files, *weight_files(directory)]:
        h.update(f"{path.name}:{path.stat().st_size}:".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars and warnings about its own defaults off inside the block (a command's output
    is its result; problems that matter raise)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_model(directory: Path, model_type: str, device: torch.device, dtype: torch.dtype) -> "nn.Module":
    from transformers import Siglip2Model, SiglipModel

    cls = SiglipModel if model_type == "siglip" else Siglip2Model
    try:
        with quiet_transformers():
            model, info = cls.from_pretrained(directory, dtype=dtype, local_files_only=True, use_safetensors=True,
                                              output_loading_info=True)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise CheckpointError(f"{directory}: transformers cannot load it as {cls.__name__} ({e})") from None
    problems = {kind: info.get(kind) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {kind: sorted(map(str, names)) for kind, names in problems.items() if names}
    if problems:
        kind, names = next(iter(problems.items()))
        raise CheckpointError(f"{directory}: {kind.replace('_', ' ')} for {cls.__name__}: {', '.join(names[:5])}"
                              + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
    width, projection = model.config.vision_config.hidden_size, model.config.text_config.projection_size
    if width != projection:
        raise CheckpointError(f"{directory / 'config.json'}: image embeddings have {width} dimensions and text "
                              f"embeddings {projection}; they must match")
    if model.config.vision_config.vision_use_head is False:
        raise CheckpointError(f"{directory / 'config.json'}: vision_use_head is false; the pooled image embedding "
                              f"needs the attention-pooling head")
    return model.to(device).eval()


def _load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
        raise CheckpointError(f"{directory}: transformers cannot load its tokenizer ({e})") from None
