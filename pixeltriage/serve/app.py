"""The ASGI application: HTTP mapped to the inference facade (`infer.Infer`) and back, from one route table
(`ROUTES`), behind one plain ASGI guard (auth, admission, content type, payload limit).

Status codes: 200; 401 missing or wrong API key; 404 unknown cache key or unknown path; 405 a method the path does
not take; 413 body past --payload-limit; 415 a body that is not `application/json`; 422 a field of the wrong type or
value (a text field past its character limit included), an image that does not decode, an unknown cache key in a
question, too many memories, questions or rerank documents, a rerank text past its token budget with `truncate:
false`, a state too long, a body that is not JSON; 429 the queue is full
(Retry-After); 499 (recorded only) the client went away first; 500 a bug; 501 /v1/memories without --cache or
/v1/retrieve without --index-encoder; 503 loading or shutting down; 504 the request's deadline passed before its
forward began. Error bodies are `{"error": message, "error_type": kind, "field": "memories[2].image" or null}`
(TEI's shape), with Cohere's `message` too on /v1/rerank and /v2/rerank.

The rerank routes (TEI's /rerank, Cohere's, Jina's and vLLM's /v1/rerank and /v2/rerank) score a query's documents
as one question's memories through the same batcher as /v1/score (docs/serve.md, "Rerank").

Each route is one line of `ROUTES`: its method and path, its handler (the request -> one `Infer` call -> the
response), its request and response models and how the guard treats it. A route with a body names its request
model there: the guard checks its content type and size, and the body is parsed straight from its bytes into that
model (pydantic's JSON parser, every string checked against its character limit as it is read: `schemas.Strict`),
so no route can skip a limit.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pixeltriage.delivery.decision import Decision, RankedDocument
from pixeltriage.errors import (InvalidMemoryError, InvalidRequestError, OverloadedError, PixelTriageError,
                                ServiceUnavailableError, StoreCorruptError, StoreError, StoreReadOnlyError,
                                StoreUnavailableError)
from pixeltriage.serve import status as service_status
from pixeltriage.serve.infer import (Admission, Answer, ClientDisconnected, FieldError, Infer, Question, Reranked,
                                     RerankQuestion, RequestTiming, ScoredQuestion)
from pixeltriage.serve.schemas import (CACHE_KEY, DEFAULT_OPEN_K, DOCUMENT_TAGS, BatchRequest, BatchResponse,
                                       Delivery, ErrorBody, MemoryInfo, MemoryPut, Policy, RerankDocument,
                                       RerankExtra, RerankRequest, RerankResponse, RerankResult, RerankSummary,
                                       RetrieveHit, RetrieveRequest, RetrieveResponse, ScoreRequest, ScoreResponse,
                                       Status, Strict, TEIRank, TEIRerankRequest, Timing, VisualTokens, status_of)
from pixeltriage.serve.service import Service

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
BODY = "pixeltriage.body"                                # scope key: the body the guard read, until parsed
ARRIVAL = "pixeltriage.arrival"                          # scope key: when the request's first byte was seen
CLIENT_CLOSED = 499                                      # the status recorded for a client that went away

ERROR_RESPONSES = {status: {"model": ErrorBody, "description": text} for status, text in (
    (401, "missing or wrong API key"), (413, "the body is larger than --payload-limit"),
    (415, "the body is not sent as application/json"),
    (422, "a field of the wrong type or value (or past its character limit), naming it"),
    (429, "the queue is full; retry after Retry-After s"),
    (503, "loading or shutting down"), (504, "the deadline passed before the forward began"))}


@dataclass(frozen=True)
class Route:
    """One line of the route table. handler: the request -> one `Infer` call -> the response; a route with a body
    is called `handler(infer, body, request)` with the body parsed into `body` (its request model: the guard reads,
    bounds and checks it), one without is FastAPI's endpoint itself. response: the response model OpenAPI shows;
    scoring: through the batcher (429 while it is full); cohere: its errors carry Cohere's `message` too; keyless:
    answered without an API key; options: FastAPI's own, for this route alone."""

    method: str
    path: str
    handler: Callable[..., Awaitable[Response]]
    body: type[Strict] | None = None
    response: Any = None
    tag: str = "status"
    scoring: bool = False
    cohere: bool = False
    keyless: bool = False
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if (self.body is not None) != (self.method == "POST"):
            raise TypeError(f"{self.method} {self.path}: a POST route names its request model, no other route has one")
        if self.body is not None and not issubclass(self.body, Strict):
            raise TypeError(f"{self.path}: {self.body.__name__} is not a schemas.Strict model: its strings would "
                            "have no limit")


