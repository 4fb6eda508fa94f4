"""Clients of `pixeltriage serve`: `Client` (sync) and `AsyncClient` (asyncio), both on httpx.

    client = Client("http://127.0.0.1:8080", api_key=None)
    scores = client.score(question, memories)          # the Scores that Scorer.score returns for the same input

Memories are the library's `Memory`: an image given as bytes, a local file path or a PIL image is sent as base64 (a
PIL image losslessly, as PNG, or TIFF for modes PNG lacks, with its EXIF orientation), a cache key as the key. The
server's refusals come back as the library's typed errors, by the table the server answers them with
(`schemas.error_statuses`: the row of the `error_type` the body names, else of the status): InvalidMemoryError (with
its index), StateTooLongError, InvalidRequestError (with the field), CacheMissError, OverloadedError (with
retry_after), DeadlineExceededError, ServiceUnavailableError, AuthenticationError, NoCacheError; any other is a
ServiceError. Connection failures, 502, 503 and 429 are retried `retries` times (scoring is idempotent; a retried
question may count twice in a server-side rate gate), after Retry-After when the server gives one, at most
`max_retry_wait` seconds.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from pixeltriage.delivery.decision import Decision, RankedDocument, VisualTokens
from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL
from pixeltriage.engine.types import Memory, Scores, user_text
from pixeltriage.errors import (STORE_ERRORS, CacheMissError, DeadlineExceededError, InvalidMemoryError,
                                InvalidRequestError, OverloadedError, ServiceError, ServiceUnavailableError,
                                StateTooLongError, StoreUnavailableError)
from pixeltriage.media.sources import read_local
from pixeltriage.serve.schemas import error_for

DEFAULT_URL = "http://127.0.0.1:8080"
RETRIED_STATUS = (429, 502, 503)
_MEMORY_INDEX = re.compile(r"memories\[(\d+)\]")
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I;16")


@dataclass(frozen=True)
class Decided:
    """A scored question with the server's delivery under a policy (what `decide` returns).

    decision: the delivery (`pixeltriage.delivery.decision.Decision`: scores, open, gate_open, visual_tokens; None
    for an answer without a policy); state_tokens: the packed state's length; timing: the server's queue /
    preprocess / forward / total milliseconds and the batch it ran in; id: the request's, echoed."""

    scores: Scores
    decision: Decision | None
    state_tokens: int
    timing: dict
    id: str | None = None


@dataclass(frozen=True)
class Reranking:
    """A rerank answer (`schemas.RerankResponse` and its `pixeltriage` summary): `results` by descending score (the
    first top_n, each a `RankedDocument`), the query's `p_vis` and `relevance_none`, the `opened` documents by index,
    the packed state's tokens, whether the query was cut; `raw` is the route's JSON as it came (Cohere's `meta`,
    Jina's `usage`)."""

    id: str
    model: str | None
    results: list[RankedDocument]
    p_vis: float
    relevance_none: float
    opened: list[int]
    state_tokens: int
    query_truncated: bool
    raw: dict = dataclasses.field(repr=False, compare=False)


# -- requests --------------------------------------------------------------------------------------------------------
def encode_memories(memories: Sequence[Memory]) -> list[dict]:
    """Memories as the API's JSON objects (images as base64). Raises InvalidMemoryError(reason, index) for what the
    library would refuse the same way: not a Memory, text that is not a string, an unreadable image source."""
    return [_encode_memory(m, i) for i, m in enumerate(memories)]


def _encode_memory(m: Memory, index: int) -> dict:
    if not isinstance(m, Memory):
        raise InvalidMemoryError(f"expected a pixeltriage.Memory, got {type(m).__name__}", index)
    out: dict[str, Any] = {"note": user_text(m.note, "note", index) if m.note is not None else None,
                           "dialogue": user_text(m.dialogue, "dialogue", index),
                           "date": user_text(m.date, "date", index)}
    if m.key is not None:
        out["key"] = m.key
    else:
        out["image"] = base64.b64encode(_image_bytes(m.image, index)).decode("ascii")
    return out


