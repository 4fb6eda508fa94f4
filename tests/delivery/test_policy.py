import json
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pixeltriage.delivery.cost import visual_tokens
from pixeltriage.delivery.profiles import ANSWERING_MODELS
from pixeltriage.delivery.policy import (
    RateGate,
    downsize_all,
    random_policy,
    retrieval_order,
    token_budget,
    top_k,
)
from pixeltriage.engine.types import Scores

gain_lists = st.lists(st.floats(0, 1), max_size=12)


# --- top_k -------------------------------------------------------------------------------------

def test_top_k_picks_highest_gains():
    assert top_k([0.1, 0.9, 0.3, 0.7], 2) == [False, True, False, True]
    assert top_k(Scores(p_vis=0.5, gains=[0.1, 0.9, 0.3]), 1) == [False, True, False]


def test_top_k_ties_go_to_earlier_memory():
    assert top_k([0.5, 0.5, 0.5], 2) == [True, True, False]
    assert top_k([0.2, 0.8, 0.8, 0.8], 2) == [False, True, True, False]


def test_top_k_small_sets():
    assert top_k([], 3) == []
    assert top_k([0.1, 0.2], 3) == [True, True]
    assert top_k([0.1, 0.2], 2) == [True, True]
    assert top_k([0.1, 0.2], 0) == [False, False]


def test_top_k_rejects_bad_input():
    with pytest.raises(ValueError):
        top_k([0.1], -1)
    with pytest.raises(ValueError):
        top_k([0.1, math.nan], 1)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gain_lists, st.integers(0, 14))
def test_top_k_matches_sorting(gains, k):
    d = top_k(gains, k)
    assert sum(d) == min(k, len(gains))
    opened = [g for g, o in zip(gains, d) if o]
    closed = [g for g, o in zip(gains, d) if not o]
    if opened and closed:
        assert min(opened) >= max(closed)


# --- token_budget -------------------------------------------------------------------------------

def test_token_budget_skips_what_does_not_fit_and_keeps_trying():
    gains = [0.9, 0.8, 0.1]
    costs = [1000, 300, 200]
    # 0.9 does not fit, 0.8 does, then 0.1 no longer fits
    assert token_budget(gains, 400, costs) == [False, True, False]
    assert token_budget(gains, 500, costs) == [False, True, True]
    assert token_budget(gains, 1500, costs) == [True, True, True]
    assert token_budget(gains, 0, costs) == [False, False, False]
    assert token_budget([], 100, []) == []


def test_token_budget_validates():
    with pytest.raises(ValueError):
        token_budget([0.5], 10, [1, 2])
    with pytest.raises(ValueError):
        token_budget([0.5], -1, [1])
    with pytest.raises(ValueError):
        token_budget([0.5], 10, [-1])


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 500)), max_size=10), st.integers(0, 2000))
def test_token_budget_never_exceeds_and_is_greedy(items, budget):
    gains = [g for g, _ in items]
    costs = [c for _, c in items]
    d = token_budget(gains, budget, costs)
    spent = sum(c for c, o in zip(costs, d) if o)
    assert spent <= budget
    # every closed image would not have fit after the higher-gain choices were made
    order = sorted(range(len(gains)), key=lambda i: (-gains[i], i))
    left = budget
    for i in order:
        if d[i]:
            left -= costs[i]
        else:
            assert costs[i] > left


# --- baselines ----------------------------------------------------------------------------------

def test_retrieval_order():
    assert retrieval_order(4, 2) == [True, True, False, False]
    assert retrieval_order(2, 5) == [True, True]
    assert retrieval_order(0, 1) == []
    with pytest.raises(ValueError):
        retrieval_order(3, -1)


def test_random_policy_is_seeded():
    a = random_policy(10, 3, seed=7)
    assert a == random_policy(10, 3, seed=7)
    assert sum(a) == 3
    assert random_policy(2, 5, seed=1) == [True, True]
    assert random_policy(0, 2, seed=1) == []
    draws = {tuple(random_policy(10, 3, seed=s)) for s in range(20)}
    assert len(draws) > 10


def test_downsize_all_keeps_small_and_shrinks_large():
    sizes = [(1000, 800), (56, 56), (2000, 500)]
    budget = 3 * 200
    out = downsize_all(sizes, budget)
    assert out[1] == (56, 56)  # 4 tokens, below its share of 200
    for (w, h), (ow, oh) in ((out[0], sizes[0]), (out[2], sizes[2])):
        assert w % 28 == 0 and h % 28 == 0
        assert visual_tokens((w, h)) <= 200
        assert abs(math.log((w / h) / (ow / oh))) < 0.35
    assert sum(visual_tokens(s) for s in out) <= budget


def test_downsize_all_edges():
    assert downsize_all([], 100) == []
    with pytest.raises(ValueError, match="spends at least"):
        downsize_all([(500, 500)] * 10, 30)  # 3 tokens each < the 4-token minimum
    with pytest.raises(ValueError):
        downsize_all([(500, 500)], -5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 4000)), min_size=1, max_size=10)
       .filter(lambda s: all(max(w, h) / min(w, h) <= 150 for w, h in s)),
       st.integers(0, 6000), st.sampled_from(sorted(n for n, m in ANSWERING_MODELS.items() if n.startswith("qwen"))))