def create_app(service: Service, *, own_lifespan: bool = True) -> FastAPI:
    """The HTTP API over `service`. own_lifespan: close the service at the app's shutdown (a server process); a
    host that manages the service's life itself passes False."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        if own_lifespan:
            await asyncio.to_thread(service.close)

    from pixeltriage import __version__

    app = FastAPI(title="PixelTriage", version=__version__, lifespan=lifespan, redoc_url=None,
                  description="System One as a service: which retrieved memories deserve pixels. See docs/serve.md.")
    app.state.service = service
    _document_bodies(app)
    _add_error_handlers(app, service)
    for route in ROUTES:
        _add_route(app, route)
    app.add_middleware(Guard, service=service)
    return app


# -- scoring ---------------------------------------------------------------------------------------------------------
async def score(infer: Infer, body: ScoreRequest, request: Request) -> Response:
    """Score one question and its memories (one state, one forward shared with whatever else is ready)."""
    question = Question(body.question, body.memories, body.policy, body.id)
    answer = await infer.score(question, _admission(request, body.timeout_s, body.priority))
    return _answer(answer, _score_response(answer.result, question.policy, answer.timing).model_dump())


async def score_batch(infer: Infer, body: BatchRequest, request: Request) -> Response:
    """Score several questions, each as its own state; they are split across forwards as the budget needs."""
    questions = [Question(q.question, q.memories, q.policy or body.policy, q.id, f"questions[{j}].")
                 for j, q in enumerate(body.questions)]
    answer = await infer.score_batch(questions, _admission(request, body.timeout_s, body.priority))
    results = [_score_response(scored, q.policy, answer.timing) for scored, q in zip(answer.result, questions)]
    return _answer(answer, BatchResponse(results=results).model_dump())


def _score_response(scored: ScoredQuestion, policy: Policy | None, timing: RequestTiming) -> ScoreResponse:
    scores, t = scored.scores, scored.timing
    return ScoreResponse(
        id=scored.id, p_vis=scores.p_vis, gains=scores.gains, relevance=scores.relevance,
        relevance_none=scores.relevance_none, state_tokens=scored.state_tokens,
        delivery=_delivery(scored.decision, policy), visual_tokens=_visual_tokens(scored.decision),
        timing=Timing(queue_ms=1000 * t.queue, preprocess_ms=1000 * t.preprocess, forward_ms=1000 * t.forward,
                      total_ms=1000 * timing.total, batch_questions=t.batch_questions, batch_tokens=t.batch_tokens))


def _delivery(decision: Decision | None, policy: Policy | None) -> Delivery | None:
    if decision is None:
        return None
    return Delivery(open=decision.open, opened=[i + 1 for i, o in enumerate(decision.open) if o],
                    gate_open=decision.gate_open, k=policy.k, token_budget=policy.token_budget,
                    gate_rate=policy.gate_rate)


def _visual_tokens(decision: Decision | None) -> VisualTokens | None:
    if decision is None or decision.visual_tokens is None:
        return None
    tokens = decision.visual_tokens
    return VisualTokens(model=tokens.model, open_all=tokens.open_all, delivery=tokens.delivery)


def _admission(request: Request, timeout: float | None, priority: int) -> Admission:
    """The request's arrival (when the guard saw it), deadline and priority, and its disconnect."""
    log.debug("%s: %s bytes", request.url.path, request.headers.get("content-length", "?"))   # lengths only
    return Admission(request.scope.get(ARRIVAL) or time.monotonic(), timeout, priority,
                     functools.partial(_disconnect, request.receive))


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _answer(answer: Answer, content) -> Response:
    """A scoring answer's JSON `content` with the request's timing headers."""
    t = answer.timing
    headers = {"x-queue-time": _ms(t.queue), "x-preprocess-time": _ms(t.preprocess),
               "x-inference-time": _ms(t.forward), "x-total-time": _ms(t.total)}
    return _json(content, headers)


