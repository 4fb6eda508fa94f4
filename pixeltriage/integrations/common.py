"""What the framework adapters share, free of any framework: an item's image and text as a `Memory`, one scoring
call per question (in process or remote), and what an adapter writes of the delivery decision.

An item (a LlamaIndex node, a LangChain document) is scored when it carries an image or a write-time cache key;
System One scores image memories only, so an item with neither is passed through unscored. Image values are
accepted as a local path, base64 (or a `data:` URI), bytes or a PIL image; a URL is fetched only when the adapter
was built with `allow_url_images=True` (otherwise it is refused, and nothing is fetched).
"""
from __future__ import annotations

import datetime
import inspect
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pixeltriage.delivery.decision import Decision
from pixeltriage.engine.types import Memory, Scores
from pixeltriage.errors import InvalidMemoryError, InvalidRequestError
from pixeltriage.media.policy import is_url
from pixeltriage.media.sources import decode_base64

MAX_URL_BYTES = 64 << 20           # a fetched image larger than this is refused before it is read whole
URL_TIMEOUT_S = 30.0
# a shorter str is a path, never base64: the smallest image files (a 1x1 PNG, 67 bytes) take 92 base64 characters,
# and a short missing path such as "img/abcd" would otherwise decode as base64 into bytes that are no image
MIN_BASE64_CHARS = 64

# the metadata each adapter writes on a scored item
OPEN = "pixeltriage_open"
GAIN = "pixeltriage_gain"
P_VIS = "pixeltriage_p_vis"
RELEVANCE = "pixeltriage_relevance"
WRITTEN_KEYS = (OPEN, GAIN, P_VIS, RELEVANCE)


@dataclass(frozen=True)
class Fields:
    """The metadata keys an item's memory is read from: an image (a path, base64 or a data: URI, bytes, a PIL image;
    for a node that carries no image itself), a write-time cache key (the key `POST /v1/memories` or
    `Cache.put` returned), the note (default: the item's own text), the dialogue and the session date."""

    image: str = "image"
    key: str = "pixeltriage_key"
    note: str = "note"
    dialogue: str = "dialogue"
    date: str = "date"


def memory_of(image: Any, image_what: str, metadata: Mapping[str, Any], text: str | None, fields: Fields,
              index: int, allow_urls: bool) -> Memory | None:
    """The Memory of one item, None when it has no image and no cache key (System One scores image memories only).

    image: the image the item carries itself (None: `metadata[fields.image]`, if any). An image wins over a cache
    key when an item has both (any scorer can score it; a key needs the scorer's cache). The note is
    `metadata[fields.note]`, else the item's text; for a memory given by key with neither, the cached note."""
    if image is None and metadata.get(fields.image) is not None:
        image, image_what = metadata[fields.image], f"metadata[{fields.image!r}]"
    key = metadata.get(fields.key)
    if image is None and key is None:
        return None
    note = _text(metadata, fields.note, index)
    if note is None:
        note = text or None
    dialogue = _text(metadata, fields.dialogue, index) or ""
    date = _text(metadata, fields.date, index) or ""
    if image is not None:
        return Memory(image=image_value(image, index, image_what, allow_urls), note=note or "", dialogue=dialogue,
                      date=date)
    if not isinstance(key, str) or not key:
        raise InvalidMemoryError(f"metadata[{fields.key!r}] must be a non-empty cache key string, got {key!r}", index)
    return Memory(key=key, note=note, dialogue=dialogue, date=date)


def written(decision: Decision, rank: int) -> dict[str, Any]:
    """The metadata (`WRITTEN_KEYS`) an adapter writes on the scored item at position `rank` of `decision` (its
    scores in `decision.scores`, the top-k delivery `decide(scores, k)` made of them)."""
    scores = decision.scores
    return {OPEN: decision.open[rank], GAIN: scores.gains[rank], P_VIS: scores.p_vis,
            RELEVANCE: scores.relevance[rank]}


def score(scorer: Any, question: str, memories: Sequence[Memory]) -> Scores:
    """`scorer.score(question, memories)`; a scorer whose `score` is a coroutine (AsyncClient) needs the async path."""
    if inspect.iscoroutinefunction(getattr(scorer, "score", None)):
        raise TypeError(f"{type(scorer).__name__}.score is a coroutine function: call the adapter's async method, "
                        "or give it a pixeltriage.Scorer or pixeltriage.serve.Client")
    return scorer.score(question, list(memories))


