"""CPU benchmarks (pytest-benchmark): the engine vs transformers' eager forward on the same packed state.

Skipped in `make test`; run with `make bench` (bench-small by default; PIXELTRIAGE_BENCH_PRESET=2b for the 2b
shape). Compare the two groups' medians in one run: that ratio is the speed-up. No timing is asserted.
"""
import os

import pytest
import torch

from pixeltriage.bench.transformers_baseline import force_transformers_torch_path, transformers_hidden
from pixeltriage.bench.workloads import packed_episode
from pixeltriage.engine.scorer import Scorer
from pixeltriage.weights.demo import demo_checkpoint

pytestmark = pytest.mark.bench
PRESET = os.environ.get("PIXELTRIAGE_BENCH_PRESET", "bench-small")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="module")
def checkpoint():
    return demo_checkpoint(PRESET)


@pytest.fixture(scope="module", params=sorted(DTYPES))
def setup(request, checkpoint):
    scorer = Scorer.load(checkpoint, dtype=DTYPES[request.param])
    state = packed_episode(scorer.packer).state
    return request.param, scorer, state


def test_engine_score(benchmark, setup):
    name, scorer, state = setup
    benchmark.group = f"{PRESET}-{name}"
    benchmark.pedantic(scorer.score_states, args=([state],), rounds=5, warmup_rounds=1)


def test_engine_score_without_native_kernels(benchmark, setup, monkeypatch):
    """The same forward on the torch implementations the C kernels replace (as on a machine without a compiler)."""
    from pixeltriage.kernels import native

    name, scorer, state = setup
    monkeypatch.setattr(native, "library", lambda: None)
    benchmark.group = f"{PRESET}-{name}"
    benchmark.pedantic(scorer.score_states, args=([state],), rounds=5, warmup_rounds=1)


def test_transformers_forward(benchmark, setup, checkpoint):
    from transformers import Qwen3_5ForConditionalGeneration

    name, _, state = setup
    force_transformers_torch_path()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=DTYPES[name]).eval()
    benchmark.group = f"{PRESET}-{name}"
    benchmark.pedantic(transformers_hidden, args=(model, state), rounds=3, warmup_rounds=1)
