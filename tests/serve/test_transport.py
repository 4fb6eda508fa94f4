"""The server's sockets and event loop: Nagle's algorithm off on every accepted connection (asyncio sets
TCP_NODELAY only on sockets made with proto IPPROTO_TCP; without it each response waited ~40 ms for a delayed ACK),
and a server on the stock asyncio loop and h11 (what `pip install ".[serve]"` gets where uvloop is absent) answers
as the library does."""
import asyncio
import os
import socket

import httpx
import pytest
from serving import ENV, ServerProcess, assert_scores_close, episode

from pixeltriage.serve import Client
from pixeltriage.serve.server import bind


def _accepted_nodelay(loop: asyncio.AbstractEventLoop) -> int:
    """TCP_NODELAY of a connection accepted on `bind()`'s socket by `loop`'s own server."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen = loop.create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            s = transport.get_extra_info("socket")
            seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await loop.create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        await server.wait_closed()
        return value

    return loop.run_until_complete(main())


def test_bind_makes_a_tcp_socket_with_nagle_off():
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def test_connections_accepted_by_the_stock_asyncio_loop_have_nagle_off():
    loop = asyncio.new_event_loop()                 # the standard library's loop, not uvloop
    try:
        assert _accepted_nodelay(loop)
    finally:
        loop.close()


@pytest.fixture
def stock_server(tiny_checkpoint, tmp_path):
    """A server that cannot import uvloop or httptools (each shadowed by a module that raises ImportError)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    for name in ("uvloop", "httptools"):
        (hide / f"{name}.py").write_text('raise ImportError("hidden by the test")\n')
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(hide), ENV["PYTHONPATH"]])}
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", env=env).wait_ready()
    yield server
    server.stop()


def test_a_server_on_asyncio_and_h11_answers_as_the_library(stock_server, library):
    assert httpx.get(stock_server.url + "/info", timeout=10).json()["transport"] == {"loop": "asyncio",
                                                                                     "http": "h11"}
    with Client(stock_server.url) as client:
        for seed in range(3):                         # keep-alive: the same connection for each request
            question, memories = episode(seed, memories=3)
            assert_scores_close(client.score(question, memories), library.score(question, memories))


def test_the_main_server_reports_its_transport(served):
    transport = httpx.get(served.url + "/info", timeout=10,
                          headers={"authorization": f"Bearer {served.key}"}).json()["transport"]
    assert transport["loop"] in ("uvloop", "asyncio") and transport["http"] in ("httptools", "h11")
