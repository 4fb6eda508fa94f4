"""Region vectors in the write-time cache's file: one float32 matrix [R, D] per (image key, fingerprint).

The vectors are the L2-normalised embeddings of an image's regions (`RegionIndex` writes and reads them). They live
in the cache's SQLite file, beside the image's thumbnail and note and under the same key, and go through the
cache's own connections (`Cache.connection()`, one per thread; every write one `Cache.transaction()`), so the file
keeps one discipline: WAL, one short `BEGIN IMMEDIATE` per write, safe across threads and processes.

Rows: raw little-endian float32 bytes with a SHA-256 checksum over the key, the fingerprint, the shape and the
bytes (a row copied under another key fails it too). Every write gives the row a new, never reused `seq`
(AUTOINCREMENT), so a reader holding the vectors in memory fetches only the rows written after the last `seq` it
saw; a trigger counts the deleted rows of each fingerprint, so that reader learns from one read that rows it holds
may be gone, and another fingerprint's deletions cost it nothing. A row that fails its checksum, or has another
shape than the reader asks for, is deleted with a warning and read as missing: only the image itself can
recompute it.

Schema (the region tables' own version, in region_schema; the cache's tables keep PRAGMA user_version):
    regions(seq AUTOINCREMENT, key -> images.key ON DELETE CASCADE, fingerprint, count, dim, vectors, checksum,
            created; unique (key, fingerprint)), indexed by (fingerprint, seq)
    region_deletions(fingerprint, deletions)   kept by the trigger regions_deleted
    trigger images_deleted_regions             an image's rows go with it, foreign keys on or off
    region_schema(version)
Version 1 is what cache schema 3 wrote (the same regions table, one deletion count for all fingerprints in
region_log, the image trigger shared with the features); files of cache schema 1 and 2 have no region tables.
Both are migrated when a store is first opened on them.
"""
from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from pixeltriage.errors import PixelTriageError
from pixeltriage.store.cache import Cache, CacheMissError

log = logging.getLogger(__name__)

REGION_SCHEMA_VERSION = 2

_TABLES = (
    """CREATE TABLE IF NOT EXISTS regions (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    count       INTEGER NOT NULL,
    dim         INTEGER NOT NULL,
    vectors     BLOB NOT NULL,
    checksum    TEXT NOT NULL,
    created     REAL NOT NULL,
    UNIQUE (key, fingerprint)
)""",
    "CREATE INDEX IF NOT EXISTS regions_by_fingerprint ON regions (fingerprint, seq)",
)
# Version 2: deletions counted per fingerprint, and the region tables' own version and image trigger.
_VERSION_2 = (
    "DROP TRIGGER IF EXISTS regions_deleted",
    "DROP TABLE IF EXISTS region_log",
    """CREATE TABLE region_deletions (
    fingerprint TEXT PRIMARY KEY,
    deletions   INTEGER NOT NULL
)""",
    # Every deleted row: a DELETE, or the cascade of an image's. A REPLACE fires no delete trigger
    # (recursive_triggers is off); its row comes back with a new seq, which readers fetch anyway.
    """CREATE TRIGGER regions_deleted AFTER DELETE ON regions BEGIN
    INSERT OR IGNORE INTO region_deletions (fingerprint, deletions) VALUES (OLD.fingerprint, 0);
    UPDATE region_deletions SET deletions = deletions + 1 WHERE fingerprint = OLD.fingerprint;
END""",
    "CREATE TABLE region_schema (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL)",
    "INSERT INTO region_schema (id, version) VALUES (0, 2)",
)
# An image's rows go with it whether or not the deleting connection enabled foreign keys (the sqlite3 shell and
# Python's sqlite3 leave them off, so ON DELETE CASCADE alone would leave orphans behind).
_IMAGES_TRIGGER = """CREATE TRIGGER images_deleted_regions AFTER DELETE ON images BEGIN
    DELETE FROM regions WHERE key = OLD.key;
END"""


class RegionRow(NamedTuple):
    """One stored row of region vectors: its write sequence number, image key and float32 [R, D] vectors."""

    seq: int
    key: str
    vectors: np.ndarray


