"""The dynamic batcher: plain threads and queues, no asyncio (the ASGI layer awaits the futures it returns).

`submit` admits a request's questions, all or none, while fewer than `max_queued` questions are admitted (waiting,
preparing, ready or in a forward); past that it raises OverloadedError with a Retry-After estimate. A small pool of
preparation threads runs each question's `prepare` (base64 and image decoding, thumbnails, tokenizing,
`Scorer.pack`) while the current forward runs, and stops preparing once a whole batch budget of ready state tokens
waits: one batch is prepared ahead, and no more (prepared states hold every image's patches).

One model worker thread owns every forward. The moment it is idle it takes ready questions, higher priority
first, then in admission order, up to `max_batch_tokens` state tokens (a question's memories are one state and are
never split; a question larger than the budget runs alone); only when it holds a partial batch does it wait, up to
`max_wait_ms`, for more. Idle with nothing ready, it prepares the next admitted question itself. A failing forward
is retried one question at a time, so that only the question that fails fails. A question whose deadline passes
before its forward begins fails with DeadlineExceededError; a future its caller cancels (deadline, disconnect) is
skipped wherever it waits, and its slot is freed at once.

`queue_state()` tells where the admitted questions are and what the threads do; `wait_until(condition, timeout)`
blocks until that state meets a condition (the drain's "every admitted question answered", or a point a caller must
act at: a batch prepared ahead, the worker holding a partial batch).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pixeltriage.errors import DeadlineExceededError, OverloadedError, ServiceUnavailableError

if TYPE_CHECKING:
    from pixeltriage.engine.state import State
    from pixeltriage.engine.types import Scores

log = logging.getLogger(__name__)

Prepare = Callable[[], "tuple[State, Any]"]   # -> (the question's state, anything the caller wants back with it)
MAX_RETRY_AFTER = 60


@dataclass(frozen=True)
class Timing:
    """Where one question's time went, in seconds."""

    queue: float            # admitted -> its forward began, preprocessing excluded
    preprocess: float
    forward: float          # its forward (shared with the batch; its own retry when the batch failed)
    batch_questions: int
    batch_tokens: int


@dataclass(frozen=True)
class Scored:
    """A question's result: its scores, what its `prepare` returned besides the state, its state length, timing."""

    scores: "Scores"
    meta: Any
    tokens: int
    timing: Timing


class Observer:
    """What the batcher reports (the service's metrics); the defaults do nothing."""

    def batch(self, questions: int, tokens: int, seconds: float) -> None: ...

    def question(self, timing: Timing) -> None: ...

    def queue(self, waiting: int, running: int) -> None: ...

    def forward_failed(self) -> None: ...


@dataclass(frozen=True)
class QueueState:
    """Where the admitted questions are at one moment, and what the threads are doing (`Batcher.queue_state`)."""

    admitted: int           # every question holding a slot, wherever it is
    pending: int            # admitted, its preparation not begun
    preparing: int          # in its `prepare`, on a preparation thread or the worker
    ready: int              # prepared, waiting for a forward
    ready_tokens: int       # their state tokens
    taken: int              # taken by the worker for its next forward while it waits (max_wait_ms) for more
    running: int            # in a forward
    idle_preparers: int     # preparation threads waiting for work (nothing to prepare, or a batch ready ahead)
    worker_idle: bool       # the worker waits with nothing ready or admitted


class _Job:
    __slots__ = ("seq", "priority", "deadline", "prepare", "future", "state", "meta", "tokens", "where",
                 "admitted", "prep_start", "prep_end")

    def __init__(self, seq: int, priority: int, deadline: float, prepare: Prepare, now: float):
        self.seq, self.priority, self.deadline, self.prepare = seq, priority, deadline, prepare
        self.future: Future = Future()
        self.state, self.meta, self.tokens = None, None, 0
        self.where = "pending"           # pending -> preparing -> ready -> taken -> running -> None (finished)
        self.admitted = self.prep_start = self.prep_end = now

    def order(self) -> tuple[int, int, "_Job"]:
        return (-self.priority, self.seq, self)


