"""One scored question's delivery decision, and the rerank ordering: what the scoring service answers with, what its
clients read back, what the framework adapters write on their items and what `pixeltriage score` reports.

- `decide`: a policy (the k highest gains, a visual-token budget, a rate gate) applied to the scores -> `Decision`.
- `rerank_order`: a reranked list's order, the scored items by descending score, then the items without a score;
  `RankedDocument`: one document of a reranked list, as the service answers it and its clients read it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pixeltriage.delivery.cost import Model, delivery_cost
from pixeltriage.delivery.policy import RateGate, by_gain, token_budget, top_k
from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL, answering_model
from pixeltriage.engine.types import Scores


@dataclass(frozen=True)
class VisualTokens:
    """The answering model's visual tokens for one question's images: every image opened, and this delivery's."""

    model: str
    open_all: int
    delivery: int


@dataclass(frozen=True)
class Decision:
    """Which of one scored question's memories are delivered as pixels.

    open: per memory (as `scores.gains` orders them), whether its pixels are delivered; gate_open: whether the rate
    gate let the question's images through (a closed gate opens none); visual_tokens: what the answering model reads
    of the images, when every image's size is known (None otherwise)."""

    scores: Scores
    open: list[bool]
    gate_open: bool = True
    visual_tokens: VisualTokens | None = None

    @property
    def order(self) -> list[int]:
        """The memories by descending gain, the earlier retrieved first among equal gains: the order `top_k` opens
        them in, and the order of a reranked list's scored items (`rerank_order`)."""
        return rerank_order(self.scores.gains)


def decide(scores: Scores, k: int | None = None, gate: RateGate | None = None,
           sizes: Sequence[tuple[int, int] | None] | None = None, answering: Model = DEFAULT_ANSWERING_MODEL,
           budget: int | None = None) -> Decision:
    """Which memories open for one scored question.

    k: open the k highest gains (None: no cap). budget: open by descending gain while the answering model's visual
    tokens fit (`token_budget`; at most k of them when k is given); it needs every image's size. Each image is priced
    alone in its prompt, which for LLaVA-OneVision (cheaper per image when a prompt holds several) keeps within the
    budget. gate: a closed gate opens nothing (the question's p_vis joins the gate's window either way). sizes: the
    images' displayed (width, height), None where unknown (None: none known); the visual tokens are counted when
    every size is known. answering: a registry name, a processor config directory or an AnsweringModel
    (pixeltriage.delivery.profiles)."""
    model = answering_model(answering)
    n = len(scores.gains)
    known = sizes is not None and all(s is not None for s in sizes)
    if budget is None:
        opened = top_k(scores, n if k is None else k)
    else:
        if not known:
            raise ValueError("a token budget needs every image's size")
        opened = token_budget(scores, budget, [model.tokens(s) for s in sizes])
        if k is not None:
            capped = set([i for i in by_gain(scores.gains) if opened[i]][:k])
            opened = [i in capped for i in range(n)]
    gate_open = gate.opens(scores.p_vis) if gate is not None else True
    if not gate_open:
        opened = [False] * n
    visual = None
    if known:
        visual = VisualTokens(model.name, delivery_cost([True] * n, sizes, model), delivery_cost(opened, sizes, model))
    return Decision(scores, opened, gate_open, visual)


@dataclass(frozen=True)
class RankedDocument:
    """One document of a reranked list: `index` in the request, `relevance_score` (what the list is ordered by: the
    gain, or the relevance; 0.0 for a document without an image), `image` (it carried an image or a cache key and
    was scored), its `gain` and `relevance` (None without an image), `open` (the delivery opens its pixels),
    `truncated` (a text of it was cut to the token budget), `document` (its text: the clients get it back with
    return_documents)."""

    index: int
    relevance_score: float
    image: bool
    gain: float | None
    relevance: float | None
    open: bool
    truncated: bool
    document: str | None = None


def rerank_order(scores: Sequence[float | None]) -> list[int]:
    """The positions of a reranked list: the items with a score by descending score, the earlier first among equal
    scores, then the items without one (None: no image was scored, so there is nothing to open) as they were given."""
    scored = [i for i, s in enumerate(scores) if s is not None]
    return [scored[j] for j in by_gain([scores[i] for i in scored])] + [i for i, s in enumerate(scores) if s is None]
