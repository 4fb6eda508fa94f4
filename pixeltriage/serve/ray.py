"""Scale-out on Ray Serve: each replica holds one `Service` (its own scorer, batcher and queue) behind the same HTTP
API, through Ray Serve's ingress (`pixeltriage serve --ray`).

A replica's constructor loads the checkpoint and runs the warm-up forward, so Ray Serve routes to it only once it
is ready; `check_health` fails a replica whose batcher stopped. On the CPU each replica reserves `cpus` Ray CPUs and
runs torch on that many threads (so N replicas on one machine do not oversubscribe it); on CUDA a replica takes
`gpus` of a GPU (a fraction shares one). Ray Serve's own queue in front of the replicas is bounded by
`max_queued_requests` (503 past it); each replica's batcher refuses past its own --max-queued with 429 and
Retry-After, as a single server does. Each replica keeps its own rate gates (docs/serve.md).

The whole deployment answers as one server: GET /metrics, on whichever replica Ray routes it to, holds every
replica's series with a `replica` label (Ray Serve's own tag for its replica metrics: the replica's unique id), and
GET /info adds a `ray` section with every replica's status. A replica reaches the others through Ray's
`__ray_call__` on their actors (by their names in Ray Serve's namespace), which runs a function of this module in
that replica's process beside its Serve code.

SIGTERM (`drain`) drains like the single server: every replica stops admitting (503 with Retry-After and
`connection: close`, /ready 503) and finishes what it admitted within --graceful-timeout while Ray's proxy keeps
accepting, so that load balancers see the 503s; then each proxy's HTTP server shuts down as uvicorn does (the
listening socket closes, answers in flight are written, idle connections are closed), and only then is Serve shut
down: no route disappears under load (Ray's proxy answers 404 for a deleted application) and no connection is reset.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import logging
import math
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

from pixeltriage.serve import status
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.service import ModelSpec

log = logging.getLogger(__name__)

APP_NAME = "pixeltriage"
DEPLOYMENT_NAME = "PixelTriage"
SERVE_NAMESPACE = "serve"                      # Ray Serve's actors: its controller, proxies and replicas
CONTROLLER_ACTOR = "SERVE_CONTROLLER_ACTOR"
PROXY_ACTOR_PREFIX = "SERVE_PROXY_ACTOR"
REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"       # + "app#deployment#unique_id"
CALL_TIMEOUT = 5.0                             # seconds one replica or proxy has to answer a call of this module
CONNECTION_GRACE = 5.0                         # seconds a proxy's HTTP server waits for answers in flight at exit
LINGER = 1.0                                   # seconds a proxy answers the connections it accepted, once it stopped
                                               # accepting, before it closes the idle ones
POLL = 0.25
RETRY_AFTER = 1                                # seconds, the Retry-After of a 503 that Ray Serve's proxy answers
GUARD_PERIOD = 2.0                             # seconds between the driver's looks for proxies to guard


def replica_class():
    """The Ray Serve deployment class (built on first use: importing this module does not import Ray)."""
    from ray import serve

    @serve.ingress()
    class PixelTriage:
        def __init__(self, spec: ModelSpec, config: ServeConfig, describe: dict):
            from pixeltriage.engine.cpu_memory import tune_malloc
            from pixeltriage.serve.service import Service

            tune_malloc()
            self.service = Service(config, spec.load, describe=describe, index_loader=spec.load_index)
            self.service.load()
            self.drain = ReplicaDrain(self.service)

        def __serve_build_asgi_app__(self):
            from pixeltriage.serve.app import create_app

            app = create_app(self.service)
            app.add_middleware(DeploymentViews, service=self.service)
            return app

        def check_health(self) -> None:
            if self.service.readiness not in ("ready", "draining"):
                raise RuntimeError(f"pixeltriage replica is {self.service.readiness}")

    return PixelTriage


def deployment(spec: ModelSpec, config: ServeConfig, *, replicas: int | None = 1,
               autoscaling: dict | None = None, cpus: float = 1.0, gpus: float = 0.0,
               max_ongoing_requests: int | None = None, max_queued_requests: int | None = None,
               max_replicas_per_node: int | None = None, describe: dict | None = None):
    """The bound Ray Serve application: `replicas` fixed replicas, or `autoscaling` (Ray Serve's autoscaling_config:
    min_replicas, max_replicas, target_ongoing_requests, ...). max_ongoing_requests: requests in a replica at once
    (default: its --max-queued, so that its batcher sees everything it may batch). max_queued_requests: requests
    Ray Serve holds for the deployment beyond those, 503 with Retry-After past it (default: --max-queued as well;
    -1: no bound). max_replicas_per_node: at most that many replicas on one node (Ray Serve spreads replicas over
    the nodes by default, as far as their resources allow; this bound holds also when a node is lost: its replicas
    wait for a node with room, such as the lost one when it comes back, rather than pile onto the others)."""
    from ray import serve

    if spec.device == "cpu" and spec.threads is None:
        spec = dataclasses.replace(spec, threads=max(1, math.floor(cpus)))
    options = dict(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
                   max_ongoing_requests=max_ongoing_requests or config.max_queued,
                   max_queued_requests=config.max_queued if max_queued_requests is None else max_queued_requests,
                   backpressure_config={"status_code": 503, "retry_after_s": RETRY_AFTER},
                   graceful_shutdown_timeout_s=config.graceful_timeout, graceful_shutdown_wait_loop_s=0.5,
                   health_check_period_s=5.0, health_check_timeout_s=30.0, max_constructor_retry_count=3)
    if max_replicas_per_node is not None:
        options["max_replicas_per_node"] = max_replicas_per_node
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    described = dict(describe or {"checkpoint": spec.checkpoint})
    described["ray"] = {"replicas": None if autoscaling is not None else replicas, "autoscaling": autoscaling,
                        "cpus_per_replica": cpus, "gpus_per_replica": gpus, "torch_threads": spec.threads,
                        "max_ongoing_requests": options["max_ongoing_requests"],
                        "max_queued_requests": options["max_queued_requests"],
                        "max_replicas_per_node": max_replicas_per_node}
    return serve.deployment(replica_class(), **options).bind(spec, config, described)


# -- the whole deployment, seen from one replica ---------------------------------------------------------------------
def serve_actor_names(prefix: str) -> list[str]:
    """The names of Ray Serve's live actors (its namespace) that start with `prefix`."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix))


