"""Request memories -> `pixeltriage.Memory`: base64 images decoded, `path` memories read from under the image root
(both by `media.sources`).

Runs on the preprocessing threads. Images are handed to the library as bytes, so the library's decoding and
validation (formats, sizes, decompression bombs) decide what is an image; errors here name the request field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

from pixeltriage.engine.types import Memory
from pixeltriage.errors import InvalidRequestError
from pixeltriage.media.policy import is_url
from pixeltriage.media.sources import DATA_URI, ImageRoot, decode_base64
from pixeltriage.serve.schemas import CACHE_KEY, DocumentIn, MemoryIn

def image_bytes(image: str | None, path: str | None, field: str, image_root: ImageRoot | None) -> bytes:
    """The bytes of an image given as base64 (`image`) or as a `path` under the server's image root; errors name
    `field` + ".image" / ".path" (`field` "" for a body's own top-level fields)."""
    where = f"{field}." if field else ""
    if image is not None:
        return decode_base64(image, f"{where}image")
    if image_root is None:
        raise InvalidRequestError("path images need the server's --image-root; send the image as base64",
                                  f"{where}path")
    return image_root.read(path, f"{where}path")


def to_memory(m: MemoryIn, field: str, image_root: ImageRoot | None) -> Memory:
    """One request memory as the library's Memory; `field` is its path in the request (`memories[2]`)."""
    if m.key is not None:
        return Memory(key=m.key, note=m.note, dialogue=m.dialogue, date=m.date)
    return Memory(image=image_bytes(m.image, m.path, field, image_root), note=m.note, dialogue=m.dialogue,
                  date=m.date)


# -- rerank documents ------------------------------------------------------------------------------------------------
_KEY = re.compile(CACHE_KEY)                # a string document that is a write-time cache key


@dataclass(frozen=True)
class RerankDoc:
    """One rerank document as System One reads it: its memory (None: no image and no key, so not scored), the text
    a client gets back with return_documents, and its field in the request (`documents[3]`)."""

    memory: MemoryIn | None
    text: str
    index: int
    field: str
    source: str = ""           # where in the document its image is: "image", "key", "content[1].image_url.url"


def rerank_doc(document: str | DocumentIn, collection: str, index: int) -> RerankDoc:
    """A string is a write-time cache key (64 hex digits), a JSON memory object (it starts with `{`: `MemoryIn`'s
    fields), or plain text; an object is Jina's `{"text", "image"}`, vLLM's `{"content": [...]}` or a memory.
    collection: the request's field of the documents ("documents", TEI's "texts")."""
    field = f"{collection}[{index}]"
    if isinstance(document, str):
        if _KEY.match(document):
            return RerankDoc(MemoryIn(key=document), document, index, field, "key")    # the note: the cached one
        if document.lstrip().startswith("{"):
            try:
                memory = MemoryIn.model_validate_json(document)
            except ValidationError as e:
                first = e.errors(include_url=False, include_input=False)[0]
                where = ".".join(str(part) for part in first["loc"])
                raise InvalidRequestError(f"a string document that starts with '{{' is read as a JSON memory object "
                                          f"(image, key or path; note, dialogue, date): {where + ': ' if where else ''}"
                                          f"{first['msg']}", field) from None
            return RerankDoc(memory, memory.note or "", index, field, memory.source)
        return RerankDoc(None, document, index, field)
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
        return RerankDoc(None, note or "", index, field)
    (where, (source, value)), = sources.items()
    if source == "image" and not DATA_URI.match(value) and is_url(value):
        raise InvalidRequestError("image URLs are not fetched by this server: send the image as base64 or a data "
                                  "URI, or put it with POST /v1/memories and send its key", f"{field}.{where}")
    try:
        memory = MemoryIn(**{source: value}, note=note, dialogue=document.dialogue, date=document.date)
    except ValidationError as e:                    # the joined texts of a vLLM document past the note's limit
        raise InvalidRequestError(f"note: {e.errors(include_url=False, include_input=False)[0]['msg']}",
                                  field) from None
    return RerankDoc(memory, note or "", index, field, where)
