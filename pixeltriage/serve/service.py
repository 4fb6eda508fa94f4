"""One scoring service: the scorer, its batcher, the write-time cache, the rate gates and the metrics, and their life
(loading -> ready -> draining -> stopped, or failed). A request's whole life is a `Service` call: `score`,
`score_batch` and `rerank` check, prepare, submit to the batcher, wait (deadline, disconnect), decide and answer
with the response model that documents it; `put_memory`, `memory` and `retrieve` run the cache's calls. The ASGI app
(`app.py`) only translates HTTP to these calls and back; a server process and each Ray Serve replica hold one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Iterator, Sequence, TypeVar

from pixeltriage.config import default_dtype
from pixeltriage.errors import (DeadlineExceededError, InvalidMemoryError, InvalidRequestError, NoCacheError,
                                OverloadedError, ServiceUnavailableError, StateTooLongError)
from pixeltriage.media.policy import THUMBNAIL_SIDE
from pixeltriage.media.sources import ImageRoot
from pixeltriage.serve import schemas
from pixeltriage.serve.batcher import Batcher, Prepare, Scored
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.inputs import RerankDoc, image_bytes, rerank_doc, to_memory
from pixeltriage.serve.metrics import Metrics
from pixeltriage.serve.schemas import MemoryIn, Policy

if TYPE_CHECKING:
    from pixeltriage.retrieval.index import RegionIndex
    from pixeltriage.store.cache import Cache
    from pixeltriage.delivery.policy import RateGate
    from pixeltriage.engine.scorer import Scorer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a checkpoint on a device, with an optional write-time cache file (plain values, so that a Ray
    replica can be handed one)."""

    checkpoint: str
    device: str = "cpu"
    dtype: str | None = None           # None: float32 on the CPU, bfloat16 on CUDA
    cache: str | None = None
    verify: bool = False
    threads: int | None = None         # torch's intra-op threads for the forward (None: torch's default)
    index_encoder: str | None = None   # a SigLIP 2 directory: /v1/memories also indexes regions, /v1/retrieve ranks
    index_overlap: float | None = None # the region grid's overlap (None: the retrieval default)

    def load(self) -> "Scorer":
        import torch

        from pixeltriage.store.cache import Cache
        from pixeltriage.engine.scorer import Scorer

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        dtype = self.dtype or default_dtype(self.device)
        cache = Cache(self.cache) if self.cache else None
        try:
            return Scorer.load(self.checkpoint, device=self.device, dtype=dtype, cache=cache,
                               verify=self.verify or None)
        except BaseException:
            if cache is not None:
                cache.close()
            raise

    def load_index(self, cache: "Cache") -> "RegionIndex | None":
        """The region index over the scorer's cache (DeliverMem R1), when an encoder was given."""
        if self.index_encoder is None:
            return None
        from pixeltriage.retrieval.encoder import SiglipEncoder
        from pixeltriage.retrieval.index import RegionIndex
        from pixeltriage.retrieval.regions import RegionGrid

        encoder = SiglipEncoder.load(self.index_encoder, device=self.device)
        grid = RegionGrid() if self.index_overlap is None else RegionGrid(self.index_overlap)
        return RegionIndex(cache, encoder, grid)


class IdleTrim:
    """Gives the memory that requests freed back to the OS (`cpu_memory.trim_malloc`) once the service has held no
    request and admitted no question for `after_s` seconds, once per idle spell (and once after the warm-up).

    Why: the server's malloc settings (`tune_malloc`: no mmap, a 1 GiB trim threshold) keep freed memory for the
    next forward, so without a trim the memory of every large body parsed and thrown away (a 4 MiB note refused
    with 422) stays with the process: over a 10-minute soak RSS rose 16% and stayed there. An idle server now holds
    what it uses; the first forward after a pause takes its buffers (the Scorer's workspace among them, released
    just before the trim) from the OS again."""

    POLLS = 4                           # looks per `after_s`

    def __init__(self, service: Service, after_s: float):
        self.service, self.after_s = service, after_s
        self.trims = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pixeltriage-idle-trim", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _busy(self) -> bool:
        service = self.service
        return bool(service.open_requests or service.pending_writes
                    or (service.batcher is not None and service.batcher.admitted))

    def _run(self) -> None:
        from pixeltriage.engine import cpu_memory

        if not cpu_memory.can_trim():
            return                              # no malloc_trim here (not glibc), or turned off
        seen, trimmed, last_busy = self.service.requests_held, None, time.monotonic()
        while not self._stop.wait(self.after_s / self.POLLS):
            now, held = time.monotonic(), self.service.requests_held
            if held != seen or self._busy():
                seen, last_busy = held, now
            elif trimmed != seen and now - last_busy >= self.after_s:
                start = time.perf_counter()
                scorer = self.service.scorer    # its workspace's buffers first, then all that malloc holds free
                released = scorer.workspace.release() if scorer is not None else 0
                if not cpu_memory.trim_malloc():
                    return
                self.trims += 1
                trimmed = seen
                log.debug("idle %.1f s: workspace (%d B) and malloc's free memory given back in %.1f ms",
                          now - last_busy, released, 1000 * (time.perf_counter() - start))


