"""Request and response bodies of the /v1 API (pydantic v2, strict: no type coercion, unknown fields refused).

Memories and questions are numbered from 0 in field paths (`memories[2].image`, as JSON indexes them) and from 1
in messages ("memory 3"), as everywhere in the engine.

Every string field of a request has a character limit (`max_length`), checked while the body is parsed, before the
model reads anything: the text the model reads (question, note, dialogue) at most TEXT_LIMIT characters, a date
DATE_LIMIT; only the encoded images are bounded by the body's size alone (`--payload-limit`), which they mark with
`PAYLOAD_BOUNDED`. A request model without a limit on a string field is refused when its class is defined.
"""
from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from annotated_types import MaxLen
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic.fields import FieldInfo

from pixeltriage.delivery.profiles import ANSWERING_MODEL_NAMES as ANSWERING_MODELS, DEFAULT_ANSWERING_MODEL

CACHE_KEY = r"^[0-9a-f]{64}$"               # pixeltriage.Cache keys: SHA-256 hex of the image's bytes

# characters of one text field the model reads. The library keeps at most 512 tokens of a question and 256 of a
# memory's text (a few thousand characters of prose), so a longer field is never read whole; refusing it bounds the
# preprocessing of a request (docs/serve.md, "Limits")
TEXT_LIMIT = 16_384
DATE_LIMIT = 256                            # the library keeps 32 tokens of a date


class PayloadBounded:
    """The metadata of a string bounded only by the body's size (base64 images): see `Strict`."""

    def __repr__(self) -> str:
        return "PAYLOAD_BOUNDED"


PAYLOAD_BOUNDED = PayloadBounded()
Text = Annotated[str, Field(max_length=TEXT_LIMIT)]
Encoded = Annotated[str, PAYLOAD_BOUNDED]


class UnboundedFieldError(TypeError):
    """A request model declares a string field with no character limit."""


def _limits(metadata) -> bool:
    return any(isinstance(m, (MaxLen, PayloadBounded)) or (isinstance(m, FieldInfo) and _limits(m.metadata))
               for m in metadata)


def _unbounded(annotation, limited: bool) -> str | None:
    """The first type inside `annotation` that can carry an unlimited string (None: none can). `limited`: a limit
    given around it applies to a string here (through Optional/Union, not into a list's items)."""
    if annotation is str:
        return None if limited else "str"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None if issubclass(annotation, Strict) else annotation.__name__     # Strict checks its own fields
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _unbounded(args[0], limited or _limits(args[1:]))
    if origin in (typing.Union, types.UnionType):
        return next((found for a in args if (found := _unbounded(a, limited))), None)
    return next((found for a in args if (found := _unbounded(a, False))), None) if origin is not Literal else None


