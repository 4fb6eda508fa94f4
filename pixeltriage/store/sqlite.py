"""The store in one SQLite file (the embedded default; store.backend has the interface).

WAL mode, one connection per thread (opened on first use), every write one short `BEGIN IMMEDIATE` transaction that
waits for other writers up to `timeout_ms`: safe from several threads and several processes at once, and a process
killed mid-write leaves the last committed state (SQLite's transactions are atomic). A forked child opens its own
connections and never touches its parent's.

Faults, as typed errors (the connection that met one of the last three is closed, so that the next call opens the
file again and succeeds once the fault is gone):

    "database or disk is full"                    StoreFullError
    "database is locked" past the wait           StoreLockedError
    a read-only file, directory or file system    StoreReadOnlyError (reads go on: a file that cannot be opened
                                                  for writing, and has no WAL content, is read as it is; each
                                                  write tries to open it for writing again)
    damaged pages ("malformed", "not a database") StoreCorruptError
    any other I/O error, a file that cannot open  StoreUnavailableError
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterator

from pixeltriage.errors import (PixelTriageError, StoreCorruptError, StoreError, StoreFullError, StoreLockedError,
                                StoreReadOnlyError, StoreUnavailableError)
from pixeltriage.store import schema

log = logging.getLogger(__name__)

# SQLite's primary result codes (an extended code's low byte)
_BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = 5, 6, 8, 10, 11, 13, 14, 26
_REOPEN = {_READONLY, _IOERR, _CORRUPT, _CANTOPEN, _NOTADB}     # close the connection that met one


class SQLiteBackend:
    """The store in the SQLite file at `path` (created with its schema if missing)."""

    dialect = "sqlite"

    def __init__(self, path: str | os.PathLike, timeout_ms: int):
        self.path = Path(path)
        self.location = str(self.path)
        self.timeout_ms = int(timeout_ms)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # --- the interface ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        conn = self._thread_connection()
        try:
            yield conn
        except sqlite3.Error as e:
            raise self._failed(conn, e) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        if getattr(self._local, "read_only", False) and not self._in_transaction():
            self._drop(self._local.conn)            # a write tries the file again: it may be writable by now
        with self.connection() as conn:
            if conn.in_transaction:                 # inside another write of this thread: part of it
                yield conn
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                _rollback(conn)
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error:
                _rollback(conn)
                raise

    def stored_bytes(self) -> int:
        """The file and its WAL, on disk."""
        return sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())

    def integrity_check(self) -> str:
        """SQLite's `PRAGMA integrity_check`: "ok" for a sound file, else what it found (the check itself stopped by
        damage: its error)."""
        conn = self._thread_connection()
        try:
            return "\n".join(r[0] for r in conn.execute("PRAGMA integrity_check").fetchall())
        except sqlite3.DatabaseError as e:
            return str(e)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    # --- internals ----------------------------------------------------------------------------------------------

    def _thread_connection(self) -> sqlite3.Connection:
        if self._closed:
            raise ValueError(f"cache {self.path} is closed")
        if os.getpid() != self._pid:
            # a forked child must not use the parent's connections: drop them without closing
            with self._lock:
                self._pid, self._connections, self._local = os.getpid(), [], threading.local()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            read_only = False
            try:
                conn = self._connect(str(self.path), uri=False)
            except sqlite3.Error as e:
                if not self._unwritable(e):
                    raise self._error(e) from None
                # a WAL file cannot be opened where its -shm cannot be made; with no WAL left behind (a clean close),
                # the file alone is the cache and is read as it is
                try:
                    conn = self._connect(f"{self.path.absolute().as_uri()}?immutable=1", uri=True)
                except sqlite3.Error as e2:
                    raise self._error(e2) from None
                read_only = True
                log.warning("cache %s is read-only: entries read, writes are refused until it is writable",
                            self.path)
            self._local.conn, self._local.read_only = conn, read_only
            with self._lock:
                self._connections.append(conn)
        return conn

    def _connect(self, database: str, uri: bool) -> sqlite3.Connection:
        conn = sqlite3.connect(database, timeout=self.timeout_ms / 1000, isolation_level=None,
                               check_same_thread=False, uri=uri)
        try:
            conn.execute(f"PRAGMA busy_timeout = {self.timeout_ms}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _unwritable(self, e: sqlite3.Error) -> bool:
        """Whether `e` came of a cache that exists and cannot be written, with no WAL content to lose by reading
        the file alone."""
        wal = Path(f"{self.path}-wal")
        return (_code(e) in (_CANTOPEN, _READONLY) and self.path.is_file()
                and not (os.access(self.path.parent, os.W_OK) and os.access(self.path, os.W_OK))
                and (not wal.exists() or wal.stat().st_size == 0))

    def _in_transaction(self) -> bool:
        conn = getattr(self._local, "conn", None)
        return conn is not None and conn.in_transaction

    def _drop(self, conn: sqlite3.Connection | None) -> None:
        """Close this thread's connection `conn`: the next call opens the file again."""
        if conn is None or getattr(self._local, "conn", None) is not conn:
            return
        self._local.conn, self._local.read_only = None, False
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    def _failed(self, conn: sqlite3.Connection, e: sqlite3.Error) -> StoreError:
        """The typed error of `e`; the connection is dropped where reopening is what clears the fault."""
        if _code(e) in _REOPEN:
            self._drop(conn)
        return self._error(e)

    def _error(self, e: sqlite3.Error) -> StoreError:
        code, where = _code(e), f"cache {self.path}"
        if code == _FULL or (code == _IOERR and _no_space(self.path)):
            return StoreFullError(f"{where}: the disk is full ({e}); free space, then write again")
        if code in (_BUSY, _LOCKED):
            return StoreLockedError(f"{where}: another process held the write lock for longer than "
                                    f"{self.timeout_ms / 1000:g} s ({e})")
        if code == _READONLY:
            return StoreReadOnlyError(f"{where}: the file, its directory or its file system is read-only ({e}); "
                                      "entries read, nothing is written until it is writable")
        if code in (_CORRUPT, _NOTADB):
            return StoreCorruptError(f"{where}: not a usable cache database ({e}); the entries on sound pages "
                                     "still read; restore the file from a backup")
        return StoreUnavailableError(f"{where}: {e}")

    def _open(self) -> None:
        """WAL mode, then the schema brought to this version in one write; a file that cannot be written (read-only)
        is read as it is, when its schema is this version's."""
        with self.connection() as conn:
            if self._local.read_only:
                version = schema.file_version(conn, self.path)
                if version != schema.VERSION:
                    raise StoreReadOnlyError(f"cache {self.path}: read-only, and its schema (version {version}) "
                                             f"must be brought to version {schema.VERSION} first")
                return
            mode = self._switch_to_wal(conn)
        if mode.lower() != "wal":
            raise PixelTriageError(f"cache {self.path}: cannot switch to WAL mode (journal_mode is {mode})")
        with self.transaction() as conn:
            schema.migrate(conn, self.path)

    def _switch_to_wal(self, conn: sqlite3.Connection) -> str:
        """`PRAGMA journal_mode = WAL`, retried until the timeout: the switch takes the file's exclusive lock from a
        shared one, and when two connections open a new file at once SQLite answers one of them "database is
        locked" at once instead of waiting (its busy handler is not called where waiting could deadlock)."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        pause = 0.001
        while True:
            try:
                return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as e:
                if _code(e) not in (_BUSY, _LOCKED) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):      # a failed rollback leaves the transaction to SQLite's recovery
            conn.execute("ROLLBACK")


def _code(e: sqlite3.Error) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF
    text = str(e)
    for words, found in (("locked", _BUSY), ("full", _FULL), ("readonly", _READONLY), ("malformed", _CORRUPT),
                         ("not a database", _NOTADB), ("unable to open", _CANTOPEN), ("disk I/O", _IOERR)):
        if words in text:
            return found
    return None


def _no_space(path: Path) -> bool:
    """Whether the file system of `path` has no free block left (SQLite reports some failed writes of a full disk
    as I/O errors: the growth of its shared-memory file, a short write)."""
    try:
        return shutil.disk_usage(path.parent).free == 0
    except OSError:
        return False
