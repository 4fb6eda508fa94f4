"""The write-time cache: per stored image, its thumbnail (`media.policy.THUMBNAIL_SIDE` px on the longer side) and a
short note, made once when the host stores it.

Where: `Cache(target)` (or `Cache.open(target)`) is given a path, for one SQLite file in WAL mode (the embedded
default), or a `postgresql://` (or `postgres://`) URL, for a PostgreSQL database that every replica on every machine
shares (`pip install 'pixeltriage[postgres]'`); store.sqlite and store.postgres hold the two, store.backend what
they share. Either is safe to use from several threads and several processes at once: every write is one short
transaction, and waits for other writers up to `busy_timeout_ms`. A process killed mid-write leaves the last
committed state. A forked child opens its own connections.

Keys: the SHA-256 hex digest of the image's encoded bytes: of the bytes themselves for a bytes
input, of the file's bytes for a path, and of `encode_png(img)` for a PIL image. The same
picture given as a file and as a decoded PIL image therefore has two keys; a host keys its
images one way. `image_key` computes a key without storing anything.

Notes: `put` is idempotent. A second put of a stored image keeps its row; a non-empty note
replaces the stored note (the latest note wins), and an empty note never erases one.

Vision features (for the scorer): `put_features` / `get_features` store one tensor per
(key, fingerprint), as safetensors bytes with a SHA-256 checksum. The fingerprint names what
produced the features (vision weights and preprocessing), so stale features are never reused.
A feature row that fails its checksum or does not decode is deleted and reported as missing
(the scorer recomputes it), with a warning in the log.

Errors: a missing key raises `CacheMissError` (a KeyError naming the key). A thumbnail row that
fails its checksum or does not decode raises `CorruptEntryError` (a CacheMissError): the row is
kept, since its note may be the only copy, and putting the image again repairs it. A fault of the store itself
raises a `StoreError` (pixeltriage.errors): StoreFullError (the disk is full), StoreLockedError (another process
held the lock past `busy_timeout_ms`), StoreReadOnlyError, StoreCorruptError (damaged pages), StoreUnavailableError
(the server cannot be reached, or went away: the next call connects again). A failed write leaves every earlier
entry as it was.

Rows: images(key, thumbnail PNG, checksum, note, width, height: the original image's displayed size, for
visual-token costs) and features(key, fingerprint, safetensors bytes, checksum); an image's features go with it.
The store's schema, its version and the migrations of older stores are `store.schema`'s, run when a Cache opens one.

Tables beside these: the region vectors of `store.regions`, in the same store, under the same key. They use this
object's connections (`connection()`) and write in `transaction()`, so the whole store follows one discipline.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

# the cache's own errors live in pixeltriage.errors (the clients raise them without torch); imported from here too
from pixeltriage.errors import CacheMissError, CorruptEntryError, InvalidMemoryError, PixelTriageError  # noqa: F401
from pixeltriage.media.image import display_size, encode_png, thumbnail
from pixeltriage.media.policy import THUMBNAIL_SIDE
from pixeltriage.media.sources import ImageSource, read_local
from pixeltriage.store import schema
from pixeltriage.store.backend import is_url, redact

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

def _open_backend(target, timeout_ms: int):
    """The backend of `target`: a PostgreSQL URL, else a path of a SQLite file."""
    if is_url(target):
        from pixeltriage.store.postgres import PostgresBackend

        return PostgresBackend(target, timeout_ms)
    if isinstance(target, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", target):
        raise PixelTriageError(f"cache {redact(target)}: a cache is a file path or a postgresql:// URL, not a "
                               f"{target.split('://', 1)[0]}:// URL")
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"a cache is a file path or a postgresql:// URL, found {type(target).__name__}")
    from pixeltriage.store.sqlite import SQLiteBackend

    return SQLiteBackend(target, timeout_ms)


def image_key(image: ImageSource) -> str:
    """The cache key of an image: SHA-256 hex of its encoded bytes (see the module docstring)."""
    return _key_and_data(image)[0]


class Cache:
    """The write-time cache in the SQLite file at a path, or the PostgreSQL database at a `postgresql://` URL
    (created with its schema if missing, migrated if older).

    `location` is what messages show (the path; the URL without its password); `path` is the file's Path, None for
    a PostgreSQL cache."""

    def __init__(self, target: str | os.PathLike, *, busy_timeout_ms: int = 60_000):
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.backend = _open_backend(target, self.busy_timeout_ms)
        self.location: str = self.backend.location
        self.path: Path | None = self.backend.path

    @classmethod
    def open(cls, target: str | os.PathLike, *, busy_timeout_ms: int = 60_000) -> "Cache":
        """The cache at `target`: a path (SQLite) or a `postgresql://` URL; the same as `Cache(target)`."""
        return cls(target, busy_timeout_ms=busy_timeout_ms)

    # --- images --------------------------------------------------------------------------------

    def put(self, image: ImageSource, note: str = "") -> str:
        """Store the image's thumbnail and note; return its key. Idempotent (see module docstring)."""
        return self.put_source(image, note)[0]

    def put_source(self, image: ImageSource, note: str = "", index: int | None = None) -> tuple[str, ImageSource]:
        """`put`, also returning what was keyed: the encoded bytes of bytes or a file (read once), or the PIL
        image as given; what a caller deriving more from the image (region vectors) must use. Errors name `index`."""
        if not isinstance(note, str):
            raise TypeError(f"note must be a str, found {type(note).__name__}")
        key, data = _key_and_data(image, index)
        self._put(key, data, image, note, index)
        return key, image if data is None else data

    def entry_of(self, image: ImageSource, index: int | None = None) -> tuple[str, tuple[Image.Image, str]]:
        """(key, (thumbnail, note)) of an image given by value: read from the cache when stored, put first when
        absent or damaged. The image is read and hashed once, the row read once. An unreadable image raises
        InvalidMemoryError(reason, index)."""
        key, data = _key_and_data(image, index)
        return key, self._put(key, data, image, "", index)

    def _put(self, key: str, data: bytes | None, image: ImageSource, note: str,
             index: int | None = None) -> tuple[Image.Image, str]:
        """Ensure a sound row for `key` (rewritten when absent, failing its checksum or not decoding), with `note`
        when one is given; returns the stored thumbnail (RGB) and note."""
        with self.connection() as conn:
            row = conn.execute("SELECT CAST(thumbnail AS BLOB), checksum, note FROM images WHERE key = ?",
                               (key,)).fetchone()
        if row is not None:
            try:
                stored = self._decoded(key, row[0], row[1])
            except CorruptEntryError:
                stored = None
            if stored is not None:
                if note and note != row[2]:
                    with self.transaction() as conn:
                        conn.execute("UPDATE images SET note = ? WHERE key = ?", (note, key))
                return stored, note or row[2]
        # the scorer's own thumbnail recipe, so cached and fresh thumbnails agree
        source = data if data is not None else image
        width, height = display_size(source, index)
        thumb = thumbnail(source, THUMBNAIL_SIDE, index)                  # RGB: what decoding its PNG gives back
        png = encode_png(thumb)
        with self.transaction() as conn:
            # an existing row (a corrupt thumbnail, or a concurrent put) keeps its note unless a new one is given
            stored_note = conn.execute(
                "INSERT INTO images (key, thumbnail, checksum, note, created, width, height) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
                "thumbnail = excluded.thumbnail, checksum = excluded.checksum, "
                "width = excluded.width, height = excluded.height, "
                "note = CASE WHEN excluded.note != '' THEN excluded.note ELSE images.note END RETURNING note",
                (key, png, _sha256(png), note, time.time(), width, height)).fetchone()[0]
        return thumb, stored_note

    def thumbnail(self, key: str) -> Image.Image:
        """The stored thumbnail (RGB). CacheMissError if absent, CorruptEntryError if damaged."""
        return self.entry(key)[0]

    def entry(self, key: str) -> tuple[Image.Image, str]:
        """The stored thumbnail (RGB) and note, from one read of the row (what scoring a memory needs)."""
        blob, checksum, note = self._row(key, "CAST(thumbnail AS BLOB), checksum, note")
        return self._decoded(key, blob, checksum), note

    @staticmethod
    def _decoded(key: str, blob: bytes, checksum: str) -> Image.Image:
        if _sha256(blob) != checksum:
            raise CorruptEntryError(key, f"thumbnail of {key} fails its checksum; put the image again")
        try:
            with Image.open(io.BytesIO(blob)) as img:
                img.load()
                return img.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise CorruptEntryError(key, f"thumbnail of {key} does not decode ({e}); put the image again") from None

    def note(self, key: str) -> str:
        return self._row(key, "note")[0]

    def size(self, key: str) -> tuple[int, int] | None:
        """The original image's displayed (width, height); None for rows written by schema version 1, and for a
        damaged size (not two positive integers: the size is outside the thumbnail's checksum), with a warning."""
        width, height = self._row(key, "width, height")
        if width is None or height is None:
            return None
        if type(width) is not int or type(height) is not int or width < 1 or height < 1:
            log.warning("cache %s: the stored size of %s is damaged (%r x %r); treated as unknown", self.location, key,
                        width, height)
            return None
        return width, height

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        with self.connection() as conn:
            return conn.execute("SELECT 1 FROM images WHERE key = ?", (key,)).fetchone() is not None

    def __len__(self) -> int:
        with self.connection() as conn:
            return conn.execute("SELECT COUNT(*) FROM images").fetchone()[0]

    # --- vision features -----------------------------------------------------------------------

    def put_features(self, key: str, fingerprint: str, features: "torch.Tensor") -> None:
        """Store `features` for (key, fingerprint), replacing any row. The image must be in the cache."""
        from safetensors.torch import save

        _check_fingerprint(fingerprint)
        data = save({"features": features.detach().to("cpu").contiguous()})
        with self.transaction() as conn:
            if conn.execute("SELECT 1 FROM images WHERE key = ?", (key,)).fetchone() is None:
                raise CacheMissError(key, f"image {key} is not in the cache; put it before its features")
            conn.execute(
                "INSERT INTO features (key, fingerprint, data, checksum, created) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (key, fingerprint) DO UPDATE SET data = excluded.data, checksum = excluded.checksum, "
                "created = excluded.created", (key, fingerprint, data, _sha256(data), time.time()))

    def get_features(self, key: str, fingerprint: str) -> "torch.Tensor | None":
        """The stored features, or None when absent or corrupt (a corrupt row is deleted)."""
        _check_fingerprint(fingerprint)
        # CAST: a damaged row may hold another storage class; read whatever is there as bytes
        with self.connection() as conn:
            row = conn.execute("SELECT CAST(data AS BLOB), checksum FROM features WHERE key = ? AND fingerprint = ?",
                               (key, fingerprint)).fetchone()
        if row is None:
            return None
        data, checksum = row
        features = _decode_features(data) if _sha256(data) == checksum else None
        if features is None:
            log.warning("cache %s: features of %s (%s) are corrupt; deleting the row", self.location, key, fingerprint)
            with self.transaction() as conn:
                # only the row read above: a concurrent writer may have replaced it since
                conn.execute("DELETE FROM features WHERE key = ? AND fingerprint = ? AND checksum = ? "
                             "AND CAST(data AS BLOB) = ?", (key, fingerprint, checksum, data))
        return features

    # --- the store ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Row counts, payload bytes and the bytes the store takes on disk (a file and its WAL; a database's
        tables)."""
        with self.connection() as conn:
            images, thumb_bytes = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(thumbnail)), 0) FROM images").fetchone()
            notes = conn.execute("SELECT COUNT(*) FROM images WHERE note != ''").fetchone()[0]
            rows, feature_bytes = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM features").fetchone()
        return {"path": self.location, "backend": self.backend.dialect, "schema_version": schema.VERSION,
                "images": images, "notes": notes, "feature_rows": rows, "thumbnail_bytes": thumb_bytes,
                "feature_bytes": feature_bytes, "bytes": self.backend.stored_bytes()}

    def integrity_check(self) -> str:
        """"ok" for a sound store: SQLite's `PRAGMA integrity_check`; on PostgreSQL, every thumbnail and feature row
        against its checksum."""
        return self.backend.integrity_check()

    def close(self) -> None:
        """Close every connection this object opened (from any thread). Idempotent."""
        self.backend.close()

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cache({self.location!r})"

    # --- the connections, for tables beside the cache's ---------------------------------------

    def connection(self) -> contextlib.AbstractContextManager:
        """`with cache.connection() as conn:` this thread's connection (`conn.execute(sql, params)`, SQL in SQLite's
        spelling, which a PostgreSQL connection translates). Read with it; write only inside `transaction()`.
        Closed by `close()`; a forked child opens its own."""
        return self.backend.connection()

    def transaction(self) -> contextlib.AbstractContextManager:
        """`with cache.transaction() as conn:` one short write, committed at the end of the block or rolled back on
        an exception; it waits for other writers up to `busy_timeout_ms`. Nested in another on the same thread, it
        is part of that one."""
        return self.backend.transaction()

    # --- internals ----------------------------------------------------------------------------

    def _row(self, key: str, columns: str) -> tuple:
        with self.connection() as conn:
            row = conn.execute(f"SELECT {columns} FROM images WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise CacheMissError(key)
        return row


def _key_and_data(image: ImageSource, index: int | None = None) -> tuple[str, bytes | None]:
    """(key, the encoded bytes when the input was bytes or a file; None for a PIL image). A path goes through
    `media.sources.local_path`'s checks (no URLs, an existing non-empty regular file), as every entry point's does."""
    if isinstance(image, Image.Image):
        return _sha256(encode_png(image)), None
    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    elif isinstance(image, (str, os.PathLike)):
        data = read_local(image, index)
    else:
        raise InvalidMemoryError(f"an image must be a PIL image, bytes or a path, found {type(image).__name__}",
                                 index)
    return _sha256(data), data


def _decode_features(data: bytes) -> "torch.Tensor | None":
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)["features"]
    except (SafetensorError, KeyError, ValueError, RuntimeError):
        return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_fingerprint(fingerprint: str) -> None:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, found {fingerprint!r}")