def test_downsize_all_total_within_budget(sizes, budget, model):
    rule = ANSWERING_MODELS[model].rule
    if budget // len(sizes) < rule.min_tokens:
        with pytest.raises(ValueError):
            downsize_all(sizes, budget, model)
        return
    out = downsize_all(sizes, budget, model)
    share = budget // len(sizes)
    assert len(out) == len(sizes)
    for size, new in zip(sizes, out):
        if visual_tokens(size, model) <= share:
            assert new == size
        else:
            assert new[0] % rule.factor == 0 and new[1] % rule.factor == 0
            # the processor keeps a size it already produced
            assert rule.resized(new) == new
            assert visual_tokens(new, model) <= share
    assert sum(visual_tokens(s, model) for s in out) <= budget


def test_downsize_tiny_and_elongated_images():
    # sides below one patch: the processor up-sizes them, so the result must be a size it keeps
    out = downsize_all([(1, 1), (1, 1), (1, 1), (2, 3)], 256, "qwen3.5")
    assert out[:3] == [(1, 1)] * 3
    assert ANSWERING_MODELS["qwen3.5"].rule.resized(out[3]) == out[3] and visual_tokens(out[3], "qwen3.5") <= 64
    out = downsize_all([(3000, 20)], 10)
    assert visual_tokens(out[0]) <= 10 and out[0][0] > out[0][1]


def test_downsize_needs_a_resize_grid():
    with pytest.raises(ValueError, match="internvl3 counts tokens with InternVLRule"):
        downsize_all([(640, 480)], 1000, "internvl3")


def test_downsize_uses_most_of_the_share():
    # a moderate aspect ratio lands within a grid step of the share
    out = downsize_all([(1920, 1080)] * 4, 4 * 300)
    t = visual_tokens(out[0])
    assert 250 <= t <= 300


# --- RateGate -----------------------------------------------------------------------------------

def _reference_opens(history, p, rate, window):
    kept = history[-(window - 1):] if window > 1 else []
    r = max(1, math.ceil(round(rate * (len(kept) + 1), 9)))
    return sum(v > p for v in kept) < r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, 1.0]) | st.floats(0, 1),
                max_size=60),
       st.sampled_from([0.1, 0.3, 0.5, 0.7, 1.0]), st.integers(1, 12))
def test_rate_gate_matches_rank_rule(stream, rate, window):
    gate = RateGate(rate, window)
    history = []
    for p in stream:
        expected = _reference_opens(history, p, rate, window)
        assert gate.threshold <= p if expected else gate.threshold > p
        assert gate.opens(p) == expected
        history.append(p)
    assert len(gate) == min(len(stream), window)


def test_rate_gate_opens_about_rate_of_a_stream():
    rng = random.Random(0)
    values = [rng.random() for _ in range(4000)]
    gate = RateGate(0.3, window=500).calibrate(values[:500])
    opened = sum(gate.opens(v) for v in values[500:])
    assert abs(opened / 3500 - 0.3) < 0.03


def test_rate_gate_cold_start_and_ties():
    gate = RateGate(0.3, window=100)
    assert gate.threshold == 0.0
    assert gate.opens(0.01)  # first question: ranked against itself only
    assert not gate.opens(0.005)  # m=2, r=1: 0.01 is greater
    for _ in range(10):
        assert gate.opens(0.5)  # ties open; 0.5 is the top value
    assert RateGate(1.0, 5).opens(0.0)
    one = RateGate(0.1, window=1)
    assert all(one.opens(v) for v in (0.9, 0.1, 0.0))


def test_rate_gate_calibrate_sets_threshold():
    gate = RateGate(0.3, window=10).calibrate([i / 10 for i in range(10)])
    # S = 0.1..0.9 (0.0 leaves when the next joins), m = 10, r = 3 -> third largest of S
    assert gate.threshold == pytest.approx(0.7)
    assert gate.opens(0.7) and not gate.opens(0.65)
    gate.calibrate([0.2] * 50)
    assert len(gate) == 10 and gate.threshold == 0.2


def test_rate_gate_state_round_trip():
    rng = random.Random(1)
    gate = RateGate(0.4, window=20)
    for _ in range(37):
        gate.opens(rng.random())
    state = json.loads(json.dumps(gate.state_dict()))
    twin = RateGate.from_state_dict(state)
    assert twin.threshold == gate.threshold
    for _ in range(30):
        p = rng.random()
        assert twin.opens(p) == gate.opens(p)
    with pytest.raises(ValueError):
        RateGate.from_state_dict({"rate": 0.4, "window": 2, "recent": [0.1, 0.2, 0.3]})
    with pytest.raises(ValueError):
        RateGate.from_state_dict({"rate": 0.4, "window": 2})


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.01, math.nan])
def test_rate_gate_rejects_bad_rate(rate):
    with pytest.raises(ValueError):
        RateGate(rate)


def test_rate_gate_rejects_bad_values():
    with pytest.raises(ValueError):
        RateGate(0.5, window=0)
    gate = RateGate(0.5)
    for bad in (math.nan, math.inf, -0.01, 1.5):
        with pytest.raises(ValueError):
            gate.opens(bad)
    with pytest.raises(ValueError):
        gate.calibrate([0.5, math.nan])
    assert len(gate) == 0
