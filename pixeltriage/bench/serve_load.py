"""`pixeltriage bench serve`: the scoring service under load, against in-process `Scorer.score` in the same run.

    pixeltriage bench serve [--preset tiny|bench-small|2b] [--device cpu|cuda] [--dtype ...] [--clients N]
                            [--rate R] [--duration S] [--requests N] [--memories M] [--max-queued Q] [--json]

Seeded episodes of M memories (`workloads.episodes`: JPEG bytes of varied photo sizes, dialogue, notes) are scored
in this process first (`Scorer.score`: every response's expected answer). Then `pixeltriage serve` starts as a
subprocess and this process drives it over loopback with pre-encoded request bodies: one client, each request right
after the same episode was scored in-process (paired, so that other load on the machine falls on both; the median
difference comes with a bootstrap 95% CI and is split at the server's own x-total-time into the part outside the
server, HTTP and the body on the wire, and the part inside it); a closed loop with N clients, between two serial
in-process runs (the serial questions/s it is compared with); an open loop at R requests/s (default: twice the
N-client throughput, i.e. 2x overload) against a queue of Q questions. Every phase is bounded by S seconds and N
requests; warm-up requests are excluded. Every response is checked against its own request (the id it echoes and the
expected scores, 1e-5), so a lost or mixed-up response is counted. Also measured: the per-request cost of the HTTP
stack on a trivial GET (raw uvicorn ASGI, a Starlette route, a FastAPI route, this service's /health through its
guard), each in its own server process on the service's own socket, event loop and HTTP parser, the apps in turn,
sequential keep-alive requests.

The goals are benchmark goals, printed beside the figures, not test assertions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pixeltriage.bench import workloads
from pixeltriage.bench.timing import median_interval, percentiles
from pixeltriage.serve.process import ServerProcess, metric

# A response's scores against the in-process ones, per dtype. float32: the service's batches give Scorer.score's
# values to 1e-5 (tests/serve). bf16: a batch's packed forward rounds its products in another order than a question
# scored alone (measured up to 5.6e-4 on the bench-small preset), so the bar is half a bf16 step at 1.0; another
# question's answer is still caught by its id and its number of gains.
ANSWER_TOLERANCE = 1e-5
ANSWER_TOLERANCES = {"float32": ANSWER_TOLERANCE, "bfloat16": 2 ** -9, "float16": 2 ** -12}
WARMUP_REQUESTS = 2
OVERHEAD_REQUESTS = 2000


# -- in-process ------------------------------------------------------------------------------------------------------
class Local:
    """`Scorer.score` in this process, on the same episodes: the expected answers and the serial reference."""

    def __init__(self, checkpoint, device: str, dtype: str, eps):
        from pixeltriage.engine.scorer import Scorer

        self.scorer = Scorer.load(checkpoint, device=device, dtype=dtype)
        self.eps = eps
        self.tolerance = ANSWER_TOLERANCES[str(dtype).removeprefix("torch.")]
        self.expected = [self.scorer.score(q, m) for q, m in eps]          # also the warm-up

    def time_one(self, episode: int) -> float:
        q, m = self.eps[episode]
        t0 = time.perf_counter()
        self.scorer.score(q, m)
        return time.perf_counter() - t0

    def serial(self, duration: float, max_requests: int) -> dict:
        """Questions one after another for `duration` s (at least one pass over the episodes): latency, questions/s."""
        latencies, start = [], time.perf_counter()
        while len(latencies) < max_requests and (time.perf_counter() - start < duration
                                                 or len(latencies) < len(self.eps)):
            latencies.append(self.time_one(len(latencies) % len(self.eps)))
        return {"latency": percentiles(latencies), "questions_per_s": len(latencies) / (time.perf_counter() - start),
                "requests": len(latencies)}


# -- load ------------------------------------------------------------------------------------------------------------
@dataclass
class Phase:
    """One load phase's outcome: latencies of the 200s, statuses, and every response checked."""

    name: str
    latencies: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    batch_questions: list[int] = field(default_factory=list)
    mixed_up: int = 0
    lost: int = 0
    wall: float = 0.0
    offered_rate: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, status: str, latency: float | None = None, batch: int | None = None, mixed_up: bool = False,
               lost: bool = False) -> None:
        with self._lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if latency is not None:
                self.latencies.append(latency)
            if batch is not None:
                self.batch_questions.append(batch)
            self.mixed_up += mixed_up
            self.lost += lost

    def summary(self) -> dict:
        ok = len(self.latencies)
        out = {"phase": self.name, "requests": sum(self.statuses.values()), "ok": ok, "statuses": self.statuses,
               "latency": percentiles(self.latencies), "questions_per_s": ok / self.wall if self.wall else 0.0,
               "mixed_up": self.mixed_up, "lost": self.lost, "wall_s": self.wall}
        if self.batch_questions:
            out["batch_questions"] = {"max": max(self.batch_questions),
                                      "mean": statistics.fmean(self.batch_questions)}
        if self.offered_rate is not None:
            out["offered_rate"] = self.offered_rate
        return out


