"""The one error table (`schemas.error_statuses`) walked through real servers: for each row, a request that the
server refuses with that row's status and error_type, and both clients (Client and AsyncClient) raising that row's
error for it; a new row without a request here fails the walk. The 503 comes from a server whose model load is held
(gated_serve.py): listening, and loading for as long as the test needs."""
import asyncio
import socket

import httpx
import pytest
from serving import API_KEY, ServerProcess, image_bytes, wait_for

from pixeltriage import Memory
from pixeltriage.serve.schemas import error_for, error_statuses, status_of

SQUARE = image_bytes((336, 336))
STORE_ROWS = {(507, "store_full"), (503, "store_unavailable")}


@pytest.fixture(scope="module")
def bare(tiny_checkpoint, tmp_path_factory):
    """No cache, one open request at a time: the 501 and the 429."""
    server = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("bare") / "server.log", "--max-queued", "1")
    yield server.wait_ready()
    server.stop()


def held_upload(url: str) -> socket.socket:
    """A request whose body never finishes: it holds one of --max-queued open requests until closed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{\"question\":")
    return sock


def calls(served, bare, loading):
    """(status, error_type) -> (server url, api key, the client call: method name and arguments)."""
    return {
        (422, "invalid_memory"): (served.url, API_KEY, ("score", "q", [Memory(image=b"\x89PNG\r\n\x1a\nbroken")])),
        (422, "state_too_long"): (served.url, API_KEY, ("score", "q", [Memory(image=SQUARE, dialogue="w " * 600,
                                                                              note="n " * 600)] * 64)),
        (422, "invalid_input"): (served.url, API_KEY, ("score", "q", [Memory(image=image_bytes())] * 65)),
        (413, "payload_too_large"): (served.url, API_KEY, ("score", "q", [Memory(image=b"0" * 3 * 2 ** 20)])),
        (401, "unauthorized"): (served.url, None, ("score", "q", [])),
        (504, "deadline"): (served.url, API_KEY, ("score", "q", [Memory(image=image_bytes())], 1e-9)),
        (404, "not_found"): (served.url, API_KEY, ("memory", "c" * 64)),
        (501, "no_cache"): (bare.url, None, ("put_memory", image_bytes())),
        (429, "overloaded"): (bare.url, None, ("score", "q", [])),
        (503, "unavailable"): (loading.url, None, ("score", "q", [])),
    }


def sync_call(client, call):
    name, *args = call
    if name == "score" and len(args) == 3:
        return client.score(args[0], args[1], timeout_s=args[2])
    return getattr(client, name)(*args)


async def async_call(url, key, call):
    from pixeltriage.serve import AsyncClient

    name, *args = call
    async with AsyncClient(url, api_key=key, retries=0) as client:
        if name == "score" and len(args) == 3:
            return await client.score(args[0], args[1], timeout_s=args[2])
        return await getattr(client, name)(*args)


def raw(url, key, call) -> httpx.Response:
    """The same call as a plain request (what the server answers, before a client reads it)."""
    from pixeltriage.serve.client import question_body

    headers = {"authorization": f"Bearer {key}"} if key else {}
    name, *args = call
    if name == "memory":
        return httpx.get(f"{url}/v1/memories/{args[0]}", headers=headers, timeout=60)
    if name == "put_memory":
        return httpx.post(f"{url}/v1/memories", json={"image": "aGVsbG8="}, headers=headers, timeout=60)
    extra = {"timeout_s": args[2]} if len(args) == 3 else {}
    return httpx.post(f"{url}/v1/score", json=question_body(args[0], args[1], **extra), headers=headers, timeout=60)


def test_every_row_is_what_the_server_answers_and_what_both_clients_raise(served, bare, gated):
    from pixeltriage.serve import Client
    from pixeltriage.serve.client import error_of

    loading = gated("loading", hold=("load",)).wait_listening()     # its load never opens: loading throughout
    walked = calls(served, bare, loading)
    table = {(row.status, row.error_type): row for row in error_statuses()}
    # the store's rows need a store in a fault (locked, a full disk): tests/serve/test_store_faults.py walks them
    # through real servers and both clients
    assert set(table) == set(walked) | {(415, "unsupported_media_type")} | STORE_ROWS
    for (status, kind), (url, key, call) in walked.items():
        row = table[(status, kind)]
        held = held_upload(url) if status == 429 else None
        try:
            if held is not None:                                      # the guard counts it once its headers are in
                response = wait_for("the held upload to fill the bare server",
                                    lambda: (r := raw(url, key, call)).status_code == 429 and r, 30)
            else:
                response = raw(url, key, call)
            assert (response.status_code, response.json()["error_type"]) == (status, kind), response.text
            assert type(error_of(response)) is row.error
            with Client(url, api_key=key, retries=0) as client:
                with pytest.raises(row.error) as raised_sync:
                    sync_call(client, call)
            raised_all = [raised_sync.value]
            if status != 413:    # the server answers 413 before reading the body and closes: httpx's async transport
                with pytest.raises(row.error) as raised_async:    # may meet the closed socket first (ReadError)
                    asyncio.run(async_call(url, key, call))
                raised_all.append(raised_async.value)
            for raised in raised_all:
                assert type(raised) is row.error
                assert getattr(raised, "status", status) == status         # a ServiceError's or a 413's status
        finally:
            if held is not None:
                held.close()


def test_the_rows_no_client_call_can_reach_over_http(served):
    """415 (the clients always send JSON) and a 503 without a JSON body (a proxy's): read as the table says."""
    from pixeltriage.serve.client import error_of

    response = httpx.post(served.url + "/v1/score", content=b'{"question": "q"}',
                          headers={"authorization": f"Bearer {API_KEY}", "content-type": "text/plain"}, timeout=30)
    assert (response.status_code, response.json()["error_type"]) == (415, "unsupported_media_type")
    assert type(error_of(response)) is error_for(415, "unsupported_media_type").error
    plain = httpx.Response(503, text="no healthy upstream", request=httpx.Request("POST", served.url + "/v1/score"))
    assert type(error_of(plain)) is error_for(503, None).error


def test_a_server_whose_model_worker_stopped_answers_the_503_row(gated):
    """The other way to the 503 row: a ready server whose batcher's threads stopped (gated_serve.py's "close
    batcher") refuses to score with it, and both clients raise its error, as from a loading server."""
    from pixeltriage.serve import Client
    from pixeltriage.serve.client import error_of

    server = gated("stopped").wait_ready()
    server.send("close batcher")
    row = error_for(503, "unavailable")
    response = httpx.post(server.url + "/v1/score", json={"question": "q", "memories": []}, timeout=30)
    assert (response.status_code, response.json()["error_type"]) == (503, "unavailable"), response.text
    assert type(error_of(response)) is row.error
    with Client(server.url, retries=0) as client:
        with pytest.raises(row.error) as raised_sync:
            client.score("q", [])
    with pytest.raises(row.error) as raised_async:
        asyncio.run(async_call(server.url, None, ("score", "q", [])))
    assert type(raised_sync.value) is type(raised_async.value) is row.error
    assert raised_sync.value.status == raised_async.value.status == 503


def test_the_server_answers_each_error_with_a_row_of_its_own_class():
    for row in error_statuses():
        found = status_of(_instance(row.error))
        assert found is not None and found.error is row.error      # no row of a base class shadows it


def _instance(cls):
    from pixeltriage.store.cache import CacheMissError
    from pixeltriage.errors import InvalidMemoryError, OverloadedError

    if cls is CacheMissError:
        return cls("c" * 64)
    if cls is OverloadedError:
        return cls("full", 1)
    if cls is InvalidMemoryError:
        return cls("bad", 0)
    return cls("refused")


def test_each_error_type_names_one_row():
    kinds = [row.error_type for row in error_statuses()]
    assert len(kinds) == len(set(kinds)), kinds


def test_a_client_reads_the_error_type_before_the_status():
    """The body's error_type picks the row whatever the status (a proxy may rewrite it); a body without a kind of the
    table falls back to the status's by_status row, and a status without one is a ServiceError."""
    from pixeltriage.store.cache import CacheMissError
    from pixeltriage.errors import InvalidRequestError, NoCacheError, OverloadedError, ServiceError
    from pixeltriage.serve.client import error_of

    key = "c" * 64

    def response(status, body=None, path=f"/v1/memories/{key}"):
        request = httpx.Request("GET", "http://127.0.0.1:1" + path)
        if body is None:
            return httpx.Response(status, text="upstream says no", request=request)
        return httpx.Response(status, json=body, request=request)

    missing = error_of(response(410, {"error": f"image {key} is not in the cache", "error_type": "not_found"}))
    assert type(missing) is CacheMissError and missing.key == key and "not in the cache" in str(missing)
    overloaded = error_of(response(502, {"error": "full", "error_type": "overloaded"}, "/v1/score"))
    assert type(overloaded) is OverloadedError and overloaded.status == 502
    no_cache = error_of(response(500, {"error": "no cache", "error_type": "no_cache"}, "/v1/memories"))
    assert type(no_cache) is NoCacheError
    plain = error_of(response(413, path="/v1/score"))                      # no body: the 413's by_status row
    assert type(plain) is InvalidRequestError and plain.status == 413
    unknown = error_of(response(422, {"error": "odd", "error_type": "not_a_kind"}, "/v1/score"))
    assert type(unknown) is InvalidRequestError                           # the 422's by_status row
    assert type(error_of(response(404, path="/v1/memories/x"))) is ServiceError    # 404 has no by_status row
    assert type(error_of(response(500, {"error": "boom", "error_type": "internal"}, "/v1/score"))) is ServiceError


def test_a_client_raises_every_row_of_the_table_without_loading_torch():
    """The clients run where the engine is not installed: building the table and raising a CacheMissError from a 404
    loads no torch (the cache's errors live in pixeltriage.errors, not in the engine's cache module)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys
import httpx
from pixeltriage.errors import CacheMissError
from pixeltriage.serve.client import error_of
from pixeltriage.serve.schemas import error_statuses
assert error_statuses()
request = httpx.Request("GET", "http://127.0.0.1/v1/memories/" + "ab" * 32)
error = error_of(httpx.Response(404, json={"error": "no such image", "error_type": "not_found"}, request=request))
assert isinstance(error, CacheMissError) and error.key == "ab" * 32, error
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