def replica_actor_names(app: str, deployment_name: str) -> list[str]:
    """The actor names of the deployment's live replicas (Ray Serve names each `SERVE_REPLICA::app#deployment#id`)."""
    return serve_actor_names(f"{REPLICA_ACTOR_PREFIX}{app}#{deployment_name}#")


def _actor(name: str):
    import ray

    return ray.get_actor(name, namespace=SERVE_NAMESPACE)


def _local_replica():
    """(this replica's unique id, its PixelTriage object): for the functions below, run in a replica's process."""
    from ray import serve

    context = serve.get_replica_context()
    return context.replica_id.unique_id, context.servable_object


def replica_metrics(_actor_object) -> tuple[str, list]:
    """Run in a replica (`__ray_call__`): (its id, its metric families, as its own /metrics would expose them)."""
    replica, servable = _local_replica()
    service = servable.service
    status.update_scorer_metrics(service)
    return replica, list(service.metrics.registry.collect())


def replica_status(_actor_object) -> dict:
    """Run in a replica (`__ray_call__`): what /info lists for it."""
    import os

    import ray

    replica, servable = _local_replica()
    batcher, cache = servable.service.batcher, servable.service.cache
    return {"replica": replica, "status": servable.service.readiness, "host": socket.gethostname(),
            "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "cache": cache.location if cache is not None else None,
            "admitted": batcher.admitted if batcher is not None else 0}