class Driver:
    """Sends pre-encoded requests and checks each answer against its own request."""

    def __init__(self, url: str, eps, expected, connections: int, tolerance: float = ANSWER_TOLERANCE):
        import httpx

        self.http = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=connections,
                                                                                 max_keepalive_connections=connections))
        self.eps, self.expected, self.tolerance = eps, expected, tolerance
        self.bodies = [workloads.request_body(q, m, "") for q, m in eps]

    def send(self, phase: Phase | None, episode: int, request_id: str) -> tuple[float, float] | None:
        """Send one request; for a 200, (the round trip, the server's own x-total-time), both in seconds."""
        import httpx

        body = self.bodies[episode].replace(b'"id": ""', f'"id": "{request_id}"'.encode(), 1)
        t0 = time.perf_counter()
        try:
            response = self.http.post("/v1/score", content=body, headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            if phase is not None:
                phase.record(f"no answer ({type(e).__name__})", lost=True)
            return None
        latency = time.perf_counter() - t0
        if phase is None:
            return None
        if response.status_code != 200:
            phase.record(str(response.status_code))
            return None
        result = response.json()
        phase.record("200", latency, result["timing"]["batch_questions"],
                     mixed_up=result.get("id") != request_id or not answer_matches(result, self.expected[episode],
                                                                                   self.tolerance))
        return latency, float(response.headers["x-total-time"]) / 1000

    def interleaved(self, local: Local, duration: float, max_requests: int) -> tuple[Phase, dict[str, list[float]]]:
        """One client, each request right after the same episode scored in-process: the pairs see the same machine
        (other load on it shifts both). -> (the server phase, per pair: in-process latency, server - in-process,
        and that difference split at the server's own x-total-time: outside it (HTTP, the body on the wire) and
        inside it (the server's work - the in-process call))."""
        phase = Phase("1 client")
        pairs: dict[str, list[float]] = {"in_process": [], "difference": [], "outside": [], "inside": []}
        for i in range(WARMUP_REQUESTS):
            self.send(None, i % len(self.eps), f"warm-{i}")
        start = time.perf_counter()
        n = 0
        while n < max_requests and time.perf_counter() - start < duration:
            episode = n % len(self.eps)
            local_time = local.time_one(episode)
            pairs["in_process"].append(local_time)
            answer = self.send(phase, episode, f"1 client-{n}")
            if answer is not None:
                latency, server_total = answer
                pairs["difference"].append(latency - local_time)
                pairs["outside"].append(latency - server_total)
                pairs["inside"].append(server_total - local_time)
            n += 1
        phase.wall = sum(phase.latencies) or 1e-9
        return phase, pairs

    def close_loop(self, name: str, clients: int, duration: float, max_requests: int) -> Phase:
        phase, counter, lock = Phase(name), iter(range(10 ** 9)), threading.Lock()
        for i in range(WARMUP_REQUESTS * clients):
            self.send(None, i % len(self.eps), f"warm-{i}")
        stop_at = time.perf_counter() + duration

        def client(c: int):
            while time.perf_counter() < stop_at:
                with lock:
                    n = next(counter)
                if n >= max_requests:
                    return
                self.send(phase, n % len(self.eps), f"{name}-{c}-{n}")

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        phase.wall = time.perf_counter() - start
        return phase

    def open_loop(self, name: str, rate: float, duration: float, max_requests: int, seed: int = 0) -> Phase:
        """Poisson arrivals at `rate`/s, each sent at once on its own thread (the server's queue decides)."""
        phase, rng = Phase(name, offered_rate=rate), random.Random(seed)
        total = min(max_requests, max(1, math.ceil(rate * duration)))
        with ThreadPoolExecutor(max_workers=min(512, total)) as pool:
            start = due = time.perf_counter()
            for n in range(total):
                due += rng.expovariate(rate)
                time.sleep(max(0.0, due - time.perf_counter()))
                pool.submit(self.send, phase, n % len(self.eps), f"{name}-{n}")
        phase.wall = time.perf_counter() - start
        return phase

    def close(self) -> None:
        self.http.close()


def answer_matches(result: dict, want, tolerance: float = ANSWER_TOLERANCE) -> bool:
    """Whether a /v1/score response holds the expected `Scores` (each within `tolerance`, ANSWER_TOLERANCES)."""
    return (len(result["gains"]) == len(want.gains) and abs(result["p_vis"] - want.p_vis) <= tolerance
            and abs(result["relevance_none"] - want.relevance_none) <= tolerance
            and all(abs(a - b) <= tolerance for a, b in zip(result["gains"], want.gains))
            and all(abs(a - b) <= tolerance for a, b in zip(result["relevance"], want.relevance)))


# -- the HTTP stack's own cost ---------------------------------------------------------------------------------------
TRIVIAL_APPS = {
    "raw uvicorn ASGI": """
async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
""",
    "Starlette route": """
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
async def health(request):
    return Response(b'{"status":"ok"}', media_type="application/json")
app = Starlette(routes=[Route("/health", health)])
""",
    "FastAPI route": """
from fastapi import FastAPI
from fastapi.responses import Response
app = FastAPI()
@app.get("/health")
async def health():
    return Response(b'{"status":"ok"}', media_type="application/json")
""",
    "pixeltriage app /health": """
from pixeltriage.serve.app import create_app
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.service import Service
app = create_app(Service(ServeConfig(), lambda: None))
""",
}

_TRIVIAL_SERVER = """
import uvicorn
from pixeltriage.serve.server import bind
{app}
sock = bind("127.0.0.1", 0)
print("PORT", sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")).run(sockets=[sock])
"""


def framework_overhead(requests: int = OVERHEAD_REQUESTS, rounds: int = 5) -> dict[str, float]:
    """Median seconds per sequential keep-alive GET /health of each trivial app, each in its own uvicorn process,
    the apps taken in turn for `rounds` rounds (so that other load on the machine falls on all of them)."""
    import httpx

    procs, clients, times = {}, {}, {name: [] for name in TRIVIAL_APPS}
    try:
        for name, source in TRIVIAL_APPS.items():
            procs[name] = subprocess.Popen([sys.executable, "-c", _TRIVIAL_SERVER.format(app=source)],
                                           stdout=subprocess.PIPE, text=True)
            port = int(procs[name].stdout.readline().split()[1])          # "PORT n", printed once it listens
            clients[name] = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            for _ in range(50):
                clients[name].get("/health")
        for _ in range(rounds):
            for name, http in clients.items():
                for _ in range(requests // rounds):
                    t0 = time.perf_counter()
                    http.get("/health")
                    times[name].append(time.perf_counter() - t0)
    finally:
        for http in clients.values():
            http.close()
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    return {name: statistics.median(t) for name, t in times.items()}


# -- the run ---------------------------------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    from pixeltriage.config import default_dtype
    from pixeltriage.weights.demo import demo_checkpoint

    dtype = args.dtype or default_dtype(args.device)
    checkpoint = demo_checkpoint(args.preset)
    eps = workloads.episodes(args.episodes, args.memories, args.seed, jpeg=True)
    body_mib = statistics.fmean(len(workloads.request_body(q, m, "")) for q, m in eps) / 2 ** 20
    report = {"preset": args.preset, "device": args.device, "dtype": dtype, "episodes": args.episodes,
              "memories": args.memories, "request_mib": body_mib, "clients": args.clients,
              "max_queued": args.max_queued, "max_wait_ms": args.max_wait_ms, "load_average": os.getloadavg()[0]}
    report["overhead_s"] = framework_overhead() if not args.no_overhead else {}
    local = Local(checkpoint, args.device, dtype, eps)
    argv = ["--checkpoint", str(checkpoint), "--device", args.device, "--dtype", dtype,
            "--max-queued", str(args.max_queued), "--max-client-batch", str(min(32, args.max_queued)),
            "--max-wait-ms", str(args.max_wait_ms)]
    if args.max_batch_tokens:
        argv += ["--max-batch-tokens", str(args.max_batch_tokens)]
    server = ServerProcess(argv)
    phases = []
    try:
        server.wait_ready()
        import httpx

        report["transport"] = httpx.get(server.url + "/info", timeout=10).json().get("transport", {})
        # a connection per open-loop thread: a request waiting for a pooled connection would count the client's
        # own queue as the server's latency
        driver = Driver(server.url, eps, local.expected, connections=max(64, args.clients * 2, min(512, args.requests)),
                        tolerance=local.tolerance)
        try:
            one, pairs = driver.interleaved(local, args.duration, args.requests)
            phases.append(one)
            report["in_process"] = {"latency": percentiles(pairs["in_process"]), "requests": len(pairs["in_process"]),
                                    "paired_difference": percentiles(pairs["difference"]),
                                    "paired_difference_median_ci95": median_interval(pairs["difference"]),
                                    "outside_server": percentiles(pairs["outside"]),
                                    "inside_server": percentiles(pairs["inside"])}
            serial = [local.serial(args.duration / 2, args.requests)]
            phases.append(driver.close_loop(f"{args.clients} clients", args.clients, args.duration, args.requests))
            serial.append(local.serial(args.duration / 2, args.requests))
            report["in_process"]["serial_questions_per_s"] = [s["questions_per_s"] for s in serial]
            rate = args.rate or 2 * phases[1].summary()["questions_per_s"]
            memory_before = server.memory_mib()
            phases.append(driver.open_loop(f"open loop {rate:.1f}/s", rate, args.duration, args.requests))
            report["server_memory_mib"] = {"before_open_loop": memory_before, "after": server.memory_mib()}
        finally:
            driver.close()
        report["server_metrics"] = _batch_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        report["server_exit_code"] = server.stop()
    report["phases"] = [p.summary() for p in phases]
    report["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _batch_metrics(text: str) -> dict:
    names = ("pixeltriage_batch_questions_sum", "pixeltriage_batch_questions_count", "pixeltriage_batch_tokens_sum",
             "pixeltriage_forward_failures_total")
    return {name: metric(text, name) for name in names}


def print_report(r: dict) -> None:
    ms = 1000.0
    print(f"bench serve: {r['preset']} preset, {r['dtype']} on {r['device']}, {r['episodes']} episodes x "
          f"{r['memories']} memories ({r['request_mib']:.2f} MiB per request), server --max-queued "
          f"{r['max_queued']} --max-wait-ms {r['max_wait_ms']:g}; machine load {r['load_average']:.2f} -> "
          f"{r['load_average_after']:.2f} (1-min average)")
    if r.get("transport"):
        print(f"server transport: event loop {r['transport']['loop']}, HTTP parser {r['transport']['http']}")
    if r["overhead_s"]:
        base = r["overhead_s"]["raw uvicorn ASGI"]
        print(f"HTTP stack per request (trivial GET /health, {OVERHEAD_REQUESTS} sequential keep-alive requests per "
              "app, apps in turn, median round trip):")
        for name, t in r["overhead_s"].items():
            extra = "" if name == "raw uvicorn ASGI" else f"  ({1e6 * (t - base):+.0f} us)"
            print(f"  {name:<26} {1e6 * t:7.0f} us{extra}")
    local = r["in_process"]
    lat = local["latency"]
    serial = local["serial_questions_per_s"]
    print(f"{'in-process Scorer.score':<28} p50 {ms * lat['p50']:8.1f} ms  p90 {ms * lat['p90']:8.1f}  "
          f"p99 {ms * lat['p99']:8.1f}  (interleaved with the 1-client requests); serial "
          f"{serial[0]:.2f} and {serial[1]:.2f} questions/s (before and after the {r['clients']}-client phase)")
    reference = statistics.fmean(serial)
    for p in r["phases"]:
        lat = p["latency"]
        if p["phase"] == "1 client":
            low, high = local["paired_difference_median_ci95"]
            extra = (f"  server - in-process per pair: median {ms * local['paired_difference']['p50']:+.1f} ms "
                     f"(95% CI {ms * low:+.1f} .. {ms * high:+.1f}; outside the server's x-total-time "
                     f"{ms * local['outside_server']['p50']:+.1f}, inside {ms * local['inside_server']['p50']:+.1f})")
        else:
            extra = f"  {p['questions_per_s']:6.2f} questions/s ({p['questions_per_s'] / reference:.2f}x serial)"
        batches = p.get("batch_questions")
        batch_text = f"; batches up to {batches['max']} (mean {batches['mean']:.1f})" if batches else ""
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(p["statuses"].items()))
        print(f"server, {p['phase']:<20} p50 {ms * lat['p50']:8.1f} ms  p90 {ms * lat['p90']:8.1f}  p99 "
              f"{ms * lat['p99']:8.1f}{extra}")
        print(f"{'':<28} statuses {{{statuses}}}; lost {p['lost']}, mixed-up {p['mixed_up']}{batch_text}")
    mem = r.get("server_memory_mib", {})
    if mem.get("after"):
        print(f"server memory: RSS {mem['before_open_loop'].get('rss', 0):.0f} MiB before the open loop, "
              f"{mem['after'].get('rss', 0):.0f} after (peak {mem['after'].get('peak', 0):.0f})")
    print(f"server exit code after SIGTERM: {r['server_exit_code']}")
    one, many, over = r["phases"]
    overload_ok = (over["lost"] == 0 and over["mixed_up"] == 0 and set(over["statuses"]) <= {"200", "429"}
                   and r["server_exit_code"] == 0)
    print("goals: 1 client p50 within 3 ms of in-process: "
          f"{'met' if one['ok'] and local['paired_difference']['p50'] <= 0.003 else 'not met'}; "
          f"{r['clients']} clients >= in-process serial: "
          f"{'met' if many['questions_per_s'] >= reference else 'not met'}; overload: "
          f"{'met' if overload_ok else 'not met'} (zero lost or mixed-up, only 200s and 429s, no crash)")
