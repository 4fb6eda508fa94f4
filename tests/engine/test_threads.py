"""The forward at several torch thread counts scores as at one thread.

The suite's parallel workers run torch on their share of the cores (tests/conftest.py: one thread each on a 2-core
machine), so most tests take every kernel's one-thread schedule; the C kernels split their work among OpenMP threads
by heads, query blocks and chunks, and oneDNN's products by rows and columns. Here the whole forward runs at 1, 2 and
3 threads, float32 and bfloat16: the scores agree within the answers' tolerance for their dtype
(bench/serve_load.ANSWER_TOLERANCES: 1e-5 float32; bf16 2^-9, half a bf16 step at 1.0, for products whose sums are
split differently), the C kernels ran at every count, and no kernel declined at a count a call it took at one thread
(the tiny checkpoint's 16-wide vision heads are declined by the bf16 vision kernel at every count: SDPA's)."""
import pytest
import torch
from reference import episode

from pixeltriage import Scorer
from pixeltriage.bench.gpu_check import max_diff
from pixeltriage.bench.serve_load import ANSWER_TOLERANCES
from pixeltriage.kernels import native, registry

THREADS = (1, 2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_forward_at_each_thread_count_scores_as_at_one(tiny_checkpoint, dtype):
    question, memories = episode()
    scorer = Scorer.load(tiny_checkpoint, dtype=dtype)
    before = torch.get_num_threads()
    scores, records = {}, {}
    try:
        for n in THREADS:
            torch.set_num_threads(n)
            scorer.score(question, memories)                    # this count's measured choices (kernels.tuning)
            with registry.recording() as record:
                scores[n] = scorer.score(question, memories)
            records[n] = record.snapshot()
    finally:
        torch.set_num_threads(before)
    tolerance = ANSWER_TOLERANCES[str(dtype).removeprefix("torch.")]
    for n in THREADS[1:]:
        assert max_diff(scores[n], scores[1]) <= tolerance, (n, scores[n], scores[1])
    for n, record in records.items():
        assert set(record.declines) == set(records[1].declines), (n, record.declines, records[1].declines)
        if native.available():
            ran_c = sorted(kernel for (_, kernel), calls in record.calls.items() if kernel.startswith("native C"))
            assert ran_c, (n, record.calls)