def replica_drain(_actor_object, timeout: float) -> bool:
    """Run in a replica (`__ray_call__`): start its drain (once) and say whether it is over."""
    return _local_replica()[1].drain.start(timeout)


class ReplicaDrain:
    """One replica's drain, as the single server's SIGTERM: stop admitting (503 with Retry-After), wait up to
    `timeout` s for the admitted questions, refuse what is left (503). Runs on its own thread; `start` is
    idempotent and returns whether it is over."""

    def __init__(self, service):
        self.service = service
        self.done = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, timeout: float) -> bool:
        with self._lock:
            if self._thread is None:
                log.warning("draining (up to %.0f s), no new requests admitted", timeout)
                self._thread = threading.Thread(target=self._run, args=(timeout,), name="pixeltriage-drain",
                                                daemon=True)
                self._thread.start()
        return self.done.is_set()

    def _run(self, timeout: float) -> None:
        service = self.service
        try:
            service.drain(timeout)
        finally:
            self.done.set()


async def _gather(names: list[str], fn: Callable, *args) -> tuple[list[Any], list[str]]:
    """`fn(*args)` run in each named replica at once -> (the answers, the names that did not answer in time)."""
    futures = {}
    for name in names:
        try:
            futures[name] = asyncio.wrap_future(_actor(name).__ray_call__.remote(fn, *args).future())
        except ValueError:                     # gone since it was listed
            continue
    if not futures:
        return [], list(names)
    await asyncio.wait(futures.values(), timeout=CALL_TIMEOUT)
    answers, missing = [], [n for n in names if n not in futures]
    for name, future in futures.items():
        if future.done() and not future.cancelled() and future.exception() is None:
            answers.append(future.result())
        else:
            future.cancel()
            if future.done() and not future.cancelled():
                log.warning("replica %s did not answer: %s", name, future.exception())
            missing.append(name)
    return answers, missing


class MergedMetrics:
    """A Prometheus collector over several replicas' metric families: each sample gains a `replica` label, the
    families keep their names, types and help (what `generate_latest` renders)."""

    def __init__(self, per_replica: list[tuple[str, list]], unreachable: int):
        self.per_replica, self.unreachable = per_replica, unreachable

    def collect(self):
        from prometheus_client.metrics_core import GaugeMetricFamily, Metric

        families: dict[str, Metric] = {}
        for replica, metrics in sorted(self.per_replica, key=lambda r: r[0]):
            for metric in metrics:
                merged = families.get(metric.name)
                if merged is None:
                    merged = families[metric.name] = Metric(metric.name, metric.documentation, metric.type,
                                                            metric.unit)
                merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in metric.samples]
        scraped = GaugeMetricFamily("pixeltriage_replicas", "replicas of the deployment by whether this scrape holds "
                                    "their series (answered) or they did not answer in time (unreachable)",
                                    labels=["outcome"])
        scraped.add_metric(["answered"], len(self.per_replica))
        scraped.add_metric(["unreachable"], self.unreachable)
        return [*families.values(), scraped]