def _image_bytes(image, index: int | None) -> bytes:
    if isinstance(image, (bytes, bytearray)):
        if not image:
            raise InvalidMemoryError("image bytes are empty", index)
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return read_local(image, index)
    from PIL import Image

    if isinstance(image, Image.Image):
        return _lossless(image)
    raise InvalidMemoryError(f"an image must be a PIL image, bytes or a path, found {type(image).__name__}", index)


def _lossless(image) -> bytes:
    """A PIL image as bytes that decode to the same pixels and orientation: PNG, or TIFF for modes PNG lacks."""
    buffer = io.BytesIO()
    exif = image.getexif()
    options = {"exif": exif.tobytes()} if len(exif) else {}
    image.save(buffer, format="PNG" if image.mode in PNG_MODES else "TIFF", **options)
    return buffer.getvalue()


def _policy(k, token_budget, gate_rate, gate_stream, answering_model) -> dict:
    return {"k": k, "token_budget": token_budget, "gate_rate": gate_rate, "gate_stream": gate_stream,
            "answering_model": answering_model}


def question_body(question, memories, **extra) -> dict:
    """The JSON body of one question: memories encoded as the server takes them (images as base64), `extra` fields
    that are not None."""
    body = {"question": user_text(question, "question", None), "memories": encode_memories(list(memories))}
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


# -- responses -------------------------------------------------------------------------------------------------------
def scores_of(result: dict) -> Scores:
    return Scores(p_vis=result["p_vis"], gains=list(result["gains"]), relevance=list(result["relevance"]),
                  relevance_none=result["relevance_none"])


def decision_of(result: dict) -> Decided:
    scores, delivery, visual = scores_of(result), result.get("delivery"), result.get("visual_tokens")
    decision = None
    if delivery:
        decision = Decision(scores, list(delivery["open"]), delivery["gate_open"],
                            VisualTokens(**visual) if visual else None)
    return Decided(scores=scores, decision=decision, state_tokens=result["state_tokens"], timing=result["timing"],
                   id=result.get("id"))


def reranking_of(response: dict) -> Reranking:
    summary = response["pixeltriage"]
    results = [RankedDocument(index=r["index"], relevance_score=r["relevance_score"], image=r["pixeltriage"]["image"],
                              gain=r["pixeltriage"]["gain"], relevance=r["pixeltriage"]["relevance"],
                              open=r["pixeltriage"]["open"], truncated=r["pixeltriage"]["truncated"],
                              document=r["document"]["text"] if r.get("document") else None)
               for r in response["results"]]
    return Reranking(id=response["id"], model=response.get("model"), results=results, p_vis=summary["p_vis"],
                     relevance_none=summary["relevance_none"], opened=list(summary["opened"]),
                     state_tokens=summary["state_tokens"], query_truncated=summary["query_truncated"], raw=response)


def error_of(response: httpx.Response, question_offset: int = 0) -> Exception:
    """The library's typed error for an error response. question_offset: where the request's questions start in
    the caller's whole list (a split batch), so that a field names the caller's question."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    message = str(body.get("error") or f"HTTP {status} {response.reason_phrase}")
    kind, field = body.get("error_type"), body.get("field")
    if question_offset and isinstance(field, str) and (found := _QUESTION.match(field)):
        renumbered = f"questions[{question_offset + int(found.group(1))}]" + field[found.end():]
        message = renumbered + message[len(field):] if message.startswith(field) else message
        field = renumbered
    row = error_for(status, kind)           # by the error_type the body names, else by status
    return _error_of_class(row.error if row is not None else ServiceError, message, field, body, response)


def _error_of_class(error: type[Exception], message: str, field: str | None, body: dict,
                    response: httpx.Response) -> Exception:
    """An instance of the table's error class `error`, given what its constructor takes."""
    status = response.status_code
    unprefixed = message.removeprefix(f"{field}: ") if field else message
    if error is InvalidMemoryError:
        if field and (index := _MEMORY_INDEX.findall(field)):
            found = InvalidMemoryError(str(body.get("reason") or message), int(index[-1]))
            found.field = field
            return found
        return InvalidRequestError(unprefixed, field, status)  # a memory the body does not number: any other 422
    if error is OverloadedError:
        return OverloadedError(message, _retry_after(response) or 1.0, status)
    if error is StateTooLongError:
        return StateTooLongError(unprefixed)
    if error is InvalidRequestError:
        return InvalidRequestError(unprefixed, field, status)
    if error is CacheMissError:                 # GET /v1/memories/{key}: the key, the server's message
        return CacheMissError(response.url.path.rsplit("/", 1)[-1], message)
    if error is StoreUnavailableError:          # the body's reason names which: locked, read_only, ...
        return STORE_ERRORS.get(body.get("reason"), StoreUnavailableError)(message, status)
    return error(message, status)        # ServiceError and its kinds: AuthenticationError, NoCacheError, ...


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


