"""The write-time store's faults and the PostgreSQL store as a server meets them: real `pixeltriage serve` processes,
real HTTP, both clients.

- SQLite locked by another process past the request's deadline (--request-timeout): 503 store_unavailable (reason
  locked), StoreLockedError in both clients; earlier memories read; the next put after the lock goes succeeds.
- SQLite on a full disk: 507 store_full, StoreFullError; earlier memories read; the next put after space is freed
  succeeds.
- PostgreSQL stopped under a running server: 503 store_unavailable (reason unreachable); started again, the next put
  succeeds on the same server; the password shows in no answer, no /info and no log line.
- Two server processes given one PostgreSQL URL: a memory put through one is a cache hit in the other.
"""
import asyncio
import subprocess
import sys
import textwrap

import httpx
import pytest
from serving import ServerProcess, image_bytes

import filesystems
from postgres import start_server, unavailable
from pixeltriage import Memory
from pixeltriage.errors import StoreFullError, StoreLockedError, StoreUnavailableError
from pixeltriage.serve.schemas import error_for

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

LOCK = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    print("locked", flush=True)
    sys.stdin.read()
    conn.execute("ROLLBACK")
    """)


def both_clients_raise(url: str, image: bytes, error: type) -> list[Exception]:
    from pixeltriage.serve import AsyncClient, Client

    with Client(url, retries=0) as client:
        with pytest.raises(error) as sync:
            client.put_memory(image)

    async def put():
        async with AsyncClient(url, retries=0) as client:
            await client.put_memory(image)

    with pytest.raises(error) as async_:
        asyncio.run(put())
    return [sync.value, async_.value]


def put(url: str, image: bytes) -> httpx.Response:
    import base64

    return httpx.post(f"{url}/v1/memories", json={"image": base64.b64encode(image).decode(), "note": "n"},
                      timeout=120)


def test_a_locked_sqlite_cache_answers_503_and_the_next_put_succeeds(tiny_checkpoint, tmp_path):
    db = tmp_path / "cache.db"
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--cache", str(db), "--request-timeout", "1")
    try:
        server.wait_ready()
        first = put(server.url, image_bytes(seed=1))
        assert first.status_code == 200, first.text
        holder = subprocess.Popen([sys.executable, "-c", LOCK, str(db)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        try:
            refused = put(server.url, image_bytes(seed=2))
            body = refused.json()
            assert (refused.status_code, body["error_type"], body["reason"]) == (503, "store_unavailable",
                                                                                 "locked"), refused.text
            assert refused.headers["retry-after"] == "1"
            assert error_for(503, "store_unavailable").error is StoreUnavailableError
            for raised in both_clients_raise(server.url, image_bytes(seed=3), StoreLockedError):
                assert type(raised) is StoreLockedError and raised.status == 503
            known = httpx.get(f"{server.url}/v1/memories/{first.json()['key']}", timeout=60)
            assert known.status_code == 200 and known.json()["note"] == "n"       # reads go on under the lock
        finally:
            holder.communicate("", timeout=60)
        assert put(server.url, image_bytes(seed=2)).status_code == 200
    finally:
        server.stop()


def test_a_full_disk_answers_507_and_the_next_put_after_space_is_freed_succeeds(tiny_checkpoint, tmp_path):
    if filesystems.unavailable():
        pytest.skip(filesystems.unavailable())
    with filesystems.tmpfs(4 * 2 ** 20) as mount:
        server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--cache", str(mount / "cache.db"))
        try:
            server.wait_ready()
            first = put(server.url, image_bytes(seed=1))
            assert first.status_code == 200, first.text
            filler = filesystems.fill(mount)
            big = [image_bytes((900, 700), seed=10 + i) for i in range(3)]
            refused = next(r for r in (put(server.url, b) for b in big) if r.status_code != 200)
            body = refused.json()
            assert (refused.status_code, body["error_type"], body["reason"]) == (507, "store_full", "full")
            assert "disk is full" in body["error"]
            for raised in both_clients_raise(server.url, big[-1], StoreFullError):
                assert type(raised) is StoreFullError and raised.status == 507
            assert error_for(507, None).error is StoreFullError                # a proxy's bare 507 too
            known = httpx.get(f"{server.url}/v1/memories/{first.json()['key']}", timeout=60)
            assert known.status_code == 200 and known.json()["note"] == "n"
            filler.unlink()
            assert put(server.url, big[0]).status_code == 200
        finally:
            server.stop()


@pytest.fixture
def own_postgres():
    """A PostgreSQL server of this test's own (it is stopped and started under a running scoring server)."""
    if unavailable():
        pytest.skip(f"PostgreSQL: {unavailable()}")
    with start_server() as server:
        yield server


def test_postgresql_gone_answers_503_and_the_next_put_reconnects(tiny_checkpoint, tmp_path, own_postgres):
    url = own_postgres.create_database("memories")
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--cache", url, "--request-timeout", "5")
    try:
        server.wait_ready()
        first = put(server.url, image_bytes(seed=1))
        assert first.status_code == 200, first.text
        own_postgres.stop()
        refused = put(server.url, image_bytes(seed=2))
        body = refused.json()
        assert (refused.status_code, body["error_type"], body["reason"]) == (503, "store_unavailable",
                                                                             "unreachable"), refused.text
        own_postgres.start()
        again = put(server.url, image_bytes(seed=2))
        assert again.status_code == 200, again.text
        assert httpx.get(f"{server.url}/v1/memories/{first.json()['key']}", timeout=60).status_code == 200
        info = httpx.get(f"{server.url}/info", timeout=60).text
        for shown in (refused.text, info, server.output()):
            assert own_postgres.password not in shown
    finally:
        server.stop()


def test_a_memory_put_through_one_server_is_a_cache_hit_in_another(tiny_checkpoint, tmp_path, postgres_url):
    """Two server processes, one PostgreSQL URL: what one stores the other answers, scoring it by its key."""
    from pixeltriage.serve import Client

    servers = [ServerProcess(tiny_checkpoint, tmp_path / f"server{i}.log", "--cache", postgres_url)
               for i in range(2)]
    try:
        for server in servers:
            server.wait_ready()
        image = image_bytes((240, 180), seed=5)
        with Client(servers[0].url, retries=0) as a, Client(servers[1].url, retries=0) as b:
            key = a.put_memory(image, "a red mug on the desk")
            stored = b.memory(key)
            assert stored["note"] == "a red mug on the desk" and (stored["width"], stored["height"]) == (240, 180)
            by_key = b.score("where is the mug?", [Memory(key=key)])
            by_image = a.score("where is the mug?", [Memory(image=image, note="a red mug on the desk")])
            assert by_key.gains == pytest.approx(by_image.gains, abs=1e-5)
            assert by_key.p_vis == pytest.approx(by_image.p_vis, abs=1e-5)
            assert b.memory(key)["features_cached"]                 # B's forward stored its vision features there
            assert a.memory(key)["features_cached"]                 # ... which A now reads
    finally:
        for server in servers:
            server.stop()