def _json(content, headers: dict[str, str] | None = None, status: int = 200) -> Response:
    # json.dumps writes floats as their shortest round-trip repr: clients read back the library's exact values
    return Response(json.dumps(content, allow_nan=False, separators=(",", ":")).encode(), status,
                    headers=headers, media_type="application/json")


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3f}"


# -- rerank ----------------------------------------------------------------------------------------------------------
async def rerank_tei(infer: Infer, body: TEIRerankRequest, request: Request) -> Response:
    """Text Embeddings Inference's rerank: the query and its texts as one question's memories -> `[{index,
    score}]` by descending score (System One's gain, or its relevance by `pixeltriage_score` or
    --rerank-score; 0 for a text with no image). A body with `documents`
    instead (what vLLM and Infinity take on /rerank) is answered as /v2/rerank answers."""
    if body.documents is not None:
        return await _cohere(infer, request, body, "2")
    if body.truncation_direction.lower() == "left":
        raise InvalidRequestError("the library keeps the beginning of a text; this server cuts on the right "
                                  "only", "truncation_direction")
    answer = await _rerank(infer, request, body, body.texts, "texts")
    reranked = answer.result
    ranks = [TEIRank(index=d.index, score=d.relevance_score, text=d.document,
                     pixeltriage=_rerank_extra(d, reranked)).model_dump() for d in reranked.documents[:body.top_n]]
    if not body.return_text:
        ranks = [{k: v for k, v in r.items() if k != "text"} for r in ranks]
    return _answer(answer, ranks)


def cohere_rerank(version: str) -> Callable[[Infer, RerankRequest, Request], Awaitable[Response]]:
    """The handler of Cohere's rerank route of API `version` ("1", "2")."""

    async def rerank(infer: Infer, body: RerankRequest, request: Request) -> Response:
        """Cohere's, Jina's and vLLM's rerank: the query and its documents as one question's memories -> `{id,
        results: [{index, relevance_score}], meta, usage}` by descending score (System One's gain, or its relevance
        by `pixeltriage_score` or --rerank-score; 0 for a document with no image), at most `top_n`."""
        return await _cohere(infer, request, body, version)

    return rerank


async def _cohere(infer: Infer, request: Request, body: RerankRequest, version: str) -> Response:
    """A rerank in Cohere's shape (with Jina's and vLLM's `model` and `usage`)."""
    answer = await _rerank(infer, request, body, body.documents, "documents")
    reranked = answer.result
    tokens = reranked.state_tokens
    results = [RerankResult(index=d.index, relevance_score=d.relevance_score, document=RerankDocument(text=d.document),
                            pixeltriage=_rerank_extra(d, reranked)) for d in reranked.documents[:body.top_n]]
    summary = RerankSummary(p_vis=reranked.scores.p_vis, relevance_none=reranked.scores.relevance_none,
                            opened=sorted(d.index for d in reranked.documents if d.open), state_tokens=tokens,
                            query_truncated=reranked.query_truncated)
    response = RerankResponse(id=uuid.uuid4().hex, model=body.model, results=results, pixeltriage=summary,
                              meta={"api_version": {"version": version},
                                    "tokens": {"input_tokens": tokens, "output_tokens": 0}},
                              usage={"total_tokens": tokens, "prompt_tokens": tokens}).model_dump()
    for result in response["results"]:
        if not body.return_documents:
            del result["document"]
    return _answer(answer, response)


