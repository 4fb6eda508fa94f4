"""Request memories -> `pixeltriage.Memory`: base64 images decoded, `path` memories read from under the image root
(both by `media.sources`).

Runs on the preprocessing threads. Images are handed to the library as bytes, so the library's decoding and
validation (formats, sizes, decompression bombs) decide what is an image; errors here name the request field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from pydantic import ValidationError

from pixeltriage.engine.types import Memory
from pixeltriage.errors import InvalidRequestError
from pixeltriage.media.policy import is_url
from pixeltriage.media.sources import DATA_URI, ImageRoot, decode_base64, is_base64_image
from pixeltriage.serve.schemas import CACHE_KEY, DocumentIn, MemoryIn


def image_bytes(image: str | None, path: str | None, field: str, image_root: ImageRoot | None) -> bytes:
    """The bytes of an image given as base64 (`image`) or as a `path` under the server's image root; errors name
    `field`, the request field that holds it (`memories[2].image`, `documents[0].content[1].image_url.url`)."""
    if image is not None:
        return decode_base64(image, field)
    if image_root is None:
        raise InvalidRequestError("path images need the server's --image-root; send the image as base64", field)
    return image_root.read(path, field)


def to_memory(m: MemoryIn, field: str, image_root: ImageRoot | None) -> Memory:
    """One request memory as the library's Memory; `field` is the request field of its image (`memories[2].image`)."""
    if m.key is not None:
        return Memory(key=m.key, note=m.note, dialogue=m.dialogue, date=m.date)
    return Memory(image=image_bytes(m.image, m.path, field, image_root), note=m.note, dialogue=m.dialogue,
                  date=m.date)


# -- rerank documents ------------------------------------------------------------------------------------------------
_KEY = re.compile(CACHE_KEY)                # a string document that is a write-time cache key
# a run of hex digits that may be meant as a cache key (64 lower-case digits), cut or doubled by a few characters:
# within 8 of 64 long, bounded by characters that are neither letters nor digits
_KEY_LIKE = re.compile(r"(?<![0-9A-Za-z])[0-9A-Fa-f]{56,72}(?![0-9A-Za-z])")


@dataclass(frozen=True)
class RerankDoc:
    """One rerank document as System One reads it: its memory (None: not scored, `status` says why), the text a
    client gets back with return_documents, its field in the request (`documents[3]`), the field of its image
    (`documents[3].content[1].image_url.url`; the document itself for a string; "" when not scored), its `status`
    (`schemas.DOCUMENT_STATUSES`) and what was found, in words (`detail`)."""

    memory: MemoryIn | None
    text: str
    index: int
    field: str
    image_field: str = ""
    status: str = "scored"
    detail: str | None = None

    def unusable(self, status: str, detail: str) -> "RerankDoc":
        """This document, not scored, for the reason `status`."""
        return replace(self, memory=None, status=status, detail=detail)


def rerank_doc(document: str | DocumentIn, collection: str, index: int) -> RerankDoc:
    """A rerank document as System One reads it (a key's presence in the cache is the caller's check). A string is
    read by `_string_document`; an object is Jina's `{"text", "image"}`, vLLM's `{"content": [...]}` or a memory.
    collection: the request's field of the documents ("documents", TEI's "texts")."""
    field = f"{collection}[{index}]"
    if isinstance(document, str):
        return _string_document(document, field, index)
    texts = [document.text] if document.text is not None else []
    sources = {name: (name, value) for name, value in (("image", document.image), ("key", document.key),
                                                         ("path", document.path)) if value is not None}
    for j, part in enumerate(document.content or []):
        if part.type == "text":
            texts.append(part.text)
        else:
            sources[f"content[{j}].image_url.url"] = ("image", part.image_url.url)
    if len(sources) > 1:
        raise InvalidRequestError(f"a document is one memory with one image; this one has {len(sources)} "
                                  f"({', '.join(sources)})", field)
    note = document.note if document.note is not None else "\n".join(texts) if texts else None
    if not sources:
        hint = ": its text is a cache key, which goes in `key`" if _KEY.fullmatch((note or "").strip()) else ""
        return RerankDoc(None, note or "", index, field, status="no_image",
                         detail=f"an object document without image, key or path{hint}")
    (where, (source, value)), = sources.items()
    if source == "image" and not DATA_URI.match(value) and is_url(value):
        raise InvalidRequestError("image URLs are not fetched by this server: send the image as base64 or a data "
                                  "URI, or put it with POST /v1/memories and send its key", f"{field}.{where}")
    try:
        memory = MemoryIn(**{source: value}, note=note, dialogue=document.dialogue, date=document.date)
    except ValidationError as e:                    # the joined texts of a vLLM document past the note's limit
        raise InvalidRequestError(f"note: {e.errors(include_url=False, include_input=False)[0]['msg']}",
                                  field) from None
    return RerankDoc(memory, note or "", index, field, f"{field}.{where}")