class Strict(BaseModel):
    """A request body (or part of one): strict types, unknown fields refused, and every string field limited."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs):
        super().__pydantic_init_subclass__(**kwargs)
        for name, info in cls.model_fields.items():
            found = _unbounded(info.annotation, _limits(info.metadata))
            if found is not None:
                raise UnboundedFieldError(f"{cls.__name__}.{name}: a request string needs a character limit "
                                          f"(Field(max_length=...), or Text; a base64 image is Encoded), and a "
                                          f"nested model must be Strict; found {found}")


class MemoryFields(Strict):
    """A memory's fields, as a score request's memory (`MemoryIn`) and a rerank document object (`DocumentIn`) both
    take them: its image (`image`, `key` or `path`) and its texts."""

    image: Optional[Encoded] = Field(None, description="the encoded image (JPEG, PNG, GIF, WebP, BMP, TIFF) as "
                                                       "base64 or a data URI (a URL is refused, never fetched)")
    key: Optional[str] = Field(None, max_length=64, pattern=CACHE_KEY,
                               description="a write-time cache key (POST /v1/memories)")
    path: Optional[str] = Field(None, min_length=1, max_length=4096,
                                description="a file under the server's --image-root, relative to it")
    note: Optional[Text] = Field(None, description="the memory's note; for a `key` memory, null means the cached "
                                                   "note")
    dialogue: Text = ""
    date: str = Field("", max_length=DATE_LIMIT)


class MemoryIn(MemoryFields):
    """One retrieved memory: exactly one of `image` (base64, or a data URI `data:image/...;base64,...`), `key` (a
    write-time cache key, needs the server's --cache) or `path` (relative to the server's --image-root)."""

    @model_validator(mode="after")
    def one_source(self) -> "MemoryIn":
        given = [name for name in ("image", "key", "path") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a memory needs exactly one of 'image', 'key' or 'path' (found {given or 'none'})")
        return self

    @property
    def source(self) -> str:
        """The field that names the image: "image", "key" or "path"."""
        return "image" if self.image is not None else "key" if self.key is not None else "path"


class Policy(Strict):
    """A delivery rule applied to the scores: the k highest gains, within a visual-token budget, behind a rate gate."""

    k: Optional[int] = Field(None, ge=0, description="open at most the k highest-gain memories (null: no cap)")
    token_budget: Optional[int] = Field(None, ge=0, description="open by descending gain while the answering "
                                                                "model's visual tokens fit this budget")
    gate_rate: Optional[float] = Field(None, gt=0, le=1, description="open images only for questions whose p_vis "
                                                                     "ranks in this top fraction of the stream")
    gate_stream: str = Field("default", min_length=1, max_length=128,
                             description="which stream's rate gate: one gate per (stream, rate)")
    answering_model: Literal[ANSWERING_MODELS] = Field(DEFAULT_ANSWERING_MODEL,
                                                       description="whose visual-token rule prices the images (docs/delivery.md)")


class ScoreRequest(Strict):
    question: Text
    memories: list[MemoryIn] = Field(default_factory=list)
    policy: Optional[Policy] = None
    id: Optional[str] = Field(None, max_length=256, description="echoed in the response")
    timeout_s: Optional[float] = Field(None, gt=0, description="a deadline shorter than the server's "
                                                               "--request-timeout")
    priority: int = Field(0, ge=0, le=9, description="higher is prepared and scored first")


class BatchQuestion(Strict):
    question: Text
    memories: list[MemoryIn] = Field(default_factory=list)
    policy: Optional[Policy] = Field(None, description="this question's rule (default: the batch's)")
    id: Optional[str] = Field(None, max_length=256)


class BatchRequest(Strict):
    questions: list[BatchQuestion] = Field(min_length=1)
    policy: Optional[Policy] = None
    timeout_s: Optional[float] = Field(None, gt=0)
    priority: int = Field(0, ge=0, le=9)


class Delivery(BaseModel):
    open: list[bool] = Field(description="per memory, whether its pixels are delivered")
    opened: list[int] = Field(description="the delivered memories, numbered from 1")
    gate_open: bool
    k: Optional[int]
    token_budget: Optional[int]
    gate_rate: Optional[float]


class VisualTokens(BaseModel):
    model: str
    open_all: int = Field(description="the answering model's visual tokens with every image opened")
    delivery: int = Field(description="... with this delivery's images opened")


class Timing(BaseModel):
    queue_ms: float = Field(description="admitted -> its forward began, preprocessing excluded")
    preprocess_ms: float = Field(description="base64 and image decoding, thumbnails, tokenizing, packing")
    forward_ms: float = Field(description="the forward this question ran in (shared with its batch)")
    total_ms: float = Field(description="arrival -> response")
    batch_questions: int
    batch_tokens: int


class ScoreResponse(BaseModel):
    id: Optional[str]
    p_vis: float
    gains: list[float]
    relevance: list[float]
    relevance_none: float
    state_tokens: int
    delivery: Optional[Delivery] = Field(description="with a policy")
    visual_tokens: Optional[VisualTokens] = Field(description="with a policy, when every image's size is known")
    timing: Timing


class BatchResponse(BaseModel):
    results: list[ScoreResponse]


class MemoryPut(Strict):
    image: Optional[Encoded] = Field(None, description="base64 or a data URI")
    path: Optional[str] = Field(None, min_length=1, max_length=4096, description="relative to --image-root")
    note: Text = ""

    @model_validator(mode="after")
    def one_source(self) -> "MemoryPut":
        if (self.image is None) == (self.path is None):
            raise ValueError("exactly one of 'image' or 'path' is needed")
        return self


class MemoryInfo(BaseModel):
    key: str
    note: str
    width: Optional[int] = Field(description="the original image's displayed width (null for old cache rows)")
    height: Optional[int]
    thumbnail_width: int
    thumbnail_height: int
    features_cached: bool = Field(description="vision features stored for this server's model")
    regions_indexed: Optional[bool] = Field(None, description="region vectors stored for this server's encoder "
                                                              "(null: the server has no --index-encoder)")


class RetrieveRequest(Strict):
    """A question to rank the cached images for, by their best region (DeliverMem R1)."""

    question: Text
    top: int = Field(10, ge=1, le=1000, description="images to return")
    whole_image: bool = Field(False, description="score by the whole-image embedding only (the control)")


class RetrieveHit(BaseModel):
    key: str
    score: float = Field(description="cosine similarity of the question and the winning region")
    region: str = Field(description="whole, top-left, top-right, bottom-left or bottom-right")
    box: Optional[list[int]] = Field(description="the region in the displayed image: [left, top, right, bottom]")


class RetrieveResponse(BaseModel):
    hits: list[RetrieveHit]


class ErrorBody(BaseModel):
    error: str
    error_type: str = Field(description="invalid_input, invalid_memory, state_too_long, payload_too_large, "
                                        "unsupported_media_type, unauthorized, overloaded, deadline, unavailable, "
                                        "not_found, method_not_allowed, no_cache, internal")
    field: Optional[str] = Field(None, description="the request field, e.g. memories[2].image")
    reason: Optional[str] = Field(None, description="invalid_memory: the library's reason, without 'memory N: '")
    message: Optional[str] = Field(None, description="/v1/rerank and /v2/rerank: `error` again, where Cohere's SDK "
                                                     "reads it")


class Status(BaseModel):
    status: str


# -- rerank (TEI, Cohere, Jina, vLLM shapes: docs/serve.md, "Rerank") ------------------------------------------------
MODEL_NAME_LIMIT = 256
DEFAULT_OPEN_K = 2                          # the open decision without a `policy`: the adapters' default k
RERANK_SCORES = ("gain", "relevance")       # what `relevance_score` (TEI: `score`) carries: Scores.gains or .relevance
RerankScore = Literal[RERANK_SCORES]


class ImageURL(Strict):
    """An OpenAI-style image part's `image_url`: a data URI or base64 (a URL is refused, never fetched)."""

    url: Encoded
    detail: Optional[Literal["auto", "low", "high"]] = None


