"""Delivery policies: turn System One's scores into a delivery d (True = open as pixels).

- `top_k`: the k memories with the highest gains (the budget k is the accuracy/cost knob).
- `RateGate`: a question-level gate on p_vis, set by the fraction of a stream's questions it opens.
- `token_budget`: open by descending gain while a visual-token budget allows.
- Baselines for A/B tests: `retrieval_order`, `random_policy`, `downsize_all`.

Every policy is deterministic: ties in gain go to the earlier retrieved memory.
"""
from __future__ import annotations

import bisect
import math
import operator
import random
from collections import deque
from collections.abc import Iterable, Sequence

from pixeltriage.delivery.cost import Model, token_rule
from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL, answering_model
from pixeltriage.delivery.rules import GridRule
from pixeltriage.engine.types import Scores


def top_k(scores: Scores | Sequence[float], k: int) -> list[bool]:
    """Open the k memories with the highest gain; all of them when there are at most k.

    Ties go to the earlier retrieved memory. n = 0 gives [].
    """
    gains = _gains(scores)
    k = _count(k, "k")
    if len(gains) <= k:
        return [True] * len(gains)
    chosen = set(by_gain(gains)[:k])
    return [i in chosen for i in range(len(gains))]


def token_budget(scores: Scores | Sequence[float], budget: int, costs: Sequence[int]) -> list[bool]:
    """Open memories by descending gain while the visual-token budget allows.

    `costs[i]` is memory i's visual tokens (`cost.visual_tokens`). An image that does not fit in
    what is left of the budget is skipped and the next ones are still tried, so a smaller,
    lower-gain image can use budget a larger one could not (the total never exceeds `budget`).
    Ties in gain go to the earlier retrieved memory.
    """
    gains = _gains(scores)
    budget = _count(budget, "budget")
    if len(costs) != len(gains):
        raise ValueError(f"costs has {len(costs)} entries for {len(gains)} memories")
    costs = [_count(c, f"costs[{i}]") for i, c in enumerate(costs)]
    delivery = [False] * len(gains)
    left = budget
    for i in by_gain(gains):
        if costs[i] <= left:
            delivery[i] = True
            left -= costs[i]
    return delivery


