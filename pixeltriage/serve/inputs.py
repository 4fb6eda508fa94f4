"""Request memories -> `pixeltriage.Memory`: base64 images decoded, `path` memories read from under the image root.

Runs on the preprocessing threads. Images are handed to the library as bytes, so the library's decoding and
validation (formats, sizes, decompression bombs) decide what is an image; errors here name the request field.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from pydantic import ValidationError

from pixeltriage.engine.types import Memory
from pixeltriage.errors import InvalidRequestError
from pixeltriage.serve.schemas import CACHE_KEY, DocumentIn, MemoryIn

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://|(file|data|http|https|ftp):)", re.IGNORECASE)
_DATA_URI = re.compile(r"^data:([^;,]*)(;[^,]*)?,", re.ASCII | re.IGNORECASE)     # a scheme is case-insensitive
_WHITESPACE = re.compile(rb"\s+")


def decode_image(text: str, field: str | None) -> bytes:
    """The bytes of a base64 image or a base64 data URI (`data:image/png;base64,...`); whitespace is ignored. The
    one decoding of an encoded image: the routes' and the framework adapters' (`integrations.common`). A refusal is
    an InvalidRequestError naming `field` (None: the message alone)."""
    uri = _DATA_URI.match(text)
    if uri is not None:
        media, params = uri.group(1).lower(), (uri.group(2) or "").lower()
        if media and not media.startswith("image/"):
            raise InvalidRequestError(f"a data URI of type {media!r}; expected image/*", field)
        if ";base64" not in params:
            raise InvalidRequestError("a data URI must be base64-encoded (data:image/...;base64,...)", field)
        text = text[uri.end():]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        data = _decode_spaced(text, field)      # wrapped lines (MIME style): 4x slower, so only when needed
    if not data:
        raise InvalidRequestError("the image is empty", field)
    return data


def _decode_spaced(text: str, field: str | None) -> bytes:
    try:
        return base64.b64decode(_WHITESPACE.sub(b"", text.encode("ascii")), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"not valid base64 ({_reason(e)})", field) from None


def _reason(e: Exception) -> str:
    return "non-ASCII characters" if isinstance(e, UnicodeEncodeError) else str(e)


class ImageRoot:
    """The folder `path` memories may name. Refused: URLs, absolute paths, `..`, NUL bytes, and any path that
    resolves (through symlinks) outside the folder; the file is opened without following a final symlink and must
    be a regular file of at most `max_bytes`."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = Path(os.path.realpath(root))
        self.max_bytes = max_bytes

    def read(self, relative: str, field: str) -> bytes:
        path = self.resolve(relative, field)
        # O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; fstat below refuses it. It changes
        # nothing for the regular file read after
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise InvalidRequestError(f"{relative!r} is not a file under the image root", field) from None
        except OSError as e:
            raise InvalidRequestError(f"{relative!r} cannot be opened ({e.strerror})", field) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidRequestError(f"{relative!r} is not a regular file", field)
            if info.st_size > self.max_bytes:
                raise InvalidRequestError(f"{relative!r} is {info.st_size} bytes, above the server's limit of "
                                          f"{self.max_bytes}", field)
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(self.max_bytes + 1)[: self.max_bytes]
        finally:
            os.close(fd)

    def resolve(self, relative: str, field: str) -> Path:
        """The real path of `relative` under the root, or InvalidRequestError naming the rule it breaks."""
        if "\x00" in relative:
            raise InvalidRequestError("a path may not contain NUL bytes", field)
        if _URL.match(relative) or relative.startswith("//"):
            raise InvalidRequestError("URLs are not accepted; give a path relative to the image root", field)
        if relative.startswith(("/", "\\")) or PureWindowsPath(relative).is_absolute() or os.path.isabs(relative):
            raise InvalidRequestError("absolute paths are not accepted; give a path relative to the image root", field)
        parts = PurePosixPath(relative.replace("\\", "/")).parts
        if ".." in parts:
            raise InvalidRequestError("a path may not contain '..'", field)
        real = Path(os.path.realpath(self.root / relative))
        if real != self.root and self.root not in real.parents:
            raise InvalidRequestError(f"{relative!r} leaves the image root (through a symlink)", field)
        return real


def image_bytes(image: str | None, path: str | None, field: str, image_root: ImageRoot | None) -> bytes:
    """The bytes of an image given as base64 (`image`) or as a `path` under the server's image root; errors name
    `field` + ".image" / ".path" (`field` "" for a body's own top-level fields)."""
    where = f"{field}." if field else ""
    if image is not None:
        return decode_image(image, f"{where}image")
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
    if source == "image" and not _DATA_URI.match(value) and _URL.match(value):
        raise InvalidRequestError("image URLs are not fetched by this server: send the image as base64 or a data "
                                  "URI, or put it with POST /v1/memories and send its key", f"{field}.{where}")
    try:
        memory = MemoryIn(**{source: value}, note=note, dialogue=document.dialogue, date=document.date)
    except ValidationError as e:                    # the joined texts of a vLLM document past the note's limit
        raise InvalidRequestError(f"note: {e.errors(include_url=False, include_input=False)[0]['msg']}",
                                  field) from None
    return RerankDoc(memory, note or "", index, field, where)