def _string_document(text: str, field: str, index: int) -> RerankDoc:
    """A string document, in this order: a write-time cache key (64 lower-case hex digits); a JSON memory object (it
    starts with `{`: `MemoryIn`'s fields); an image as a data URI or raw base64 (its bytes start as an image); a URL
    (not fetched); a text holding one cache key, as the frameworks send a node's or document's key with its metadata
    around it (LlamaIndex: `file_name: ...` lines, a blank line, then the text), read as that key and its cached note
    (the rest of the text is not read); a text holding a near miss of one (a key cut or doubled by a few digits, or
    in upper case: never read as text); anything else is text without an image."""
    stripped = text.strip()
    if _KEY.fullmatch(stripped):
        return RerankDoc(MemoryIn(key=stripped), text, index, field, field)      # the note: the cached one
    if stripped.startswith("{"):
        try:
            memory = MemoryIn.model_validate_json(stripped)
        except ValidationError as e:
            first = e.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(part) for part in first["loc"])
            raise InvalidRequestError(f"a string document that starts with '{{' is read as a JSON memory object "
                                      f"(image, key or path; note, dialogue, date): {where + ': ' if where else ''}"
                                      f"{first['msg']}", field) from None
        return RerankDoc(memory, memory.note or "", index, field, f"{field}.{memory.source}")
    if DATA_URI.match(stripped) or is_base64_image(stripped):
        return RerankDoc(MemoryIn(image=stripped), "", index, field, field)
    if is_url(stripped) and not any(c.isspace() for c in stripped):
        return RerankDoc(None, text, index, field, status="url",
                         detail=f"a URL ({_short(stripped)}): this server fetches nothing; put the image with POST "
                                "/v1/memories and send its key, or send it as base64")
    runs = _KEY_LIKE.findall(text)
    keys = sorted({run for run in runs if _KEY.fullmatch(run)})
    if len(keys) == 1:
        return RerankDoc(MemoryIn(key=keys[0]), text, index, field, field,
                         detail=f"the cache key {keys[0]} in the document's text (the rest of the text is not read)")
    if len(keys) > 1:
        return RerankDoc(None, text, index, field, status="several_keys",
                         detail=f"{len(keys)} cache keys in one document ({', '.join(k[:12] + '...' for k in keys)}); "
                                "a document is one memory: send one key")
    if runs:
        return RerankDoc(None, text, index, field, status="near_miss_key", detail=_near_miss(runs[0]))
    return RerankDoc(None, text, index, field, status="not_a_key_or_memory",
                     detail="text without an image: not a cache key (64 lower-case hex digits, alone or in the text), "
                            "a JSON memory object, a data URI or base64 image")


def _near_miss(run: str) -> str:
    """What is wrong with a run of hex digits that looks like a cache key."""
    wrong = []
    if len(run) != 64:
        wrong.append(f"{len(run)} hex digits where a cache key has 64")
    if run != run.lower():
        wrong.append("upper-case digits where a cache key is lower-case hex (the key POST /v1/memories returned, "
                     "as it returned it)")
    return f"a near miss of a cache key ({run[:12]}...): " + "; ".join(wrong)


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
