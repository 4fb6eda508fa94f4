"""Test images shared by the image and patch tests: random pixels in any mode, encoded in any format."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image


def random_image(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    width, height = size
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8))
    if mode == "P":
        return rgba.convert("RGB").quantize(64)
    return rgba.convert(mode)


def encoded(img: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **params)
    return buffer.getvalue()
