"""The store in a PostgreSQL database (store.backend has the interface), through psycopg 3 (`pip install
'pixeltriage[postgres]'`): every replica on every machine that is given one URL reads and writes one store.

Connections: one pool per process (psycopg_pool.ConnectionPool, made on first use; a forked child makes its own and
never touches its parent's connections), from which a thread borrows one connection for each call, or for a whole
`transaction()`; calls nested inside one on the same thread use that same connection. Each connection is checked
when borrowed (a round trip), so one broken by a server restart is replaced, not handed out: a call running when
the server goes away fails with StoreUnavailableError, and the next call connects again. Writers wait for a lock
up to `timeout_ms` (PostgreSQL's lock_timeout), and a call waits for a connection as long.

Rows as in the SQLite file (store.schema has the tables): thumbnails, features and region vectors as bytea, the same
checksums. The region vectors' write sequence numbers must become visible in order (a reader fetches the rows past
the last seq it saw), so every region write takes one transaction-level advisory lock before it draws a seq.

The URL (postgresql:// or postgres://, any libpq parameter) is shown only with its password replaced by ***.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from typing import Iterator

from pixeltriage.errors import (PixelTriageError, StoreCorruptError, StoreError, StoreFullError, StoreLockedError,
                                StoreReadOnlyError, StoreUnavailableError)
from pixeltriage.store import schema
from pixeltriage.store.backend import redact, scrub

POOL_SIZE = 16                         # connections a process keeps at most (threads borrow them per call)
CONNECT_TIMEOUT_S = 10                 # one connection attempt, unless the URL says (connect_timeout=)
REGION_WRITE_LOCK = 0x50_54_72_65      # the advisory lock that orders region writes (any constant of our own)


class _Connection:
    """A psycopg connection that takes the store's SQL in SQLite's spelling: `?` parameters, `CAST(column AS BLOB)`
    (a bytea column is bytes already)."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        self.raw = raw

    def execute(self, sql: str, params=()):
        return self.raw.execute(_translated(sql), params)

    def executemany(self, sql: str, rows):
        cursor = self.raw.cursor()
        cursor.executemany(_translated(sql), list(rows))
        return cursor


@functools.lru_cache(maxsize=512)
def _translated(sql: str) -> str:
    return re.sub(r"CAST\((\w+) AS BLOB\)", r"\1", sql).replace("?", "%s")