class Batcher:
    """Admission, preparation threads and the model worker around `forward` (`Scorer.score_states`)."""

    def __init__(self, forward: Callable[[list["State"]], list["Scores"]], *, max_batch_tokens: int,
                 max_wait_ms: float = 0.0, max_queued: int = 256, preprocess_threads: int = 2,
                 observer: Observer | None = None):
        if max_batch_tokens < 1 or max_queued < 1 or preprocess_threads < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_tokens, max_queued and preprocess_threads must be >= 1, max_wait_ms >= 0")
        self.forward = forward
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_queued = max_queued
        self.observer = observer or Observer()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)   # the worker and the preparation threads wait on it for work
        self._watch = threading.Condition(lock)  # callers of wait_until wait on it (never wakes the threads)
        self._pending: list = []          # heap of _Job.order(): admitted, not yet preparing
        self._ready: list = []            # heap of _Job.order(): prepared, not yet in a forward
        self._ready_tokens = 0
        self._dead = 0                    # cancelled jobs still sitting in a heap
        self._admitted = 0
        self._running = 0
        self._preparing = 0
        self._idle_preparers = 0
        self._seq = itertools.count()
        self._seconds_per_question = 0.0  # moving average of forward time per question, for Retry-After
        self._threads: list[threading.Thread] = []
        self._preprocess_threads = preprocess_threads
        self._accepting = False
        self._closed = False
        self._close_reason = ""             # the first close's: also what a question prepared after it fails with
        self._worker_idle = False           # waiting with nothing ready or admitted

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker and the preparation threads and begin admitting."""
        with self._cond:
            if self._threads:
                return
            self._threads = [threading.Thread(target=self._work, name="pixeltriage-forward", daemon=True)]
            self._threads += [threading.Thread(target=self._prepare_loop, name=f"pixeltriage-prepare-{i}",
                                               daemon=True) for i in range(self._preprocess_threads)]
            for t in self._threads:
                t.start()
            self._accepting = True

    def stop_admitting(self) -> None:
        """From now on `submit` raises ServiceUnavailableError; admitted questions are still scored."""
        with self._cond:
            self._accepting = False

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every admitted question is answered; False if some were still admitted after `timeout` s."""
        with self._watch:
            return self._watch.wait_for(lambda: self._admitted == 0, timeout)

    def queue_state(self) -> QueueState:
        """Where the admitted questions are now, and what the threads are doing."""
        with self._cond:
            return self._queue_state()

    def wait_until(self, condition: Callable[[QueueState], bool], timeout: float) -> QueueState:
        """Block until `condition(queue_state)` holds, checked again at every change of the queue and whenever a
        thread starts waiting for work; -> the state that met it. TimeoutError naming the last state after
        `timeout` s."""
        with self._watch:
            met = self._watch.wait_for(lambda: condition(self._queue_state()), timeout)
            state = self._queue_state()
        if not met:
            raise TimeoutError(f"the batcher's queue did not reach the awaited state within {timeout:g} s; it is "
                               f"{state}")
        return state

    def close(self, reason: str = "the service is shutting down", join_timeout: float = 10.0) -> None:
        """Stop admitting, fail every question not yet in a forward with ServiceUnavailableError(reason), let the
        running forward finish, stop the threads."""
        with self._cond:
            if not self._closed:
                self._close_reason = reason
            self._accepting, self._closed = False, True
            # taken out of the queues under the lock: neither the worker nor a second close can reach them again
            waiting = [entry[-1] for entry in self._pending + self._ready if entry[-1].where in ("pending", "ready")]
            self._pending, self._ready = [], []
            self._dead = 0
            self._changed()
        for job in waiting:
            self._fail(job, ServiceUnavailableError(reason, 503))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(join_timeout)

    # -- admission -----------------------------------------------------------------------------------------------
    def submit(self, prepares: Sequence[Prepare], deadline: float, priority: int = 0) -> list[Future]:
        """Admit one request's questions (all or none) -> one Future of `Scored` per question, in order.

        deadline: `time.monotonic()` by which each question's forward must begin. Raises OverloadedError when the
        queue lacks room for them all, ServiceUnavailableError when not admitting."""
        now = time.monotonic()
        with self._cond:
            if not self._accepting:
                raise ServiceUnavailableError("the service is not admitting requests (loading or shutting down)",
                                              503)
            if self._admitted + len(prepares) > self.max_queued:
                raise OverloadedError(f"the queue is full ({self._admitted} of {self.max_queued} questions "
                                      f"admitted; this request has {len(prepares)})", self.retry_after())
            jobs = [_Job(next(self._seq), priority, deadline, p, now) for p in prepares]
            for job in jobs:
                job.future.add_done_callback(lambda _, job=job: self._finished(job))
                heapq.heappush(self._pending, job.order())
            self._admitted += len(jobs)
            self._report_queue()
            self._changed()
        return [job.future for job in jobs]

    @property
    def admitted(self) -> int:
        return self._admitted

    @property
    def free(self) -> int:
        """Questions the queue can still admit."""
        return self.max_queued - self._admitted

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive(self) -> bool:
        """Whether the worker and the preparation threads are all running (a stopped worker scores nothing)."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained enough to admit again: its questions at the recent forward
        time per question, 1 to MAX_RETRY_AFTER."""
        return max(1, min(MAX_RETRY_AFTER, math.ceil(self._admitted * self._seconds_per_question)))

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _finished(self, job: _Job) -> None:
        """Every future's done callback (a result, an error or a cancel): free its slot and what it holds."""
        with self._cond:
            where, job.where = job.where, None
            if where is None:
                return
            self._admitted -= 1
            if where == "ready":
                self._ready_tokens -= job.tokens
            elif where == "running":
                self._running -= 1
            elif where == "preparing":
                self._preparing -= 1
            if where in ("pending", "ready"):
                self._dead += 1
                if self._dead > self.max_queued:
                    self._compact()
            job.prepare = job.state = job.meta = None
            self._report_queue()
            self._changed()

    def _compact(self) -> None:
        """Drop cancelled entries from the heaps (they are otherwise skipped when reached)."""
        self._pending = [e for e in self._pending if e[-1].where == "pending"]
        self._ready = [e for e in self._ready if e[-1].where == "ready"]
        heapq.heapify(self._pending)
        heapq.heapify(self._ready)
        self._dead = 0

    def _queue_state(self) -> QueueState:
        """Lock held. Every admitted job is in exactly one of pending, preparing, ready, taken and running, so the
        taken ones (out of the ready heap, not yet running) are what the others leave."""
        pending = sum(1 for entry in self._pending if entry[-1].where == "pending")
        ready = sum(1 for entry in self._ready if entry[-1].where == "ready")
        taken = self._admitted - pending - self._preparing - ready - self._running
        return QueueState(admitted=self._admitted, pending=pending, preparing=self._preparing, ready=ready,
                          ready_tokens=self._ready_tokens, taken=taken, running=self._running,
                          idle_preparers=self._idle_preparers, worker_idle=self._worker_idle)

    def _changed(self) -> None:
        """Wake the threads waiting for work and the callers of wait_until. Lock held."""
        self._cond.notify_all()
        self._watch.notify_all()

    def _report_queue(self) -> None:
        self.observer.queue(self._admitted - self._running, self._running)

    def _fail(self, job: _Job, error: BaseException) -> None:
        """Fail a job that no forward holds; one already finished (answered, failed or cancelled) is left as it is."""
        if job.future.done():
            return
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(error)

    def _expired(self, job: _Job, now: float) -> bool:
        if now <= job.deadline:
            return False
        self._fail(job, DeadlineExceededError(f"the request passed its deadline after "
                                              f"{now - job.admitted:.3f} s in the queue; it was dropped", 504))
        return True

    # -- preparation ---------------------------------------------------------------------------------------------
    def _prepare_loop(self) -> None:
        while (job := self._next_to_prepare()) is not None:
            self._prepare(job)

    def _prepare(self, job: _Job) -> None:
        """Run a job's `prepare` (on whichever thread took it) and queue its state as ready."""
        try:
            state, meta = job.prepare()
        except Exception as e:                     # the request's own fault (a bad image, a state too long): its own
            self._fail(job, e)
            return
        with self._cond:
            job.prepare, job.prep_end = None, time.monotonic()
            if job.where != "preparing":           # cancelled meanwhile
                return
            if self._closed:
                self._fail(job, ServiceUnavailableError(self._close_reason, 503))
                return
            job.state, job.meta, job.tokens, job.where = state, meta, state.num_tokens, "ready"
            self._preparing -= 1
            heapq.heappush(self._ready, job.order())
            self._ready_tokens += job.tokens
            self._changed()

    def _next_to_prepare(self) -> _Job | None:
        with self._cond:
            while True:
                # ahead of the worker only: an idle worker prepares the next question itself
                while not self._closed and not (self._pending and self._ready_tokens < self.max_batch_tokens
                                                and not self._worker_idle):
                    self._idle_preparers += 1
                    self._watch.notify_all()
                    self._cond.wait()
                    self._idle_preparers -= 1
                if self._closed:
                    return None
                job = self._pop_pending()
                if job is not None:
                    return job

    def _pop_pending(self) -> _Job | None:
        """The next admitted job still wanted, marked preparing (expired ones failed on the way); None if none.
        Call with the lock held."""
        while self._pending:
            job = heapq.heappop(self._pending)[-1]
            if job.where != "pending":
                self._dead -= 1
                continue
            job.where, job.prep_start = "preparing", time.monotonic()
            self._preparing += 1
            self._watch.notify_all()
            if not self._expired(job, job.prep_start):
                return job
        return None

    # -- the model worker ----------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            group = self._next_group()
            if group is None:
                return
            try:
                self._run(group)
            except BaseException as e:             # never leave a caller waiting, never let the worker die
                log.exception("forward worker: unexpected error")
                for job in group:
                    if not job.future.done():
                        job.future.set_exception(e)

    def _next_group(self) -> list[_Job] | None:
        """The next forward's questions, marked running (cancelled ones dropped); None once closed. Idle with
        nothing ready, the worker prepares the next admitted question itself rather than wait for a preparation
        thread: a state packed on another thread costs its first forward more (the pixels cross cores; measured
        +10-20 ms per 10-memory question on the tiny preset here), so a lone question takes the in-process path."""
        while True:
            with self._cond:
                if self._closed:
                    return None
                group: list[_Job] = []
                tokens = self._take_ready(group, 0)
                if group:
                    return self._start(group, tokens)
                job = self._pop_pending()
                if job is None:
                    self._worker_idle = True
                    self._watch.notify_all()
                    self._cond.wait()
                    self._worker_idle = False
                    # preparation threads woken with it saw the worker idle and slept again: the rest of a
                    # several-question request would wait for the first question's preparation
                    self._changed()
                    continue
            self._prepare(job)

    def _start(self, group: list[_Job], tokens: int) -> list[_Job]:
        """Wait for more (max_wait, when the batch is partial), then mark the group running. Lock held."""
        if self.max_wait and tokens < self.max_batch_tokens:
            end = time.monotonic() + self.max_wait
            self._watch.notify_all()               # a wait_until may be waiting for this partial batch
            while tokens < self.max_batch_tokens and not self._closed and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
                tokens = self._take_ready(group, tokens)
        running = []
        for job in group:
            # a job cancelled meanwhile is left to its done callback (_finished), which frees its slot
            if job.where == "taken" and job.future.set_running_or_notify_cancel():
                job.where = "running"
                running.append(job)
        self._running += len(running)
        self._report_queue()
        self._changed()                            # the preparation threads may go on
        return running

    def _take_ready(self, group: list[_Job], tokens: int) -> int:
        """Move ready jobs onto `group` while they fit the budget (the first always does); the group's tokens."""
        now = time.monotonic()
        while self._ready and tokens < self.max_batch_tokens:
            job = self._ready[0][-1]
            if job.where != "ready":
                heapq.heappop(self._ready)
                self._dead -= 1
                continue
            if group and tokens + job.tokens > self.max_batch_tokens:
                break
            heapq.heappop(self._ready)
            self._ready_tokens -= job.tokens
            job.where = "taken"
            if self._expired(job, now):
                continue
            group.append(job)
            tokens += job.tokens
        return tokens

    def _run(self, group: list[_Job]) -> None:
        if not group:
            return
        tokens = sum(job.tokens for job in group)
        start = time.monotonic()
        try:
            results = self.forward([job.state for job in group])
        except Exception as e:
            seconds = time.monotonic() - start
            self.observer.forward_failed()
            if len(group) == 1:
                log.warning("forward of 1 question (%d tokens) failed: %s", tokens, type(e).__name__)
                group[0].future.set_exception(e)
                return
            log.warning("forward of %d questions (%d tokens) failed (%s); retrying them one at a time",
                        len(group), tokens, type(e).__name__)
            self.observer.batch(len(group), tokens, seconds)
            for job in group:
                self._run_alone(job)
            return
        seconds = time.monotonic() - start
        self.observer.batch(len(group), tokens, seconds)
        self._learn(seconds, len(group))
        for job, scores in zip(group, results):
            self._deliver(job, scores, start, seconds, len(group), tokens)

    def _run_alone(self, job: _Job) -> None:
        start = time.monotonic()
        try:
            scores = self.forward([job.state])[0]
        except Exception as e:
            self.observer.forward_failed()
            job.future.set_exception(e)
            return
        seconds = time.monotonic() - start
        self.observer.batch(1, job.tokens, seconds)
        self._deliver(job, scores, start, seconds, 1, job.tokens)

    def _deliver(self, job: _Job, scores, start: float, seconds: float, questions: int, tokens: int) -> None:
        preprocess = job.prep_end - job.prep_start
        timing = Timing(queue=max(0.0, start - job.admitted - preprocess), preprocess=preprocess, forward=seconds,
                        batch_questions=questions, batch_tokens=tokens)
        self.observer.question(timing)
        job.future.set_result(Scored(scores, job.meta, job.tokens, timing))

    def _learn(self, seconds: float, questions: int) -> None:
        per_question = seconds / questions
        previous = self._seconds_per_question
        self._seconds_per_question = per_question if previous == 0 else 0.8 * previous + 0.2 * per_question