@dataclass(frozen=True)
class Question:
    """One question to score: its text, its memories as the request gave them (decoded on a preparation thread),
    the delivery policy (None: scores only), the caller's id (echoed) and where it sits in the request ("" for
    /v1/score's body, "questions[2]." in a batch: the prefix of its error fields)."""

    text: str
    memories: Sequence[MemoryIn] = ()
    policy: Policy | None = None
    id: str | None = None
    field: str = ""


@dataclass(frozen=True)
class RerankQuestion:
    """One rerank: the query and the request's documents (strings or objects, as `rerank_doc` reads them), scored
    as one question's memories. collection: the body's field that holds them ("documents", TEI's "texts");
    max_tokens: the client's own cut of each document's text (None: the library's budget only); score: what each
    result's `relevance_score` carries, "gain" (Scores.gains) or "relevance" (Scores.relevance)."""

    query: str
    documents: Sequence[Any]
    policy: Policy
    collection: str = "documents"
    truncate: bool = True
    max_tokens: int | None = None
    score: str = "gain"

    def __post_init__(self):
        if self.score not in schemas.RERANK_SCORES:
            raise ValueError(f"a rerank scores by one of {schemas.RERANK_SCORES}, not {self.score!r}")


@dataclass(frozen=True)
class Admission:
    """A request's place in the queue: when it arrived, its own deadline (None: the server's --request-timeout; a
    longer one is cut to it), its priority, and an awaitable that returns when the client goes away (None: never
    watched)."""

    arrival: float
    timeout_s: float | None = None
    priority: int = 0
    disconnected: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class RequestTiming:
    """Where a request's time went, in seconds: the slowest of its questions' queue, preprocessing and forward, and
    arrival -> answer."""

    queue: float
    preprocess: float
    forward: float
    total: float


Response = TypeVar("Response")


@dataclass(frozen=True)
class Answer(Generic[Response]):
    """A scoring call's answer: the response model (or list of models) and the request's timing."""

    response: Response
    timing: RequestTiming


@dataclass(frozen=True)
class Reranked:
    """A rerank's results, every document by descending score (images first), and its summary."""

    results: list[schemas.RerankResult]
    summary: schemas.RerankSummary


class ClientDisconnected(Exception):
    """The client closed its connection before its answer was ready; its queued questions were dropped."""


class FieldError(Exception):
    """A question's error with the request field it concerns (`questions[1].memories[2].image`)."""

    def __init__(self, field: str | None, error: Exception):
        self.field, self.error = field, error
        super().__init__(f"{field}: {error}" if field else str(error))


def _document_error(error: FieldError, documents: Sequence[RerankDoc]) -> FieldError:
    """A scored memory's error (`memories[2].image`) renamed for the document it came from (`documents[5].image`),
    a library error numbered by the document."""
    found = _MEMORY_FIELD.match(error.field or "")
    if found is None:
        if error.field != "memories":
            return error
        collection = documents[0].field.split("[", 1)[0] if documents else "documents"
        return FieldError(collection, error.error)          # the whole state (too long)
    document = documents[int(found.group(1))]
    inner = error.error
    if isinstance(inner, InvalidMemoryError):
        inner = InvalidMemoryError(inner.reason, document.index)
    return FieldError(f"{document.field}.{document.source}", inner)


_MEMORY_FIELD = re.compile(r"^memories\[(\d+)\]")