class _Retry:
    """When to try again: a connection failure, 502, 503 or 429, `retries` times, backing off."""

    def __init__(self, retries: int, max_wait: float):
        self.left, self.max_wait, self.attempt = retries, max_wait, 0

    def wait_after(self, response: httpx.Response | None) -> float | None:
        """Seconds to wait before the next try, or None to stop."""
        if self.left <= 0 or (response is not None and response.status_code not in RETRIED_STATUS):
            return None
        self.left -= 1
        self.attempt += 1
        given = _retry_after(response) if response is not None else None
        return min(self.max_wait, given if given is not None else 0.1 * 2 ** (self.attempt - 1))


CONNECTION_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                     httpx.ConnectTimeout)


# -- the clients -----------------------------------------------------------------------------------------------------
class _Base:
    def __init__(self, url: str, api_key: str | None, timeout: float, retries: int, max_retry_wait: float):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries, self.max_retry_wait = retries, max_retry_wait
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._batch_size: int | None = None

    def _http_timeout(self, timeout_s: float | None) -> float:
        # the server drops a request at its deadline; give the answer time to arrive
        return self.timeout if timeout_s is None else min(self.timeout, timeout_s + 5.0)

    def _batch_body(self, chunk, policy, timeout_s, priority) -> dict:
        return {"questions": [question_body(q, m) for q, m in chunk], "policy": policy, "timeout_s": timeout_s,
                "priority": priority}

    @staticmethod
    def _memory_body(image, note: str) -> dict:
        return {"image": base64.b64encode(_image_bytes(image, None)).decode("ascii"),
                "note": user_text(note, "note", None)}

    @staticmethod
    def _rerank_body(query: str, documents: Sequence, top_n: int | None, k: int | None, score: str | None,
                     return_documents: bool, timeout_s: float | None) -> dict:
        docs = [_encode_memory(d, i) if isinstance(d, Memory) else d for i, d in enumerate(documents)]
        body: dict[str, Any] = {"query": user_text(query, "query", None), "documents": docs, "top_n": top_n,
                                "return_documents": return_documents, "pixeltriage_score": score,
                                "timeout_s": timeout_s}
        if k is not None:
            body["policy"] = {"k": k}
        return body

    @staticmethod
    def _retrieve_body(question: str, top: int, whole_image: bool) -> dict:
        return {"question": user_text(question, "question", None), "top": top, "whole_image": whole_image}


