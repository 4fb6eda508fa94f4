"""One server process: uvicorn on a socket bound here, the model loaded in the background, SIGTERM drained.

SIGTERM or SIGINT: the service stops admitting at once (503 on /v1 and /ready, while the socket still accepts, so
that load balancers see it), admitted questions are scored for up to `graceful_timeout` seconds, what is left is
refused with 503, then uvicorn closes the connections and the app's shutdown closes the batcher and the cache. A
second signal exits at once.
"""
from __future__ import annotations

import contextlib
import asyncio
import atexit
import errno
import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

from pixeltriage.errors import PixelTriageError
from pixeltriage.serve.app import create_app
from pixeltriage.serve.service import Service

log = logging.getLogger(__name__)

CONNECTION_GRACE = 5.0      # seconds uvicorn waits for responses to leave once the queue is empty


class ServerError(PixelTriageError):
    """The server could not start (its address is taken, or the model did not load)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port), or ServerError naming the address.

    Made with proto IPPROTO_TCP, not 0: asyncio's event loop turns Nagle's algorithm off (TCP_NODELAY) only on
    sockets that say they are TCP, and without it every response, written as headers then body, waited ~40 ms for
    the client's delayed ACK (measured: 44 ms per request on a trivial route, 1.1 ms with the flag). uvloop sets
    the flag itself; the listening socket's own flag covers connections accepted by any loop (Linux inherits it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        reason = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise ServerError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server with the drain above in place of its own signal handling."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service
        self._signalled = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        if self._signalled:
            log.warning("second signal: exiting without waiting")
            self.should_exit = self.force_exit = True
            return
        self._signalled = True
        log.warning("%s: draining (up to %.0f s), no new requests admitted", signal.Signals(sig).name,
                    self.service.config.graceful_timeout)
        threading.Thread(target=self._drain, name="pixeltriage-drain", daemon=True).start()

    def _drain(self) -> None:
        self.service.drain(self.service.config.graceful_timeout)     # refuses what is left past the timeout
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        # what uvicorn chose ("auto": uvloop and httptools where installed; the serve extra brings httptools, 1.6
        # vs 2.7 ms per 0.2 MiB request against h11, measured), as it runs: shown by /info
        http = self.config.http_protocol_class
        chosen = {"loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
                  "http": getattr(http, "__module__", "").rsplit(".", 1)[-1].removesuffix("_impl") or str(http)}
        self.service.describe["transport"] = chosen
        log.info("event loop %s, HTTP parser %s", chosen["loop"], chosen["http"])

    def load_failed(self, error: BaseException) -> None:
        self.should_exit = True


def run(service: Service, sock: socket.socket, *, access_log: bool = False, on_ready=None) -> None:
    """Serve on `sock` until a signal drains the service. Loading starts at once; /health answers meanwhile and
    /ready once loaded (then `on_ready()`). Raises the load's error (a PixelTriageError for a bad checkpoint) if it
    failed."""
    config = uvicorn.Config(create_app(service), log_config=None, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=CONNECTION_GRACE, server_header=False,
                            log_level=logging.getLogger().getEffectiveLevel())
    if access_log:      # uvicorn logs each request at INFO: asked for, it is shown at the default verbosity too
        logging.getLogger("uvicorn.access").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    server = _Server(config, service)
    service.start_loading(server.load_failed, on_ready)
    server.run(sockets=[sock])
    if service.error is not None:
        raise service.error


def end_process(code: int = 0):
    """End a server process that has stopped cleanly (drained, its batcher and cache closed): the atexit handlers
    run and the output is flushed, then the process exits without the interpreter's finalization, which tears down
    torch's ~1,200 modules one by one (0.5 s of a quiet 2-core machine, up to 4 s of a busy one, measured), time
    in which the port is closed yet a supervisor or a rolling restart still waits for the exit. Called only from the
    main thread of the `pixeltriage serve` command."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed or broken stream: nothing left to say on it
            pass
    os._exit(code)