class Gates:
    """The rate gates: one `RateGate` per (stream, rate), the least recently used dropped past `max_gates`.

    A gate's threshold is a rank over the recent p_vis of its own stream, so hosts whose questions differ keep
    apart by naming their stream; decisions are made in the order answers complete."""

    def __init__(self, window: int, max_gates: int):
        self.window, self.max_gates = window, max_gates
        self._gates: OrderedDict[tuple[str, float], "RateGate"] = OrderedDict()
        self._lock = threading.Lock()

    def decide(self, stream: str, rate: float, decide: Callable[["RateGate"], dict]) -> dict:
        from pixeltriage.delivery.policy import RateGate

        with self._lock:
            gate = self._gates.pop((stream, rate), None) or RateGate(rate, self.window)
            self._gates[(stream, rate)] = gate
            while len(self._gates) > self.max_gates:
                self._gates.popitem(last=False)
            return decide(gate)

    def __len__(self) -> int:
        return len(self._gates)


class Service:
    """Loads the model (`load`, or `start_loading` in the background), admits and scores questions, drains."""

    def __init__(self, config: ServeConfig, loader: Callable[[], "Scorer"], *, describe: dict | None = None,
                 index_loader: Callable[["Cache"], "RegionIndex | None"] | None = None):
        self.config = config
        self.rerank_score = config.rerank_score   # a rerank's `relevance_score` when its request does not choose
        self.loader = loader
        self.index_loader = index_loader
        self.index: "RegionIndex | None" = None    # the region index, when the server was given an encoder
        self.describe = dict(describe or {})
        self.metrics = Metrics()
        self.metrics.queue_capacity.set(config.max_queued)
        self.gates = Gates(config.gate_window, config.max_gates)
        self.image_root = ImageRoot(config.image_root, config.payload_limit) if config.image_root else None
        self.scorer: "Scorer | None" = None
        self.batcher: Batcher | None = None
        self.status = "loading"            # loading, ready, draining, stopped, failed
        self.error: BaseException | None = None
        self.open_requests = 0             # /v1 requests with a body, arrival to response (the body bound)
        self.requests_held = 0             # every such request so far (the idle trim's sign of activity)
        self._trim: IdleTrim | None = None
        self.pending_writes = 0
        self._lock = threading.Lock()

    @property
    def cache(self) -> "Cache | None":
        return self.scorer.cache if self.scorer is not None else None

    # -- life ----------------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the scorer, run one warm-up forward at the full batch budget, start the batcher: then ready."""
        start = time.monotonic()
        scorer = self.loader()
        try:
            if self.index_loader is not None and scorer.cache is not None:
                self.index = self.index_loader(scorer.cache)
                if self.index is not None:
                    self.index.refresh()           # read the stored vectors now, not in the first search
            budget = self.config.max_batch_tokens or scorer.max_batch_tokens
            scorer.max_batch_tokens = budget
            warm_up(scorer, budget)
            scorer.vision_fingerprint          # computed once now, not in the first question's forward
        except BaseException:
            if scorer.cache is not None:       # a failed load leaves no open cache behind
                scorer.cache.close()
            raise
        batcher = Batcher(scorer.score_states, max_batch_tokens=budget, max_wait_ms=self.config.max_wait_ms,
                          max_queued=self.config.max_queued, preprocess_threads=self.config.preprocess_threads,
                          observer=self.metrics)
        with self._lock:
            if self.status != "loading":       # shut down while loading
                if scorer.cache is not None:
                    scorer.cache.close()
                return
            self.scorer, self.batcher = scorer, batcher
            batcher.start()
            if self.config.trim_idle_s is not None:
                self._trim = IdleTrim(self, self.config.trim_idle_s)
                self._trim.start()
            self.status = "ready"
        self.metrics.ready.set(1)
        self.metrics.build.info({k: str(v) for k, v in self.build_info().items()})
        log.info("ready in %.1f s: batch budget %d tokens, queue %d questions", time.monotonic() - start, budget,
                 self.config.max_queued)

    def start_loading(self, on_failure: Callable[[BaseException], None],
                      on_ready: Callable[[], None] | None = None) -> threading.Thread:
        """`load` on a background thread (the server answers /health meanwhile); then `on_ready()`, or
        `on_failure(error)` if it failed."""
        def run():
            try:
                self.load()
            except BaseException as e:
                self.status, self.error = "failed", e
                on_failure(e)
                return
            if on_ready is not None and self.status == "ready":
                on_ready()

        thread = threading.Thread(target=run, name="pixeltriage-load", daemon=True)
        thread.start()
        return thread

    @property
    def admitting(self) -> bool:
        return self.readiness == "ready"

    @property
    def readiness(self) -> str:
        """`status`, except "stalled" when ready but its batcher's threads have stopped (what /ready and Ray's health
        check report: such a server must be restarted)."""
        status = self.status
        if status == "ready" and self.batcher is not None and not self.batcher.alive:
            return "stalled"
        return status

    def refusal(self, holds_body: bool, scoring: bool) -> ServiceUnavailableError | OverloadedError | None:
        """Why a request is refused before its body is read (None: admit it): ServiceUnavailableError while not
        ready; OverloadedError for a request with a body while --max-queued of them are open, or for a scoring one
        while the batcher has no room (its retry_after: the batcher's estimate)."""
        if not self.admitting:
            return ServiceUnavailableError(f"the service is {self.status}; retry on another replica or later")
        if holds_body and (self.open_requests >= self.config.max_queued or (scoring and self.batcher.free <= 0)):
            return OverloadedError(f"the server is full ({self.batcher.admitted} of {self.config.max_queued} "
                                   f"questions admitted, {self.open_requests} requests open)",
                                   self.batcher.retry_after())
        return None

    @contextmanager
    def holding_body(self) -> Iterator[None]:
        """Count a request body held in memory (arrival to response): at most --max-queued of them."""
        self.open_requests += 1
        self.requests_held += 1
        try:
            yield
        finally:
            self.open_requests -= 1

    def drain(self, timeout: float) -> bool:
        """Stop admitting (503 from now on) and wait up to `timeout` s for admitted questions; True if all finished.
        Past the timeout, the questions not yet in a forward are refused (503) and the batcher closes."""
        with self._lock:
            if self.status == "ready":
                self.status = "draining"
            elif self.status == "loading":
                self.status = "stopped"
        self.metrics.ready.set(0)
        if self.batcher is None:
            return True
        self.batcher.stop_admitting()
        done = self.batcher.wait_idle(timeout)
        if not done:
            log.warning("graceful timeout (%.1f s): %d questions still admitted are refused", timeout,
                        self.batcher.admitted)
            self.batcher.close("the service shut down before this request was scored (graceful timeout)")
        return done

    def close(self) -> None:
        """Refuse what is still queued (503), stop the threads, close the cache. Idempotent."""
        with self._lock:
            self.status = "stopped" if self.status != "failed" else "failed"
        self.metrics.ready.set(0)
        if self._trim is not None:
            self._trim.stop()
        try:
            if self.batcher is not None:
                self.batcher.close()
        finally:
            if self.cache is not None:
                self.cache.close()

    # -- scoring -------------------------------------------------------------------------------------------------
    async def score(self, question: Question, admission: Admission) -> Answer[schemas.ScoreResponse]:
        """Score one question (one state, one forward shared with whatever else is ready)."""
        answer = await self._score([question], admission)
        return Answer(answer.response[0], answer.timing)

    async def score_batch(self, questions: Sequence[Question],
                          admission: Admission) -> Answer[schemas.BatchResponse]:
        """Score several questions, each as its own state, split across forwards as the budget needs."""
        if len(questions) > self.config.max_client_batch:
            raise InvalidRequestError(f"{len(questions)} questions; this server takes at most "
                                      f"{self.config.max_client_batch} per request (--max-client-batch): send "
                                      "the rest in another request", "questions")
        answer = await self._score(questions, admission)
        return Answer(schemas.BatchResponse(results=answer.response), answer.timing)

    async def _score(self, questions: Sequence[Question],
                     admission: Admission) -> Answer[list[schemas.ScoreResponse]]:
        for q in questions:
            self.check_question(q.memories, q.field)
        log.debug("%d question(s), %d memories", len(questions), sum(len(q.memories) for q in questions))
        scored, timing = await self._run([self.prepare(q) for q in questions], admission)
        return Answer([self._response(s, q, timing) for s, q in zip(scored, questions)], timing)

    async def _run(self, prepares: Sequence[Prepare], admission: Admission) -> tuple[list[Scored], RequestTiming]:
        """Submit prepared questions to the batcher and wait for them (deadline, disconnect)."""
        limit = (self.config.request_timeout if admission.timeout_s is None
                 else min(admission.timeout_s, self.config.request_timeout))
        deadline = admission.arrival + limit
        futures = self.batcher.submit(prepares, deadline, admission.priority)
        scored = await _wait(futures, deadline, admission.disconnected)
        total = time.monotonic() - admission.arrival
        self.metrics.request_duration.observe(total)
        return scored, RequestTiming(queue=max(s.timing.queue for s in scored),
                                     preprocess=max(s.timing.preprocess for s in scored),
                                     forward=max(s.timing.forward for s in scored), total=total)

    def _response(self, scored: Scored, question: Question, timing: RequestTiming) -> schemas.ScoreResponse:
        scores, t = scored.scores, scored.timing
        delivery, visual = self.decide(scores, scored.meta, question.policy)
        return schemas.ScoreResponse(
            id=question.id, p_vis=scores.p_vis, gains=scores.gains, relevance=scores.relevance,
            relevance_none=scores.relevance_none, state_tokens=scored.tokens, delivery=delivery,
            visual_tokens=visual,
            timing=schemas.Timing(queue_ms=1000 * t.queue, preprocess_ms=1000 * t.preprocess,
                                  forward_ms=1000 * t.forward, total_ms=1000 * timing.total,
                                  batch_questions=t.batch_questions, batch_tokens=t.batch_tokens))

    def check_question(self, memories: Sequence[MemoryIn], prefix: str) -> None:
        if len(memories) > self.config.max_memories:
            raise InvalidRequestError(f"{len(memories)} memories; this server scores at most "
                                      f"{self.config.max_memories} per question (--max-memories)", f"{prefix}memories")

    def prepare(self, q: Question) -> Prepare:
        """The preprocessing of one question, run on a preparation thread: -> (State, image sizes)."""
        from pixeltriage.delivery.report import image_size

        scorer, image_root = self.scorer, self.image_root
        question, memories, policy, prefix = q.text, q.memories, q.policy, q.field

        def prepare():
            try:
                decoded = [to_memory(m, f"{prefix}memories[{i}]", image_root) for i, m in enumerate(memories)]
                state = scorer.pack(question, decoded)
                # the answering model's visual tokens are reported with a delivery only: no policy, no headers read
                sizes = [image_size(m, i, scorer.cache) for i, m in enumerate(decoded)] if policy else []
            except InvalidMemoryError as e:
                known = e.index is not None and 0 <= e.index < len(memories)
                raise FieldError(f"{prefix}memories[{e.index}].{memories[e.index].source}" if known
                                 else f"{prefix}memories", e) from None
            except StateTooLongError as e:
                raise FieldError(f"{prefix}memories", e) from None
            except InvalidRequestError as e:
                raise FieldError(e.field, e) from None
            if policy is not None and policy.token_budget is not None and None in sizes:
                unknown = sizes.index(None)
                raise FieldError(f"{prefix}policy.token_budget", InvalidRequestError(
                    f"needs every image's size, and memory {unknown + 1} (a cache row written before sizes were "
                    "recorded) has none; put the image again"))
            return state, sizes

        return prepare

    def decide(self, scores, sizes: list, policy: Policy | None) -> tuple[dict | None, dict | None]:
        """(delivery, visual_tokens) of the response for one scored question."""
        from pixeltriage.delivery.report import delivery

        if policy is None:
            return None, None

        def run(gate):
            return delivery(scores, policy.k, gate, sizes, policy.answering_model, policy.token_budget)

        decided = (self.gates.decide(policy.gate_stream, policy.gate_rate, run) if policy.gate_rate is not None
                   else run(None))
        opened = decided["open"]
        out = {"open": opened, "opened": [i + 1 for i, o in enumerate(opened) if o], "gate_open": decided["gate_open"],
               "k": policy.k, "token_budget": policy.token_budget, "gate_rate": policy.gate_rate}
        return out, decided.get("visual_tokens")

    # -- rerank ----------------------------------------------------------------------------------------------------
    async def rerank(self, rerank: RerankQuestion, admission: Admission) -> Answer[Reranked]:
        """Score the documents that carry an image (or a key) as one question's memories -> every document's
        result by descending score (a document without an image scores 0, after every image) and the summary."""
        self.check_documents(rerank.documents, rerank.collection)
        docs = [rerank_doc(d, rerank.collection, j) for j, d in enumerate(rerank.documents)]
        log.debug("rerank: %d documents, %d with images", len(docs), sum(d.memory is not None for d in docs))
        prepare = self.prepare_rerank(rerank.query, docs, rerank.policy, rerank.truncate, rerank.max_tokens, "query")
        (scored,), timing = await self._run([prepare], admission)
        sizes, query_cut, cuts = scored.meta
        scores = scored.scores
        delivery, _ = self.decide(scores, sizes, rerank.policy)
        results, i = [], 0
        for d in docs:
            extra = {"image": d.memory is not None, "gain": None, "relevance": None, "p_vis": scores.p_vis,
                     "open": False, "truncated": False}
            if d.memory is not None:
                extra.update(gain=scores.gains[i], relevance=scores.relevance[i], open=delivery["open"][i],
                             truncated=cuts[i])
                i += 1
            results.append(schemas.RerankResult(index=d.index, relevance_score=extra[rerank.score] or 0.0,
                                                document=schemas.RerankDocument(text=d.text),
                                                pixeltriage=schemas.RerankExtra(**extra)))
        # images first (a document without one has nothing to open: its gain is 0), then by score, then as given
        results.sort(key=lambda r: (not r.pixeltriage.image, -r.relevance_score, r.index))
        summary = schemas.RerankSummary(p_vis=scores.p_vis, relevance_none=scores.relevance_none,
                                        opened=sorted(r.index for r in results if r.pixeltriage.open),
                                        state_tokens=scored.tokens, query_truncated=query_cut)
        return Answer(Reranked(results, summary), timing)

    def check_documents(self, documents: Sequence, field: str) -> None:
        """A rerank request's documents are one question's memories (one state, never split: the gains are relative
        to each other): at most --max-memories of them."""
        if len(documents) > self.config.max_memories:
            raise InvalidRequestError(f"{len(documents)} documents; this server reranks at most "
                                      f"{self.config.max_memories} per request (--max-memories): they are one "
                                      "question's memories, scored together", field)

    def prepare_rerank(self, query: str, documents: Sequence[RerankDoc], policy: Policy, truncate: bool,
                       max_tokens: int | None, query_field: str) -> Prepare:
        """`prepare` of the documents that carry an image (or a key), cut first to the client's `max_tokens`: ->
        (State, (image sizes, whether the query was cut, per scored document whether a text of it was cut)). What
        the library cut is the packer's own report (`State.text_cuts`); with `truncate` False, a text it cut is a
        FieldError naming its budget (the query first)."""
        scored = [d for d in documents if d.memory is not None]

        def prepare():
            memories, client_cuts = self._cut_to(scored, max_tokens)
            try:
                state, sizes = self.prepare(Question(query, memories, policy))()
            except FieldError as e:
                raise _document_error(e, scored) from None
            cuts = state.text_cuts
            # a cached note (null) is the server's own: its cut is neither reported nor refused
            library = [cut - {"note"} if m.note is None else cut for m, cut in zip(memories, cuts.memories)]
            if not truncate:
                self._refuse_cuts(cuts.question, library, scored, query_field)
            return state, (sizes, cuts.question, [bool(c or lib) for c, lib in zip(client_cuts, library)])

        return prepare

    def _cut_to(self, documents: Sequence[RerankDoc], max_tokens: int | None) -> tuple[list[MemoryIn], list[bool]]:
        """The documents' memories with note, then dialogue, cut to the client's `max_tokens` (None: no cut of its
        own) where that is below the library's budget for them, and per memory whether this cut anything."""
        packer = self.scorer.packer
        memories, cuts = [], []
        for d in documents:
            m, cut = d.memory, False
            if max_tokens is not None and max_tokens < packer.text_budget(packer.cut_date(m.date)):
                note = m.note or ""      # a cached note (null) is the server's own: not cut
                kept_note = packer.encoder.truncate_counted(note, max_tokens)
                kept_dialogue, dialogue_cut = packer.encoder.cut(m.dialogue, max_tokens - kept_note.tokens)
                if kept_note.cut or dialogue_cut:
                    cut = True
                    m = m.model_copy(update={"note": kept_note.text if m.note is not None else None,
                                             "dialogue": kept_dialogue})
            memories.append(m)
            cuts.append(cut)
        return memories, cuts

    def _refuse_cuts(self, query_cut: bool, library_cuts: Sequence[frozenset], documents: Sequence[RerankDoc],
                     query_field: str) -> None:
        """With `truncate: false`: the first text the library cut, the query first, as a FieldError naming its
        budget."""
        from pixeltriage.engine.state import DATE_TOKENS

        budgets = self.scorer.packer.cfg
        if query_cut:
            raise FieldError(query_field, InvalidRequestError(
                f"longer than the model's question budget of {budgets.max_question_tokens} tokens; truncate: true "
                "(the default) cuts it there"))
        for d, cut in zip(documents, library_cuts):
            if cut:
                raise FieldError(d.field, InvalidRequestError(
                    f"longer than the model's budget for a memory's text: {budgets.max_memory_text_tokens} tokens "
                    f"of date (at most {DATE_TOKENS}), note (at most half the rest) and dialogue; truncate: true "
                    "(the default) cuts it there"))

    # -- the write-time cache ------------------------------------------------------------------------------------
    async def put_memory(self, put: schemas.MemoryPut) -> schemas.MemoryInfo:
        """Put an image and its note into the write-time cache -> its metadata (NoCacheError without a cache)."""
        self._need_cache()
        return schemas.MemoryInfo(**await self._write(self._put_memory, put.image, put.path, put.note))

    async def memory(self, key: str) -> schemas.MemoryInfo:
        """A cached image's metadata; CacheMissError when absent or damaged (NoCacheError without a cache)."""
        self._need_cache()
        return schemas.MemoryInfo(**await self._write(self.memory_info, key))

    async def retrieve(self, request: schemas.RetrieveRequest) -> schemas.RetrieveResponse:
        """The region index's ranking of the cached images for a question (NoCacheError without an index)."""
        if self.index is None:
            raise NoCacheError("this server has no region index; start it with --cache DB --index-encoder DIR")
        hits = await self._write(self._retrieve, request.question, request.top, request.whole_image)
        return schemas.RetrieveResponse(hits=hits)

    def _need_cache(self) -> None:
        if self.cache is None:
            raise NoCacheError("this server has no write-time cache; start it with --cache DB")

    async def _write(self, fn, *args):
        """Run one cache call on a worker thread; past max_queued waiting calls, 429 (they decode images too)."""
        if self.pending_writes >= self.config.max_queued:
            raise OverloadedError(f"{self.pending_writes} cache writes are waiting", 1)
        self.pending_writes += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.pending_writes -= 1

    def _put_memory(self, image: str | None, path: str | None, note: str) -> dict:
        """Decode (or read from under the image root) and `Cache.put` one image -> its metadata."""
        data = image_bytes(image, path, "", self.image_root)
        try:
            key = self.index.add(data, note) if self.index is not None else self.cache.put(data, note)
        except InvalidMemoryError as e:
            raise InvalidRequestError(e.reason, "image" if image is not None else "path") from None
        return self.memory_info(key)

    def memory_info(self, key: str) -> dict:
        """A cached image's metadata; CacheMissError when absent or damaged."""
        cache = self.cache
        thumbnail, note = cache.entry(key)
        size = cache.size(key)
        features = cache.get_features(key, self.scorer.vision_fingerprint) is not None
        return {"key": key, "note": note, "width": size[0] if size else None, "height": size[1] if size else None,
                "thumbnail_width": thumbnail.width, "thumbnail_height": thumbnail.height, "features_cached": features,
                "regions_indexed": None if self.index is None else self._indexed(key)}

    def _indexed_images(self) -> int:
        self.index.refresh()
        return len(self.index)

    def _indexed(self, key: str) -> bool:
        self.index.refresh()                       # rows written since the last search, by any process
        return key in self.index

    def _retrieve(self, question: str, top: int, whole_image: bool) -> list[dict]:
        """The region index's ranking of the cached images for `question` (MaxSim, or the whole-image control)."""
        return [hit.to_dict() for hit in self.index.search(question, top, whole_image=whole_image)]

    # -- /info, /metrics -----------------------------------------------------------------------------------------
    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus text format and its content type, the scorer's brought up to date first."""
        self.update_scorer_metrics()
        return self.metrics.expose()

    def update_scorer_metrics(self) -> None:
        """Bring what the metrics read off the scorer up to date: the vision tower's counters
        (`Metrics.vision_counts` adds what they gained since its last call) and the workspace's bytes."""
        if self.scorer is not None:
            self.metrics.vision_counts(self.scorer.vision_counts)
            self.metrics.workspace_bytes.set(self.scorer.workspace.nbytes)

    def build_info(self) -> dict:
        from pixeltriage import __version__

        scorer = self.scorer
        return {"version": __version__, "checkpoint": self.describe.get("checkpoint", ""),
                "device": str(scorer.device) if scorer else "", "dtype": str(scorer.dtype).removeprefix("torch.")
                if scorer else ""}

    def info(self) -> dict:
        from pixeltriage import __version__

        out = {"version": __version__, "status": self.status, **self.describe,
               "instance": {"host": socket.gethostname(), "pid": os.getpid()}, "limits": self.config.limits()}
        scorer = self.scorer
        if scorer is None:
            return out
        text, vision = scorer.model_config.text, scorer.model_config.vision
        out["limits"]["max_batch_tokens"] = scorer.max_batch_tokens
        out["limits"]["max_state_tokens"] = scorer.packer.max_tokens
        out.update({
            "checkpoint_fingerprint": scorer.checkpoint_fingerprint,
            "vision_fingerprint": scorer.vision_fingerprint,
            "device": str(scorer.device),
            "dtype": str(scorer.dtype).removeprefix("torch."),
            "model": {"hidden_size": text.hidden_size, "layers": len(text.layer_types),
                      "full_attention_layers": sum(t == "full_attention" for t in text.layer_types),
                      "attention_heads": text.num_attention_heads, "kv_heads": text.num_key_value_heads,
                      "vocab_size": text.vocab_size, "vision_depth": vision.depth,
                      "vision_hidden_size": vision.hidden_size, "patch_size": vision.patch_size,
                      "head_dim": scorer.triage_config.head_dim,
                      "thumbnail_size": scorer.triage_config.thumbnail_size},
            "kernels": kernels(scorer),
            "cache": scorer.cache is not None,
            "region_index": None if self.index is None else {"images": self._indexed_images(),
                                                             "fingerprint": self.index.fingerprint},
            "gates": {"active": len(self.gates), "window": self.config.gate_window, "max": self.config.max_gates},
        })
        return out


