"""The batcher in-process, with a stand-in forward: batches within the token budget (a question never split, one
larger than the budget alone), one batch prepared ahead, priority, a failing forward retried per question,
deadlines, cancellation, admission and close. The HTTP tests run the same code behind a real server.

A test that needs the queue at some point (a batch prepared ahead, the worker holding a partial batch) waits for
that state with `Batcher.wait_until`, never for time to pass; the stand-in forward holds while its gate is
cleared."""
import threading
import time
from concurrent.futures import CancelledError

import pytest

from pixeltriage.engine.types import Scores
from pixeltriage.errors import DeadlineExceededError, OverloadedError, ServiceUnavailableError
from pixeltriage.serve.batcher import Batcher


class FakeState:
    def __init__(self, name: str, tokens: int, poison: bool = False):
        self.name, self.num_tokens, self.poison = name, tokens, poison


class Forward:
    """Records each forward's states; holds the next forward while `gate` is cleared; fails on a poisoned state."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, states):
        self.entered.set()
        assert self.gate.wait(30)
        self.batches.append([s.name for s in states])
        if any(s.poison for s in states):
            raise RuntimeError("a bad state")
        return [Scores(p_vis=0.5, gains=[float(s.num_tokens)], relevance=[0.5], relevance_none=0.5) for s in states]


def prepared(name, tokens, poison=False, log=None):
    def prepare():
        if log is not None:
            log.append(name)
        return FakeState(name, tokens, poison), name
    return prepare


@pytest.fixture
def forward():
    return Forward()


def make(forward, **kw):
    b = Batcher(forward, **{"max_batch_tokens": 100, "max_queued": 16, "preprocess_threads": 2, **kw})
    b.start()
    return b


def far():
    return time.monotonic() + 30


WAIT = 10.0     # seconds any awaited batcher state may take before the test fails (TimeoutError naming the state)


def until_past(moment: float) -> None:
    """Return once time.monotonic() is past `moment` (a deadline the test lets pass)."""
    while (left := moment - time.monotonic()) >= 0:
        time.sleep(left + 1e-3)


def closing(batcher: Batcher, *reason: str) -> threading.Thread:
    """`batcher.close(*reason)` on its own thread (it waits for the forward in progress)."""
    closer = threading.Thread(target=batcher.close, args=reason)
    closer.start()
    return closer


def test_batches_fill_the_budget_never_split_a_question_and_run_a_large_one_alone(forward):
    b = make(forward)
    forward.gate.clear()
    first = b.submit([prepared("warm", 10)], far())
    assert forward.entered.wait(10)                        # the worker is busy: what follows queues up
    sizes = (("a", 60), ("b", 30), ("c", 20), ("big", 150), ("d", 5))
    futures = b.submit([prepared(name, tokens) for name, tokens in sizes], far())
    # the preparation threads stop once a whole budget is ready ahead: a and b at least
    b.wait_until(lambda q: q.idle_preparers == 2 and q.ready_tokens >= 100, WAIT)
    forward.gate.set()
    results = [f.result(10) for f in first + futures]
    assert [r.meta for r in results] == ["warm", "a", "b", "c", "big", "d"]
    assert forward.batches[:2] == [["warm"], ["a", "b"]]   # a + b fill the budget; c (20 more) would pass it
    tokens = dict(sizes)
    assert all(sum(tokens[n] for n in batch) <= 100 or batch == ["big"] for batch in forward.batches[1:])
    assert ["big"] in forward.batches and sorted(sum(forward.batches, [])) == sorted(["warm", *tokens])
    assert results[1].timing.batch_questions == len(next(x for x in forward.batches if "a" in x))
    b.close()


def test_one_batch_is_prepared_ahead_and_no_more(forward):
    b = make(forward, max_batch_tokens=50, preprocess_threads=1)
    forward.gate.clear()
    log = []
    futures = b.submit([prepared(f"q{i}", 50, log=log) for i in range(6)], far())
    assert forward.entered.wait(10)                        # one runs, the next fills the budget ahead; nothing more
    state = b.wait_until(lambda q: q.idle_preparers == 1 and q.ready_tokens >= 50, WAIT)
    assert sorted(log) == ["q0", "q1"]
    assert (state.running, state.ready, state.pending) == (1, 1, 4)
    forward.gate.set()
    assert [f.result(10).meta for f in futures] == [f"q{i}" for i in range(6)]
    b.close()


def test_priority_goes_first(forward):
    b = make(forward, max_batch_tokens=10, preprocess_threads=1)
    forward.gate.clear()
    blocker = b.submit([prepared("blocker", 10)], far())
    assert forward.entered.wait(10)
    # the one preparation thread is held inside a question while low, then high, are admitted: both wait together
    release = threading.Event()

    def held():
        assert release.wait(10)
        return FakeState("held", 1), "held"

    holder = b.submit([held], far())
    b.wait_until(lambda q: q.preparing == 1, WAIT)
    low = b.submit([prepared("low", 10)], far())
    high = b.submit([prepared("high", 10)], far(), priority=5)
    release.set()
    state = b.wait_until(lambda q: q.idle_preparers == 1 and q.ready_tokens >= 10, WAIT)
    assert (state.ready, state.pending) == (2, 1)          # held and the next by priority; one left waiting
    forward.gate.set()
    for f in blocker + holder + low + high:
        f.result(10)
    assert forward.batches.index(["high"]) < forward.batches.index(["low"])
    b.close()


def test_a_failing_forward_is_retried_per_question_so_only_the_bad_one_fails(forward):
    b = make(forward)
    forward.gate.clear()
    first = b.submit([prepared("warm", 10)], far())
    assert forward.entered.wait(10)
    futures = b.submit([prepared("a", 10), prepared("bad", 10, poison=True), prepared("c", 10)], far())
    b.wait_until(lambda q: q.ready == 3, WAIT)             # all three wait for the next forward: one batch
    forward.gate.set()
    first[0].result(10)
    assert futures[0].result(10).meta == "a" and futures[2].result(10).meta == "c"
    with pytest.raises(RuntimeError, match="a bad state"):
        futures[1].result(10)
    assert ["a", "bad", "c"] in forward.batches and ["bad"] in forward.batches
    b.close()


def test_a_failing_prepare_fails_its_question_only(forward):
    b = make(forward)

    def broken():
        raise ValueError("undecodable")

    good, bad = b.submit([prepared("good", 10), broken], far())
    assert good.result(10).meta == "good"
    with pytest.raises(ValueError, match="undecodable"):
        bad.result(10)
    assert b.wait_idle(10) and b.admitted == 0
    b.close()


def test_deadline_cancel_admission_and_close(forward):
    b = make(forward, max_queued=3)
    forward.gate.clear()
    running = b.submit([prepared("running", 10)], far())
    assert forward.entered.wait(10)
    late_deadline = time.monotonic() + 0.05
    late = b.submit([prepared("late", 10)], late_deadline)
    waiting = b.submit([prepared("waiting", 10)], far())
    with pytest.raises(OverloadedError) as e:
        b.submit([prepared("x", 1)], far())
    assert 1 <= e.value.retry_after <= 60
    assert waiting[0].cancel()                             # a cancelled question frees its slot at once
    assert b.admitted == 2 and b.free == 1
    until_past(late_deadline)
    forward.gate.set()
    running[0].result(10)
    with pytest.raises(DeadlineExceededError):
        late[0].result(10)
    with pytest.raises(CancelledError):
        waiting[0].result(0)
    assert "waiting" not in sum(forward.batches, [])
    assert b.wait_idle(10) and b.admitted == 0
    forward.gate.clear()
    forward.entered.clear()
    in_forward = b.submit([prepared("in forward", 10)], far())
    assert forward.entered.wait(10)
    queued = b.submit([prepared("queued", 10)], far())
    closer = closing(b)
    with pytest.raises(ServiceUnavailableError):           # failed by close while the forward still holds
        queued[0].result(10)
    with pytest.raises(ServiceUnavailableError):
        b.submit([prepared("after", 1)], far())
    assert closer.is_alive()                               # close waits for the forward in progress
    forward.gate.set()
    closer.join(30)
    assert not closer.is_alive() and in_forward[0].result(10).meta == "in forward"


def test_max_wait_lets_an_idle_worker_fill_a_partial_batch(forward):
    b = make(forward, max_wait_ms=20_000)                  # ends early: the second question fills the budget
    first = b.submit([prepared("a", 10)], far())
    b.wait_until(lambda q: q.taken == 1, WAIT)            # the worker holds a partial batch and waits
    second = b.submit([prepared("b", 90)], far())
    first[0].result(10), second[0].result(10)
    assert forward.batches == [["a", "b"]]
    b.close()


def test_close_twice_and_after_a_graceful_timeout_fails_each_question_once(forward):
    """SIGTERM's drain closes the batcher at its timeout and the service closes it again: the second close finds
    nothing left to fail (it used to fail finished futures again, and the shutdown then crashed)."""
    b = make(forward, max_queued=8)
    forward.gate.clear()
    in_forward = b.submit([prepared("in forward", 10)], far())
    assert forward.entered.wait(10)
    queued = b.submit([prepared(f"q{i}", 10) for i in range(4)], far())
    closer = closing(b, "graceful timeout")
    for future in queued:                                  # failed by the first close, the forward still held
        with pytest.raises(ServiceUnavailableError, match="graceful timeout"):
            future.result(10)
    forward.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    b.close()                                              # idempotent: no RuntimeError, nothing failed twice
    assert in_forward[0].result(10).meta == "in forward" and b.admitted == 0


def test_close_while_the_worker_waits_for_a_fuller_batch(forward):
    """With --max-wait-ms the worker holds a partial batch and waits; a close meanwhile takes the queued questions
    away from it under the lock, so no question is both failed by close and run by the worker."""
    b = make(forward, max_wait_ms=20_000)
    first = b.submit([prepared("waits", 10)], far())
    b.wait_until(lambda q: q.taken == 1, WAIT)            # the worker took it and waits for more
    queued = b.submit([prepared(f"q{i}", 10) for i in range(3)], far())
    b.close()
    first[0].result(10)                                    # the held batch still runs
    outcomes = []
    for future in queued:
        try:
            future.result(10)
            outcomes.append("scored")
        except ServiceUnavailableError:
            outcomes.append("refused")
    assert len(outcomes) == 3 and b.admitted == 0
    assert not b.alive                                     # the threads stopped, none of them by an error


def test_an_idle_worker_does_not_hold_back_the_preparation_threads(forward):
    """Two questions reach an idle worker at once: the worker prepares the first and a preparation thread
    another at the same time (each preparation waits for a second one to be running: serial preparation would
    break the barrier)."""
    together = threading.Barrier(2, timeout=10)

    def prepare_with(name):
        def prepare():
            together.wait()                  # a BrokenBarrierError fails the question if no second one runs
            return FakeState(name, 10), name
        return prepare

    batcher = Batcher(forward, max_batch_tokens=100, preprocess_threads=2)
    batcher.start()
    try:
        batcher.wait_until(lambda q: q.worker_idle and q.idle_preparers == 2, WAIT)   # all waiting for work
        futures = batcher.submit([prepare_with("a"), prepare_with("b")], deadline=time.monotonic() + 60)
        assert [f.result(30).meta for f in futures] == ["a", "b"]
    finally:
        batcher.close()