class RegionStore:
    """The region vectors of the images of `cache`, in its file (the tables are created or migrated here)."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self._create_tables()

    @property
    def path(self):
        return self.cache.path

    # --- writes -------------------------------------------------------------------------------------------------

    def put(self, key: str, fingerprint: str, vectors) -> int:
        """Store float32 `vectors` [R, D] (a numpy array or a torch tensor) for (key, fingerprint), replacing any
        row; returns the row's new seq. The image must be in the cache."""
        return self.put_many(fingerprint, [(key, vectors)])[0]

    def put_many(self, fingerprint: str, rows: Iterable[tuple[str, object]]) -> list[int]:
        """`put` for (key, vectors) pairs in one transaction (all stored or none); returns their seqs in order."""
        _check_fingerprint(fingerprint)
        prepared = [(key, _as_matrix(vectors, key)) for key, vectors in rows]
        seqs = []
        with self.cache.transaction() as conn:
            for key, matrix in prepared:
                if key not in self.cache:
                    raise CacheMissError(key, f"image {key} is not in the cache; put it before its region vectors")
                data = matrix.tobytes()
                count, dim = matrix.shape
                seqs.append(conn.execute(
                    "INSERT OR REPLACE INTO regions (key, fingerprint, count, dim, vectors, checksum, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
                    (key, fingerprint, count, dim, data, _checksum(key, fingerprint, count, dim, data),
                     time.time())).fetchone()[0])
        return seqs

    # --- reads --------------------------------------------------------------------------------------------------

    def get(self, key: str, fingerprint: str, shape: tuple[int, int] | None = None) -> np.ndarray | None:
        """The stored vectors of (key, fingerprint), float32 [R, D] (read-only); None when absent, corrupt or, with
        `shape`, of another shape (such a row is deleted, with a warning)."""
        _check_fingerprint(fingerprint)
        rows, _ = self._page("key = ? AND fingerprint = ?", (key, fingerprint), 1, shape)
        return rows[0].vectors if rows else None

    def rows(self, fingerprint: str, after: int = 0, page: int = 4096,
             shape: tuple[int, int] | None = None) -> Iterator[RegionRow]:
        """Every sound row of `fingerprint` (of `shape`, when given) with seq > `after`, in seq order, read `page`
        rows at a time; the others are deleted, with a warning, and left out."""
        _check_fingerprint(fingerprint)
        while True:
            rows, last = self._page("fingerprint = ? AND seq > ?", (fingerprint, int(after)), page, shape)
            yield from rows
            if last is None:
                return
            after = last

    def state(self, fingerprint: str) -> tuple[int, int]:
        """(the highest seq of `fingerprint`, the number of its rows ever deleted): what a reader holding rows
        compares with what it saw last. Two index lookups, whatever the number of rows."""
        return tuple(self.cache.connection().execute(
            "SELECT (SELECT COALESCE(MAX(seq), 0) FROM regions WHERE fingerprint = ?), "
            "COALESCE((SELECT deletions FROM region_deletions WHERE fingerprint = ?), 0)",
            (fingerprint, fingerprint)).fetchone())

    def keys(self, fingerprint: str) -> set[str]:
        """Keys with a row of `fingerprint`, sound or not (the rows are not read): what a reader holding rows checks
        them against after deletions."""
        return {r[0] for r in self.cache.connection().execute("SELECT key FROM regions WHERE fingerprint = ?",
                                                              (fingerprint,))}

    def keys_without(self, fingerprint: str) -> list[str]:
        """Keys of cached images that have no row of `fingerprint`, oldest first."""
        return [r[0] for r in self.cache.connection().execute(
            "SELECT key FROM images WHERE key NOT IN (SELECT key FROM regions WHERE fingerprint = ?) "
            "ORDER BY created, key", (fingerprint,))]

    def fingerprints(self) -> dict[str, int]:
        """fingerprint -> rows, for every fingerprint with region vectors in the file."""
        return dict(self.cache.connection().execute("SELECT fingerprint, COUNT(*) FROM regions GROUP BY fingerprint"))

    def stats(self) -> dict:
        """Row count and vector bytes, beside `Cache.stats()`."""
        rows, data = self.cache.connection().execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(vectors)), 0) FROM regions").fetchone()
        return {"region_schema_version": REGION_SCHEMA_VERSION, "region_rows": rows, "region_bytes": data}

    def __repr__(self) -> str:
        return f"RegionStore({self.cache!r})"

    # --- internals ----------------------------------------------------------------------------------------------

    def _page(self, where: str, params: tuple, limit: int,
              shape: tuple[int, int] | None) -> tuple[list[RegionRow], int | None]:
        """(the sound rows among the first `limit` matching ones, the seq of the last row read when `limit` rows
        were read, else None: no more rows)."""
        # CAST: a damaged row may hold another storage class; read whatever is there as bytes
        found = self.cache.connection().execute(
            f"SELECT seq, key, fingerprint, count, dim, CAST(vectors AS BLOB), checksum FROM regions "
            f"WHERE {where} ORDER BY seq LIMIT ?", (*params, limit)).fetchall()
        rows, damaged = [], []
        for seq, key, fingerprint, count, dim, data, checksum in found:
            vectors = _decode(key, fingerprint, count, dim, data, checksum)
            if vectors is None:
                log.warning("cache %s: region vectors of %s (%s) are corrupt; deleting the row (index the image "
                            "again to recompute them)", self.path, key, fingerprint)
            elif shape is not None and vectors.shape != tuple(shape):
                log.warning("cache %s: region vectors of %s (%s) have shape %s, expected %s; deleting the row "
                            "(index the image again)", self.path, key, fingerprint, vectors.shape, tuple(shape))
            else:
                rows.append(RegionRow(seq, key, vectors))
                continue
            damaged.append((seq, checksum))
        if damaged:
            with self.cache.transaction() as conn:
                # only the rows read above: a concurrent writer may have replaced them since (with a new seq)
                conn.executemany("DELETE FROM regions WHERE seq = ? AND checksum = ?", damaged)
        return rows, (found[-1][0] if len(found) == limit else None)

    def _create_tables(self) -> None:
        try:
            if self._current(self.cache.connection()):
                return                              # nothing to write: no write lock taken
            with self.cache.transaction() as conn:
                version = self._version(conn)       # again, under the lock: another process may have migrated
                if version == 0:
                    for statement in _TABLES:
                        conn.execute(statement)
                if version < 2:
                    for statement in _VERSION_2:
                        conn.execute(statement)
                if not _has_trigger(conn, "images_deleted_regions"):
                    conn.execute(_IMAGES_TRIGGER)
                    # rows a delete without foreign keys left behind while no trigger removed them
                    conn.execute("DELETE FROM regions WHERE key NOT IN (SELECT key FROM images)")
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            raise PixelTriageError(f"{self.path}: the region tables are not usable ({e})") from None

    def _current(self, conn: sqlite3.Connection) -> bool:
        return self._version(conn) == REGION_SCHEMA_VERSION and _has_trigger(conn, "images_deleted_regions")

    def _version(self, conn: sqlite3.Connection) -> int:
        """The region tables' version: region_schema's, else 1 for cache schema 3's tables, else 0 (none)."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "region_schema" in tables:
            version = conn.execute("SELECT version FROM region_schema WHERE id = 0").fetchone()
            if version is None or not isinstance(version[0], int) or version[0] < 2:
                raise PixelTriageError(f"cache {self.path}: region_schema holds no valid version ({version})")
            if version[0] > REGION_SCHEMA_VERSION:
                raise PixelTriageError(f"cache {self.path}: region tables of version {version[0]} are newer than "
                                       f"this version of pixeltriage reads ({REGION_SCHEMA_VERSION})")
            return version[0]
        return 1 if "regions" in tables else 0


def _has_trigger(conn: sqlite3.Connection, name: str) -> bool:
    found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'trigger' AND name = ?", (name,)).fetchone()
    return found is not None


def _as_matrix(vectors, key: str) -> np.ndarray:
    """Vectors (a torch tensor or anything numpy reads) -> a C-contiguous little-endian float32 [R, D] array."""
    if hasattr(vectors, "detach"):
        vectors = vectors.detach().to("cpu").float().numpy()
    matrix = np.ascontiguousarray(vectors, dtype="<f4")
    if matrix.ndim != 2 or 0 in matrix.shape:
        raise ValueError(f"region vectors of {key} must be a non-empty [R, D] matrix, found shape {matrix.shape}")
    if not np.isfinite(matrix).all():
        raise ValueError(f"region vectors of {key} hold NaN or Inf")
    return matrix


def _checksum(key: str, fingerprint: str, count: int, dim: int, data: bytes) -> str:
    h = hashlib.sha256(f"{key}\0{fingerprint}\0{count}x{dim}\0".encode())
    h.update(data)
    return h.hexdigest()


def _decode(key: str, fingerprint: str, count, dim, data: bytes, checksum) -> np.ndarray | None:
    """The [count, dim] matrix of a row (a read-only view of `data`: no copy), or None when its shape, length or
    checksum is wrong."""
    if not (isinstance(count, int) and isinstance(dim, int) and count > 0 and dim > 0):
        return None
    if len(data) != count * dim * 4 or _checksum(key, fingerprint, count, dim, data) != checksum:
        return None
    return np.frombuffer(data, dtype="<f4").reshape(count, dim).astype(np.float32, copy=False)


def _check_fingerprint(fingerprint: str) -> None:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, found {fingerprint!r}")