class DeploymentViews:
    """ASGI, outside the app's own guard: GET /metrics answers for every replica of the deployment (its own text
    format, each series labelled `replica`); GET /info, once the app answered it 200 (API key checked), gains a
    `ray` section (this replica, every replica's status) and the proxy's `transport`. Everything else goes to the
    app, every 503 with a Retry-After (`_with_retry_after`)."""

    def __init__(self, app, service):
        self.app, self.service = app, service
        self._transport: dict | None = None     # Ray Serve's proxy: its event loop and HTTP parser

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            if scope["path"] == "/metrics":
                await self._metrics(send)
                return
            if scope["path"] == "/info":
                await self._info(scope, receive, send)
                return
        await self.app(scope, receive, _with_retry_after(send) if scope["type"] == "http" else send)

    async def _metrics(self, send) -> None:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
        from ray import serve

        context = serve.get_replica_context()
        names = await asyncio.to_thread(replica_actor_names, context.app_name, context.deployment)
        answers, missing = await _gather(names, replica_metrics)
        body = generate_latest(MergedMetrics(answers, len(missing)))
        self.service.metrics.requests.labels("/metrics", "200").inc()
        await _respond(send, 200, body, CONTENT_TYPE_LATEST)

    async def _info(self, scope, receive, send) -> None:
        from ray import serve

        messages = []

        async def keep(message) -> None:
            messages.append(message)

        await self.app(scope, receive, keep)
        start = messages[0] if messages else None
        if start is None or start["status"] != 200:
            for message in messages:
                await send(message)
            return
        info = json.loads(b"".join(m.get("body", b"") for m in messages[1:]))
        context = serve.get_replica_context()
        names = await asyncio.to_thread(replica_actor_names, context.app_name, context.deployment)
        statuses, missing = await _gather(names, replica_status)
        ray_info = info.setdefault("ray", {})
        ray_info.update({"application": context.app_name, "deployment": context.deployment,
                         "replica": context.replica_id.unique_id,
                         "replicas_live": sorted(statuses, key=lambda s: s["replica"]),
                         "replicas_unreachable": len(missing)})
        if self._transport is None:
            proxies = await asyncio.to_thread(serve_actor_names, PROXY_ACTOR_PREFIX)
            answers, _ = await _gather(proxies, proxy_transport)
            self._transport = {"server": "ray-serve-proxy", **(answers[0] if answers else {})}
        info["transport"] = self._transport
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        body = json.dumps(info, allow_nan=False, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _with_retry_after(send):
    """`send` that gives a 503 without Retry-After one (1 s, and `connection: close`): the app's refusal of a
    request its guard let through just before the drain began has none, and under load balancing every 503 of a
    draining replica should tell the client when to come back."""

    async def sending(message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            headers = list(message.get("headers", []))
            if not any(k.lower() == b"retry-after" for k, _ in headers):
                headers = [(k, v) for k, v in headers if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"retry-after", b"1"), (b"connection", b"close")]}
        await send(message)

    return sending


async def _respond(send, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# -- the proxies -----------------------------------------------------------------------------------------------------
_proxy_stopping: dict[str, float] = {}          # in a proxy's process: when it stopped taking connections
SO_ATTACH_FILTER = 26                          # Linux's setsockopt option for a classic BPF socket filter
BPF_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)   # one instruction, BPF_RET | BPF_K 0: keep no byte of any packet


def proxy_stop_http(proxy, grace: float) -> bool:
    """Run in a Ray Serve proxy (`__ray_call__`), again until it returns True: shut its HTTP server down as uvicorn
    does on a signal, with one step before, so that no connection is reset. True once the server has stopped.

    First the proxy stops taking connections without closing its listening socket (`refuse_new_connections`), and
    for LINGER s answers those it holds (503 with `connection: close` while the replicas drain, so their clients
    go): closing the socket at once would reset every connection still waiting in its accept queue, and uvicorn's
    shutdown closes a connection whose request it has not read yet without an answer. Then uvicorn's shutdown:
    the socket closes (clients are refused), idle connections close, answers in flight are written within `grace` s.

    The proxy keeps its uvicorn server in the task that started it (Ray Serve 2.60's ProxyActor); True with a
    warning where it is not there (its connections then close when Serve kills the proxy)."""
    started = getattr(proxy, "_start_http_server_task", None)
    running = getattr(proxy, "_running_http_server_task", None)
    if started is None or not started.done() or running is None:
        log.warning("this Ray Serve proxy keeps no uvicorn server where expected: its connections close at exit")
        return True
    server = started.result()[1]
    stopped_at = _proxy_stopping.get("at")
    if stopped_at is None:
        _proxy_stopping["at"] = time.monotonic()
        refuse_new_connections(server)
        return False
    if time.monotonic() - stopped_at >= LINGER and not server.should_exit:
        server.config.timeout_graceful_shutdown = grace
        server.should_exit = True
    return running.done()


