"""The inference facade, as Text Embeddings Inference's `Infer`: typed questions in (`Question`, `RerankQuestion`),
domain answers out (`ScoredQuestion`, `Reranked`: the library's Scores and Decision, never an HTTP schema). A
question is checked, prepared on a preparation thread (decoded, tokenized, packed), submitted to the batcher and
waited for (deadline, disconnect); its delivery is decided behind its rate gate; the request's time is observed.
`put_memory`, `memory` and `retrieve` run the write-time cache's calls on worker threads, bounded as the queue is.

The ASGI app (`app.py`) maps HTTP to these calls and back; the service's life (load, warm-up, drain, idle trim) is
`service.Service`, which builds one `Infer` once the scorer is loaded.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Sequence, TypeVar

from pixeltriage.delivery.decision import Decision, RankedDocument, decide, rerank_order
from pixeltriage.delivery.policy import RateGate
from pixeltriage.engine.types import Scores
from pixeltriage.errors import (DeadlineExceededError, InvalidMemoryError, InvalidRequestError, NoCacheError,
                                OverloadedError, StateTooLongError)
from pixeltriage.media.sources import ImageRoot
from pixeltriage.serve.batcher import Batcher, Prepare, Scored, Timing
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.inputs import RerankDoc, image_bytes, rerank_doc, to_memory
from pixeltriage.serve.metrics import Metrics
from pixeltriage.serve.schemas import RERANK_SCORES, MemoryIn, Policy

if TYPE_CHECKING:
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.retrieval.index import RegionIndex
    from pixeltriage.retrieval.types import Hit
    from pixeltriage.store.cache import Cache

log = logging.getLogger(__name__)


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
    result's `relevance_score` carries, "gain" (Scores.gains) or "relevance" (Scores.relevance); None: the
    server's --rerank-score; strict: a document not scored is refused (None: the server's --rerank-strict)."""

    query: str
    documents: Sequence[Any]
    policy: Policy
    collection: str = "documents"
    truncate: bool = True
    max_tokens: int | None = None
    score: str | None = None
    strict: bool | None = None

    def __post_init__(self):
        if self.score is not None and self.score not in RERANK_SCORES:
            raise ValueError(f"a rerank scores by one of {RERANK_SCORES}, not {self.score!r}")


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


Result = TypeVar("Result")


@dataclass(frozen=True)
class Answer(Generic[Result]):
    """A scoring call's answer: its result (one question's, a batch's list of them, or a rerank's) and the request's
    timing."""

    result: Result
    timing: RequestTiming


@dataclass(frozen=True)
class ScoredQuestion:
    """One question's answer: the caller's id (echoed), its scores, its delivery under its policy (None without
    one), its packed state's tokens and where its own time went (the forward it ran in, that forward's batch)."""

    id: str | None
    scores: Scores
    decision: Decision | None
    state_tokens: int
    timing: Timing


@dataclass(frozen=True)
class Reranked:
    """A rerank's answer: every document in `rerank_order` (the scored ones by descending score, then those without
    an image, as given), the query's scores and the delivery over its scored documents, the packed state's tokens,
    and whether the query was cut to its budget."""

    documents: list[RankedDocument]
    scores: Scores
    decision: Decision
    state_tokens: int
    query_truncated: bool


@dataclass(frozen=True)
class CachedMemory:
    """A cached image's metadata: its key and note, the original's displayed size (None for rows written before sizes
    were recorded), its thumbnail's size, whether this server's model has its vision features stored, and whether
    its regions are indexed (None: the server has no region index)."""

    key: str
    note: str
    width: int | None
    height: int | None
    thumbnail_width: int
    thumbnail_height: int
    features_cached: bool
    regions_indexed: bool | None


class ClientDisconnected(Exception):
    """The client closed its connection before its answer was ready; its queued questions were dropped."""


class FieldError(Exception):
    """A question's error with the request field it concerns (`questions[1].memories[2].image`)."""

    def __init__(self, field: str | None, error: Exception):
        self.field, self.error = field, error
        super().__init__(f"{field}: {error}" if field else str(error))


def refuse_unusable(documents: Sequence[RerankDoc]) -> None:
    """A strict rerank: a FieldError naming the first document not scored, its status and why, and how many more."""
    unusable = [d for d in documents if d.memory is None]
    if not unusable:
        return
    first, more = unusable[0], unusable[1:]
    rest = f"; {len(more)} more not scored: " + ", ".join(f"{d.field} ({d.status})" for d in more[:8]) if more else ""
    rest += ", ..." if len(more) > 8 else ""
    raise FieldError(first.field, InvalidRequestError(f"not scored ({first.status}): {first.detail}{rest}; strict: "
                                                      "false answers every document, this one scored 0"))


