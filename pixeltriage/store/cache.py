"""The write-time cache: per stored image, its thumbnail (`media.policy.THUMBNAIL_SIDE` px on the longer side) and a
short note, made once when the host stores it.

One SQLite file in WAL mode, safe to use from several threads (one connection per thread) and
several processes at once (every write is one short `BEGIN IMMEDIATE` transaction, and waits
for other writers up to `busy_timeout_ms`). A process killed mid-write leaves the last committed
state: SQLite's transactions are atomic.

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
kept, since its note may be the only copy, and putting the image again repairs it.

Rows: images(key, thumbnail PNG, checksum, note, width, height: the original image's displayed size, for
visual-token costs) and features(key, fingerprint, safetensors bytes, checksum); an image's features go with it.
The file's schema, its version and the migrations of older files are `store.schema`'s, run when a Cache opens it.

Tables beside these: the region vectors of `store.regions`, in the same file, under the same key. They use this
object's connections (`connection()`, one per thread) and write in `transaction()`, so the whole file follows one
discipline.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import sqlite3
import threading
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

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

def image_key(image: ImageSource) -> str:
    """The cache key of an image: SHA-256 hex of its encoded bytes (see the module docstring)."""
    return _key_and_data(image)[0]


class Cache:
    """The write-time cache in one SQLite file at `path` (created with its schema if missing)."""

    def __init__(self, path: str | os.PathLike, *, busy_timeout_ms: int = 60_000):
        self.path = Path(path)
        self.busy_timeout_ms = int(busy_timeout_ms)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self._create_schema()

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
        row = self.connection().execute("SELECT CAST(thumbnail AS BLOB), checksum, note FROM images WHERE key = ?",
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
            log.warning("cache %s: the stored size of %s is damaged (%r x %r); treated as unknown", self.path, key, width, height)
            return None
        return width, height

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return self.connection().execute("SELECT 1 FROM images WHERE key = ?", (key,)).fetchone() is not None

    def __len__(self) -> int:
        return self.connection().execute("SELECT COUNT(*) FROM images").fetchone()[0]

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
                "INSERT OR REPLACE INTO features (key, fingerprint, data, checksum, created) "
                "VALUES (?, ?, ?, ?, ?)", (key, fingerprint, data, _sha256(data), time.time()))

    def get_features(self, key: str, fingerprint: str) -> "torch.Tensor | None":
        """The stored features, or None when absent or corrupt (a corrupt row is deleted)."""
        _check_fingerprint(fingerprint)
        # CAST: a damaged row may hold another storage class; read whatever is there as bytes
        row = self.connection().execute("SELECT CAST(data AS BLOB), checksum FROM features "
                                        "WHERE key = ? AND fingerprint = ?", (key, fingerprint)).fetchone()
        if row is None:
            return None
        data, checksum = row
        features = _decode_features(data) if _sha256(data) == checksum else None
        if features is None:
            log.warning("cache %s: features of %s (%s) are corrupt; deleting the row", self.path, key, fingerprint)
            with self.transaction() as conn:
                # only the row read above: a concurrent writer may have replaced it since
                conn.execute("DELETE FROM features WHERE key = ? AND fingerprint = ? AND checksum = ? "
                             "AND CAST(data AS BLOB) = ?", (key, fingerprint, checksum, data))
        return features

    # --- the file --------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Row counts, payload bytes and on-disk bytes (database + WAL)."""
        conn = self.connection()
        images, thumb_bytes = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(thumbnail)), 0) FROM images").fetchone()
        notes = conn.execute("SELECT COUNT(*) FROM images WHERE note != ''").fetchone()[0]
        rows, feature_bytes = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM features").fetchone()
        on_disk = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())
        return {"path": str(self.path), "schema_version": schema.VERSION, "images": images,
                "notes": notes, "feature_rows": rows, "thumbnail_bytes": thumb_bytes,
                "feature_bytes": feature_bytes, "bytes": on_disk}

    def integrity_check(self) -> str:
        """SQLite's `PRAGMA integrity_check`: "ok" for a healthy file."""
        return "\n".join(r[0] for r in self.connection().execute("PRAGMA integrity_check").fetchall())

    def close(self) -> None:
        """Close every connection this object opened (from any thread). Idempotent."""
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cache({str(self.path)!r})"

    # --- the connections, for tables beside the cache's ---------------------------------------

    def connection(self) -> sqlite3.Connection:
        """This thread's connection to the file (opened on first use, foreign keys on). Read with it; write only
        inside `transaction()`. Closed by `close()`; a forked child opens its own."""
        if self._closed:
            raise ValueError(f"cache {self.path} is closed")
        if os.getpid() != self._pid:
            # a forked child must not use the parent's connections: drop them without closing
            with self._lock:
                self._pid, self._connections, self._local = os.getpid(), [], threading.local()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000,
                                   isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA synchronous = NORMAL")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def transaction(self) -> "_Transaction":
        """`with cache.transaction() as conn:` one short write (`BEGIN IMMEDIATE` ... `COMMIT`, or `ROLLBACK` on an
        exception) on this thread's connection; it waits for other writers up to `busy_timeout_ms`."""
        return _Transaction(self.connection())

    # --- internals ----------------------------------------------------------------------------

    def _row(self, key: str, columns: str) -> tuple:
        row = self.connection().execute(f"SELECT {columns} FROM images WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise CacheMissError(key)
        return row

    def _create_schema(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._create_tables()
        except sqlite3.DatabaseError as e:
            self.close()
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            raise PixelTriageError(f"{self.path}: not a usable cache database ({e})") from None

    def _switch_to_wal(self, conn: sqlite3.Connection) -> str:
        """`PRAGMA journal_mode = WAL`, retried until `busy_timeout_ms`: the switch takes the file's exclusive lock
        from a shared one, and when two connections open a new file at once SQLite answers one of them "database
        is locked" at once instead of waiting (its busy handler is not called where waiting could deadlock)."""
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        pause = 0.001
        while True:
            try:
                return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _create_tables(self) -> None:
        mode = self._switch_to_wal(self.connection())
        if mode.lower() != "wal":
            raise PixelTriageError(f"cache {self.path}: cannot switch to WAL mode (journal_mode is {mode})")
        with self.transaction() as conn:
            schema.migrate(conn, self.path)


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT`, or `ROLLBACK` on an exception: one short write."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.conn.execute("ROLLBACK")
            return
        try:
            self.conn.execute("COMMIT")
        except sqlite3.Error:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise


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