def refuse_new_connections(server) -> None:
    """Stop a uvicorn server's listening sockets from completing new connections, keeping those already in their
    accept queue: a socket filter that keeps no packet drops each new SYN (the client sends it again a second
    later, and by then the closed socket refuses it), while accept() still hands over the queued connections.
    Linux only; elsewhere the sockets are closed at once (queued connections are then reset)."""
    program = ctypes.create_string_buffer(BPF_DROP_ALL)
    fprog = struct.pack("HP", 1, ctypes.addressof(program))     # struct sock_fprog, native alignment
    for listener in server.servers:
        for sock in listener.sockets:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            except OSError as e:
                log.warning("cannot filter the proxy's listening socket (%s): closing it at once", e)
                listener.get_loop().call_soon_threadsafe(listener.close)


def proxy_transport(proxy) -> dict:
    """Run in a Ray Serve proxy (`__ray_call__`): its uvicorn's event loop and HTTP parser, as /info reports."""
    started = getattr(proxy, "_start_http_server_task", None)
    if started is None or not started.done():
        return {}
    config = started.result()[1].config
    loop = config.loop if isinstance(config.loop, str) else type(config.loop).__module__.split(".")[0]
    http = getattr(config, "http_protocol_class", config.http)
    return {"loop": loop, "http": getattr(http, "__module__", str(http)).rsplit(".", 1)[-1].removesuffix("_impl")}


def lost_replica(exc: BaseException) -> bool:
    """Whether `exc`, as Ray Serve's proxy meets it, says the replica went away (its actor died or cannot be
    reached: a replica killed, a node lost) rather than that the application failed."""
    from ray.exceptions import RayActorError

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RayActorError):
            return True
        seen.add(id(exc))
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


def proxy_guard(_proxy) -> bool:
    """Run in a Ray Serve proxy (`__ray_call__`), again whenever the driver looks (it does nothing the second time):
    a request whose replica is lost before it answered is answered 503 with Retry-After and the reason, where Ray
    Serve's proxy writes no answer at all (its ASGI call returns without one, so uvicorn sends a bare 500). The
    question was scored by nobody, scoring is idempotent, and clients and load balancers retry a 503: a node lost
    under load costs its in-flight requests one retry, not an error. Any other failure keeps Ray Serve's answer.

    The proxy maps a failed request to its status with `get_http_response_status` of its module (Ray Serve 2.60),
    which this wraps; False with a warning where it is not there."""
    from ray.serve._private import proxy as ray_proxy
    from ray.serve._private.proxy_request_response import ResponseStatus

    current = getattr(ray_proxy, "get_http_response_status", None)
    if current is None:
        log.warning("this Ray Serve proxy has no get_http_response_status: a lost replica's requests answer 500")
        return False
    if getattr(current, "pixeltriage_guard", False):
        return True

    def response_status(exc: BaseException, request_timeout_s, request_id: str) -> ResponseStatus:
        if lost_replica(exc):
            log.warning("request %s: its replica was lost before answering (%s): 503", request_id,
                        type(exc).__name__)
            return ResponseStatus(code=503, is_error=True,
                                  message=f"the replica of request {request_id} was lost before it answered; "
                                          f"retry after {RETRY_AFTER} s",
                                  headers=[(b"retry-after", str(RETRY_AFTER).encode())])
        return current(exc, request_timeout_s, request_id)

    response_status.pixeltriage_guard = True
    ray_proxy.get_http_response_status = response_status
    return True


