"""`pixeltriage bench cost`: prefill compute per question (System One + one answering call) against
opening every retrieved image and against text proxies only, from the analytic model in
`pixeltriage.bench.models.flops`.

ours@k opens the first k retrieved images (the ranking; every image when fewer than k exist) and
sends the rest as text proxies; its compute includes one System One forward over the question and
the thumbnails of the retrieved images.

Scenario presets (the PixelTriage paper's, "Decide Before You Look", Sections 6.1 and 6.4; sizes not
given there are stated as chosen):
- dmv: 10 retrieved product photos of 1120x840 px, 1200 Qwen2.5-VL tokens each (the paper: ~12k
  for all ten); 2450 prompt tokens besides the images' captions, 25 tokens per caption, an opened
  image keeps its caption. System One state: 10 thumbnails + 1280 tokens = 2280 tokens.
- m3exam: 4.2 retrieved images on average, taken as 4 images (probability 0.8) or 5 (0.2), of
  960x720 px (884 Qwen2.5-VL tokens); 2400 prompt tokens, 15 tokens per image identifier and
  caption, which an opened image replaces. System One state: the thumbnails + 1900 tokens
  (2300 and 2400 tokens; the paper: 2.2k to 2.4k).
- custom: --image-sizes, --text-tokens, --proxy-tokens, --keep-proxy, --state-text-tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pixeltriage.bench.models.flops import (
    SYSTEM_ONE_HEAD_DIM,
    answering_shape,
    paper_state,
    prefill_flops,
    shape_from_config,
    system_one_config,
    system_one_flops,
    total,
)
from pixeltriage.delivery.profiles import answering_model

ImageSize = tuple[int, int]  # (width, height) in pixels


@dataclass(frozen=True)
class Retrieval:
    """One possible retrieved set, with its probability within the scenario."""

    weight: float
    image_sizes: tuple[ImageSize, ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    retrievals: tuple[Retrieval, ...]
    text_tokens: int        # answering prompt tokens besides images and their proxies
    proxy_tokens: int       # one image's text proxy in the answering prompt
    keep_proxy: bool        # an opened image keeps its proxy (True) or replaces it (False)
    state_text_tokens: int  # System One state tokens besides the thumbnails

    def __post_init__(self):
        if not self.retrievals or abs(sum(r.weight for r in self.retrievals) - 1.0) > 1e-9:
            raise ValueError(f"scenario {self.name!r}: retrieval weights must sum to 1")
        if min(self.text_tokens, self.proxy_tokens, self.state_text_tokens) < 0:
            raise ValueError(f"scenario {self.name!r}: token counts must be >= 0")
        for r in self.retrievals:
            if not r.image_sizes or r.weight < 0:
                raise ValueError(f"scenario {self.name!r}: every retrieval needs images and a weight >= 0")


SCENARIOS: dict[str, Scenario] = {
    "dmv": Scenario(
        name="dmv", retrievals=(Retrieval(1.0, ((1120, 840),) * 10),),
        text_tokens=2450, proxy_tokens=25, keep_proxy=True, state_text_tokens=1280),
    "m3exam": Scenario(
        name="m3exam",
        retrievals=(Retrieval(0.8, ((960, 720),) * 4), Retrieval(0.2, ((960, 720),) * 5)),
        text_tokens=2400, proxy_tokens=15, keep_proxy=False, state_text_tokens=1900),
}


def custom_scenario(image_sizes: Sequence[ImageSize], text_tokens: int, proxy_tokens: int = 20,
                    keep_proxy: bool = False, state_text_tokens: int | None = None) -> Scenario:
    """One retrieved set; the System One state defaults to 128 text tokens per memory."""
    state_text = 128 * len(image_sizes) if state_text_tokens is None else state_text_tokens
    return Scenario(name="custom", retrievals=(Retrieval(1.0, tuple(image_sizes)),), text_tokens=text_tokens,
                    proxy_tokens=proxy_tokens, keep_proxy=keep_proxy, state_text_tokens=state_text)


def _answer_tflop(shape, scenario: Scenario, sizes: tuple[ImageSize, ...], opened: int) -> float:
    kept = opened if scenario.keep_proxy else 0
    text = scenario.text_tokens + scenario.proxy_tokens * (len(sizes) - opened + kept)
    return total(prefill_flops(shape, text, sizes[:opened])).total / 1e12


def _system_one_tflop(shape, scenario: Scenario, sizes: tuple[ImageSize, ...], cached_vision: bool) -> float:
    state = paper_state(len(sizes), text_tokens=scenario.state_text_tokens, vision=shape.vision)
    parts = system_one_flops(shape, state, head_dim=SYSTEM_ONE_HEAD_DIM, cached_vision=cached_vision)
    return total(parts).total / 1e12


def cost_report(scenario: str | Scenario, answering: str, ks: Sequence[int], system_one: str = "2b",
                cached_vision: bool = False) -> dict:
    """Visual tokens and prefill TFLOP per question, as an expectation over the scenario's retrievals.

    answering: an answering checkpoint (pixeltriage.delivery.profiles.CHECKPOINTS); its visual tokens follow the
    registry's rule for its model. tflop.ours[k] = System One + the answering prefill with the first k images opened.
    """
    if isinstance(scenario, str) and scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {sorted(SCENARIOS)}")
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    shape = answering_shape(answering)
    profile = answering_model(shape.answering)          # the registry's visual-token rule, as the delivery counts
    if not ks or min(ks) < 1:
        raise ValueError(f"budgets k must be >= 1, found {list(ks)}")
    vis = {"open_all": 0.0, "ours": {k: 0.0 for k in ks}}
    tf = {"system_one": 0.0, "open_all": 0.0, "text_only": 0.0, "ours": {k: 0.0 for k in ks}}
    s1_shape = shape_from_config(system_one_config(system_one))
    for r in sc.retrievals:
        sizes, n = r.image_sizes, len(r.image_sizes)
        tokens = [profile.tokens(size) for size in sizes]
        s1 = _system_one_tflop(s1_shape, sc, sizes, cached_vision)
        tf["system_one"] += r.weight * s1
        tf["open_all"] += r.weight * _answer_tflop(shape, sc, sizes, n)
        tf["text_only"] += r.weight * _answer_tflop(shape, sc, sizes, 0)
        vis["open_all"] += r.weight * sum(tokens)
        for k in ks:
            opened = min(k, n)
            vis["ours"][k] += r.weight * sum(tokens[:opened])
            tf["ours"][k] += r.weight * (s1 + _answer_tflop(shape, sc, sizes, opened))
    return {
        "scenario": sc.name,
        "answering": answering,
        "system_one": f"{system_one}+cached-vision" if cached_vision else system_one,
        "visual_tokens": {"open_all": round(vis["open_all"]),
                          "ours": {str(k): round(v) for k, v in vis["ours"].items()}},
        "tflop": {"system_one": round(tf["system_one"], 3), "open_all": round(tf["open_all"], 3),
                  "text_only": round(tf["text_only"], 3),
                  "ours": {str(k): round(v, 3) for k, v in tf["ours"].items()}},
    }


def format_report(report: dict) -> str:
    tf, vis = report["tflop"], report["visual_tokens"]
    open_all = tf["open_all"]
    lines = [f"scenario {report['scenario']}, answering {report['answering']}, System One {report['system_one']}",
             f"{'delivery':<22}{'visual tokens':>14}{'TFLOP':>10}{'vs open all':>13}",
             f"{'System One alone':<22}{'-':>14}{tf['system_one']:>10.1f}{tf['system_one'] / open_all:>13.1%}",
             f"{'text proxies only':<22}{0:>14}{tf['text_only']:>10.1f}{tf['text_only'] / open_all:>13.1%}",
             f"{'open all':<22}{vis['open_all']:>14}{open_all:>10.1f}{1:>13.1%}"]
    for k, value in tf["ours"].items():
        lines.append(f"{'ours@' + k + ' (+System One)':<22}{vis['ours'][k]:>14}{value:>10.1f}{value / open_all:>13.1%}")
    return "\n".join(lines)


def run_cost(args: argparse.Namespace) -> int:
    if args.scenario == "custom":
        if args.image_sizes is None or args.text_tokens is None:
            print("error: --scenario custom needs --image-sizes and --text-tokens", file=sys.stderr)
            return 2
        scenario = custom_scenario(args.image_sizes, args.text_tokens, args.proxy_tokens, args.keep_proxy,
                                   args.state_text_tokens)
    else:
        scenario = SCENARIOS[args.scenario]
    report = cost_report(scenario, args.answering, args.k, args.system_one, args.cached_vision)
    print(json.dumps(report) if args.json else format_report(report))
    return 0

