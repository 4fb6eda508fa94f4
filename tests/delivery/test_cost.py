"""The visual cost of a delivery, and the Qwen resize grid against transformers' own image processor on random
sizes and with the pixel limits overridden (tests/delivery/test_profiles.py checks every family on a grid of awkward
sizes).

Qwen2.5-VL, Qwen3-VL and Qwen3.5 all resize images with transformers' Qwen2-VL image processor
(qwen3_vl and qwen3_5 have no image resize rule of their own); they differ in patch size and
in the pixel limits of their preprocessor_config.json.
"""
import random

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize as hf_smart_resize,
)

from pixeltriage.delivery.cost import cost_ratio, delivery_cost, token_rule, visual_tokens
from pixeltriage.delivery.profiles import ANSWERING_MODELS

PREPROCESSOR = {  # the checkpoints' preprocessor_config.json fields the Qwen2-VL image processor reads
    "qwen2.5-vl": {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056},
    "qwen3.5": {"patch_size": 16, "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216}},
}
RULES = {name: ANSWERING_MODELS[name].rule for name in PREPROCESSOR}
SEEDS = {"qwen2.5-vl": 25, "qwen3.5": 35}    # fixed: the same sizes under any PYTHONHASHSEED


def _processor(model: str, **size_override) -> Qwen2VLImageProcessorPil:
    kwargs = dict(PREPROCESSOR[model])
    if size_override:
        kwargs.pop("min_pixels", None), kwargs.pop("max_pixels", None)
    if size_override:
        kwargs["size"] = dict(size_override)
    return Qwen2VLImageProcessorPil(**kwargs)


def _sizes(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < n:
        w = rng.choice([rng.randint(1, 64), rng.randint(1, 2000), rng.randint(1, 12000)])
        h = rng.choice([rng.randint(1, 64), rng.randint(1, 2000), rng.randint(1, 12000)])
        if max(w, h) / min(w, h) <= 200:
            sizes.append((w, h))
    # exact multiples, one off, and the pixel limits
    sizes += [(28, 28), (56, 56), (27, 29), (32, 32), (64, 64), (256, 256), (1024, 980), (5600, 28), (28, 5600),
              (1920, 1080), (1080, 1920), (4096, 4096), (200, 1), (1, 200)]
    return sizes


@pytest.mark.parametrize("model", sorted(RULES))
def test_rules_hold_the_processors_settings(model):
    hf, rule = _processor(model), RULES[model]
    assert (hf.patch_size, hf.merge_size) == (rule.patch_size, rule.merge_size)
    assert (hf.size.shortest_edge, hf.size.longest_edge) == (rule.min_pixels, rule.max_pixels)
    assert RULES["qwen2.5-vl"].factor == 28 and RULES["qwen3.5"].factor == 32


@pytest.mark.parametrize("model", sorted(RULES))
def test_tokens_match_processor_on_random_sizes(model):
    hf = _processor(model)
    rule = RULES[model]
    for w, h in _sizes(1500, seed=SEEDS[model]):
        expected = hf.get_number_of_image_patches(h, w) // rule.merge_size ** 2
        assert visual_tokens((w, h), model) == expected, (w, h)
        rh, rw = hf_smart_resize(h, w, factor=rule.factor, min_pixels=rule.min_pixels, max_pixels=rule.max_pixels)
        assert rule.resized((w, h)) == (rw, rh)


@pytest.mark.parametrize("model", sorted(RULES))
def test_pixel_overrides_match_processor(model):
    rule = RULES[model]
    f2 = rule.factor ** 2
    for min_pixels, max_pixels in [(4 * f2, 256 * f2), (f2, 64 * f2), (100 * f2, 100 * f2)]:
        hf = _processor(model, shortest_edge=min_pixels, longest_edge=max_pixels)
        for w, h in _sizes(300, seed=min_pixels):
            expected = hf.get_number_of_image_patches(h, w) // rule.merge_size ** 2
            got = visual_tokens((w, h), model, min_pixels=min_pixels, max_pixels=max_pixels)
            assert got == expected, (w, h, min_pixels, max_pixels)


def test_known_values():
    assert visual_tokens((1920, 1080)) == 2691  # 1932 x 1092 px = 69 x 39 tokens
    assert visual_tokens((1920, 1080), max_pixels=28 * 28 * 1280) == 1222  # the class default: 1316 x 728 px
    assert visual_tokens((1920, 1080), "qwen3.5") == 2040
    assert visual_tokens((1, 1)) == 4  # up-sized to 56 x 56
    assert visual_tokens((1, 1), "qwen3.5") == 64  # up-sized to 256 x 256
    assert RULES["qwen2.5-vl"].min_tokens == 4 and RULES["qwen3.5"].min_tokens == 64
    assert visual_tokens((10000, 10000)) <= 12845056 // 28 ** 2


def test_extreme_aspect_ratio_rejected_like_transformers():
    with pytest.raises(ValueError):
        hf_smart_resize(10, 2100)
    with pytest.raises(ValueError):
        visual_tokens((2100, 10))


@pytest.mark.parametrize("bad", [(0, 10), (10, -1), (10.5, 10), (10,), "10x10", (True, 10)])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        visual_tokens(bad)


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown answering model"):
        visual_tokens((10, 10), "gpt")
    with pytest.raises(ValueError):
        token_rule("qwen2.5-vl", min_pixels=2000, max_pixels=1000)
    with pytest.raises(ValueError, match="Qwen resize grid"):
        visual_tokens((10, 10), "gemma-3", max_pixels=1000)


def test_delivery_cost_and_ratio():
    sizes = [(1920, 1080), (56, 56), (640, 480)]
    taus = [visual_tokens(s) for s in sizes]
    assert delivery_cost([1, 0, 1], sizes) == taus[0] + taus[2]
    assert delivery_cost([False] * 3, sizes) == 0
    assert delivery_cost([True] * 3, sizes, "qwen2.5-vl") == sum(taus)
    assert cost_ratio([0, 1, 0], sizes) == pytest.approx(taus[1] / sum(taus))
    assert cost_ratio([1, 1, 1], sizes) == 1.0
    assert cost_ratio([], []) == 0.0
    assert delivery_cost([], []) == 0
    qwen35 = [visual_tokens(s, "qwen3.5") for s in sizes]
    assert delivery_cost([1, 1, 0], sizes, "qwen3.5") == qwen35[0] + qwen35[1]


def test_several_images_in_one_prompt():
    """LLaVA-OneVision prices each of several images in one prompt at its base tile (729 + 1); alone, an image is
    priced with its any-resolution tiles. Every other family costs the same together as alone."""
    sizes = [(1920, 1080), (640, 480), (56, 56)]
    alone = [visual_tokens(s, "llava-onevision") for s in sizes]
    assert delivery_cost([1, 0, 0], sizes, "llava-onevision") == alone[0] > 730
    assert delivery_cost([1, 1, 0], sizes, "llava-onevision") == 2 * 730
    assert cost_ratio([1, 0, 0], sizes, "llava-onevision") == pytest.approx(alone[0] / (3 * 730))
    for model in ("internvl3", "gemma-3", "gpt-4o", "claude"):
        assert delivery_cost([1, 1, 1], sizes, model) == sum(visual_tokens(s, model) for s in sizes)


def test_delivery_validation():
    with pytest.raises(ValueError, match="entries"):
        delivery_cost([1, 0], [(10, 10)])
    with pytest.raises(ValueError):
        cost_ratio([2], [(10, 10)])
