"""`pixeltriage serve`: System One as an HTTP scoring service (docs/serve.md), in this process or as Ray Serve
replicas (--ray)."""
from __future__ import annotations

import argparse
import os
import sys

from pixeltriage.cli.common import (add_checkpoint_arguments, add_device_arguments, cache_target, device_dtype,
                                    existing_directory, fraction, int_at_least, non_negative_float, positive_float,
                                    resolved_checkpoint)
from pixeltriage.cli.retrieve import DEFAULT_OVERLAP, encoder_directory, overlap

DEFAULTS = {"max_queued": 256, "max_client_batch": 32, "max_memories": 64, "request_timeout": 60.0,
            "payload_limit": 32.0, "preprocess_threads": 2, "gate_window": 1000, "max_gates": 256,
            "graceful_timeout": 30.0, "trim_idle_s": 1.0}   # pixeltriage.serve.config.ServeConfig's


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535 (0: any free port), got {value}")
    return value


port.__name__ = "int"


def api_key_file(text: str) -> tuple[str, ...]:
    """The keys of a key file, read at parse time: a missing, unreadable or empty file is a usage error."""
    from pixeltriage.serve.config import read_api_keys

    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    try:
        return read_api_keys(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(p)
    add_device_arguments(p)
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    net.add_argument("--port", type=port, default=8080, help="TCP port (default 8080; 0: any free port)")
    net.add_argument("--api-key-file", metavar="F", type=api_key_file, default=None, dest="api_keys",
                     help="require 'Authorization: Bearer KEY' for /v1, /info and the docs; one key per line "
                          "(/health, /ready and /metrics stay open)")
    net.add_argument("--payload-limit", metavar="MB", type=positive_float, default=DEFAULTS["payload_limit"],
                     help=f"largest request body in MiB (default {DEFAULTS['payload_limit']:g}); larger: 413")
    net.add_argument("--access-log", action="store_true",
                     help="log one line per request (client, method, path, status) to stderr, at any verbosity")
    data = p.add_argument_group("memories")
    data.add_argument("--cache", metavar="DB", type=cache_target, default=None,
                      help="write-time cache file, or a postgresql:// URL that replicas share: POST /v1/memories "
                           "fills it, memories may be given by key, thumbnails and vision features are reused")
    data.add_argument("--image-root", metavar="DIR", type=existing_directory, default=None,
                      help="allow memories given by 'path', relative to DIR (never outside it)")
    data.add_argument("--index-encoder", metavar="DIR", type=encoder_directory, default=None,
                      help="SigLIP 2 checkpoint directory: POST /v1/memories also stores each image's region "
                           "vectors and POST /v1/retrieve ranks the cached images (needs --cache; docs/retrieval.md)")
    data.add_argument("--index-overlap", metavar="F", type=overlap, default=DEFAULT_OVERLAP,
                      help=f"the region grid's overlap (default {DEFAULT_OVERLAP}; as the vectors were indexed with)")
    data.add_argument("--max-memories", metavar="N", type=int_at_least(1), default=DEFAULTS["max_memories"],
                      help=f"memories per question (default {DEFAULTS['max_memories']}); more: 422")
    batching = p.add_argument_group("batching and overload")
    batching.add_argument("--max-batch-tokens", metavar="N", type=int_at_least(1), default=None,
                          help="state tokens per forward (default 4096 on the CPU, 32768 on CUDA); a question "
                               "longer than this runs alone")
    batching.add_argument("--max-wait-ms", metavar="X", type=non_negative_float, default=0.0,
                          help="an idle worker with a partial batch waits up to X ms for more (default 0)")
    batching.add_argument("--max-queued", metavar="N", type=int_at_least(1), default=DEFAULTS["max_queued"],
                          help=f"questions admitted at once (default {DEFAULTS['max_queued']}); more: 429 "
                               "with Retry-After")
    batching.add_argument("--max-client-batch", metavar="N", type=int_at_least(1), default=None,
                          help=f"questions per /v1/score/batch request (default {DEFAULTS['max_client_batch']}, or "
                               "--max-queued when that is smaller; at most --max-queued); more: 422")
    batching.add_argument("--request-timeout", metavar="S", type=positive_float, default=DEFAULTS["request_timeout"],
                          help=f"seconds a request may wait for its forward (default {DEFAULTS['request_timeout']:g});"
                               " later: dropped, 504")
    batching.add_argument("--preprocess-threads", metavar="N", type=int_at_least(1),
                          default=DEFAULTS["preprocess_threads"],
                          help=f"threads decoding images and packing states during the forward "
                               f"(default {DEFAULTS['preprocess_threads']})")
    batching.add_argument("--threads", metavar="N", type=int_at_least(1), default=None,
                          help="torch threads of the forward (default: torch's, one per core)")
    batching.add_argument("--gate-window", metavar="N", type=int_at_least(1), default=DEFAULTS["gate_window"],
                          help=f"recent questions each rate gate ranks p_vis among (default {DEFAULTS['gate_window']})")
    batching.add_argument("--graceful-timeout", metavar="S", type=positive_float,
                          default=DEFAULTS["graceful_timeout"],
                          help=f"on SIGTERM, seconds to finish admitted work (default {DEFAULTS['graceful_timeout']:g})")
    batching.add_argument("--trim-idle-s", metavar="S", type=non_negative_float, default=DEFAULTS["trim_idle_s"],
                          help="seconds idle after which the memory requests freed goes back to the OS; 0: never "
                               f"(default {DEFAULTS['trim_idle_s']:g})")
    p.add_argument("--verify", action="store_true", help="read every weight of a packed checkpoint at load")
    p.add_argument("--rerank-score", choices=("gain", "relevance"), default="gain",
                   help="what the rerank routes answer as relevance_score (TEI: score) when a request does not set "
                        "pixeltriage_score: System One's gain (default) or its relevance")
    p.add_argument("--rerank-strict", action="store_true",
                   help="a rerank document that cannot be scored from an image (an unknown or mistyped cache key, "
                        "text, a URL) is a 422 naming it, unless its request sets strict: false (default: scored 0, "
                        "its status saying why)")
    ray = p.add_argument_group("Ray Serve (scale-out; pip install 'pixeltriage[ray]')")
    ray.add_argument("--ray", action="store_true", help="run as a Ray Serve deployment of replicas, each with its "
                                                        "own batcher, behind Ray Serve's HTTP proxy")
    ray.add_argument("--ray-address", metavar="ADDR", default=None,
                     help="join this Ray cluster ('auto', or the head's HOST:6379; default: start a local one)")
    ray.add_argument("--replicas", metavar="N", type=int_at_least(1), default=None,
                     help="a fixed number of replicas (default 1; not with the autoscaling flags)")
    ray.add_argument("--min-replicas", metavar="N", type=int_at_least(0), default=None, help="autoscaling: fewest")
    ray.add_argument("--max-replicas", metavar="N", type=int_at_least(1), default=None, help="autoscaling: most")
    ray.add_argument("--target-ongoing-requests", metavar="X", type=positive_float, default=None,
                     help="autoscaling: requests per replica to aim for (default 2 x --max-client-batch)")
    ray.add_argument("--cpus-per-replica", metavar="X", type=positive_float, default=1.0,
                     help="CPUs Ray reserves per replica (default 1)")
    ray.add_argument("--gpus-per-replica", metavar="X", type=fraction, default=None,
                     help="GPUs per replica on CUDA, a fraction shares one (default 1 with --device cuda)")
    ray.add_argument("--max-replicas-per-node", metavar="N", type=int_at_least(1), default=None,
                     help="at most N replicas on one Ray node, also while a node is lost (default: no bound; Ray "
                          "Serve spreads replicas over the nodes as far as their CPUs allow)")


def check_serve_arguments(args: argparse.Namespace) -> None:
    """The checks that span several flags, before anything is imported or loaded: ConfigError (exit 2)."""
    from pixeltriage.serve.config import ConfigError as UsageError

    if args.max_client_batch is not None and args.max_client_batch > args.max_queued:
        raise UsageError(f"--max-client-batch {args.max_client_batch} is above --max-queued {args.max_queued}: "
                         "such a batch could never be admitted")
    ray_flags = [name for name in ("ray_address", "replicas", "min_replicas", "max_replicas",
                                   "target_ongoing_requests", "gpus_per_replica", "max_replicas_per_node")
                 if getattr(args, name) is not None]
    if ray_flags and not args.ray:
        raise UsageError(f"--{ray_flags[0].replace('_', '-')} needs --ray")
    autoscaling = [n for n in ("min_replicas", "max_replicas", "target_ongoing_requests") if getattr(args, n) is not None]
    if autoscaling and args.replicas is not None:
        raise UsageError("--replicas is a fixed count; leave it out with --min-replicas/--max-replicas")
    if args.min_replicas is not None and args.max_replicas is not None and args.min_replicas > args.max_replicas:
        raise UsageError(f"--min-replicas {args.min_replicas} is above --max-replicas {args.max_replicas}")
    if args.gpus_per_replica is not None and args.device != "cuda":
        raise UsageError("--gpus-per-replica needs --device cuda")
    if args.index_encoder is not None and args.cache is None:
        raise UsageError("--index-encoder needs --cache DB: the region vectors are stored in the write-time cache")


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve_config(args: argparse.Namespace):
    from pathlib import Path

    from pixeltriage.serve.config import MIB, ServeConfig

    return ServeConfig(max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                       max_queued=args.max_queued, max_client_batch=args.max_client_batch,
                       max_memories=args.max_memories, request_timeout=args.request_timeout,
                       payload_limit=int(args.payload_limit * MIB), preprocess_threads=args.preprocess_threads,
                       image_root=Path(args.image_root) if args.image_root else None,
                       api_keys=args.api_keys or (), gate_window=args.gate_window,
                       graceful_timeout=args.graceful_timeout, rerank_score=args.rerank_score,
                       rerank_strict=args.rerank_strict, trim_idle_s=args.trim_idle_s or None)


def run_serve(args: argparse.Namespace) -> int:
    check_serve_arguments(args)
    from pixeltriage.engine.cpu_memory import tune_malloc
    from pixeltriage.serve.service import ModelSpec

    config = serve_config(args)
    args.checkpoint = resolved_checkpoint(args)      # a hub id becomes its local snapshot once, for every replica
    spec = ModelSpec(checkpoint=args.checkpoint, device=args.device, dtype=device_dtype(args), cache=args.cache,
                     cache_timeout=config.request_timeout, verify=args.verify, threads=args.threads, index_encoder=args.index_encoder,
                     index_overlap=args.index_overlap)
    if args.ray:
        from pixeltriage.serve.ray import run_ray

        return run_ray(spec, config, args)
    from pixeltriage.serve import server
    from pixeltriage.serve.service import Service

    tune_malloc()
    sock = server.bind(args.host, args.port)
    host, bound = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    service = Service(config, spec.load, describe={"checkpoint": args.checkpoint}, index_loader=spec.load_index)
    print(f"pixeltriage serve: listening on {url}; loading {args.checkpoint} (GET /ready answers 200 once ready)",
          file=sys.stderr, flush=True)
    if not config.api_keys and not _loopback(host):
        print(f"pixeltriage serve: warning: {host} is reachable from other machines and no --api-key-file is set",
              file=sys.stderr, flush=True)
    server.run(service, sock, access_log=args.access_log,
               on_ready=lambda: print(f"pixeltriage serve: ready on {url}", file=sys.stderr, flush=True))
    print("pixeltriage serve: stopped", file=sys.stderr, flush=True)
    server.end_process(0)
