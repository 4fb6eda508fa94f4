"""Region vectors in the write-time cache's store: one float32 matrix [R, D] per (image key, fingerprint).

The vectors are the L2-normalised embeddings of an image's regions (`RegionIndex` writes and reads them). They live
in the cache's store (its SQLite file or PostgreSQL database), beside the image's thumbnail and note and under the
same key, and go through the cache's own connections (`Cache.connection()`; every write one `Cache.transaction()`),
so the store keeps one discipline: one short transaction per write, safe across threads and processes.

Rows: raw little-endian float32 bytes with a SHA-256 checksum over the key, the fingerprint, the shape and the
bytes (a row copied under another key fails it too). Every write gives the row a new, never reused `seq`
(AUTOINCREMENT; on PostgreSQL an identity column, drawn under a lock that orders the region writes, so that seqs
become visible in order), so a reader holding the vectors in memory fetches only the rows written after the last
`seq` it saw; a trigger counts the deleted rows of each fingerprint, so that reader learns from one read that rows it holds
may be gone, and another fingerprint's deletions cost it nothing. A row that fails its checksum, or has another
shape than the reader asks for, is deleted with a warning and read as missing: only the image itself can
recompute it.

Tables (created with the store, `store.schema`): regions(seq AUTOINCREMENT, key -> images.key, fingerprint, count,
dim, vectors, checksum, created; unique (key, fingerprint)), indexed by (fingerprint, seq); region_deletions
(fingerprint, deletions), kept by a trigger; an image's rows go with it, foreign keys on or off.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from pixeltriage.store.cache import Cache, CacheMissError
from pixeltriage.store.postgres import REGION_WRITE_LOCK

log = logging.getLogger(__name__)

# a row's replacement gets a new seq: SQLite's REPLACE deletes and inserts (no delete trigger fires: recursive
# triggers are off), PostgreSQL's upsert draws the next seq; neither counts a deletion
_PUT = {
    "sqlite": "INSERT OR REPLACE INTO regions (key, fingerprint, count, dim, vectors, checksum, created) "
              "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
    "postgresql": "INSERT INTO regions (key, fingerprint, count, dim, vectors, checksum, created) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key, fingerprint) DO UPDATE SET "
                  "seq = nextval(pg_get_serial_sequence('regions', 'seq')), count = excluded.count, "
                  "dim = excluded.dim, vectors = excluded.vectors, checksum = excluded.checksum, "
                  "created = excluded.created RETURNING seq",
}
# taken first by every region write, where writers run at once (PostgreSQL): seqs become visible in order
_ORDER_WRITES = {"sqlite": None, "postgresql": f"SELECT pg_advisory_xact_lock({REGION_WRITE_LOCK})"}


class RegionRow(NamedTuple):
    """One stored row of region vectors: its write sequence number, image key and float32 [R, D] vectors."""

    seq: int
    key: str
    vectors: np.ndarray


class RegionStore:
    """The region vectors of the images of `cache`, in its store."""

    def __init__(self, cache: Cache):
        self.cache = cache

    @property
    def path(self):
        return self.cache.path

    @property
    def location(self) -> str:
        return self.cache.location

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
        dialect = self.cache.backend.dialect
        with self.cache.transaction() as conn:
            if _ORDER_WRITES[dialect]:
                conn.execute(_ORDER_WRITES[dialect])
            for key, matrix in prepared:
                if key not in self.cache:
                    raise CacheMissError(key, f"image {key} is not in the cache; put it before its region vectors")
                data = matrix.tobytes()
                count, dim = matrix.shape
                seqs.append(conn.execute(_PUT[dialect], (key, fingerprint, count, dim, data,
                                                         _checksum(key, fingerprint, count, dim, data),
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
        with self.cache.connection() as conn:
            return tuple(conn.execute(
                "SELECT (SELECT COALESCE(MAX(seq), 0) FROM regions WHERE fingerprint = ?), "
                "COALESCE((SELECT deletions FROM region_deletions WHERE fingerprint = ?), 0)",
                (fingerprint, fingerprint)).fetchone())

    def keys(self, fingerprint: str) -> set[str]:
        """Keys with a row of `fingerprint`, sound or not (the rows are not read): what a reader holding rows checks
        them against after deletions."""
        with self.cache.connection() as conn:
            return {r[0] for r in conn.execute("SELECT key FROM regions WHERE fingerprint = ?", (fingerprint,))}

    def keys_without(self, fingerprint: str) -> list[str]:
        """Keys of cached images that have no row of `fingerprint`, oldest first."""
        with self.cache.connection() as conn:
            return [r[0] for r in conn.execute(
                "SELECT key FROM images WHERE key NOT IN (SELECT key FROM regions WHERE fingerprint = ?) "
                "ORDER BY created, key", (fingerprint,))]

    def fingerprints(self) -> dict[str, int]:
        """fingerprint -> rows, for every fingerprint with region vectors in the store."""
        with self.cache.connection() as conn:
            return dict(conn.execute("SELECT fingerprint, COUNT(*) FROM regions GROUP BY fingerprint"))

    def stats(self) -> dict:
        """Row count and vector bytes, beside `Cache.stats()`."""
        with self.cache.connection() as conn:
            rows, data = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(vectors)), 0) FROM regions").fetchone()
        return {"region_rows": rows, "region_bytes": data}

    def __repr__(self) -> str:
        return f"RegionStore({self.cache!r})"

    # --- internals ----------------------------------------------------------------------------------------------

    def _page(self, where: str, params: tuple, limit: int,
              shape: tuple[int, int] | None) -> tuple[list[RegionRow], int | None]:
        """(the sound rows among the first `limit` matching ones, the seq of the last row read when `limit` rows
        were read, else None: no more rows)."""
        # CAST: a damaged row may hold another storage class; read whatever is there as bytes
        with self.cache.connection() as conn:
            found = conn.execute(f"SELECT seq, key, fingerprint, count, dim, CAST(vectors AS BLOB), checksum "
                                 f"FROM regions WHERE {where} ORDER BY seq LIMIT ?", (*params, limit)).fetchall()
        rows, damaged = [], []
        for seq, key, fingerprint, count, dim, data, checksum in found:
            vectors = _decode(key, fingerprint, count, dim, data, checksum)
            if vectors is None:
                log.warning("cache %s: region vectors of %s (%s) are corrupt; deleting the row (index the image "
                            "again to recompute them)", self.location, key, fingerprint)
            elif shape is not None and vectors.shape != tuple(shape):
                log.warning("cache %s: region vectors of %s (%s) have shape %s, expected %s; deleting the row "
                            "(index the image again)", self.location, key, fingerprint, vectors.shape, tuple(shape))
            else:
                rows.append(RegionRow(seq, key, vectors))
                continue
            damaged.append((seq, checksum))
        if damaged:
            with self.cache.transaction() as conn:
                # only the rows read above: a concurrent writer may have replaced them since (with a new seq)
                conn.executemany("DELETE FROM regions WHERE seq = ? AND checksum = ?", damaged)
        return rows, (found[-1][0] if len(found) == limit else None)


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