class ProxyGuards:
    """The driver's side of `proxy_guard`: every GUARD_PERIOD s (`poll`), the guard is sent to every Ray Serve proxy
    (one per node: a node that joins, or comes back, has a new one), without waiting for the answers; a proxy
    that did not answer within CALL_TIMEOUT (its node lost) is sent it again on a later look, and one that failed
    is reported once."""

    def __init__(self):
        self.pending: dict[str, tuple[Any, float]] = {}    # proxy name -> (the call's ref, sent at)
        self.guarded: set[str] = set()
        self.failed: set[str] = set()
        self._next = 0.0

    def poll(self, wait: float = 0.0) -> None:
        """Look now if GUARD_PERIOD has passed; with `wait`, wait up to that long for the answers of this look."""
        import ray

        now = time.monotonic()
        if now >= self._next:
            self._next = now + GUARD_PERIOD
            for name in serve_actor_names(PROXY_ACTOR_PREFIX):
                if name not in self.pending:
                    try:
                        self.pending[name] = (_actor(name).__ray_call__.remote(proxy_guard), now)
                    except ValueError:         # gone since it was listed
                        continue
        if not self.pending:
            return
        refs = [ref for ref, _ in self.pending.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        done = set(done)
        for name, (ref, sent) in list(self.pending.items()):
            if ref in done:
                del self.pending[name]
                try:
                    if ray.get(ref):
                        self.guarded.add(name)
                except ray.exceptions.RayError as e:   # a proxy on a node being lost: tried again while listed
                    if name not in self.failed:
                        self.failed.add(name)
                        log.warning("%s did not take the guard (tried again while it is listed): %s", name,
                                    str(e).splitlines()[0])
            elif time.monotonic() - sent > CALL_TIMEOUT:
                del self.pending[name]


def _call_all(names: list[str], fn: Callable, *args) -> dict[str, Any]:
    """`fn(*args)` in each named actor, at once, from the driver -> {name: answer}; None for an actor that did not
    answer within CALL_TIMEOUT, no entry for one that is gone."""
    import ray

    refs = {}
    for name in names:
        try:
            refs[name] = _actor(name).__ray_call__.remote(fn, *args)
        except ValueError:                     # gone since it was listed
            continue
    out = {}
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref, timeout=CALL_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            log.warning("%s did not answer within %.0f s", name, CALL_TIMEOUT)
            out[name] = None
        except ray.exceptions.RayActorError:
            continue
    return out


# -- pixeltriage serve --ray -----------------------------------------------------------------------------------------
class Signals:
    """SIGTERM and SIGINT of `serve --ray`: the first asks for a drain (`stop`), a second for an exit without
    waiting (`hurry`). While starting, the first interrupts the start (KeyboardInterrupt)."""

    def __init__(self):
        self.stop, self.hurry = threading.Event(), threading.Event()
        self.started = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig, frame) -> None:
        if self.stop.is_set():
            log.warning("second signal: exiting without waiting")
            self.hurry.set()
            return
        self.stop.set()
        if not self.started:
            raise KeyboardInterrupt(signal.Signals(sig).name)


def drain(config: ServeConfig, hurry: threading.Event, *, stop_proxies: bool) -> bool:
    """SIGTERM of the deployment: every replica drains (503 with Retry-After while it finishes its admitted
    questions, up to --graceful-timeout), replicas started meanwhile too; then, with `stop_proxies`, each Ray Serve
    proxy's HTTP server shuts down gracefully. True when every replica finished its admitted questions."""
    grace = config.graceful_timeout
    deadline = time.monotonic() + grace + 2 * CALL_TIMEOUT
    finished = False
    while not hurry.is_set() and time.monotonic() < deadline:
        names = replica_actor_names(APP_NAME, DEPLOYMENT_NAME)
        answers = _call_all(names, replica_drain, grace)
        if all(answers.get(name, True) for name in names):   # one that is gone has nothing left to answer
            finished = True
            break
        hurry.wait(POLL)
    if not finished:
        log.warning("the replicas did not all report their drain within %.0f s", grace + 2 * CALL_TIMEOUT)
    if stop_proxies:
        proxies = serve_actor_names(PROXY_ACTOR_PREFIX)
        deadline = time.monotonic() + LINGER + CONNECTION_GRACE + CALL_TIMEOUT
        while proxies and not hurry.is_set() and time.monotonic() < deadline:
            answers = _call_all(proxies, proxy_stop_http, CONNECTION_GRACE)
            proxies = [name for name in proxies if not answers.get(name, True)]
            if proxies:
                hurry.wait(POLL)
    return finished