async def _wait(futures: list[Future], deadline: float,
                disconnected: Callable[[], Awaitable[None]] | None) -> list[Scored]:
    """The futures' results; on a disconnect or at the deadline the questions still waiting are cancelled (a
    question already in its forward is waited for: it finishes within that forward)."""
    gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved: no "never retrieved" noise
    watcher = asyncio.ensure_future(disconnected() if disconnected is not None else asyncio.Event().wait())
    try:
        done, _ = await asyncio.wait((gathered, watcher), timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if gathered in done:
            return _results(gathered, futures)
        cancelled = [f.cancel() for f in futures]
        if watcher in done:
            raise ClientDisconnected()
        if any(cancelled):
            raise DeadlineExceededError("the request passed its deadline before it was scored; it was dropped "
                                        "from the queue", 504)
        await asyncio.wait((gathered,))
        return _results(gathered, futures)
    finally:
        watcher.cancel()


def _results(gathered: asyncio.Future, futures: list[Future]) -> list[Scored]:
    if gathered.cancelled() or gathered.exception() is not None:
        for f in futures:
            f.cancel()
    return gathered.result()


def warm_up(scorer: "Scorer", budget: int) -> None:
    """One forward at the full batch budget (copies of a one-image state, packed varlen), then one single question:
    the first real requests then meet warm allocators and kernels. Runs without the cache (writes nothing to it)."""
    from PIL import Image

    from pixeltriage.engine.types import Memory

    plain = scorer.with_cache(None)
    plain.max_batch_tokens = budget
    image = Image.new("RGB", (THUMBNAIL_SIDE, THUMBNAIL_SIDE), (127, 127, 127))
    state = plain.pack("warm-up", [Memory(image=image, note="warm-up")])
    plain.score_states([state] * max(1, budget // state.num_tokens))
    plain.score_states([state])


def kernels(scorer: "Scorer") -> dict[str, str]:
    """Which kernel runs each op of the forward on this scorer's device and dtype (`Scorer.kernels`, from the kernel
    registry), and on the CPU whether the C kernels are built (or why not)."""
    from pixeltriage.kernels import native, registry

    names = scorer.kernels()
    if registry.kernel_device(scorer.device) == "cpu":
        names["native_kernels"] = "available" if native.available() else native.status()
    return names
