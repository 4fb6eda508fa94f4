"""Visual cost of a delivery: the answering model's visual tokens for the images it opens.

    c(d) = sum_i d_i * tau(x_i)

tau is the answering model's rule (pixeltriage.delivery.profiles: one registry, each rule following the model's
own image processor or a hosted model's published formula; docs/delivery.md). `model` is a registry name, a
processor config directory, an AnsweringModel or a rule; it defaults to DEFAULT_ANSWERING_MODEL.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL, AnsweringModel, answering_model
from pixeltriage.delivery.rules import GridRule, Rule

Model = str | os.PathLike | AnsweringModel | Rule


def token_rule(model: Model = DEFAULT_ANSWERING_MODEL, *, min_pixels: int | None = None,
               max_pixels: int | None = None) -> Rule:
    """The rule of `model`; min/max pixels override a Qwen resize grid's limits (the processor's `size`)."""
    rule = answering_model(model).rule
    if min_pixels is None and max_pixels is None:
        return rule
    if not isinstance(rule, GridRule):
        raise ValueError(f"min_pixels/max_pixels apply to a Qwen resize grid; {answering_model(model).name} "
                         f"counts tokens with {type(rule).__name__}")
    if min_pixels is not None:
        rule = replace(rule, min_pixels=int(min_pixels))
    if max_pixels is not None:
        rule = replace(rule, max_pixels=int(max_pixels))
    return rule


def visual_tokens(image_size: tuple[int, int], model: Model = DEFAULT_ANSWERING_MODEL, *,
                  min_pixels: int | None = None, max_pixels: int | None = None) -> int:
    """tau(x): the answering model's visual tokens for an image of `image_size` = (width, height), alone in its
    prompt."""
    return token_rule(model, min_pixels=min_pixels, max_pixels=max_pixels).tokens(image_size)


def delivery_cost(delivery: Sequence[bool], image_sizes: Sequence[tuple[int, int]],
                  model: Model = DEFAULT_ANSWERING_MODEL) -> int:
    """c(d): the visual tokens of the opened images, sent together in one prompt. `image_sizes` are (width, height)
    in retrieval order. For every model but LLaVA-OneVision this is sum_i d_i * tau(x_i)."""
    rule = token_rule(model)
    opened = check_delivery(delivery, len(image_sizes))
    return sum(rule.prompt_tokens([size for size, is_open in zip(image_sizes, opened) if is_open]))


def cost_ratio(delivery: Sequence[bool], image_sizes: Sequence[tuple[int, int]],
               model: Model = DEFAULT_ANSWERING_MODEL) -> float:
    """c(d) / c(1): the cost relative to opening every retrieved image; 0.0 when nothing was retrieved."""
    total = delivery_cost([True] * len(image_sizes), image_sizes, model)
    part = delivery_cost(delivery, image_sizes, model)
    return part / total if total else 0.0


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
