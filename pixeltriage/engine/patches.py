"""Thumbnails -> Qwen vision patches.

`patchify` reproduces transformers' `Qwen2VLImageProcessorPil` bit for bit on an RGB image: PIL BICUBIC resize of
the uint8 image to the `smart_resize` size, rescale in float64 then cast to float32, normalize in float32, patches
laid out in merge_size x merge_size blocks with the single frame repeated temporal_patch_size times. `preprocess`
chains it after `media.image.thumbnail` (decoding, orientation, RGB, the thumbnail).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from pixeltriage.config import ImageConfig
from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media.image import DECODE_ERRORS, describe, thumbnail
from pixeltriage.media.policy import THUMBNAIL_SIDE


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL target size: both sides multiples of factor, area within [min_pixels, max_pixels].

    Same arithmetic as transformers' `smart_resize`. Raises ValueError for a non-positive side or an
    aspect ratio above 200. Returns (resized_height, resized_width).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(img_rgb: Image.Image, cfg: ImageConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resize, rescale, normalize and cut an RGB image into vision patches.

    Returns pixel_values float32 [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] and
    grid_thw = (1, grid_h, grid_w); rows are ordered in merge_size x merge_size blocks, each row is
    [C, T, patch, patch] flattened.
    """
    if img_rgb.mode != "RGB":
        raise ValueError(f"patchify needs an RGB image, got mode {img_rgb.mode!r}")
    height, width = smart_resize(img_rgb.height, img_rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = img_rgb.resize((width, height), Image.Resampling.BICUBIC)
    pixels = np.asarray(resized).transpose(2, 0, 1)  # [3, H, W] uint8
    pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
    pixels = (pixels - mean) / std  # float32 arithmetic, as transformers' normalize
    grid_h, grid_w = height // cfg.patch_size, width // cfg.patch_size
    return _to_patches(torch.from_numpy(pixels), cfg), (1, grid_h, grid_w)


def _to_patches(pixels: torch.Tensor, cfg: ImageConfig) -> torch.Tensor:
    channels, height, width = pixels.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    blocks = blocks.unsqueeze(5).expand(*blocks.shape[:5], t, p, p)  # one frame repeated t times
    return blocks.reshape(grid_h * grid_w, channels * t * p * p).contiguous()


def preprocess(source, cfg: ImageConfig, thumbnail_size: int = THUMBNAIL_SIDE,
               index: int | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One memory image -> (pixel_values float32 [N, 3 * T * patch**2], grid_thw (1, grid_h, grid_w)).

    = patchify(thumbnail(source, thumbnail_size), cfg). Every failure (unreadable image, aspect ratio above
    200, ...) is raised as InvalidMemoryError(reason, index).
    """
    return preprocess_thumbnail(thumbnail(source, thumbnail_size, index), cfg, index, source)


def preprocess_thumbnail(thumb: Image.Image, cfg: ImageConfig, index: int | None = None,
                         source=None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`preprocess` for a thumbnail `thumbnail` already made (fresh, or write-time cached): patchify only, no
    second decode, orientation or resize. `source` names the image in errors."""
    try:
        return patchify(thumb, cfg)
    except DECODE_ERRORS as e:
        raise InvalidMemoryError(f"{describe(source)}: cannot preprocess image ({e})", index) from e