async def _rerank(infer: Infer, request: Request, body: RerankRequest, documents: Sequence,
                  collection: str) -> Answer[Reranked]:
    """The body's rerank through the facade. collection: the body's field of `documents` ("documents", TEI's
    "texts")."""
    if body.raw_scores:
        raise InvalidRequestError("System One's scores are probabilities (the gain); this server answers "
                                  "raw_scores: false only", "raw_scores")
    rerank = RerankQuestion(body.query, documents, body.policy or Policy(k=DEFAULT_OPEN_K), collection,
                            body.truncate is not False, body.max_tokens_per_doc, body.pixeltriage_score)
    return await infer.rerank(rerank, _admission(request, body.timeout_s, 0))


def _rerank_extra(document: RankedDocument, reranked: Reranked) -> RerankExtra:
    return RerankExtra(image=document.image, gain=document.gain, relevance=document.relevance,
                       p_vis=reranked.scores.p_vis, open=document.open, truncated=document.truncated)


# -- the write-time cache --------------------------------------------------------------------------------------------
async def put_memory(infer: Infer, body: MemoryPut, request: Request) -> Response:
    """Put an image (base64, or a path under --image-root) and its note into the write-time cache -> its key.
    Idempotent: a second put keeps the row; a non-empty note replaces the stored one."""
    return _json(MemoryInfo(**asdict(await infer.put_memory(body.image, body.path, body.note))).model_dump())


async def get_memory(request: Request, key: str = Path(pattern=CACHE_KEY)) -> Response:
    """A cached image's note, sizes and whether its vision features are stored for this server's model."""
    return _json(MemoryInfo(**asdict(await _infer(request).memory(key))).model_dump())


async def retrieve(infer: Infer, body: RetrieveRequest, request: Request) -> Response:
    """Rank the cached images for a question by their best region (MaxSim over SigLIP 2 vectors stored at write
    time by /v1/memories), or by the whole image with `whole_image`: what to hand /v1/score."""
    hits = await infer.retrieve(body.question, body.top, body.whole_image)
    return _json(RetrieveResponse(hits=[RetrieveHit(**hit.to_dict()) for hit in hits]).model_dump())


