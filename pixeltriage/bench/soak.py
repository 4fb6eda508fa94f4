"""`pixeltriage bench soak`: one server, S seconds of normal, oversized, malformed, cut-off and overload traffic.

    pixeltriage bench soak --duration S [--preset tiny|bench-small|2b] [--device cpu|cuda] [--dtype ...]
                           [--clients N] [--baseline B] [--max-queued Q] [--episodes E] [--memories M]
                           [--kinds normal,oversized,malformed,disconnect,burst] [--no-latency-goal] [--json]

One `pixeltriage serve` process starts on loopback (`ServerProcess`, as `bench serve` starts it) and this process
drives it over real HTTP (httpx), reusing `bench serve`'s episodes, driver and answer check. Seeded episodes are
scored in this process first (`Scorer.score`: every normal response's expected answer). Then:

1. warm-up: two rounds of normal requests from every client, then twice: every oversized and malformed body, a
   disconnect and an overload burst, then WARMUP_MIX_S seconds (at most S) of the mix below (every kind at once,
   three bursts: the concurrency and the batch sizes the run will meet, so that the server's threads and its
   forwards' primitives have met them once); the server's RSS is read SETTLE_S seconds after it ("after warm-up");
2. baseline: N clients send normal `/v1/score` requests alone for B seconds (p50/p99 "alone");
3. the mix, S seconds: the same N clients go on with normal requests while one thread each sends
   - oversized text fields (question, note or dialogue one character past the documented limit up to 4 MiB:
     422 expected),
   - malformed bodies (bad JSON, a body sent as form data or text, wrong field types, an empty body: 400/415/422),
   - client disconnects (raw sockets closed half-way through the body, or right after it, before the answer),
   - overload bursts (3 x `--max-queued` concurrent normal requests at once, every 15 s: 200s checked like
     the normal ones, 429s must carry Retry-After).

Every normal or burst answer is checked against its own request (echoed id, expected scores to 1e-5 in float32,
`serve_load.ANSWER_TOLERANCES`); a response for another request counts as mixed up, a request without an answer
(connection error, timeout) as lost. The server's RSS (VmRSS) is sampled every second; its peak is the largest
sample and the kernel's VmHWM. Both the "after warm-up" and the "end" figures are read once the server has been idle
SETTLE_S seconds, past the second after which it gives freed memory back (`ServeConfig.trim_idle_s`): the same idle
state twice, so that their difference is memory the server still holds, not what malloc kept at one moment and not
at the other. Normal p99 during the mix is given over the whole mix and split into the requests that overlapped a
burst and those that did not (the ones sent during the oversized, malformed and disconnect traffic alone). The
samples taken while serving from SETTLED_S seconds in (half-way in shorter runs) are summed up as ten of them, their
largest growth over the first, and their least-squares slope in MiB per hour.

--kinds sends only the kinds named (each in the warm-up and the mix): what grows under each. Without normal
traffic there is no baseline and no p99 goal.

Goals (exit code 1 and the failed ones printed when any is not met): no crash (the server up at the end, /ready
200, exit 0 after SIGTERM); no lost or mixed-up response; no 500; RSS at the end within 10% of after warm-up;
RSS while serving, once settled, within 10% of its first settled sample; the normal p99 during the mix's oversized
traffic (outside the bursts) within 2x the p99 alone (reported but not enforced with --no-latency-goal, for a
machine shared with other work). The other figures (p99 including the bursts, unexpected statuses) are printed
beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from pixeltriage.bench import workloads
from pixeltriage.bench.serve_load import Driver, Local, Phase, answer_matches
from pixeltriage.bench.timing import percentiles
from pixeltriage.bench.workloads import request_body
from pixeltriage.config import default_dtype
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.process import ServerProcess

RSS_GROWTH_LIMIT = 0.10            # end RSS within 10% of after warm-up
P99_RATIO_LIMIT = 2.0              # normal p99 in the mix within 2x alone
BURST_FACTOR = 3                   # a burst: 3 x --max-queued concurrent requests
BURST_EVERY_S = 15.0
OVERSIZED_EVERY_S = 0.25
MALFORMED_EVERY_S = 0.1
DISCONNECT_EVERY_S = 0.5
# idle before each RSS figure: past the server's idle trim (its default ServeConfig.trim_idle_s) and its poll
SETTLE_S = ServeConfig.trim_idle_s + 2.0
# the warm-up's share of the mix: three bursts among the other kinds, long enough for the batches to meet most of the
# row counts the run will (each row-count bucket makes its oneDNN primitives once: `kernels.linear.bucket_rows`)
WARMUP_MIX_S = 3 * BURST_EVERY_S
SETTLED_S = 300.0                  # serving RSS is judged from here on (from half-way in shorter runs)
KINDS = ("normal", "oversized", "malformed", "disconnect", "burst")     # what --kinds selects from
# a 429 is a right answer to any request while a burst holds the queue (the guard admits before it parses)
EXPECTED = {"oversized": {"422", "429"}, "malformed": {"400", "415", "422", "429"}, "normal": {"200", "429"},
            "burst": {"200", "429"}}


# -- bad requests ----------------------------------------------------------------------------------------------------
def oversized_bodies(eps, text_limit: int, seed: int) -> list[tuple[str, bytes]]:
    """(the field made too long, the body): question, a note and a dialogue, each at the limit + 1, 1 MiB, 4 MiB."""
    from dataclasses import replace

    rng, out = random.Random(seed), []
    for size in (text_limit + 1, 2 ** 20, 4 * 2 ** 20):
        text = "x" * size
        q, mems = eps[rng.randrange(len(eps))]
        out.append(("question", request_body(text, mems, f"oversized-question-{size}")))
        if mems:
            out.append(("note", request_body(q, [replace(mems[0], note=text), *mems[1:]], f"oversized-note-{size}")))
            out.append(("dialogue", request_body(q, [replace(mems[0], dialogue=text), *mems[1:]],
                                                 f"oversized-dialogue-{size}")))
    return out


def malformed_requests(good: bytes) -> list[tuple[str, bytes, str]]:
    """(what is wrong, the body, its content type)."""
    return [("bad JSON", good[: len(good) // 2], "application/json"),
            ("not JSON", b"question=hello&memories=none", "application/json"),
            ("form content type", good, "application/x-www-form-urlencoded"),
            ("text content type", good, "text/plain"),
            ("wrong types", json.dumps({"question": 42, "memories": "none"}).encode(), "application/json"),
            ("missing field", json.dumps({"memories": []}).encode(), "application/json"),
            ("JSON array", b"[1, 2, 3]", "application/json"),
            ("empty body", b"", "application/json")]


def disconnect(host: str, port: int, body: bytes, half: bool) -> None:
    """A POST /v1/score on a raw socket, closed half-way through the body (`half`) or right after it, unread."""
    head = (f"POST /v1/score HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(head + (body[: len(body) // 2] if half else body))
        if not half:
            time.sleep(0.01)                      # the server has the whole request; the answer is never read


# -- the run ---------------------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, server: ServerProcess, driver: Driver, eps, max_queued: int, seed: int):
        from pixeltriage.serve.schemas import TEXT_LIMIT

        self.server, self.driver, self.eps, self.max_queued = server, driver, eps, max_queued
        self.rng = random.Random(seed)
        self.kinds = {name: Phase(name) for name in ("oversized", "malformed", "disconnect", "burst")}
        self.oversized = oversized_bodies(eps, TEXT_LIMIT, seed)
        self.malformed = malformed_requests(driver.bodies[0])
        address = urlsplit(server.url)
        self.host, self.port = address.hostname, address.port
        self.bursts: list[list[float]] = []            # [start, end] of each burst (end inf while it runs)
        self.inside, self.outside = [], []             # mix latencies of normal 200s: overlapping a burst or not
        self.rss: list[float] = []
        self.rss_at: list[float] = []                  # each sample's time (perf_counter)
        self.no_retry_after = 0
        self._lock = threading.Lock()
        self._n = 0

    def next_id(self, prefix: str) -> str:
        with self._lock:
            self._n += 1
            return f"{prefix}-{self._n}"

    # normal clients
    def normal(self, phase: Phase, until: float, split: bool) -> None:
        while time.perf_counter() < until:
            episode = self.rng.randrange(len(self.eps))
            t0 = time.perf_counter()
            answer = self.driver.send(phase, episode, self.next_id(phase.name))
            if answer is not None and split:
                with self._lock:
                    overlapped = any(start <= time.perf_counter() and end >= t0 for start, end in self.bursts)
                (self.inside if overlapped else self.outside).append(answer[0])

    def clients(self, phase: Phase, count: int, seconds: float, split: bool, extra=()) -> None:
        until = time.perf_counter() + seconds
        threads = [threading.Thread(target=self.normal, args=(phase, until, split)) for _ in range(count)]
        threads += [threading.Thread(target=fn, args=(until,)) for fn in extra]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        phase.wall = time.perf_counter() - start

    # bad kinds, one of each
    def post(self, kind: str, body: bytes, content_type: str = "application/json"):
        """POST /v1/score -> the response, or None (recorded as lost under `kind`) when none came back."""
        import httpx

        try:
            return self.driver.http.post("/v1/score", content=body, headers={"content-type": content_type})
        except httpx.HTTPError as e:
            self.kinds[kind].record(f"no answer ({type(e).__name__})", lost=True)
            return None

    def send_oversized(self, body: bytes | None = None) -> None:
        body = body if body is not None else self.oversized[self.rng.randrange(len(self.oversized))][1]
        r = self.post("oversized", body)
        if r is not None:
            self.kinds["oversized"].record(str(r.status_code))

    def send_malformed(self, body: bytes | None = None, content_type: str = "") -> None:
        if body is None:
            _, body, content_type = self.malformed[self.rng.randrange(len(self.malformed))]
        r = self.post("malformed", body, content_type)
        if r is not None:
            self.kinds["malformed"].record(str(r.status_code))

    def send_disconnect(self) -> None:
        half = self.rng.random() < 0.5
        try:
            disconnect(self.host, self.port, self.driver.bodies[self.rng.randrange(len(self.eps))], half)
            self.kinds["disconnect"].record("cut mid-body" if half else "cut before the answer")
        except OSError as e:
            self.kinds["disconnect"].record(f"refused ({type(e).__name__})")

    def burst_one(self, n: int) -> None:
        episode = n % len(self.eps)
        request_id = self.next_id("burst")
        body = self.driver.bodies[episode].replace(b'"id": ""', f'"id": "{request_id}"'.encode(), 1)
        phase = self.kinds["burst"]
        r = self.post("burst", body)
        if r is None:
            return
        if r.status_code == 200:
            result = r.json()
            phase.record("200", mixed_up=result.get("id") != request_id
                         or not answer_matches(result, self.driver.expected[episode], self.driver.tolerance))
            return
        if r.status_code == 429 and "retry-after" not in r.headers:
            with self._lock:
                self.no_retry_after += 1
        phase.record(str(r.status_code))

    def send_burst(self) -> None:
        size = BURST_FACTOR * self.max_queued
        window = [time.perf_counter(), float("inf")]
        with self._lock:
            self.bursts.append(window)
        with ThreadPoolExecutor(max_workers=size) as pool:
            list(pool.map(self.burst_one, range(size)))
        window[1] = time.perf_counter()

    def paced(self, fn, every: float):
        def loop(until: float):
            while time.perf_counter() < until:
                t0 = time.perf_counter()
                fn()
                time.sleep(max(0.0, min(every - (time.perf_counter() - t0), until - time.perf_counter())))
        return loop

    def mix(self, kinds=KINDS) -> tuple:
        """The mix's senders besides the normal clients, each paced: those of `kinds` among oversized, malformed,
        disconnect and burst."""
        senders = {"oversized": (self.send_oversized, OVERSIZED_EVERY_S),
                   "malformed": (self.send_malformed, MALFORMED_EVERY_S),
                   "disconnect": (self.send_disconnect, DISCONNECT_EVERY_S), "burst": (self.send_burst, BURST_EVERY_S)}
        return tuple(self.paced(fn, every) for name, (fn, every) in senders.items() if name in kinds)

    def sample_rss(self, stop: threading.Event) -> None:
        while not stop.is_set():
            rss = self.server.memory_mib().get("rss")
            if rss:
                self.rss.append(rss)
                self.rss_at.append(time.perf_counter())
            stop.wait(1.0)


def run_soak(args: argparse.Namespace) -> int:
    import httpx

    from pixeltriage.weights.demo import demo_checkpoint

    dtype = args.dtype or default_dtype(args.device)
    kinds = tuple(k for k in KINDS if k in (args.kinds or KINDS))
    clients = args.clients if "normal" in kinds else 0        # without normal traffic: no baseline, no p99 goal
    baseline = (args.baseline if args.baseline is not None else min(60.0, max(4.0, args.duration / 10))) if clients \
        else 0.0
    checkpoint = demo_checkpoint(args.preset)
    eps = workloads.episodes(args.episodes, args.memories, args.seed, jpeg=True)
    report = {"preset": args.preset, "device": args.device, "dtype": dtype, "kinds": list(kinds), "clients": clients,
              "episodes": args.episodes, "memories": args.memories, "max_queued": args.max_queued,
              "duration_s": args.duration, "baseline_s": baseline, "burst_size": BURST_FACTOR * args.max_queued,
              "burst_every_s": BURST_EVERY_S, "load_average": list(os.getloadavg()),
              # the malloc switches the server inherits, so that a run with any of them set says so
              "malloc_env": {k: os.environ[k] for k in ("PIXELTRIAGE_MALLOC_TUNING", "PIXELTRIAGE_MALLOC_TRIM",
                                                        "MALLOC_ARENA_MAX") if k in os.environ}}
    local = Local(checkpoint, args.device, dtype, eps)
    server = ServerProcess(["--checkpoint", str(checkpoint), "--device", args.device, "--dtype", dtype,
                            "--max-queued", str(args.max_queued),
                            "--max-client-batch", str(min(32, args.max_queued))])
    alone, mix = Phase("normal alone"), Phase("normal mix")
    stop = threading.Event()
    crashed, ready_at_end = False, False
    try:
        server.wait_ready()
        burst = BURST_FACTOR * args.max_queued
        driver = Driver(server.url, eps, local.expected, connections=args.clients + burst + 8,
                        tolerance=local.tolerance)
        soak = Soak(server, driver, eps, args.max_queued, args.seed)
        sampler = threading.Thread(target=soak.sample_rss, args=(stop,), daemon=True)
        try:
            for i in range(2 * args.clients if "normal" in kinds else 0):    # warm-up
                driver.send(None, i % len(eps), f"warm-{i}")
            for _ in range(2):                                               # every request shape, twice
                for field_name, body in soak.oversized if "oversized" in kinds else ():
                    soak.send_oversized(body)
                for _, body, content_type in soak.malformed if "malformed" in kinds else ():
                    soak.send_malformed(body, content_type)
                if "disconnect" in kinds:
                    soak.send_disconnect()
                if "burst" in kinds:
                    soak.send_burst()
            soak.clients(Phase("warm-up mix"), clients, min(WARMUP_MIX_S, args.duration), split=False,
                         extra=soak.mix(kinds))
            for phase in soak.kinds.values():                               # the warm-up's bad requests not counted
                phase.statuses.clear()
                phase.lost = phase.mixed_up = 0
            soak.bursts.clear()
            soak.no_retry_after = 0
            time.sleep(SETTLE_S)
            rss_after_warmup = server.memory_mib().get("rss", float("nan"))
            sampler.start()
            serving_from = time.perf_counter()
            if clients:
                soak.clients(alone, clients, baseline, split=False)
            soak.clients(mix, clients, args.duration, split=True, extra=soak.mix(kinds))
            serving_to = time.perf_counter()
            time.sleep(SETTLE_S)                                             # settle: what is left once idle
            rss_end = server.memory_mib()
        finally:
            stop.set()
            driver.close()
        crashed = server.proc.poll() is not None
        try:
            ready_at_end = httpx.get(server.url + "/ready", timeout=10).status_code == 200
        except httpx.HTTPError:
            ready_at_end = False
    finally:
        report["server_exit_code"] = server.stop()
    samples = soak.rss + [rss_end.get("rss", 0.0)]
    report["rss_mib"] = {"after_warmup": rss_after_warmup, "peak": max(max(samples), rss_end.get("peak", 0.0)),
                         "peak_sampled": max(samples), "end": rss_end.get("rss", float("nan")),
                         # ten points over the run (one sample a second): growth that levels off vs a steady climb
                         "trajectory": [samples[round(i * (len(samples) - 1) / 10)] for i in range(11)],
                         "serving": serving_rss(soak.rss_at, soak.rss, serving_from, serving_to)}
    report["normal_alone"] = alone.summary()
    report["normal_mix"] = mix.summary()
    report["normal_mix_outside_bursts"] = {"requests": len(soak.outside), **percentiles(soak.outside)}
    report["normal_mix_during_bursts"] = {"requests": len(soak.inside), **percentiles(soak.inside)}
    report["kinds"] = {name: {"requests": sum(p.statuses.values()), "statuses": p.statuses, "lost": p.lost,
                              "mixed_up": p.mixed_up} for name, p in soak.kinds.items() if name in kinds}
    if "normal" in kinds:
        report["kinds"]["normal"] = {
            "requests": report["normal_alone"]["requests"] + report["normal_mix"]["requests"],
            "statuses": _merge(alone.statuses, mix.statuses), "lost": alone.lost + mix.lost,
            "mixed_up": alone.mixed_up + mix.mixed_up}
    report["bursts"] = len(soak.bursts)
    report["burst_429_without_retry_after"] = soak.no_retry_after
    report["lost"] = sum(k["lost"] for k in report["kinds"].values())
    report["mixed_up"] = sum(k["mixed_up"] for k in report["kinds"].values())
    report["status_500"] = sum(k["statuses"].get("500", 0) for k in report["kinds"].values())
    report["unexpected"] = {name: {s: n for s, n in k["statuses"].items() if s not in EXPECTED[name]}
                            for name, k in report["kinds"].items() if name in EXPECTED}
    report["crashed"] = crashed or not ready_at_end or report["server_exit_code"] != 0
    report["load_average_after"] = list(os.getloadavg())
    report["latency_goal_enforced"] = not args.no_latency_goal
    report["goals"] = goals(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if all(g["met"] or not g["enforced"] for g in report["goals"].values()) else 1


def serving_rss(times: list[float], rss: list[float], start: float, end: float) -> dict:
    """The RSS samples taken while serving (start..end), from SETTLED_S seconds in (at most half-way): the first of
    them (the reference), their largest growth over it, ten of them evenly spread with their times (s since the
    start), and the least-squares slope through all of them in MiB per hour."""
    settled = min(SETTLED_S, (end - start) / 2)
    points = [(t - start, v) for t, v in zip(times, rss) if start + settled <= t <= end]
    if len(points) < 2:
        return {"settled_s": settled, "samples": len(points), "reference": float("nan"), "growth": float("nan"),
                "ten": [[round(t, 1), v] for t, v in points], "slope_mib_per_h": float("nan")}
    reference = points[0][1]
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    slope = (sum((t - mean_t) * (v - mean_v) for t, v in points)
             / sum((t - mean_t) ** 2 for t, _ in points))
    ten = [points[round(i * (len(points) - 1) / 9)] for i in range(10)]
    return {"settled_s": settled, "samples": len(points), "reference": reference,
            "growth": (max(v for _, v in points) - reference) / reference,
            "ten": [[round(t, 1), v] for t, v in ten], "slope_mib_per_h": 3600 * slope}


def _merge(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


def goals(r: dict) -> dict:
    rss = r["rss_mib"]
    growth = (rss["end"] - rss["after_warmup"]) / rss["after_warmup"]
    serving = rss["serving"]
    p99_alone, p99_mix = r["normal_alone"]["latency"]["p99"], r["normal_mix_outside_bursts"]["p99"]
    ratio = p99_mix / p99_alone if p99_alone > 0 else float("nan")
    out = {
        "no crash": {"met": not r["crashed"], "detail": f"server exit code {r['server_exit_code']}"},
        "no lost or mixed-up response": {"met": r["lost"] == 0 and r["mixed_up"] == 0,
                                         "detail": f"lost {r['lost']}, mixed up {r['mixed_up']}"},
        "no 500": {"met": r["status_500"] == 0, "detail": f"{r['status_500']} answered 500"},
        "end RSS within 10% of after warm-up": {"met": growth <= RSS_GROWTH_LIMIT,
                                                "detail": f"{rss['after_warmup']:.0f} -> {rss['end']:.0f} MiB "
                                                          f"({100 * growth:+.1f}%)"},
        "serving RSS within 10% of its level once settled": {
            "met": serving["growth"] <= RSS_GROWTH_LIMIT,
            "detail": f"{serving['reference']:.0f} MiB at {serving['settled_s']:.0f} s, at most "
                      f"{100 * serving['growth']:+.1f}% after; {serving['slope_mib_per_h']:+.1f} MiB/h"},
    }
    if "normal" in r["kinds"]:
        out["normal p99 in the mix within 2x alone"] = {"met": ratio <= P99_RATIO_LIMIT,
                                                        "detail": f"{1000 * p99_mix:.1f} vs {1000 * p99_alone:.1f} "
                                                                  f"ms ({ratio:.2f}x; outside the bursts)",
                                                        "enforced": r["latency_goal_enforced"]}
    for goal in out.values():
        goal.setdefault("enforced", True)
    return out


def print_report(r: dict) -> None:
    ms = 1000.0
    print(f"bench soak: {r['preset']} preset, {r['dtype']} on {r['device']}, {r['duration_s']:g} s of mix after a "
          f"{r['baseline_s']:g} s baseline; {r['clients']} normal clients, {r['episodes']} episodes x "
          f"{r['memories']} memories; server --max-queued {r['max_queued']}; bursts of {r['burst_size']} every "
          f"{r['burst_every_s']:g} s; machine load {r['load_average'][0]:.2f} -> {r['load_average_after'][0]:.2f} "
          f"(1-min average){'; ' + str(r['malloc_env']) if r['malloc_env'] else ''}")
    print("requests by kind and status:")
    for name, k in sorted(r["kinds"].items(), key=lambda item: KINDS.index(item[0])):
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(k["statuses"].items()))
        print(f"  {name:<11} {k['requests']:6d}  {{{statuses}}}  lost {k['lost']}, mixed up {k['mixed_up']}")
    print(f"  429s of the bursts without Retry-After: {r['burst_429_without_retry_after']}; bursts: {r['bursts']}")
    for label, key in (("normal alone", "normal_alone"), ("normal, mix (all)", "normal_mix"))[
            :2 if "normal" in r["kinds"] else 0]:
        lat = r[key]["latency"]
        print(f"{label:<28} p50 {ms * lat['p50']:8.1f} ms  p99 {ms * lat['p99']:8.1f} ms  ({r[key]['ok']} answered "
              f"200, {r[key]['questions_per_s']:.2f}/s)")
    for label, key in (("normal, mix outside bursts", "normal_mix_outside_bursts"),
                       ("normal, mix during bursts", "normal_mix_during_bursts"))[:2 if "normal" in r["kinds"] else 0]:
        lat = r[key]
        print(f"{label:<28} p50 {ms * lat['p50']:8.1f} ms  p99 {ms * lat['p99']:8.1f} ms  ({lat['requests']})")
    rss = r["rss_mib"]
    print(f"server RSS: {rss['after_warmup']:.0f} MiB after warm-up, peak {rss['peak']:.0f} (sampled "
          f"{rss['peak_sampled']:.0f}), {rss['end']:.0f} at the end; over the run: "
          f"{' '.join(f'{v:.0f}' for v in rss['trajectory'])}")
    serving = rss["serving"]
    print(f"serving RSS from {serving['settled_s']:.0f} s on ({serving['samples']} samples; s: MiB): "
          f"{', '.join(f'{t:.0f}: {v:.0f}' for t, v in serving['ten'])}; slope {serving['slope_mib_per_h']:+.1f} "
          f"MiB/h")
    unexpected = {k: v for k, v in r["unexpected"].items() if v}
    print(f"unexpected statuses: {unexpected or 'none'}; server exit code after SIGTERM: {r['server_exit_code']}")
    failed = [name for name, g in r["goals"].items() if not g["met"] and g["enforced"]]
    for name, g in r["goals"].items():
        print(f"goal {'met    ' if g['met'] else 'NOT MET'} {name}: {g['detail']}"
              f"{'' if g['enforced'] else ' (not enforced: --no-latency-goal)'}")
    print("all goals met" if not failed else f"goals not met: {', '.join(failed)}")