def shut_serve_down(timeout: float) -> None:
    """Serve's own shutdown (its applications, proxies and controller), waited for by watching the controller's
    name go: `serve.shutdown()` waits on a call the controller never returns from (Ray logs its retry as a failure
    when the controller exits)."""
    import ray

    try:
        controller = ray.get_actor(CONTROLLER_ACTOR, namespace=SERVE_NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(controller.graceful_shutdown.remote(False), timeout=CALL_TIMEOUT)
    except ray.exceptions.RayActorError:       # already gone
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if CONTROLLER_ACTOR not in serve_actor_names(CONTROLLER_ACTOR):
            return
        time.sleep(POLL)
    log.warning("Ray Serve did not shut down within %.0f s; leaving Ray", timeout)


def run_ray(spec: ModelSpec, config: ServeConfig, args: argparse.Namespace) -> int:
    """`pixeltriage serve --ray`: join (or start) a Ray cluster, run the deployment behind Ray Serve's HTTP proxy on
    --host/--port, block until SIGTERM or SIGINT, drain (`drain`), shut Serve down (or, in a cluster whose Serve
    was already running, delete this application only) and leave."""
    import ray
    from ray import serve

    from pixeltriage.serve.server import ServerError

    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None or args.target_ongoing_requests is not None:
        autoscaling = {"min_replicas": args.min_replicas if args.min_replicas is not None else 1,
                       "max_replicas": args.max_replicas or max(1, args.min_replicas or 1),
                       "target_ongoing_requests": args.target_ongoing_requests or 2 * config.max_client_batch}
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (1.0 if spec.device == "cuda" else 0.0)
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=bool(getattr(args, "verbose", 0)))
    signals = Signals()                        # after ray.init, which sets its own SIGTERM handler
    owns_serve = True
    try:
        try:
            ray.get_actor(CONTROLLER_ACTOR, namespace=SERVE_NAMESPACE)
            owns_serve = False                 # another's Serve: its proxies stay, only this application goes
        except ValueError:
            pass
        serve.start(http_options={"host": args.host, "port": args.port})
        app = deployment(spec, config, replicas=args.replicas or 1, autoscaling=autoscaling,
                         cpus=args.cpus_per_replica, gpus=gpus, max_replicas_per_node=args.max_replicas_per_node,
                         describe={"checkpoint": args.checkpoint})
        print(f"pixeltriage serve --ray: starting replicas on Ray ({ray.get_runtime_context().gcs_address})",
              file=sys.stderr, flush=True)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except KeyboardInterrupt:
            raise
        except Exception as e:                 # a replica that cannot load: Ray's error names the cause
            raise ServerError(f"the Ray Serve application did not start: {str(e).strip().splitlines()[-1]}") from None
        guards = ProxyGuards()
        guards.poll(wait=CALL_TIMEOUT)
        signals.started = True
        if signals.stop.is_set():
            raise KeyboardInterrupt("signalled while starting")
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        print(f"pixeltriage serve --ray: ready on http://{args.host}:{args.port} ({nodes} Ray nodes, "
              f"{len(guards.guarded)} proxies)", file=sys.stderr, flush=True)
        while not signals.stop.wait(POLL):
            guards.poll()
        print(f"pixeltriage serve --ray: draining (up to {config.graceful_timeout:g} s), no new requests admitted",
              file=sys.stderr, flush=True)
        drained = drain(config, signals.hurry, stop_proxies=owns_serve)
        print(f"pixeltriage serve --ray: {'drained' if drained else 'graceful timeout'}; shutting Ray Serve down",
              file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("pixeltriage serve --ray: stopped while starting", file=sys.stderr, flush=True)
    finally:
        signals.started = True                 # from here a signal only hurries
        try:
            if owns_serve:
                shut_serve_down(config.graceful_timeout + 30.0)
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    print("pixeltriage serve --ray: stopped", file=sys.stderr, flush=True)
    return 0