class PostgresBackend:
    """The store in the PostgreSQL database at `url` (its tables created if missing)."""

    dialect = "postgresql"
    path = None

    def __init__(self, url: str, timeout_ms: int):
        try:
            import psycopg  # noqa: F401
            import psycopg_pool  # noqa: F401
        except ImportError:
            raise PixelTriageError("a postgresql:// cache needs psycopg 3 and its pool: pip install "
                                   "'pixeltriage[postgres]'") from None
        self.url = url
        self.location = redact(url)
        self.timeout_ms = int(timeout_ms)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool = None
        self._pool_pid = None
        self._closed = False
        self._kwargs = self._connection_kwargs()
        self._migrate()

    # --- the interface ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def connection(self) -> Iterator[_Connection]:
        import psycopg

        held = getattr(self._local, "conn", None)
        if held is not None and self._pool_pid == os.getpid():
            yield held
            return
        pool = self._process_pool()
        try:
            with pool.connection() as raw:
                conn = _Connection(raw)
                self._local.conn = conn
                try:
                    yield conn
                finally:
                    self._local.conn = None
        except psycopg.Error as e:
            raise self._error(e) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Connection]:
        from psycopg.pq import TransactionStatus

        with self.connection() as conn:
            if conn.raw.info.transaction_status != TransactionStatus.IDLE:   # inside another write: part of it
                yield conn
                return
            with conn.raw.transaction():
                yield conn

    def stored_bytes(self) -> int:
        """The store's tables with their indexes and TOAST, on the server's disk."""
        with self.connection() as conn:
            return int(conn.execute("SELECT " + " + ".join(f"pg_total_relation_size('{t}')" for t in schema.TABLES)
                                    ).fetchone()[0])

    def integrity_check(self) -> str:
        """"ok" when every thumbnail and every feature row matches its checksum (the server keeps the pages sound);
        else one line per damaged row."""
        with self.connection() as conn:
            bad = conn.execute("SELECT 'thumbnail of ' || key FROM images WHERE encode(sha256(thumbnail), 'hex') "
                               "!= checksum UNION ALL SELECT 'features of ' || key || ' (' || fingerprint || ')' "
                               "FROM features WHERE encode(sha256(data), 'hex') != checksum").fetchall()
        return "\n".join(f"{r[0]} fails its checksum" for r in bad) or "ok"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.close()

    # --- internals ----------------------------------------------------------------------------------------------

    def _connection_kwargs(self) -> dict:
        from psycopg.conninfo import conninfo_to_dict

        try:
            given = conninfo_to_dict(self.url)
        except Exception as e:                                     # psycopg.ProgrammingError: a malformed URL
            raise PixelTriageError(f"cache {self.location}: not a usable PostgreSQL URL "
                                   f"({scrub(str(e), self.url)})") from None
        kwargs = {"autocommit": True}
        if "connect_timeout" not in given:
            kwargs["connect_timeout"] = max(2, min(CONNECT_TIMEOUT_S, round(self.timeout_ms / 1000)))
        if "application_name" not in given:
            kwargs["application_name"] = "pixeltriage"
        return kwargs

    def _configure(self, raw) -> None:
        raw.execute(f"SET lock_timeout = {max(1, self.timeout_ms)}")

    def _migrate(self) -> None:
        """The database's tables brought to this version in one transaction (on a connection of its own: the pool is
        the process's that uses it, made on first use)."""
        import psycopg

        try:
            with psycopg.connect(self.url, **self._kwargs) as raw:
                self._configure(raw)
                with raw.transaction():
                    schema.migrate_postgres(_Connection(raw), self.location)
        except psycopg.Error as e:
            raise self._error(e) from None

    def _process_pool(self):
        from psycopg_pool import ConnectionPool

        if self._closed:
            raise ValueError(f"cache {self.location} is closed")
        pid = os.getpid()
        if self._pool_pid != pid:
            with self._lock:
                if self._pool_pid != pid:
                    # a forked child: the parent's pool (its connections, its threads) is never used nor closed here
                    self._local = threading.local()
                    pool = ConnectionPool(self.url, kwargs=self._kwargs, min_size=1, max_size=POOL_SIZE,
                                          open=False, configure=self._configure, check=ConnectionPool.check_connection,
                                          timeout=self.timeout_ms / 1000, name=f"pixeltriage-cache-{pid}")
                    pool.open(wait=False)
                    self._pool, self._pool_pid = pool, pid
        return self._pool

    def _error(self, e: Exception) -> StoreError:
        import psycopg
        from psycopg_pool import PoolTimeout

        where, message = f"cache {self.location}", scrub(str(e).strip(), self.url)
        state = getattr(e, "sqlstate", None) or ""
        if isinstance(e, PoolTimeout):
            return StoreUnavailableError(f"{where}: no connection to the PostgreSQL server within "
                                         f"{self.timeout_ms / 1000:g} s ({message})")
        if state == "53100":
            return StoreFullError(f"{where}: the server's disk is full ({message}); free space, then write again")
        if state in ("55P03", "40P01", "40001"):
            return StoreLockedError(f"{where}: another session held a lock for longer than "
                                    f"{self.timeout_ms / 1000:g} s ({message})")
        if state == "25006":
            return StoreReadOnlyError(f"{where}: the server takes no writes ({message}); entries read, nothing is "
                                      "written until it does")
        if state in ("XX001", "XX002"):
            return StoreCorruptError(f"{where}: the server reports damaged data ({message})")
        if isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError)) or state[:2] in ("08", "53", "57", "58"):
            return StoreUnavailableError(f"{where}: the PostgreSQL server cannot be reached or went away ({message}); "
                                         "the next call connects again")
        return StoreError(f"{where}: {message}")
