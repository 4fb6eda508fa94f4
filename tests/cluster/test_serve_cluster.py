"""`pixeltriage serve --ray` on a Ray cluster of three nodes, each in its own network namespace (a machine of its
own on the network: its own address, ports and loopback), that loses a worker node under load.

The head (198.18.0.1) runs Ray's GCS, Serve's controller and a proxy, and the `serve --ray` command; it takes no
replica (`--num-cpus 0`, as a head usually does). The workers (198.18.0.2, .3) have 2 Ray CPUs each and take one
replica each: `--max-replicas-per-node 1` puts the two apart and keeps them apart while one node is gone. Every
replica reads one write-time cache in PostgreSQL on a fourth host (198.18.0.4), and each question names its memories
by cache key. The command is given an API key file; every node's proxy asks for the key. A load client, a process of
its own in the head's namespace, posts through the head's proxy. Then:

- every node's proxy answers /ready 200 (what a load balancer in front of them checks), the head's too, and refuses
  a question without the key (401);
- a memory put through one node's proxy is scored through the other's (each proxy prefers its own node's
  replica): the cache is one;
- worker 1 is killed whole (its `ray start`, raylet, agents and workers SIGKILLed) under load: every request is
  answered 200 or refused 503/429 with Retry-After, none 500 or another status, and after the client's retries
  every request has its own answer (echoed id, the library's scores for its question);
- worker 1 comes back (`ray start` again): a replica returns to it and answers;
- SIGTERM drains the whole deployment as on one node: 200 for what was admitted, 503 with Retry-After, then
  connections refused; no 404, no 500, no reset; the command exits 0.

The figures (requests, statuses, retries, time to recover) are printed (-s shows them)."""
import base64
import json
import secrets
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from database import postgres_on
from images import encoded, random_image
from netns import Hosts, kill_session
from raynodes import Cluster

from pixeltriage import Memory, Scorer
from pixeltriage.store.backend import redact
from pixeltriage.store.cache import Cache

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pixeltriage[ray]')")
pytestmark = pytest.mark.slow

PORT = 8000
TOL = 1e-5
READY_TIMEOUT = 300.0          # the serve command up: replicas on two nodes load and warm up (2 shared cores)
RECOVER_TIMEOUT = 300.0        # the killed node back with a ready replica
EXIT_TIMEOUT = 120.0           # SIGTERM -> the serve command gone
GRACEFUL_TIMEOUT = 20.0
STEADY = 8.0                   # seconds of load before the kill, after it, and after the node is back
OUTAGE = 20.0                  # seconds from the kill to the node's `ray start` (at least until Ray lists it dead)
ADMITTED = 2.0                 # a request sent this long before SIGTERM has reached its replica
CLIENT_EXIT = 180.0            # the load client's last requests (its own deadline per request is 120 s)


def _bodies(cache_url: str, count: int) -> tuple[list[dict], list[tuple[str, list[str]]]]:
    """`count` /v1/score bodies whose memories are cache keys (1 to 3 each, of images put into the cache here),
    and the same questions as (question, keys) for the library."""
    with Cache(cache_url) as cache:
        keys = [cache.put(encoded(random_image("RGB", (64 + 8 * i, 48 + 4 * i), seed=i), "PNG"), note=f"photo {i}")
                for i in range(8)]
    bodies, questions = [], []
    for n in range(count):
        chosen = [keys[(n + j) % len(keys)] for j in range(1 + n % 3)]
        question = f"question {n}: which photo shows the {['mug', 'bike', 'cat', 'sky'][n % 4]}?"
        bodies.append({"question": question, "memories": [{"key": k} for k in chosen]})
        questions.append((question, chosen))
    return bodies, questions


def _expected(checkpoint, cache_url: str, questions) -> list:
    with Cache(cache_url) as cache:
        scorer = Scorer.load(checkpoint, cache=cache)
        return [scorer.score(q, [Memory(key=k) for k in keys]) for q, keys in questions]


def _close(entry: dict, want) -> bool:
    return (abs(entry["p_vis"] - want.p_vis) <= TOL and abs(entry["relevance_none"] - want.relevance_none) <= TOL
            and len(entry["gains"]) == len(want.gains)
            and all(abs(a - b) <= TOL for a, b in zip(entry["gains"], want.gains))
            and all(abs(a - b) <= TOL for a, b in zip(entry["relevance"], want.relevance)))


