"""The forms an image arrives in, before it is decoded: the types the library takes (`ImageSource`), a local file
(`local_path`, `read_local`), base64 text or a data URI (the HTTP routes, the framework adapters) and a path under
a served folder (`ImageRoot`)."""
from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Union

from PIL import Image

from pixeltriage.errors import InvalidMemoryError, InvalidRequestError
from pixeltriage.media.policy import is_url

# what the library takes as an image: a PIL image, its encoded bytes or a local file path
ImageSource = Union[Image.Image, bytes, bytearray, str, os.PathLike]

DATA_URI = re.compile(r"^data:([^;,]*)(;[^,]*)?,", re.ASCII | re.IGNORECASE)     # a scheme is case-insensitive
_WHITESPACE = re.compile(rb"\s+")


def decode_base64(text: str, field: str | None) -> bytes:
    """The bytes of a base64 image or a base64 data URI (`data:image/png;base64,...`); whitespace is ignored. The
    one decoding of an encoded image: the routes' (`serve.inputs`) and the framework adapters'
    (`integrations.common`). A refusal is an InvalidRequestError naming `field` (None: the message alone)."""
    uri = DATA_URI.match(text)
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


def local_path(source, index: int | None = None) -> str:
    """A path the library reads an image from, as a str: refused (InvalidMemoryError naming `index`) when it is a
    URL, empty, missing, a directory, not a regular file, or an empty file."""
    path = os.fsdecode(os.fspath(source))
    if is_url(path):
        raise InvalidMemoryError(f"{path}: URLs are not accepted; pass a local file path or the image bytes", index)
    if not path:
        raise InvalidMemoryError("image path is empty", index)
    if not os.path.exists(path):
        raise InvalidMemoryError(f"{path}: image file not found", index)
    if os.path.isdir(path):
        raise InvalidMemoryError(f"{path}: is a directory, not an image file", index)
    if not os.path.isfile(path):
        raise InvalidMemoryError(f"{path}: not a regular file", index)
    if os.path.getsize(path) == 0:
        raise InvalidMemoryError(f"{path}: image file is empty (0 bytes)", index)
    return path


def read_local(source, index: int | None = None) -> bytes:
    """The bytes of a local image file, after `local_path`'s checks."""
    path = local_path(source, index)
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidMemoryError(f"{path}: cannot read file ({e.strerror or e})", index) from None


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
        if is_url(relative) or relative.startswith("//"):
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