class Gates:
    """The rate gates: one `RateGate` per (stream, rate), the least recently used dropped past `max_gates`.

    A gate's threshold is a rank over the recent p_vis of its own stream, so hosts whose questions differ keep
    apart by naming their stream; decisions are made in the order answers complete."""

    def __init__(self, window: int, max_gates: int):
        self.window, self.max_gates = window, max_gates
        self._gates: OrderedDict[tuple[str, float], "RateGate"] = OrderedDict()
        self._lock = threading.Lock()

    def decide(self, stream: str, rate: float, decide: Callable[[RateGate], Decision]) -> Decision:
        with self._lock:
            gate = self._gates.pop((stream, rate), None) or RateGate(rate, self.window)
            self._gates[(stream, rate)] = gate
            while len(self._gates) > self.max_gates:
                self._gates.popitem(last=False)
            return decide(gate)

    def __len__(self) -> int:
        return len(self._gates)


class Infer:
    """Scores questions through the batcher and runs the write-time cache's calls, for one loaded scorer."""

    def __init__(self, config: ServeConfig, scorer: "Scorer", batcher: Batcher, metrics: Metrics,
                 index: "RegionIndex | None" = None):
        self.config, self.scorer, self.batcher, self.metrics = config, scorer, batcher, metrics
        self.index = index                         # the region index, when the server was given an encoder
        self.gates = Gates(config.gate_window, config.max_gates)
        self.image_root = ImageRoot(config.image_root, config.payload_limit) if config.image_root else None
        self.pending_writes = 0                    # cache calls waiting for or running on a worker thread

    @property
    def cache(self) -> "Cache | None":
        return self.scorer.cache

    # -- scoring -------------------------------------------------------------------------------------------------
    async def score(self, question: Question, admission: Admission) -> Answer[ScoredQuestion]:
        """Score one question (one state, one forward shared with whatever else is ready)."""
        answer = await self._score([question], admission)
        return Answer(answer.result[0], answer.timing)

    async def score_batch(self, questions: Sequence[Question],
                          admission: Admission) -> Answer[list[ScoredQuestion]]:
        """Score several questions, each as its own state, split across forwards as the budget needs."""
        if len(questions) > self.config.max_client_batch:
            raise InvalidRequestError(f"{len(questions)} questions; this server takes at most "
                                      f"{self.config.max_client_batch} per request (--max-client-batch): send "
                                      "the rest in another request", "questions")
        return await self._score(questions, admission)

    async def _score(self, questions: Sequence[Question],
                     admission: Admission) -> Answer[list[ScoredQuestion]]:
        for q in questions:
            self.check_question(q.memories, q.field)
        log.debug("%d question(s), %d memories", len(questions), sum(len(q.memories) for q in questions))
        scored, timing = await self._run([self.prepare(q) for q in questions], admission)
        return Answer([ScoredQuestion(q.id, s.scores, self.decide(s.scores, s.meta, q.policy), s.tokens, s.timing)
                       for s, q in zip(scored, questions)], timing)

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

    def check_question(self, memories: Sequence[MemoryIn], prefix: str) -> None:
        if len(memories) > self.config.max_memories:
            raise InvalidRequestError(f"{len(memories)} memories; this server scores at most "
                                      f"{self.config.max_memories} per question (--max-memories)", f"{prefix}memories")

    def prepare(self, q: Question) -> Prepare:
        """The preprocessing of one question, run on a preparation thread: -> (State, image sizes)."""
        fields = [f"{q.field}memories[{i}].{m.source}" for i, m in enumerate(q.memories)]
        return lambda: self._pack(q.text, q.memories, q.policy, fields, f"{q.field}memories", f"{q.field}policy")

    def _pack(self, question: str, memories: Sequence[MemoryIn], policy: Policy | None, image_fields: Sequence[str],
              memories_field: str, policy_field: str) -> tuple:
        """(State, image sizes) of one question; a refusal is a FieldError naming the request's own field: the
        field of memory i's image (`image_fields[i]`), the memories as a whole (`memories_field`: a state too long)
        or the policy's token budget."""
        from pixeltriage.delivery.report import image_size

        scorer = self.scorer
        try:
            decoded = [to_memory(m, field, self.image_root) for m, field in zip(memories, image_fields)]
            state = scorer.pack(question, decoded)
            # the answering model's visual tokens are reported with a delivery only: no policy, no headers read
            sizes = [image_size(m, i, scorer.cache) for i, m in enumerate(decoded)] if policy else []
        except InvalidMemoryError as e:
            known = e.index is not None and 0 <= e.index < len(memories)
            raise FieldError(image_fields[e.index] if known else memories_field, e) from None
        except StateTooLongError as e:
            raise FieldError(memories_field, e) from None
        except InvalidRequestError as e:
            raise FieldError(e.field, e) from None
        if policy is not None and policy.token_budget is not None and None in sizes:
            raise FieldError(f"{policy_field}.token_budget", InvalidRequestError(
                f"needs every image's size, and {image_fields[sizes.index(None)]} (a cache row written before sizes "
                "were recorded) has none; put the image again"))
        return state, sizes

    def decide(self, scores: Scores, sizes: list, policy: Policy | None) -> Decision | None:
        """The delivery of one scored question under its policy, behind the policy's rate gate (None: no policy)."""
        if policy is None:
            return None

        def run(gate: RateGate | None) -> Decision:
            return decide(scores, policy.k, gate, sizes, policy.answering_model, policy.token_budget)

        return self.gates.decide(policy.gate_stream, policy.gate_rate, run) if policy.gate_rate is not None \
            else run(None)

    # -- rerank ----------------------------------------------------------------------------------------------------
    async def rerank(self, rerank: RerankQuestion, admission: Admission) -> Answer[Reranked]:
        """Score the documents that carry an image (or a key the cache holds) as one question's memories -> every
        document ranked by its score (a document not scored scores 0, after every image, its status saying why),
        and the query's summary. With `strict`, a document not scored is a FieldError naming it."""
        self.check_documents(rerank.documents, rerank.collection)
        docs = [rerank_doc(d, rerank.collection, j) for j, d in enumerate(rerank.documents)]
        strict = self.config.rerank_strict if rerank.strict is None else rerank.strict
        prepare = self.prepare_rerank(rerank.query, docs, rerank.policy, rerank.truncate, rerank.max_tokens, "query",
                                      strict)
        (scored,), timing = await self._run([prepare], admission)
        sizes, query_cut, cuts, docs = scored.meta
        scores = scored.scores
        decision = self.decide(scores, sizes, rerank.policy)
        by = scores.gains if (rerank.score or self.config.rerank_score) == "gain" else scores.relevance
        ranked, i = [], 0
        for d in docs:
            if d.memory is None:        # nothing to open: after every image, scored 0
                ranked.append(RankedDocument(d.index, 0.0, False, None, None, False, False, d.text, d.status,
                                             d.detail))
                continue
            ranked.append(RankedDocument(d.index, by[i], True, scores.gains[i], scores.relevance[i], decision.open[i],
                                         cuts[i], d.text, d.status, d.detail))
            i += 1
        for d in docs:
            self.metrics.rerank_documents.labels(d.status).inc()
        log.debug("rerank: %d documents, %d scored", len(docs), i)
        order = rerank_order([r.relevance_score if r.image else None for r in ranked])
        return Answer(Reranked([ranked[j] for j in order], scores, decision, scored.tokens, query_cut), timing)

    def check_documents(self, documents: Sequence, field: str) -> None:
        """A rerank request's documents are one question's memories (one state, never split: the gains are relative
        to each other): at most --max-memories of them."""
        if len(documents) > self.config.max_memories:
            raise InvalidRequestError(f"{len(documents)} documents; this server reranks at most "
                                      f"{self.config.max_memories} per request (--max-memories): they are one "
                                      "question's memories, scored together", field)

    def prepare_rerank(self, query: str, documents: Sequence[RerankDoc], policy: Policy, truncate: bool,
                       max_tokens: int | None, query_field: str, strict: bool = False) -> Prepare:
        """`prepare` of the documents that carry an image or a key the cache holds (`known_keys`), cut first to the
        client's `max_tokens`: -> (State, (image sizes, whether the query was cut, per scored document whether a
        text of it was cut, every document with its final status)). What the library cut is the packer's own
        report (`State.text_cuts`); with `truncate` False, a text it cut is a FieldError naming its budget (the query
        first); with `strict`, so is a document not scored (`refuse_unusable`)."""

        def prepare():
            docs = self.known_keys(documents)
            if strict:
                refuse_unusable(docs)
            scored = [d for d in docs if d.memory is not None]
            memories, client_cuts = self._cut_to(scored, max_tokens)
            collection = documents[0].field.split("[", 1)[0] if documents else "documents"
            state, sizes = self._pack(query, memories, policy, [d.image_field for d in scored], collection, "policy")
            cuts = state.text_cuts
            # a cached note (null) is the server's own: its cut is neither reported nor refused
            library = [cut - {"note"} if m.note is None else cut for m, cut in zip(memories, cuts.memories)]
            if not truncate:
                self._refuse_cuts(cuts.question, library, scored, query_field)
            return state, (sizes, cuts.question, [bool(c or lib) for c, lib in zip(client_cuts, library)], docs)

        return prepare

    def known_keys(self, documents: Sequence[RerankDoc]) -> list[RerankDoc]:
        """The documents, a key the write-time cache does not hold (or a key on a server without a cache) marked not
        scored: `unknown_key`, `no_cache`."""
        cache, out = self.cache, []
        for d in documents:
            key = d.memory.key if d.memory is not None else None
            if key is not None and cache is None:
                d = d.unusable("no_cache", f"the cache key {key}, and this server has no write-time cache (start it "
                                           "with --cache DB)")
            elif key is not None and key not in cache:
                d = d.unusable("unknown_key", f"the cache key {key} is not in this server's write-time cache: put "
                                              "the image with POST /v1/memories first")
            out.append(d)
        return out

    def _cut_to(self, documents: Sequence[RerankDoc], max_tokens: int | None) -> tuple[list[MemoryIn], list[bool]]:
        """The documents' memories with note, then dialogue, cut to the client's `max_tokens` (None: no cut of its
        own; `StatePacker.client_cut`), and per memory whether this cut anything."""
        if max_tokens is None:
            return [d.memory for d in documents], [False] * len(documents)
        memories, cuts = [], []
        for d in documents:
            m = d.memory
            note, dialogue, cut = self.scorer.packer.client_cut(m.date, m.note, m.dialogue, max_tokens)
            memories.append(m.model_copy(update={"note": note, "dialogue": dialogue}) if cut else m)
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
    async def put_memory(self, image: str | None, path: str | None, note: str) -> CachedMemory:
        """Put an image (base64, or a path under the image root) and its note into the write-time cache -> its
        metadata (NoCacheError without a cache)."""
        self._need_cache()
        return await self._write(self._put_memory, image, path, note)

    async def memory(self, key: str) -> CachedMemory:
        """A cached image's metadata; CacheMissError when absent or damaged (NoCacheError without a cache)."""
        self._need_cache()
        return await self._write(self.memory_info, key)

    async def retrieve(self, question: str, top: int, whole_image: bool) -> list["Hit"]:
        """The region index's ranking of the cached images for `question` (MaxSim over their regions, or the
        whole-image control); NoCacheError without an index."""
        if self.index is None:
            raise NoCacheError("this server has no region index; start it with --cache DB --index-encoder DIR")
        return await self._write(self.index.search, question, top, whole_image=whole_image)

    def _need_cache(self) -> None:
        if self.cache is None:
            raise NoCacheError("this server has no write-time cache; start it with --cache DB")

    async def _write(self, fn, *args, **kwargs):
        """Run one cache call on a worker thread; past max_queued waiting calls, 429 (they decode images too)."""
        if self.pending_writes >= self.config.max_queued:
            raise OverloadedError(f"{self.pending_writes} cache writes are waiting", 1)
        self.pending_writes += 1
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            self.pending_writes -= 1

    def _put_memory(self, image: str | None, path: str | None, note: str) -> CachedMemory:
        """Decode (or read from under the image root) and `Cache.put` one image -> its metadata."""
        data = image_bytes(image, path, "", self.image_root)
        try:
            key = self.index.add(data, note) if self.index is not None else self.cache.put(data, note)
        except InvalidMemoryError as e:
            raise InvalidRequestError(e.reason, "image" if image is not None else "path") from None
        return self.memory_info(key)

    def memory_info(self, key: str) -> CachedMemory:
        """A cached image's metadata; CacheMissError when absent or damaged."""
        cache = self.cache
        thumbnail, note = cache.entry(key)
        size = cache.size(key)
        features = cache.get_features(key, self.scorer.vision_fingerprint) is not None
        return CachedMemory(key, note, size[0] if size else None, size[1] if size else None, thumbnail.width,
                            thumbnail.height, features, None if self.index is None else self._indexed(key))

    def _indexed(self, key: str) -> bool:
        self.index.refresh()                       # rows written since the last search, by any process
        return key in self.index


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