class Head:
    """The test's own HTTP client, from the head's namespace (its sockets are opened there), with the API key."""

    def __init__(self, hosts: Hosts, key: str):
        self.hosts, self.headers = hosts, {"authorization": f"Bearer {key}"}

    def get(self, url: str) -> httpx.Response:
        with self.hosts.entered("head"):
            return httpx.get(url, timeout=30, headers=self.headers)

    def post(self, url: str, body: dict, *, key: bool = True) -> httpx.Response:
        with self.hosts.entered("head"):
            return httpx.post(url, json=body, timeout=60, headers=self.headers if key else None)

    def score_200s(self, url: str) -> dict[str, float]:
        """{replica id: its /v1/score 200s} from the deployment's /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(self.get(url + "/metrics").text):
            for s in family.samples:
                if (s.name == "pixeltriage_requests_total" and s.labels.get("route") == "/v1/score"
                        and s.labels.get("status") == "200"):
                    out[s.labels["replica"]] = s.value
        return out

    def replicas_on(self, url: str, ips: set[str], timeout: float) -> list[dict]:
        """/info's live replicas once there is one ready replica on each of `ips` and no other."""
        deadline = time.monotonic() + timeout
        live = []
        while time.monotonic() < deadline:
            try:
                live = self.get(url + "/info").json()["ray"]["replicas_live"]
            except (httpx.HTTPError, KeyError, ValueError):
                live = []
            if sorted(r["node_ip"] for r in live) == sorted(ips) and all(r["status"] == "ready" for r in live):
                return live
            time.sleep(1.0)
        raise AssertionError(f"not one ready replica on each of {sorted(ips)} after {timeout:.0f} s: {live}")


def test_a_cluster_loses_a_node_under_load_and_drains(namespaces, tiny_checkpoint, tmp_path):
    logs = tmp_path
    with Hosts(["head", "w1", "w2", "db"]) as hosts, postgres_on(hosts, "db") as database:
        bodies, questions = _bodies(database.local_url, 12)
        expected = _expected(tiny_checkpoint, database.local_url, questions)
        (tmp_path / "bodies.json").write_text(json.dumps(bodies))
        key, key_file = secrets.token_urlsafe(24), tmp_path / "api-keys.txt"
        key_file.write_text(key + "\n")
        cluster = Cluster(hosts, logs)
        head, w1, w2 = (hosts.address(n) for n in ("head", "w1", "w2"))
        url = f"http://{head}:{PORT}"
        try:
            t0 = time.monotonic()
            cluster.start_head("head", cpus=0)
            cluster.join("w1", cpus=2)
            cluster.join("w2", cpus=2)
            nodes = cluster.wait_nodes(3)
            print(f"cluster: {len(nodes)} nodes in {time.monotonic() - t0:.0f} s: {nodes}")

            serve_log = logs / "serve.log"
            server = hosts.popen("head", [
                sys.executable, "-m", "pixeltriage", "serve", "--ray", "--ray-address", cluster.address,
                "--replicas", "2", "--max-replicas-per-node", "1", "--cpus-per-replica", "1",
                "--host", "0.0.0.0", "--port", str(PORT), "--checkpoint", str(tiny_checkpoint),
                "--cache", database.url, "--api-key-file", str(key_file), "--graceful-timeout", str(GRACEFUL_TIMEOUT)],
                log=serve_log, env=cluster.env)
            deadline = time.monotonic() + READY_TIMEOUT
            while b"ready on" not in serve_log.read_bytes():
                assert server.poll() is None, serve_log.read_text(errors="replace")
                assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT:.0f} s:\n{serve_log.read_text()}"
                time.sleep(0.5)
            print(f"serve --ray ready {time.monotonic() - t0:.0f} s after the first node started")

            # spread: one replica on each worker, none on the head; each reads the one PostgreSQL cache
            probe = Head(hosts, key)
            live = probe.replicas_on(url, {w1, w2}, 60.0)
            replica_on = {r["node_ip"]: r["replica"] for r in live}
            assert {r["cache"] for r in live} == {redact(database.url)}, live
            for node in (head, w1, w2):
                assert probe.get(f"http://{node}:{PORT}/ready").status_code == 200, node
                refused = probe.post(f"http://{node}:{PORT}/v1/score", {"question": "q?"}, key=False)
                assert refused.status_code == 401, (node, refused.status_code, refused.text)

            # one cache: a memory put through worker 1's proxy is scored through worker 2's, and the other way
            # round; both replicas answer
            image = encoded(random_image("RGB", (80, 60), seed=99), "PNG")
            put = probe.post(f"http://{w1}:{PORT}/v1/memories",
                             {"image": base64.b64encode(image).decode(), "note": "put through one node"})
            assert put.status_code == 200, put.text
            key = put.json()["key"]
            with Cache(database.local_url) as cache:
                want = Scorer.load(tiny_checkpoint, cache=cache).score("the new photo?", [Memory(key=key)])
            before = probe.score_200s(url)
            for proxy in (w2, w1):
                for _ in range(4):
                    r = probe.post(f"http://{proxy}:{PORT}/v1/score",
                                   {"question": "the new photo?", "memories": [{"key": key}]})
                    assert r.status_code == 200, r.text
                    assert _close(r.json(), want)
            after = probe.score_200s(url)
            served = {ip: after.get(rid, 0) - before.get(rid, 0) for ip, rid in replica_on.items()}
            print("a memory put through one node, scored through each node's proxy: 200s per replica's node",
                  served)
            assert all(n > 0 for n in served.values()), served

            # load through the head's proxy, from a process of its own in the head's namespace
            attempts, stop = logs / "attempts.jsonl", logs / "stop"
            client = hosts.popen("head", [sys.executable, str(Path(__file__).with_name("load_client.py")),
                                          "--url", url + "/v1/score", "--bodies", str(logs / "bodies.json"),
                                          "--out", str(attempts), "--stop", str(stop), "--threads", "4",
                                          "--api-key-file", str(key_file)],
                                 log=logs / "client.log", env=cluster.env)
            time.sleep(STEADY)
            before_kill = probe.score_200s(url)
            killed_at = time.monotonic()
            killed = cluster.kill("w1")
            noticed = cluster.wait_gone("w1")
            print(f"killed worker 1 ({len(killed)} processes) at +{killed_at - t0:.0f} s; Ray lists it dead "
                  f"{noticed:.0f} s later")
            time.sleep(max(0.0, killed_at + OUTAGE - time.monotonic()))
            back_at = time.monotonic()
            starts = cluster.join("w1", cpus=2)
            joined_at = time.monotonic()
            live = probe.replicas_on(url, {w1, w2}, RECOVER_TIMEOUT)
            recovered_at = time.monotonic()
            returned = {r["node_ip"]: r["replica"] for r in live}[w1]
            assert returned != replica_on[w1]
            assert {r["cache"] for r in live} == {redact(database.url)}, live
            print(f"worker 1 started again {back_at - killed_at:.0f} s after the kill ({starts} `ray start`); in "
                  f"the cluster {joined_at - back_at:.0f} s later; a replica ready on it {recovered_at - joined_at:.0f} "
                  f"s after that ({recovered_at - killed_at:.0f} s after the kill)")
            time.sleep(STEADY)
            after_return = probe.score_200s(url)
            assert after_return.get(returned, 0) > 0, (returned, after_return)    # the returned replica answers
            assert client.poll() is None, (logs / "client.log").read_text()

            # SIGTERM drains the whole deployment under load
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            server.wait(EXIT_TIMEOUT)
            exited = time.monotonic()
            time.sleep(1.0)
            stop.touch()
            client.wait(CLIENT_EXIT)
            assert server.returncode == 0, serve_log.read_text(errors="replace")[-4000:]
            assert client.returncode == 0, (logs / "client.log").read_text()
        finally:
            (logs / "stop").touch()
            for proc in hosts.procs:
                if proc.poll() is None and proc not in cluster.nodes.values():
                    kill_session(proc.pid, signal.SIGTERM)
            cluster.stop()

    entries = [json.loads(line) for line in attempts.read_text().splitlines()]
    _judge(entries, expected, signalled=signalled, exited=exited, served_before_kill=before_kill,
           figures=dict(killed_at=killed_at, recovered_at=recovered_at))