class RateGate:
    """Opens images for the questions whose p_vis ranks in the top `rate` of recent questions.

    The rule, for a question with probability p: let S be the p_vis of the last `window - 1`
    questions before it (fewer at the start), m = len(S) + 1 the questions ranked with this one,
    and r = ceil(rate * m) the number of them the gate may open. The question opens when fewer
    than r values in S are strictly greater than p, i.e. when p >= `threshold`, the r-th largest
    value of S (0.0 when S has fewer than r values). Then p joins the window.

    - Ties open: a p equal to the threshold opens, so a run of equal values may open more than
      `rate` of the questions.
    - Cold start: with an empty window the first question always opens, and the opening rate
      approaches `rate` as the window fills. `calibrate` seeds the window with unlabeled p_vis
      values (e.g. those of 50 earlier questions) to skip this phase.
    - rate = 1 opens every question; window = 1 compares each question with itself only and
      so opens every question too.
    """

    def __init__(self, rate: float, window: int = 1000):
        self.rate = _check_rate(rate)
        self.window = _check_window(window)
        self._recent: deque[float] = deque(maxlen=self.window)  # arrival order
        self._sorted: list[float] = []  # the same values, ascending

    def opens(self, p_vis: float) -> bool:
        """Decide for one question and add its p_vis to the window."""
        p_vis = _check_probability(p_vis, "p_vis")
        decision = p_vis >= self.threshold
        self._push(p_vis)
        return decision

    @property
    def threshold(self) -> float:
        """The smallest p_vis that opens the next question."""
        values = self._sorted
        # S: the values that stay in the window once the next question joins it
        leaving = None
        if len(self._recent) == self.window:
            leaving = bisect.bisect_left(values, self._recent[0])
        size = len(values) - (leaving is not None)
        r = _slots(self.rate, size + 1)
        if size < r:
            return 0.0
        at = size - r  # position of the r-th largest in S, ascending
        if leaving is not None and at >= leaving:
            at += 1
        return values[at]

    def calibrate(self, values: Iterable[float]) -> "RateGate":
        """Replace the window with unlabeled p_vis values (the last `window` of them are kept)."""
        checked = [_check_probability(v, f"values[{i}]") for i, v in enumerate(values)]
        self._recent.clear()
        self._sorted.clear()
        for v in checked[-self.window:]:
            self._push(v)
        return self

    def __len__(self) -> int:
        return len(self._recent)

    def state_dict(self) -> dict:
        """A JSON-serialisable snapshot: rate, window and the window's values, oldest first."""
        return {"rate": self.rate, "window": self.window, "recent": list(self._recent)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RateGate":
        for key in ("rate", "window", "recent"):
            if key not in state:
                raise ValueError(f"RateGate state: missing key {key!r}")
        gate = cls(state["rate"], state["window"])
        recent = list(state["recent"])
        if len(recent) > gate.window:
            raise ValueError(f"RateGate state: {len(recent)} values for a window of {gate.window}")
        return gate.calibrate(recent)

    def _push(self, p_vis: float) -> None:
        if len(self._recent) == self.window:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(p_vis)
        bisect.insort(self._sorted, p_vis)

    def __repr__(self) -> str:
        return f"RateGate(rate={self.rate}, window={self.window}, filled={len(self)})"


def retrieval_order(n: int, k: int) -> list[bool]:
    """Baseline: open the first k retrieved memories."""
    n, k = _count(n, "n"), _count(k, "k")
    return [i < k for i in range(n)]


def random_policy(n: int, k: int, seed: int) -> list[bool]:
    """Baseline: open min(k, n) memories drawn uniformly with `random.Random(seed)`.

    The same (n, k, seed) always gives the same delivery; derive the seed from the question id
    to draw independently per question.
    """
    n, k = _count(n, "n"), _count(k, "k")
    chosen = set(random.Random(seed).sample(range(n), min(k, n)))
    return [i in chosen for i in range(n)]


def downsize_all(image_sizes: Sequence[tuple[int, int]], budget_tokens: int,
                 model: Model = DEFAULT_ANSWERING_MODEL) -> list[tuple[int, int]]:
    """Baseline: open every image, each down-sized to an equal share of the budget.

    Every image gets share = budget_tokens // n tokens. An image whose tokens are already at most
    its share keeps its (width, height); any other is resized, aspect ratio kept as closely as
    the grid allows, to multiples of the model's factor (28 px for Qwen2.5-VL) with at most
    `share` tokens. Shares left unused by small images are not redistributed, so the total is
    at most budget_tokens. Returns (width, height) per image; resize with these exact sizes and
    the answering model's processor keeps them.

    Raises ValueError when the share is below the fewest tokens the model spends on any image
    (the processor would up-size it), or when the model's rule is not a Qwen resize grid (a tiled rule has no
    size to shrink an image to by a given token count); a budget of 0 means the baseline opens nothing.
    """
    name, rule = answering_model(model).name, token_rule(model)
    if not isinstance(rule, GridRule):
        raise ValueError(f"downsize_all needs a Qwen resize grid; {name} counts tokens with {type(rule).__name__}")
    budget_tokens = _count(budget_tokens, "budget_tokens")
    if not image_sizes:
        return []
    share = budget_tokens // len(image_sizes)
    if share < rule.min_tokens:
        raise ValueError(f"budget of {budget_tokens} tokens over {len(image_sizes)} images leaves "
                         f"{share} per image; {name} spends at least {rule.min_tokens}")
    return [size if rule.tokens(size) <= share else _fit(size, share, rule, name)
            for size in image_sizes]


def _fit(image_size: tuple[int, int], share: int, rule: GridRule, name: str) -> tuple[int, int]:
    """The grid size closest to the image's aspect ratio that the processor keeps as it is and
    that costs at most `share` tokens (the most tokens among equally close ones)."""
    f = rule.factor
    # the processor's own rule with the share as its pixel ceiling: right for all but extreme shapes
    size = token_rule(rule, max_pixels=share * f * f).resized(image_size)
    if rule.resized(size) == size and rule.tokens(size) <= share:
        return size
    # tiny or very elongated images: search the grid shapes the processor keeps
    width, height = image_size
    aspect = width / height
    best = None
    for rows in range(1, share + 1):
        low = max(1, math.ceil(rule.min_pixels / (f * f * rows)))
        high = share // rows
        if low > high:
            continue
        ideal = rows * aspect
        for cols in {min(high, max(low, math.floor(ideal))), min(high, max(low, math.ceil(ideal)))}:
            size = (cols * f, rows * f)
            if max(cols, rows) / min(cols, rows) > 200 or rule.resized(size) != size:
                continue
            rank = (abs(math.log(cols / rows / aspect)), -cols * rows)
            if best is None or rank < best[0]:
                best = (rank, size)
    if best is None:
        raise ValueError(f"no {name} grid size for image {image_size} fits {share} tokens")
    return best[1]


def by_gain(gains: list[float]) -> list[int]:
    """Memory indices by descending gain, earlier retrieved first among equal gains."""
    return sorted(range(len(gains)), key=lambda i: (-gains[i], i))


def _gains(scores: Scores | Sequence[float]) -> list[float]:
    values = scores.gains if isinstance(scores, Scores) else scores
    gains = []
    for i, g in enumerate(values):
        g = float(g)
        if not math.isfinite(g):
            raise ValueError(f"gain {i} is not finite: {g}")
        gains.append(g)
    return gains


def _count(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, found {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, found {value}")
    return value


def _slots(rate: float, m: int) -> int:
    """ceil(rate * m), robust to the float error in products like 0.3 * 10."""
    return max(1, math.ceil(round(rate * m, 9)))


def _check_rate(rate: float) -> float:
    rate = float(rate)
    if not 0.0 < rate <= 1.0:  # also rejects NaN
        raise ValueError(f"rate must be in (0, 1], found {rate}")
    return rate


def _check_window(window: int) -> int:
    window = _count(window, "window")
    if window < 1:
        raise ValueError(f"window must be >= 1, found {window}")
    return window


def _check_probability(p: float, name: str) -> float:
    if isinstance(p, bool):
        raise TypeError(f"{name} must be a float, found {p!r}")
    p = float(p)
    if not 0.0 <= p <= 1.0:  # also rejects NaN and inf
        raise ValueError(f"{name} must be a finite probability in [0, 1], found {p}")
    return p
