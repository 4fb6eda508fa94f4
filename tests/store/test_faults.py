"""The store under faults, on both backends: a full disk during a put, the store locked by another process past the
wait, damaged pages (SQLite), SIGKILL during a schema migration, a read-only store, and (PostgreSQL) a server that
goes away mid-request. Each gives its named error (pixeltriage.errors), keeps every earlier entry readable, and the
next put after the fault clears succeeds."""
import contextlib
import io
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

import filesystems
from postgres import own_directory
from pixeltriage.errors import (StoreCorruptError, StoreFullError, StoreLockedError, StoreReadOnlyError,
                                StoreUnavailableError)
from pixeltriage.store.cache import Cache
from pixeltriage.store.regions import RegionStore
from pixeltriage.store.schema import VERSION

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT = 600          # an interpreter start (torch import) can be slow on a loaded machine


def noise_png(seed: int, size=(64, 48)) -> bytes:
    rng = random.Random(seed)
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def put_some(cache: Cache, n: int = 5) -> dict[str, str]:
    return {cache.put(noise_png(seed), note=f"note {seed}"): f"note {seed}" for seed in range(n)}


def assert_readable(cache: Cache, entries: dict[str, str]) -> None:
    for key, note in entries.items():
        assert cache.entry(key)[1] == note and cache.thumbnail(key).size == (64, 48)


def needs_mount():
    if filesystems.unavailable():
        pytest.skip(filesystems.unavailable())