class ContentPart(Strict):
    """One part of a vLLM multimodal document: `{"type": "image_url", "image_url": {"url": ...}}` or
    `{"type": "text", "text": ...}`."""

    type: Literal["image_url", "text"]
    image_url: Optional[ImageURL] = None
    text: Optional[Text] = None

    @model_validator(mode="after")
    def matches_type(self) -> "ContentPart":
        if (self.type == "text") != (self.text is not None) or (self.type == "image_url") != (self.image_url is not None):
            raise ValueError(f"a '{self.type}' part needs its '{self.type}' field and no other")
        return self


class DocumentIn(MemoryFields):
    """A rerank document given as an object: Jina's `{"text", "image"}`, vLLM's `{"content": [...]}`, or a memory
    (`MemoryFields`: `key`, `path`, `image`, with `note`, `dialogue`, `date`). `text` is the note when `note` is
    absent; unlike `MemoryIn`, a document may have no image (it is then scored 0)."""

    text: Optional[Text] = None
    content: Optional[list[ContentPart]] = Field(None, description="vLLM's multimodal document: at most one image")


DOCUMENT_TAGS = ("string-document", "object-document")     # the union's branches: left out of error field paths


def _document_kind(value) -> str:
    return DOCUMENT_TAGS[0] if isinstance(value, str) else DOCUMENT_TAGS[1]


Document = Annotated[Union[Annotated[Text, Tag(DOCUMENT_TAGS[0])], Annotated[DocumentIn, Tag(DOCUMENT_TAGS[1])]],
                     Discriminator(_document_kind)]


class RerankRequest(Strict):
    """Cohere v1/v2, Jina, vLLM and Infinity's rerank body (POST /v1/rerank, /v2/rerank, and /rerank), with
    PixelTriage's `policy`. A string document is a write-time cache key, a JSON memory object, or plain text (no
    image: scored 0)."""

    model: Optional[str] = Field(None, max_length=MODEL_NAME_LIMIT, description="echoed; the server's model scores")
    query: Text
    documents: list[Document] = Field(description="at most --max-memories; see docs/serve.md for what each may be")
    top_n: Optional[int] = Field(None, ge=1, description="return the n highest scores (null: all)")
    return_documents: Optional[bool] = Field(None, description="each result carries `document: {text}`")
    max_tokens_per_doc: Optional[int] = Field(None, ge=1, description="cut each document's note and dialogue to "
                                                                      "this many tokens (below the library's budget)")
    max_chunks_per_doc: Optional[int] = Field(None, ge=1, description="Cohere v1; a document is one memory, never "
                                                                      "chunked")
    truncate: Optional[bool] = Field(None, description="false: a text past the library's token budget is a 422 "
                                                       "instead of being cut")
    raw_scores: bool = Field(False, description="TEI and Infinity; true is refused: the gain is a probability")
    policy: Optional[Policy] = Field(None, description=f"the open decision (default: k={DEFAULT_OPEN_K})")
    pixeltriage_score: Optional[RerankScore] = Field(None, description="what `relevance_score` (TEI: `score`) "
                                                     "carries and the results are sorted by: System One's `gain` or "
                                                     "its `relevance` (null: the server's --rerank-score, default "
                                                     "gain); both are in each result's `pixeltriage` either way")
    timeout_s: Optional[float] = Field(None, gt=0)


