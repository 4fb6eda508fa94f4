"""Visual cost of a delivery: the answering model's visual tokens for the images it opens.

    c(d) = sum_i d_i * tau(x_i)

tau follows the answering model's own image processor: the image is resized (aspect ratio kept)
to multiples of `patch_size * merge_size` pixels within [min_pixels, max_pixels], and every
merged `factor x factor` block becomes one token.

- "qwen2.5-vl": 14-px patches merged 2x2 -> one token per 28x28 px, min 56*56, max 28*28*1280
  (the Qwen2-VL image processor's defaults, which Qwen2.5-VL ships).
- "qwen3.5": 16-px patches merged 2x2 -> one token per 32x32 px, min 65536 (64 tokens), max
  16777216 px (16384 tokens): Qwen3.5's preprocessor_config.json, read by transformers'
  Qwen2-VL image processor (Qwen3-VL and Qwen3.5 have no image resize rule of their own).
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pixeltriage.engine.image import smart_resize


@dataclass(frozen=True)
class TokenRule:
    """One answering model's image resize rule and its token count."""

    name: str
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def __post_init__(self):
        if min(self.patch_size, self.merge_size) < 1:
            raise ValueError(f"{self.name}: patch_size and merge_size must be >= 1")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"{self.name}: need 1 <= min_pixels <= max_pixels, "
                             f"found {self.min_pixels}, {self.max_pixels}")

    @property
    def factor(self) -> int:
        """Pixels per token along each side."""
        return self.patch_size * self.merge_size

    @property
    def min_tokens(self) -> int:
        """The fewest tokens any image costs: the processor up-sizes anything smaller."""
        return self.tokens((self.factor, self.factor))

    def resized(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(width, height) the processor feeds to the vision tower."""
        width, height = _check_size(image_size)
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return w, h

    def tokens(self, image_size: tuple[int, int]) -> int:
        w, h = self.resized(image_size)
        return (w // self.factor) * (h // self.factor)


RULES: dict[str, TokenRule] = {
    "qwen2.5-vl": TokenRule("qwen2.5-vl", patch_size=14, merge_size=2,
                            min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
    "qwen3.5": TokenRule("qwen3.5", patch_size=16, merge_size=2,
                         min_pixels=65536, max_pixels=16777216),
}


def token_rule(model: str | TokenRule = "qwen2.5-vl", *, min_pixels: int | None = None,
               max_pixels: int | None = None) -> TokenRule:
    """The rule of `model` (a name in RULES or a TokenRule), with min/max pixels overridden if given."""
    if isinstance(model, TokenRule):
        rule = model
    elif model in RULES:
        rule = RULES[model]
    else:
        raise ValueError(f"unknown answering model {model!r}; known: {sorted(RULES)}")
    if min_pixels is not None:
        rule = replace(rule, min_pixels=int(min_pixels))
    if max_pixels is not None:
        rule = replace(rule, max_pixels=int(max_pixels))
    return rule


def visual_tokens(image_size: tuple[int, int], model: str | TokenRule = "qwen2.5-vl", *,
                  min_pixels: int | None = None, max_pixels: int | None = None) -> int:
    """tau(x): the answering model's visual tokens for an image of `image_size` = (width, height)."""
    return token_rule(model, min_pixels=min_pixels, max_pixels=max_pixels).tokens(image_size)


def delivery_cost(delivery: Sequence[bool], image_sizes: Sequence[tuple[int, int]],
                  model: str | TokenRule = "qwen2.5-vl") -> int:
    """c(d) = sum_i d_i * tau(x_i). `image_sizes` are (width, height) in retrieval order."""
    rule = token_rule(model)
    opened = check_delivery(delivery, len(image_sizes))
    return sum(rule.tokens(size) for size, is_open in zip(image_sizes, opened) if is_open)


def cost_ratio(delivery: Sequence[bool], image_sizes: Sequence[tuple[int, int]],
               model: str | TokenRule = "qwen2.5-vl") -> float:
    """c(d) / c(1): the cost relative to opening every retrieved image; 0.0 when nothing was retrieved."""
    rule = token_rule(model)
    opened = check_delivery(delivery, len(image_sizes))
    all_tokens = [rule.tokens(size) for size in image_sizes]
    total = sum(all_tokens)
    if total == 0:
        return 0.0
    return sum(t for t, is_open in zip(all_tokens, opened) if is_open) / total


def _check_size(image_size) -> tuple[int, int]:
    try:
        width, height = image_size
    except (TypeError, ValueError):
        raise ValueError(f"image size must be (width, height), found {image_size!r}") from None
    try:
        if isinstance(width, bool) or isinstance(height, bool):
            raise TypeError
        width, height = operator.index(width), operator.index(height)
    except TypeError:
        raise ValueError(f"image size must be two ints (width, height), found {image_size!r}") from None
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, found {image_size!r}")
    return width, height


def check_delivery(delivery: Sequence[bool], n: int) -> list[bool]:
    """A delivery (one open/closed flag per retrieved memory) as bools; ValueError for a wrong length or value."""
    if len(delivery) != n:
        raise ValueError(f"delivery has {len(delivery)} entries for {n} memories")
    opened = []
    for i, d in enumerate(delivery):
        if d not in (0, 1):  # True/False/0/1 only
            raise ValueError(f"delivery[{i}] must be 0/1 or a bool, found {d!r}")
        opened.append(bool(d))
    return opened
