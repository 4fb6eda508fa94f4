"""The delivery decision and the rerank ordering that the scoring service, its clients and the framework adapters
share: `decide` against the policies it applies, `rerank_order` against the order its callers promise."""
import random

import pytest

from pixeltriage.delivery.cost import delivery_cost
from pixeltriage.delivery.decision import Decision, VisualTokens, decide, rerank_order
from pixeltriage.delivery.policy import RateGate, by_gain, token_budget, top_k
from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL, answering_model
from pixeltriage.engine.types import Scores

SIZES = [(1920, 1080), (640, 480), (300, 2000), (512, 512)]
SCORES = Scores(p_vis=0.7, gains=[0.5, 0.9, 0.5, 0.2], relevance=[0.5, 0.1, 0.3, 0.2], relevance_none=0.1)


def test_rerank_order_is_scored_by_descending_score_then_the_unscored_as_given():
    assert rerank_order([0.2, None, 0.9, 0.2, None, 0.5]) == [2, 5, 0, 3, 1, 4]
    assert rerank_order([None, None]) == [0, 1] and rerank_order([]) == []
    rng = random.Random(0)
    for _ in range(200):
        scores = [rng.choice([None, 0.0, 0.25, 0.5, rng.random()]) for _ in range(rng.randrange(12))]
        want = sorted(range(len(scores)), key=lambda i: (scores[i] is None, -(scores[i] or 0.0), i))
        assert rerank_order(scores) == want
        plain = [s for s in scores if s is not None]
        assert rerank_order(plain) == by_gain(plain)


def test_decision_order_is_the_order_top_k_opens_in():
    decision = decide(SCORES, 2)
    assert decision.order == by_gain(SCORES.gains) == [1, 0, 2, 3]     # equal gains: the earlier retrieved first
    assert decision.open == top_k(SCORES, 2) == [i in decision.order[:2] for i in range(4)]
    assert decision.gate_open and decision.visual_tokens is None           # no sizes given: no token count
    assert decide(SCORES).open == [True] * 4                               # no k: every memory


def test_visual_tokens_are_counted_when_every_size_is_known():
    decision = decide(SCORES, 1, sizes=SIZES)
    model = answering_model(DEFAULT_ANSWERING_MODEL)
    assert decision.visual_tokens == VisualTokens(model.name, delivery_cost([True] * 4, SIZES, model),
                                                  delivery_cost(decision.open, SIZES, model))
    assert decide(SCORES, 1, sizes=[*SIZES[:3], None]).visual_tokens is None
    empty = decide(Scores(p_vis=0.5, gains=[], relevance=[], relevance_none=1.0), 2, sizes=[])
    assert empty == Decision(empty.scores, [], True, VisualTokens(model.name, 0, 0))


def test_a_budget_opens_what_fits_at_most_k_and_needs_every_size():
    costs = [answering_model(DEFAULT_ANSWERING_MODEL).tokens(size) for size in SIZES]
    budget = costs[1] + costs[0] + costs[2]
    assert decide(SCORES, None, None, SIZES, budget=budget).open == token_budget(SCORES, budget, costs)
    capped = decide(SCORES, 1, None, SIZES, budget=budget)
    assert capped.open == [False, True, False, False] and capped.visual_tokens.delivery <= budget
    with pytest.raises(ValueError, match="every image's size"):
        decide(SCORES, 2, None, [*SIZES[:3], None], budget=budget)


def test_a_closed_gate_opens_nothing_and_says_so():
    gate = RateGate(0.5, window=10)
    assert decide(Scores(p_vis=0.9, gains=[0.1], relevance=[0.1], relevance_none=0.1), 1, gate).gate_open
    closed = decide(Scores(p_vis=0.1, gains=SCORES.gains, relevance=SCORES.relevance, relevance_none=0.1), 2, gate,
                    SIZES)
    assert not closed.gate_open and closed.open == [False] * 4 and closed.visual_tokens.delivery == 0