def child(code: str) -> subprocess.Popen:
    """A Python process running `code` (this checkout on the path), its output read line by line."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))


def wait_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline().strip()
    if line != expected:
        proc.kill()
        raise AssertionError(f"the child said {line!r}, not {expected!r}: {proc.communicate(timeout=60)[1]}")


# --- a full disk ----------------------------------------------------------------------------------------------------

@pytest.fixture
def small_store(backend, request):
    """(a store on a 24 MiB tmpfs, that tmpfs's directory): a SQLite file in it, or a PostgreSQL database whose
    tablespace is in it (its WAL stays on the server's own disk: a full tablespace refuses writes, a full WAL
    directory would stop the server)."""
    needs_mount()
    with filesystems.tmpfs(24 * 2 ** 20) as mount:
        if backend == "sqlite":
            yield str(mount / "cache.db"), mount
            return
        server = request.getfixturevalue("postgres_server")
        space = mount / "tablespace"
        space.mkdir()
        own_directory(space)
        name = f"small_{os.getpid()}_{random.randrange(1 << 30)}"
        server.execute(f"CREATE TABLESPACE {name} LOCATION '{space}'")
        url = server.create_database(tablespace=name)
        try:
            yield url, mount
        finally:
            server.drop_database(url.rsplit("/", 1)[1])
            server.execute(f"DROP TABLESPACE {name}")


def test_a_full_disk_refuses_the_put_keeps_the_entries_and_the_next_put_succeeds(small_store):
    target, mount = small_store
    with Cache(target) as cache:
        entries = put_some(cache)
        filler = filesystems.fill(mount)
        with pytest.raises(StoreFullError, match="disk is full") as raised:
            for seed in range(100, 140):                     # large images until one needs a page the disk lacks
                cache.put(noise_png(seed, (900, 700)), note="big")
        assert raised.value.status == 507 and raised.value.reason == "full"
        assert_readable(cache, entries)
        filler.unlink()
        key = cache.put(noise_png(7), note="after")
        assert cache.note(key) == "after"
        assert_readable(cache, entries)
        assert cache.integrity_check() == "ok"


# --- locked past the wait ---------------------------------------------------------------------------------------------

LOCK_HOLDER = {
    "sqlite": """
        import sqlite3, sys
        conn = sqlite3.connect(sys.argv[1], isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")                # the write lock, held until stdin closes
        print("locked", flush=True)
        sys.stdin.read()
        conn.execute("ROLLBACK")
        """,
    "postgresql": """
        import psycopg, sys
        conn = psycopg.connect(sys.argv[1])
        conn.execute("LOCK TABLE images IN EXCLUSIVE MODE")   # writers wait, readers do not
        print("locked", flush=True)
        sys.stdin.read()
        conn.rollback()
        """,
}


def hold_lock(backend: str, target: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_HOLDER[backend]), target],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_line(proc, "locked")
    return proc


def test_a_lock_held_past_the_wait_refuses_the_put_and_reads_go_on(target, backend):
    with Cache(target, busy_timeout_ms=500) as cache:
        entries = put_some(cache)
        holder = hold_lock(backend, target)
        try:
            with pytest.raises(StoreLockedError, match="lock") as raised:
                cache.put(noise_png(50), note="waits")
            assert raised.value.status == 503 and isinstance(raised.value, TimeoutError)
            assert_readable(cache, entries)                  # a writer's lock does not block readers
        finally:
            holder.communicate("", timeout=60)
        key = cache.put(noise_png(50), note="after")
        assert cache.note(key) == "after" and len(cache) == len(entries) + 1


# --- damaged pages (SQLite) -----------------------------------------------------------------------------------------

def test_damaged_pages_give_a_typed_error_and_the_entries_elsewhere_read(tmp_path):
    """The features table's page overwritten with garbage: reading features is StoreCorruptError, every image entry
    (thumbnail, note) still reads, and a new put succeeds."""
    import torch

    path = tmp_path / "cache.db"
    with Cache(path) as cache:
        entries = put_some(cache)
        first = next(iter(entries))
        cache.put_features(first, "vit", torch.ones(4))
        with sqlite3.connect(path) as conn:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'features'").fetchone()[0]
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(random.Random(0).randbytes(page_size))
    with Cache(path) as cache:
        with pytest.raises(StoreCorruptError, match="malformed") as raised:
            cache.get_features(first, "vit")
        assert raised.value.status == 503 and raised.value.reason == "corrupt"
        assert_readable(cache, entries)
        assert cache.integrity_check() != "ok"
        key = cache.put(noise_png(60), note="after")
        assert cache.note(key) == "after"


# --- SIGKILL during a migration ---------------------------------------------------------------------------------------

def _as_version_2(path: Path) -> None:
    """A current file made one that cache schema 2 wrote: no region tables, no image trigger, no version table."""
    with sqlite3.connect(path, isolation_level=None) as conn:
        for trigger in ("images_deleted", "images_deleted_regions", "regions_deleted"):
            conn.execute(f"DROP TRIGGER {trigger}")
        for table in ("regions", "region_deletions", "schema_version"):
            conn.execute(f"DROP TABLE {table}")
        conn.execute("PRAGMA user_version = 2")


MIGRATING = """
    import sys, time
    from pixeltriage.store import schema
    from pixeltriage.store.cache import Cache

    real = schema.migrate if sys.argv[1] == "sqlite" else schema.migrate_postgres

    def migrate_then_hang(*args):          # the whole migration done, its transaction not yet committed
        real(*args)
        print("migrated", flush=True)
        time.sleep(3600)

    setattr(schema, "migrate" if sys.argv[1] == "sqlite" else "migrate_postgres", migrate_then_hang)
    Cache(sys.argv[2])
    """


def test_sigkill_during_a_migration_leaves_the_store_as_it_was(target, backend, raw):
    if backend == "sqlite":
        with Cache(target) as cache:
            entries = put_some(cache)
        _as_version_2(Path(target))
    else:
        entries = {}                       # a database's only migration yet is its creation
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(MIGRATING), backend, target],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        wait_line(proc, "migrated")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    if backend == "sqlite":                # nothing of the migration landed
        assert raw.one("PRAGMA user_version") == 2
        assert not raw("SELECT name FROM sqlite_master WHERE name IN ('schema_version', 'regions')")
    else:
        assert raw.one("SELECT to_regclass('schema_version')") is None
        assert raw.one("SELECT to_regclass('images')") is None
    with Cache(target) as cache:
        assert_readable(cache, entries)
        key = cache.put(noise_png(70), note="after")
        assert cache.note(key) == "after" and RegionStore(cache).state("enc") == (0, 0)
        assert cache.integrity_check() == "ok"
    assert raw("SELECT version FROM schema_version") == [(VERSION,)]


# --- read-only ------------------------------------------------------------------------------------------------------

def test_a_read_only_sqlite_directory_reads_refuses_puts_and_writes_once_writable(tmp_path):
    needs_mount()
    directory = tmp_path / "ro"
    directory.mkdir()
    with Cache(directory / "cache.db") as cache:
        entries = put_some(cache)
    with filesystems.read_only(directory):
        cache = Cache(directory / "cache.db")          # opened while read-only: the file read as it is
        assert_readable(cache, entries)
        with pytest.raises(StoreReadOnlyError, match="read-only") as raised:
            cache.put(noise_png(80), note="refused")
        assert raised.value.status == 503 and raised.value.reason == "read_only"
        assert len(cache) == len(entries)
    key = cache.put(noise_png(80), note="after")         # the same object, once the directory is writable
    assert cache.note(key) == "after" and len(cache) == len(entries) + 1
    assert_readable(cache, entries)
    cache.close()


def test_a_read_only_postgresql_server_reads_refuses_puts_and_writes_once_writable(postgres_server, postgres_url):
    with Cache(postgres_url) as cache:
        entries = put_some(cache)
        postgres_server.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        postgres_server.execute("SELECT pg_reload_conf()")
        try:
            seeds = iter(range(1000, 10_000))

            def refused():                            # a new image each time: a stored one is not written again
                try:
                    cache.put(noise_png(next(seeds)), note="refused")
                except StoreReadOnlyError as e:
                    return e
                return None

            deadline = time.monotonic() + 60          # the reload reaches each session at its next command
            while (error := refused()) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert isinstance(error, StoreReadOnlyError) and error.reason == "read_only"
            assert_readable(cache, entries)
            stored = len(cache)
            with pytest.raises(StoreReadOnlyError):
                cache.put(noise_png(90), note="refused")
            assert len(cache) == stored
        finally:
            postgres_server.execute("ALTER SYSTEM RESET default_transaction_read_only")
            postgres_server.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                key = cache.put(noise_png(91), note="after")
                break
            except StoreReadOnlyError:
                time.sleep(0.1)
        assert cache.note(key) == "after"
        assert_readable(cache, entries)


# --- the server goes away (PostgreSQL) --------------------------------------------------------------------------------

def test_a_server_restarted_mid_request_gives_a_typed_error_and_the_next_call_reconnects(postgres_server,
                                                                                        postgres_url, caplog):
    """A put waits on a lock while the server crashes and restarts: it fails with StoreUnavailableError; the next put,
    on the same Cache, connects again and succeeds. The stop is pg_ctl's immediate one: a fast stop ends the lock's
    holder first, so the put may take the lock and commit before its own session is ended (then nothing failed). The password is in no message and no log line."""
    import psycopg

    database = postgres_url.rsplit("/", 1)[1]
    with Cache(postgres_url) as cache:
        entries = put_some(cache)
        outcome = []
        admin = postgres_server.admin(database)        # the restart ends its session too
        try:
            admin.execute("BEGIN")
            admin.execute("LOCK TABLE images IN EXCLUSIVE MODE")

            def put():
                try:
                    outcome.append(cache.put(noise_png(95), note="in flight"))
                except Exception as e:       # the test names it below
                    outcome.append(e)

            worker = threading.Thread(target=put)
            worker.start()
            deadline = time.monotonic() + 60
            while not postgres_server.execute("SELECT 1 FROM pg_stat_activity WHERE datname = %s AND "
                                              "wait_event_type = 'Lock'", (database,)):
                assert time.monotonic() < deadline, "the put never waited on the lock"
                time.sleep(0.05)
            postgres_server.restart("immediate")
        finally:
            with contextlib.suppress(psycopg.Error):
                admin.close()
        worker.join(timeout=120)
        assert not worker.is_alive(), "the put did not return after the restart"
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailableError), outcome
        assert outcome[0].status == 503 and outcome[0].reason == "unreachable"
        key = cache.put(noise_png(96), note="after")
        assert cache.note(key) == "after"
        assert_readable(cache, entries)
        password = postgres_server.password
        assert password not in str(outcome[0]) and password not in repr(cache) and password not in cache.location
        assert password not in caplog.text


def test_a_password_is_never_shown(postgres_server, postgres_url, caplog):
    from pixeltriage.store.backend import redact

    password = postgres_server.password
    assert redact(postgres_url) == postgres_url.replace(password, "***")
    assert redact("postgresql://u@h/db?password=s3cret&sslmode=disable") == \
        "postgresql://u@h/db?password=***&sslmode=disable"
    wrong = postgres_url.replace(password, password + "x")
    with pytest.raises(StoreUnavailableError) as raised:
        Cache(wrong, busy_timeout_ms=5_000)
    assert "password authentication failed" in str(raised.value) and password not in str(raised.value)
    with Cache(postgres_url) as cache:
        stats = cache.stats()
        assert stats["path"] == redact(postgres_url) and password not in str(stats) and password not in repr(cache)
    assert password not in caplog.text