async def ascore(scorer: Any, question: str, memories: Sequence[Memory]) -> Scores:
    """`await scorer.score(...)` for an AsyncClient; a synchronous scorer runs in a worker thread."""
    if inspect.iscoroutinefunction(getattr(scorer, "score", None)):
        return await scorer.score(question, list(memories))
    import asyncio

    return await asyncio.to_thread(scorer.score, question, list(memories))


def check_scorer(scorer: Any) -> Any:
    if not callable(getattr(scorer, "score", None)):
        raise TypeError(f"scorer must have .score(question, memories) (a pixeltriage.Scorer or "
                        f"pixeltriage.serve.Client), got {type(scorer).__name__}")
    return scorer


def build_scorer(scorer: Any, model: str | None, base_url: str | None, *, api_key: str | None, device: str,
                 revision: str | None, allow_download: bool) -> Any:
    """The scorer an adapter uses: `scorer` as given, a `Scorer` loaded from `model` (a local path or a hub id,
    `pixeltriage.hub`), or a `Client` of the server at `base_url`; exactly one of the three."""
    given = [name for name, value in (("scorer", scorer), ("model", model), ("base_url", base_url))
             if value is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of scorer= (a pixeltriage.Scorer or Client), model= (a checkpoint path "
                         f"or hub id) or base_url= (a pixeltriage serve URL); got {given or 'none'}")
    if scorer is not None:
        return check_scorer(scorer)
    if model is not None:
        from pixeltriage.engine.scorer import Scorer

        return Scorer.load(model, device=device, revision=revision, allow_download=allow_download)
    from pixeltriage.serve.client import Client

    return Client(base_url, api_key=api_key)


def image_value(value: Any, index: int, what: str, allow_urls: bool) -> Any:
    """An image as `Memory` takes it: bytes and PIL images as they are; a str (or path) is a local file when one
    exists, a `data:` URI or base64 otherwise, a URL when allowed (fetched here)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, os.PathLike):
        return value
    if not isinstance(value, str):
        from PIL import Image

        if isinstance(value, Image.Image):
            return value
        raise InvalidMemoryError(f"{what}: an image must be a path, base64 text, bytes or a PIL image, found "
                                 f"{type(value).__name__}", index)
    if value[:5].lower() == "data:":
        return base64_image(value, index, what)
    if is_url(value):
        if not allow_urls:
            raise InvalidMemoryError(f"{what}: {_short(value)} is a URL, and URL images are not fetched unless the "
                                     "adapter is built with allow_url_images=True; pass a local path, base64 or bytes",
                                     index)
        return fetch_url(value, index, what)
    if os.path.isfile(os.path.expanduser(value)):
        return os.path.expanduser(value)
    if len(value) < MIN_BASE64_CHARS:
        raise InvalidMemoryError(f"{what}: {_short(value)}: no such file", index)
    try:
        return decode_base64(value, None)
    except InvalidRequestError:
        raise InvalidMemoryError(f"{what}: {_short(value)} is neither an existing file, a data: URI nor base64",
                                 index) from None


def fetch_url(url: str, index: int, what: str) -> bytes:
    """The bytes at an http(s) URL (the caller allowed it): at most MAX_URL_BYTES, URL_TIMEOUT_S per read."""
    if not url.lower().startswith(("http://", "https://")):
        raise InvalidMemoryError(f"{what}: {_short(url)}: only http(s) URLs are fetched", index)
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as response:
            data = response.read(MAX_URL_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidMemoryError(f"{what}: cannot fetch {_short(url)}: {e}", index) from None
    if len(data) > MAX_URL_BYTES:
        raise InvalidMemoryError(f"{what}: {_short(url)} is larger than {MAX_URL_BYTES >> 20} MiB", index)
    return data or _empty(index, what)


def _text(metadata: Mapping[str, Any], field: str, index: int) -> str | None:
    """metadata[field] as text (a date or datetime in ISO form), None when absent."""
    value = metadata.get(field)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    raise InvalidMemoryError(f"metadata[{field!r}] must be a string, got {type(value).__name__}", index)


def base64_image(text: str, index: int, what: str) -> bytes:
    """The bytes of an image given as base64 text or a base64 `data:` URI, decoded as the server decodes a request's
    image (`media.sources.decode_base64`); its refusal as the item's InvalidMemoryError."""
    try:
        return decode_base64(text, None)
    except InvalidRequestError as e:
        raise InvalidMemoryError(f"{what}: {_short(text)}: {e}", index) from None


def _empty(index: int, what: str) -> bytes:
    raise InvalidMemoryError(f"{what}: the image is empty (0 bytes)", index)


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