# -- status ----------------------------------------------------------------------------------------------------------
async def health() -> Response:
    """Alive: the process answers (the model may still be loading; see /ready)."""
    return _json({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 once the checkpoint is loaded and a warm-up forward at the full batch budget ran; 503 while loading
    or shutting down, and once its model worker stopped ("stalled")."""
    status = _service(request).readiness
    return _json({"status": status}, status=200 if status == "ready" else 503)


async def info(request: Request) -> Response:
    """Checkpoint fingerprints, model shape, device, dtype, the kernel each op uses, limits, version, and the
    event loop and HTTP parser the server runs on."""
    return _json(service_status.info(_service(request)))


async def metrics(request: Request) -> Response:
    """Prometheus text format (the service's own registry)."""
    body, content_type = service_status.exposition(_service(request))
    return Response(body, media_type=content_type)


def _service(request: Request) -> Service:
    return request.app.state.service


def _infer(request: Request) -> Infer:
    return _service(request).infer


# -- the route table -------------------------------------------------------------------------------------------------
ROUTES = (
    Route("POST", "/v1/score", score, ScoreRequest, ScoreResponse, "scoring", scoring=True),
    Route("POST", "/v1/score/batch", score_batch, BatchRequest, BatchResponse, "scoring", scoring=True),
    Route("POST", "/v1/rerank", cohere_rerank("1"), RerankRequest, RerankResponse, "rerank", scoring=True,
          cohere=True),
    Route("POST", "/v2/rerank", cohere_rerank("2"), RerankRequest, RerankResponse, "rerank", scoring=True,
          cohere=True),
    Route("POST", "/rerank", rerank_tei, TEIRerankRequest, list[TEIRank] | RerankResponse, "rerank", scoring=True),
    Route("POST", "/v1/memories", put_memory, MemoryPut, MemoryInfo, "memories"),
    Route("GET", "/v1/memories/{key}", get_memory, None, MemoryInfo, "memories"),
    Route("POST", "/v1/retrieve", retrieve, RetrieveRequest, RetrieveResponse, "memories"),
    Route("GET", "/health", health, None, Status, keyless=True),
    Route("GET", "/ready", ready, None, Status, keyless=True, options={"responses": {503: {"model": Status}}}),
    Route("GET", "/info", info),
    Route("GET", "/metrics", metrics, keyless=True, options={"response_class": Response}),
)
BODY_ROUTES = {r.path: r for r in ROUTES if r.body is not None}   # the bodies the guard reads, bounds and parses
SCORING_PATHS = {r.path for r in ROUTES if r.scoring}
COHERE_PATHS = {r.path for r in ROUTES if r.cohere}
KEYLESS_PATHS = {r.path for r in ROUTES if r.keyless}
LABELLED_PATHS = (*(r.path for r in ROUTES), "/docs", "/openapi.json")     # the table's and FastAPI's own


def _add_route(app: FastAPI, route: Route) -> None:
    """Register `route` with FastAPI: its handler, or for a body route an endpoint that parses the body the guard
    read into the route's request model and calls the handler with the service's facade."""
    options = {"response_model": route.response, "tags": [route.tag], **route.options}
    if _guarded(route.path):
        options.setdefault("responses", ERROR_RESPONSES)
    endpoint = route.handler
    if route.body is not None:
        endpoint = _body_endpoint(route.handler, route.body)
        body_schema = {"$ref": f"#/components/schemas/{route.body.__name__}"}
        options["openapi_extra"] = {"requestBody": {"required": True,
                                                    "content": {JSON_TYPE: {"schema": body_schema}}}}
    app.add_api_route(route.path, endpoint, methods=[route.method], **options)


def _body_endpoint(handler: Callable[..., Awaitable[Response]], model: type[Strict]):
    """FastAPI's endpoint of a body route: `handler(infer, body, request)`, named and documented as the handler."""

    @functools.wraps(handler)
    async def endpoint(request: Request):
        return await handler(_infer(request), await parse_body(request, model), request)

    endpoint.__signature__ = inspect.Signature([inspect.Parameter(
        "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)])
    return endpoint


# -- bodies ----------------------------------------------------------------------------------------------------------
async def parse_body(request: Request, model: type[Strict]) -> Strict:
    """The request's body as `model`, parsed from its bytes and validated in one pass (no dict of the body is built;
    a string past its limit is dropped as soon as it is read, never tokenized); a RequestValidationError (422)
    naming the field."""
    body = request.scope.pop(BODY, None)        # dropped from the scope: the parsed body is all that stays
    if body is None:
        body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False, include_context=True)) from None


def _document_bodies(app: FastAPI) -> None:
    """Put the route table's request models into the OpenAPI schema's components (the routes refer to them by
    name)."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for route in BODY_ROUTES.values():
            body = route.body.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[route.body.__name__] = body
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


# -- errors ----------------------------------------------------------------------------------------------------------
def _error(status: int, kind: str, message: str, field: str | None = None, headers: dict | None = None,
           path: str = "", **extra) -> Response:
    """An error body: TEI's `{error, error_type}` with the field; on COHERE_PATHS Cohere's `message` too."""
    if path in COHERE_PATHS:
        extra["message"] = message
    return _json({"error": message, "error_type": kind, "field": field, **extra}, headers, status)


FAILURE_OF = {"invalid_memory": "invalid_input", "invalid_input": "invalid_input", "state_too_long": "state_too_long",
              "overloaded": "overloaded", "deadline": "deadline", "unavailable": "unavailable",
              "not_found": "not_found", "no_cache": "no_cache", "store_full": "store", "store_unavailable": "store"}


def error_kind(error: BaseException) -> tuple[int, str]:
    """(HTTP status, error_type) of an error raised while answering (a FieldError: of the error it carries), from
    the table the clients read (`schemas.error_statuses`); 500 "internal" for any other."""
    if isinstance(error, FieldError):
        error = error.error
    row = status_of(error)
    return (row.status, row.error_type) if row is not None else (500, "internal")


def _passing(error: BaseException) -> bool:
    """A store fault that a retry may find gone (a lock released, a server back), unlike a read-only or damaged
    store, which waits for its operator."""
    return isinstance(error, StoreUnavailableError) and not isinstance(error, (StoreReadOnlyError, StoreCorruptError))


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    failures = service.metrics.failures

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = field_path(first.get("loc", ()))
        failures.labels("invalid_input").inc()
        message = str(first.get("msg"))
        if first.get("type") == "string_too_long":
            message = (f"longer than this server's limit of {first['ctx']['max_length']} characters for this field "
                       "(docs/serve.md, Limits)")
        return _error(422, "invalid_input", f"{field}: {message}" if field else message, field,
                      path=request.url.path)

    async def known(request: Request, e: Exception):
        status, kind = error_kind(e)
        failures.labels(FAILURE_OF.get(kind, "internal")).inc()
        inner = e.error if isinstance(e, FieldError) else e
        field = e.field if isinstance(e, FieldError) else getattr(e, "field", None)
        message = str(inner) if isinstance(inner, InvalidRequestError) or not field else f"{field}: {inner}"
        extra = {"reason": inner.reason} if isinstance(inner, (InvalidMemoryError, StoreError)) else {}
        # a 503 raised past the guard (a request admitted just before a drain) says when to retry, as the guard's do
        headers = ({"retry-after": str(math.ceil(inner.retry_after))} if isinstance(inner, OverloadedError)
                   else {"retry-after": "1", "connection": "close"} if isinstance(inner, ServiceUnavailableError)
                   else {"retry-after": "1"} if _passing(inner)
                   else None)
        log.debug("%s: %d %s (field %s)", request.url.path, status, kind, field)
        return _error(status, kind, message, field, headers, path=request.url.path, **extra)

    app.add_exception_handler(FieldError, known)
    app.add_exception_handler(PixelTriageError, known)             # every typed error, by error_kind

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):   # unknown routes, unparsable bodies
        # a path the service does not have is "no_route", not the cache's "not_found": a client raises
        # CacheMissError only for a key the cache lacks
        kind = {404: "no_route", 405: "method_not_allowed"}.get(e.status_code, "invalid_input")
        # a body FastAPI cannot parse at all (not UTF-8, numbers past Python's digit limit, nesting too deep) is
        # malformed input like any other: 422, as documented, not FastAPI's 400
        status = 422 if e.status_code == 400 else e.status_code
        return _error(status, kind, str(e.detail), headers=getattr(e, "headers", None), path=request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, e: ClientDisconnected):
        failures.labels("disconnected").inc()
        return _error(CLIENT_CLOSED, "disconnected", "the client disconnected")

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):            # the server logs the traceback after this
        failures.labels("internal").inc()
        return _error(500, "internal", f"internal error ({type(e).__name__}); the server log has the traceback",
                      path=request.url.path)


def field_path(loc: Sequence) -> str | None:
    """A pydantic error location as a field path: ("body", "memories", 2, "image") -> "memories[2].image"."""
    parts = list(loc)
    if parts and parts[0] in ("body", "path", "query"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("function-after[one_source()]", "function-after[matches_type()]", *DOCUMENT_TAGS):
            out += f".{part}" if out else str(part)
    return out or None


# -- the guard -------------------------------------------------------------------------------------------------------
class Guard:
    """Plain ASGI, before any routing: counts requests, checks the API key, refuses early (no body read) while not
    ready, draining or full, and reads the body within --payload-limit (Content-Length or streamed: 413)."""

    def __init__(self, app: ASGIApp, service: Service):
        self.app, self.service = app, service
        self.keys = [key.encode() for key in service.config.api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL] = time.monotonic()
        path = scope["path"]
        route = _label(path)
        counted = self.service.metrics.requests

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                counted.labels(route, str(message["status"])).inc()
            await send(message)

        refusal = self._refusal(scope, path)
        if refusal is not None:
            await refusal(scope, receive, counting_send)
            return
        if path not in BODY_ROUTES or scope["method"] not in ("POST", "PUT"):
            await self.app(scope, receive, counting_send)      # no body of ours to read (unknown routes: 404)
            return
        wrong_type = _wrong_content_type(scope, path)
        if wrong_type is not None:
            self.service.metrics.failures.labels("unsupported_media_type").inc()
            await wrong_type(scope, receive, counting_send)
            return
        with self.service.holding_body():      # every body held in memory counts: at most max_queued of them
            body = await self._body(scope, receive, path)
            if isinstance(body, Response):
                await body(scope, receive, counting_send)
                return
            scope[BODY] = body                 # parsed by the route (`parse_body`), which drops it from the scope
            del body
            await self.app(scope, _after_body(receive), counting_send)

    def _refusal(self, scope: Scope, path: str) -> Response | None:
        service, failures = self.service, self.service.metrics.failures
        if self.keys and path not in KEYLESS_PATHS and not self._authorized(scope):
            failures.labels("unauthorized").inc()
            return _error(401, "unauthorized", "a valid API key is needed: Authorization: Bearer KEY",
                          headers={"www-authenticate": 'Bearer realm="pixeltriage"'}, path=path)
        if not _guarded(path):
            return None
        refused = service.refusal(path in BODY_ROUTES, path in SCORING_PATHS)
        if refused is None:
            return None
        status, kind = error_kind(refused)
        failures.labels(kind).inc()
        if isinstance(refused, OverloadedError):
            headers = {"retry-after": str(refused.retry_after)}
        elif service.status == "loading":
            headers = {"retry-after": "5"}
        else:      # draining or stopped: this replica will not be ready again, so the connection closes
            headers = {"retry-after": "1", "connection": "close"}
        return _error(status, kind, str(refused), headers=headers, path=path)

    def _authorized(self, scope: Scope) -> bool:
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        found = False
        for key in self.keys:                      # every key compared: the time does not tell which matched
            found |= hmac.compare_digest(token, key)
        return found

    async def _body(self, scope: Scope, receive: Receive, path: str) -> bytes | Response:
        limit = self.service.config.payload_limit
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            return self._too_large(limit, path)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _error(CLIENT_CLOSED, "disconnected", "the client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return self._too_large(limit, path)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, limit: int, path: str) -> Response:
        self.service.metrics.failures.labels("payload_too_large").inc()
        return _error(413, "payload_too_large", f"the request body is larger than this server's payload limit of "
                      f"{limit} bytes (--payload-limit); split a batch or send smaller images",
                      headers={"connection": "close"}, path=path)


def _after_body(receive: Receive) -> Receive:
    """The receive of a request whose body the guard read (it is in scope[BODY]): an empty last chunk once (for a
    reader of `request.body()` that comes after `parse_body`), then the connection's own messages (its
    disconnect)."""
    sent = False

    async def after() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()

    return after


def _wrong_content_type(scope: Scope, path: str) -> Response | None:
    """415 for a body not sent as JSON (curl's -d sends application/x-www-form-urlencoded), else None."""
    value = next((v for k, v in scope["headers"] if k == b"content-type"), b"").decode("latin-1")
    media = value.split(";", 1)[0].strip().lower()
    if media == JSON_TYPE:
        return None
    given = f"content-type {media!r}" if media else "no content-type"
    return _error(415, "unsupported_media_type", f"the body must be JSON sent with 'content-type: {JSON_TYPE}' "
                  f"(this request has {given}); with curl: -H 'content-type: {JSON_TYPE}' --data-binary @body.json",
                  headers={"accept": JSON_TYPE}, path=path)


def _guarded(path: str) -> bool:
    """Whether the guard refuses a request to `path` while the service is not ready (or is full): every /v1 path and
    every route with a body."""
    return path.startswith("/v1/") or path in BODY_ROUTES


def _label(path: str) -> str:
    """A request's route as the metrics label it: a path of LABELLED_PATHS (a templated one by the part before its
    parameter), else "other"."""
    for known in LABELLED_PATHS:
        if path == known or ("{" in known and path.startswith(known.split("{", 1)[0])):
            return known
    return "other"
