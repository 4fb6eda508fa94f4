"""Scale-out on Ray Serve: each replica holds one `Service` (its own scorer, batcher and queue) behind the same HTTP
API, through Ray Serve's ingress (`pixeltriage serve --ray`).

A replica's constructor loads the checkpoint and runs the warm-up forward, so Ray Serve routes to it only once it
is ready; `check_health` fails a replica whose batcher stopped. On the CPU each replica reserves `cpus` Ray CPUs and
runs torch on that many threads (so N replicas on one machine do not oversubscribe it); on CUDA a replica takes
`gpus` of a GPU (a fraction shares one). Ray Serve's own queue in front of the replicas is bounded by
`max_queued_requests` (503 past it); each replica's batcher refuses past its own --max-queued with 429 and
Retry-After, as a single server does. Each replica keeps its own rate gates (docs/serve.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import signal
import sys
import threading

from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.service import ModelSpec

log = logging.getLogger(__name__)

APP_NAME = "pixeltriage"
DEPLOYMENT_NAME = "PixelTriage"


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

        def __serve_build_asgi_app__(self):
            from pixeltriage.serve.app import create_app

            return create_app(self.service)

        def check_health(self) -> None:
            if self.service.readiness not in ("ready", "draining"):
                raise RuntimeError(f"pixeltriage replica is {self.service.readiness}")

    return PixelTriage


def deployment(spec: ModelSpec, config: ServeConfig, *, replicas: int | None = 1,
               autoscaling: dict | None = None, cpus: float = 1.0, gpus: float = 0.0,
               max_ongoing_requests: int | None = None, max_queued_requests: int | None = None,
               describe: dict | None = None):
    """The bound Ray Serve application: `replicas` fixed replicas, or `autoscaling` (Ray Serve's autoscaling_config:
    min_replicas, max_replicas, target_ongoing_requests, ...). max_ongoing_requests: requests in a replica at once
    (default: its --max-queued, so that its batcher sees everything it may batch). max_queued_requests: requests
    Ray Serve holds for the deployment beyond those, 503 past it (default: --max-queued as well; -1: no bound)."""
    from ray import serve

    if spec.device == "cpu" and spec.threads is None:
        spec = dataclasses.replace(spec, threads=max(1, math.floor(cpus)))
    options = dict(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
                   max_ongoing_requests=max_ongoing_requests or config.max_queued,
                   max_queued_requests=config.max_queued if max_queued_requests is None else max_queued_requests,
                   graceful_shutdown_timeout_s=config.graceful_timeout, graceful_shutdown_wait_loop_s=0.5,
                   health_check_period_s=5.0, health_check_timeout_s=30.0, max_constructor_retry_count=3)
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    return serve.deployment(replica_class(), **options).bind(spec, config, describe or {"checkpoint": spec.checkpoint})


def run_ray(spec: ModelSpec, config: ServeConfig, args: argparse.Namespace) -> int:
    """`pixeltriage serve --ray`: join (or start) a Ray cluster, run the deployment behind Ray Serve's HTTP proxy on
    --host/--port, block until SIGTERM or SIGINT, then shut the application down (replicas drain) and leave."""
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
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = deployment(spec, config, replicas=args.replicas or 1, autoscaling=autoscaling,
                         cpus=args.cpus_per_replica, gpus=gpus, describe={"checkpoint": args.checkpoint})
        print(f"pixeltriage serve --ray: starting replicas on Ray ({ray.get_runtime_context().gcs_address})",
              file=sys.stderr, flush=True)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as e:                 # a replica that cannot load: Ray's error names the cause
            raise ServerError(f"the Ray Serve application did not start: {str(e).strip().splitlines()[-1]}") from None
        print(f"pixeltriage serve --ray: ready on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        _wait_for_signal()
        print("pixeltriage serve --ray: shutting down (replicas drain)", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()
    print("pixeltriage serve --ray: stopped", file=sys.stderr, flush=True)
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