def _judge(entries, expected, *, signalled, exited, served_before_kill, figures) -> None:
    by_request: dict[str, list[dict]] = {}
    for e in entries:
        by_request.setdefault(e["id"], []).append(e)
    for tries in by_request.values():
        tries.sort(key=lambda e: e["attempt"])
    statuses = Counter(e["status"] for e in entries)
    undrained = {rid: tries for rid, tries in by_request.items() if tries[0]["sent"] < signalled - ADMITTED}
    draining = [e for e in entries if e["sent"] >= signalled - ADMITTED]
    outage = [e for e in entries if figures["killed_at"] <= e["sent"] < figures["recovered_at"]]
    retried = [tries for tries in undrained.values() if len(tries) > 1]
    print("requests:", len(by_request), "attempts:", len(entries), "statuses (every attempt):", dict(statuses))
    print("before the drain:", len(undrained), "requests,", sum(len(t) - 1 for t in undrained.values()),
          "retries over", len(retried), "requests; statuses:",
          dict(Counter(e["status"] for t in undrained.values() for e in t)))
    print("from the kill to the returned replica:", len(outage), "attempts,", dict(Counter(e["status"] for e in outage)))
    print("draining (sent from 2 s before SIGTERM):", dict(Counter(e["status"] for e in draining)),
          f"SIGTERM -> exit {exited - signalled:.1f} s")
    print("replicas' 200s before the kill:", served_before_kill)

    # every attempt: 200, or 503/429 with Retry-After; never 500, 404, a reset; refused only once the proxy stopped
    bad = [e for e in entries if e["status"] not in (200, 503, 429, "ConnectError")]
    assert not bad, bad[:5]
    no_retry_after = [e for e in entries if e["status"] in (503, 429) and not e.get("retry_after")]
    assert not no_retry_after, no_retry_after[:5]
    refused_early = [e for e in entries if e["status"] == "ConnectError" and e["sent"] < signalled]
    assert not refused_early, refused_early[:5]
    # every request before the drain ends answered 200 with its own id and its own question's scores
    unanswered = [tries[-1] for tries in undrained.values() if tries[-1]["status"] != 200]
    assert not unanswered, unanswered[:5]
    mixed = [tries[-1] for tries in undrained.values()
             if tries[-1]["echoed"] != tries[-1]["id"] or not _close(tries[-1], expected[tries[-1]["body"]])]
    assert not mixed, mixed[:5]
    assert len(served_before_kill) == 2 and all(v > 0 for v in served_before_kill.values()), served_before_kill
    assert any(e["status"] == 200 and e["sent"] < signalled < e["answered"] for e in entries)   # admitted, answered
    assert any(e["status"] == 503 for e in draining), "no 503 while draining"