class Client(_Base):
    """A synchronous client (thread-safe: httpx's connection pool). Use as a context manager, or call close()."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 120.0,
                 retries: int = 2, max_retry_wait: float = 10.0, transport: httpx.BaseTransport | None = None):
        super().__init__(url, api_key, timeout, retries, max_retry_wait)
        self._http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout, transport=transport)

    def score(self, question: str, memories: Sequence[Memory], *, timeout_s: float | None = None,
              priority: int = 0) -> Scores:
        """p_vis, gains and relevance for one question: what `Scorer.score(question, memories)` returns."""
        return scores_of(self._score(question_body(question, memories, timeout_s=timeout_s, priority=priority),
                                     timeout_s))

    def decide(self, question: str, memories: Sequence[Memory], *, k: int | None = None,
               token_budget: int | None = None, gate_rate: float | None = None, gate_stream: str = "default",
               answering_model: str = DEFAULT_ANSWERING_MODEL, timeout_s: float | None = None, priority: int = 0,
               id: str | None = None) -> Decided:
        """Scores and the server's delivery under a policy (top k, a visual-token budget, a rate gate)."""
        body = question_body(question, memories, policy=_policy(k, token_budget, gate_rate, gate_stream,
                                                                 answering_model),
                              timeout_s=timeout_s, priority=priority, id=id)
        return decision_of(self._score(body, timeout_s))

    def score_batch(self, episodes: Sequence[tuple[str, Sequence[Memory]]], *, timeout_s: float | None = None,
                    priority: int = 0) -> list[Scores]:
        """Scores of several (question, memories) episodes, in order; sent in requests of at most the server's
        --max-client-batch questions."""
        episodes, size, out = list(episodes), self.batch_size(), []
        for start in range(0, len(episodes), size):
            body = self._batch_body(episodes[start:start + size], None, timeout_s, priority)
            out += [scores_of(r) for r in self._request("POST", "/v1/score/batch", body, timeout_s, start)["results"]]
        return out

    def rerank(self, query: str, documents: Sequence, *, top_n: int | None = None, k: int | None = None,
               score: str | None = None, return_documents: bool = False,
               timeout_s: float | None = None) -> Reranking:
        """POST /v2/rerank: `documents` are Memory objects or what the route takes (a cache key, a JSON memory
        string, plain text, a Jina or vLLM object); `k` the open decision (server default 2); `score` "gain" or
        "relevance" (None: the server's --rerank-score). A `Reranking`: `results` by descending score, each a
        `RankedDocument`, and the query's summary; `.raw` is the route's JSON (docs/serve.md, "Rerank")."""
        body = self._rerank_body(query, documents, top_n, k, score, return_documents, timeout_s)
        return reranking_of(self._request("POST", "/v2/rerank", body, timeout_s))

    def put_memory(self, image, note: str = "") -> str:
        """Put an image (bytes, a local path or a PIL image) and its note into the server's write-time cache; its key."""
        return self._request("POST", "/v1/memories", self._memory_body(image, note))["key"]

    def memory(self, key: str) -> dict:
        """A cached image's metadata (note, sizes, features_cached, regions_indexed); CacheMissError when absent."""
        return self._request("GET", f"/v1/memories/{key}")

    def retrieve(self, question: str, top: int = 10, *, whole_image: bool = False) -> list:
        """The server's region-index ranking of its cached images for `question`: `pixeltriage.retrieval.Hit`s, as
        `RegionIndex.search` returns them (needs a server started with --index-encoder)."""
        return _hits(self._request("POST", "/v1/retrieve", self._retrieve_body(question, top, whole_image)))

    def health(self) -> dict:
        return self._request("GET", "/health")

    def ready(self) -> bool:
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def info(self) -> dict:
        return self._request("GET", "/info")

    def batch_size(self) -> int:
        if self._batch_size is None:
            self._batch_size = int(self.info()["limits"]["max_client_batch"])
        return self._batch_size

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _score(self, body: dict, timeout_s: float | None) -> dict:
        return self._request("POST", "/v1/score", body, timeout_s)

    def _request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None,
                 question_offset: int = 0) -> dict:
        retry = _Retry(self.retries, self.max_retry_wait)
        while True:
            try:
                response = self._http.request(method, path, json=body, timeout=self._http_timeout(timeout_s))
            except CONNECTION_ERRORS as e:
                wait = retry.wait_after(None)
                if wait is None:
                    raise ServiceUnavailableError(f"{self.url}{path}: no answer ({type(e).__name__}: {e})") from None
                time.sleep(wait)
                continue
            except httpx.TimeoutException as e:
                raise DeadlineExceededError(f"{self.url}{path}: no answer within the client's timeout ({e})") from None
            if response.status_code == 200:
                return response.json()
            wait = retry.wait_after(response)
            if wait is None:
                raise error_of(response, question_offset)
            time.sleep(wait)