class TEIRerankRequest(RerankRequest):
    """POST /rerank: Text Embeddings Inference's body (`texts`, answered as TEI's list of ranks), or, as vLLM and
    Infinity serve /rerank, the Cohere/Jina body (`documents`, answered as /v2/rerank answers)."""

    documents: Optional[list[Document]] = Field(None, description="the Cohere/Jina shape (exactly one of "
                                                                  "documents or texts)")
    texts: Optional[list[Text]] = Field(None, description="TEI's: documents as strings (a cache key, a JSON memory "
                                                          "object, or plain text)")
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    return_text: bool = False

    @model_validator(mode="after")
    def one_shape(self) -> "TEIRerankRequest":
        if (self.texts is None) == (self.documents is None):
            raise ValueError("exactly one of 'texts' (TEI's shape) or 'documents' (Cohere's and Jina's) is needed")
        return self


class RerankExtra(BaseModel):
    """What System One says of one document beyond its score (ignored by the standard clients)."""

    image: bool = Field(description="the document carried an image (or a cache key) and was scored")
    gain: Optional[float] = Field(description="Scores.gains[i] (null: no image)")
    relevance: Optional[float] = Field(description="Scores.relevance[i] (null: no image)")
    p_vis: float = Field(description="Scores.p_vis of the query (the same for every document)")
    open: bool = Field(description="the policy delivers this document's pixels")
    truncated: bool = Field(description="a text of the document was cut to the token budget")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = Field(None, description="with return_documents")
    pixeltriage: RerankExtra


class RerankSummary(BaseModel):
    p_vis: float
    relevance_none: float
    opened: list[int] = Field(description="the documents whose pixels are delivered, by index")
    state_tokens: int
    query_truncated: bool


class RerankResponse(BaseModel):
    """Cohere's shape (`id`, `results`, `meta`) with Jina's and vLLM's (`model`, `usage`)."""

    id: str
    model: Optional[str]
    results: list[RerankResult]
    meta: dict
    usage: dict
    pixeltriage: RerankSummary


class TEIRank(BaseModel):
    index: int
    score: float
    text: Optional[str] = None
    pixeltriage: RerankExtra


# -- errors over HTTP ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorStatus:
    """How one error crosses HTTP: the library error, the status and the `error_type` of its body.

    by_status: a response with this status and no `error_type` of the table (a proxy's plain 503, an unknown kind)
    is still this error."""

    error: type[Exception]
    status: int
    error_type: str
    by_status: bool = False


@functools.cache
def error_statuses() -> tuple[ErrorStatus, ...]:
    """The one table of the scoring service's errors: the server answers an error with the first row its class
    matches, and both clients (`Client`, `AsyncClient`) raise the row of the error_type a response's body names
    (`error_for`: else the `by_status` row of its status, else ServiceError). Each error_type names one row."""
    from pixeltriage.errors import (AuthenticationError, CacheMissError, DeadlineExceededError, InvalidMemoryError,
                                    InvalidRequestError, NoCacheError, OverloadedError, ServiceUnavailableError,
                                    StateTooLongError, StoreFullError, StoreUnavailableError)

    return (ErrorStatus(InvalidMemoryError, 422, "invalid_memory"),
            ErrorStatus(StateTooLongError, 422, "state_too_long"),
            ErrorStatus(InvalidRequestError, 422, "invalid_input", by_status=True),
            ErrorStatus(InvalidRequestError, 413, "payload_too_large", by_status=True),
            ErrorStatus(InvalidRequestError, 415, "unsupported_media_type", by_status=True),
            ErrorStatus(AuthenticationError, 401, "unauthorized", by_status=True),
            ErrorStatus(OverloadedError, 429, "overloaded", by_status=True),
            ErrorStatus(DeadlineExceededError, 504, "deadline", by_status=True),
            ErrorStatus(ServiceUnavailableError, 503, "unavailable", by_status=True),
            ErrorStatus(CacheMissError, 404, "not_found"),
            ErrorStatus(NoCacheError, 501, "no_cache"),
            # the write-time store's faults; the body's `reason` names which (errors.StoreError.reason)
            ErrorStatus(StoreFullError, 507, "store_full", by_status=True),
            ErrorStatus(StoreUnavailableError, 503, "store_unavailable"))


def status_of(error: BaseException) -> ErrorStatus | None:
    """The table's row for an error the server raised (None: not a refusal of the table, a 500)."""
    return next((row for row in error_statuses() if isinstance(error, row.error)), None)


def error_for(status: int, error_type: str | None) -> ErrorStatus | None:
    """The table's row for an error response: the row of the `error_type` its body names (each names one row), else
    the `by_status` row of its status (a body without a kind of the table: a proxy's); None: the client raises
    ServiceError."""
    rows = error_statuses()
    return (next((r for r in rows if r.error_type == error_type), None)
            or next((r for r in rows if r.status == status and r.by_status), None))
