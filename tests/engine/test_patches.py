"""Patches compared with transformers' PIL Qwen2-VL processor; smart_resize; preprocess of every source kind."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

from images import encoded, random_image
from pixeltriage.config import ImageConfig
from pixeltriage.engine.patches import patchify, preprocess, smart_resize
from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media.image import make_thumbnail, to_rgb


def qwen_pil():
    """transformers' PIL Qwen2-VL processor module, or a skip of the test asking for it: only the comparisons with
    transformers need it, the rest of this file runs without transformers."""
    return pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def reference_processor(cfg: ImageConfig):
    return qwen_pil().Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size, merge_size=cfg.merge_size,
        image_mean=list(cfg.image_mean), image_std=list(cfg.image_std),
        min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
    )


def assert_matches_transformers(img: Image.Image, cfg: ImageConfig) -> None:
    pixel_values, grid_thw = patchify(to_rgb(img) if img.mode != "RGB" else img, cfg)
    ref = reference_processor(cfg)(images=img, return_tensors="np")
    assert grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert pixel_values.dtype == torch.float32 and pixel_values.is_contiguous()
    # Exact: same PIL resize, same float64 rescale, same float32 normalize.
    np.testing.assert_array_equal(pixel_values.numpy(), ref["pixel_values"])


# -- patches vs transformers -------------------------------------------------------------------

@pytest.mark.parametrize("mode,size", [
    ("RGBA", (64, 96)), ("L", (96, 64)), ("P", (500, 200)), ("RGB", (1, 1)), ("RGB", (336, 336)),
    ("LA", (17, 333)), ("RGB", (333, 17)), ("RGB", (1000, 750)), ("RGB", (2, 300)),
])
def test_thumbnail_patches_match_transformers(mode, size):
    thumbnail = make_thumbnail(to_rgb(random_image(mode, size)))
    assert_matches_transformers(thumbnail, ImageConfig())


def test_clip_mean_std_patch14_and_max_pixels_match_transformers():
    cfg = ImageConfig(patch_size=14, min_pixels=28 * 28, max_pixels=128 * 128,
                      image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)
    thumbnail = make_thumbnail(random_image("RGB", (640, 480), seed=3))
    pixel_values, grid_thw = patchify(thumbnail, cfg)
    assert pixel_values.shape[1] == 3 * 2 * 14 * 14
    assert grid_thw[1] * grid_thw[2] * 14 * 14 <= cfg.max_pixels
    assert_matches_transformers(thumbnail, cfg)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_alpha_compositing_matches_transformers(mode):
    img = random_image(mode, (40, 30), seed=5)
    if mode == "P":
        img.info["transparency"] = 7
    assert_matches_transformers(img, ImageConfig())


def test_patch_layout():
    cfg = ImageConfig(min_pixels=64 * 64, max_pixels=64 * 64, image_mean=(0.0,) * 3, image_std=(1.0,) * 3,
                      rescale_factor=1.0)
    values = np.arange(64 * 64, dtype=np.uint8).reshape(64, 64) % 251
    img = Image.fromarray(np.stack([values] * 3, axis=-1))
    pixel_values, grid_thw = patchify(img, cfg)
    assert grid_thw == (1, 4, 4)
    # Row 1 is the patch right of patch 0 (same 2x2 merge block); row 2 the one below patch 0.
    first = pixel_values[:, : 16 * 16].reshape(16, 16, 16)
    np.testing.assert_array_equal(first[1].numpy(), values[0:16, 16:32])
    np.testing.assert_array_equal(first[2].numpy(), values[16:32, 0:16])
    np.testing.assert_array_equal(first[4].numpy(), values[0:16, 32:48])
    # Both temporal copies are the same frame.
    rows = pixel_values.reshape(16, 3, 2, 256)
    np.testing.assert_array_equal(rows[:, :, 0].numpy(), rows[:, :, 1].numpy())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([28, 32]),
       st.integers(1, 100_000), st.integers(1, 3_000_000))
def test_smart_resize_matches_transformers(height, width, factor, min_pixels, extra):
    max_pixels = min_pixels + extra
    try:
        expected = qwen_pil().smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize(height, width, factor, min_pixels, max_pixels)
        return
    assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected


def test_smart_resize_rejects_extreme_aspect():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 32, 3136, 1_000_000)
    with pytest.raises(ValueError):
        smart_resize(0, 10, 32, 3136, 1_000_000)


def test_preprocess_same_for_every_source_kind(tmp_path):
    img = random_image("RGBA", (700, 300), seed=2)
    data = encoded(img, "PNG")
    path = tmp_path / "memory.png"
    path.write_bytes(data)
    cfg = ImageConfig()
    expected, grid = patchify(make_thumbnail(to_rgb(img)), cfg)
    for source in (img, data, bytearray(data), path, str(path)):
        pixel_values, grid_thw = preprocess(source, cfg, index=0)
        assert grid_thw == grid == (1, 8, 20)
        np.testing.assert_array_equal(pixel_values.numpy(), expected.numpy())


def test_extreme_aspect_ratio_raises_invalid_memory():
    with pytest.raises(InvalidMemoryError, match="aspect ratio") as info:
        preprocess(Image.new("RGB", (1000, 1)), ImageConfig(), index=3)
    assert info.value.index == 3