class AsyncClient(_Base):
    """The asyncio client: the same methods as `Client`, awaited."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 120.0,
                 retries: int = 2, max_retry_wait: float = 10.0, transport: httpx.AsyncBaseTransport | None = None,
                 max_connections: int = 100):
        super().__init__(url, api_key, timeout, retries, max_retry_wait)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout, transport=transport,
                                       limits=httpx.Limits(max_connections=max_connections))

    async def score(self, question: str, memories: Sequence[Memory], *, timeout_s: float | None = None,
                    priority: int = 0) -> Scores:
        body = question_body(question, memories, timeout_s=timeout_s, priority=priority)
        return scores_of(await self._request("POST", "/v1/score", body, timeout_s))

    async def decide(self, question: str, memories: Sequence[Memory], *, k: int | None = None,
                     token_budget: int | None = None, gate_rate: float | None = None, gate_stream: str = "default",
                     answering_model: str = DEFAULT_ANSWERING_MODEL, timeout_s: float | None = None, priority: int = 0,
                     id: str | None = None) -> Decided:
        body = question_body(question, memories, policy=_policy(k, token_budget, gate_rate, gate_stream,
                                                                 answering_model),
                              timeout_s=timeout_s, priority=priority, id=id)
        return decision_of(await self._request("POST", "/v1/score", body, timeout_s))

    async def score_batch(self, episodes: Sequence[tuple[str, Sequence[Memory]]], *, timeout_s: float | None = None,
                          priority: int = 0) -> list[Scores]:
        episodes, size, out = list(episodes), await self.batch_size(), []
        for start in range(0, len(episodes), size):
            body = self._batch_body(episodes[start:start + size], None, timeout_s, priority)
            out += [scores_of(r) for r in
                    (await self._request("POST", "/v1/score/batch", body, timeout_s, start))["results"]]
        return out

    async def rerank(self, query: str, documents: Sequence, *, top_n: int | None = None, k: int | None = None,
                     score: str | None = None, return_documents: bool = False,
                     timeout_s: float | None = None) -> Reranking:
        body = self._rerank_body(query, documents, top_n, k, score, return_documents, timeout_s)
        return reranking_of(await self._request("POST", "/v2/rerank", body, timeout_s))

    async def put_memory(self, image, note: str = "") -> str:
        return (await self._request("POST", "/v1/memories", self._memory_body(image, note)))["key"]

    async def memory(self, key: str) -> dict:
        return await self._request("GET", f"/v1/memories/{key}")

    async def retrieve(self, question: str, top: int = 10, *, whole_image: bool = False) -> list:
        return _hits(await self._request("POST", "/v1/retrieve", self._retrieve_body(question, top, whole_image)))

    async def health(self) -> dict:
        return await self._request("GET", "/health")

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    async def info(self) -> dict:
        return await self._request("GET", "/info")

    async def batch_size(self) -> int:
        if self._batch_size is None:
            self._batch_size = int((await self.info())["limits"]["max_client_batch"])
        return self._batch_size

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None,
                 question_offset: int = 0) -> dict:
        retry = _Retry(self.retries, self.max_retry_wait)
        while True:
            try:
                response = await self._http.request(method, path, json=body, timeout=self._http_timeout(timeout_s))
            except CONNECTION_ERRORS as e:
                wait = retry.wait_after(None)
                if wait is None:
                    raise ServiceUnavailableError(f"{self.url}{path}: no answer ({type(e).__name__}: {e})") from None
                await asyncio.sleep(wait)
                continue
            except httpx.TimeoutException as e:
                raise DeadlineExceededError(f"{self.url}{path}: no answer within the client's timeout ({e})") from None
            if response.status_code == 200:
                return response.json()
            wait = retry.wait_after(response)
            if wait is None:
                raise error_of(response, question_offset)
            await asyncio.sleep(wait)


def _hits(response: dict) -> list:
    from pixeltriage.retrieval.types import Box, Hit

    return [Hit(h["key"], h["score"], h["region"], None if h["box"] is None else Box(*h["box"]))
            for h in response["hits"]]


_QUESTION = re.compile(r"^questions\[(\d+)\]")
