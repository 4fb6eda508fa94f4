"""Ray Serve on a real local Ray instance: `pixeltriage serve --ray --replicas 2` with CPU replicas of the tiny demo
checkpoint; responses equal the library's, both replicas answer, a replica killed mid-load leaves every request
answered after the client's retries (none hangs, none fails); /metrics holds every replica's series and /info every replica;
SIGTERM under load drains as the single server does (503 with Retry-After, admitted requests answered, no 404, no
reset), and no Ray process outlives the server, even when a test fails.

The tests share one server (starting Ray on two shared cores takes a while) and run in file order; the SIGTERM test
comes last and stops it."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest
from serving import ENV, assert_scores_close, episode, get, wait_for

from pixeltriage.errors import PixelTriageError
from pixeltriage.serve.client import question_body

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pixeltriage[ray]')")

START_TIMEOUT = 240.0
GRACEFUL_TIMEOUT = 20.0
EXIT_TIMEOUT = 90.0          # SIGTERM -> the server process gone (drain, proxy stop, Serve and Ray shutdown)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parents() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, session id)} of every process (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(entry)] = (int(fields[1]), int(fields[3]))
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (Ray's raylet and its workers, started by the server process)."""
    parents = {p: pp for p, (pp, _) in _parents().items()}
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        todo += children
    return found


def in_session(sid: int) -> list[int]:
    """The live processes of session `sid` (the server was started as a session leader: every Ray process it
    starts is in its session, even once reparented)."""
    return [p for p, (_, s) in _parents().items() if s == sid and _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def replica_pids(pid: int) -> list[int]:
    out = []
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::ServeReplica"):
                    out.append(child)
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def ray_server(tiny_checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pixeltriage", "serve", "--ray", "--replicas", "2",
                                 "--cpus-per-replica", "0.5", "--checkpoint", str(tiny_checkpoint),
                                 "--graceful-timeout", str(GRACEFUL_TIMEOUT), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while b"ready on" not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"Ray Serve not ready in {START_TIMEOUT:.0f} s:\n{log.read_text()}"
            time.sleep(0.2)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        left = _wait_session_gone(proc.pid, 30.0)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)           # its session: Ray's own processes, whatever happened
            proc.wait(30)
    assert not left, f"Ray processes outlived the server: {left}\n{log.read_text(errors='replace')[-4000:]}"
    assert proc.returncode == 0, log.read_text(errors="replace")


def _wait_session_gone(sid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def join_all(threads: list[threading.Thread], timeout: float, what: str) -> None:
    """Join every thread within `timeout` s in all; fail naming `what` and how many are left."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    left = sum(t.is_alive() for t in threads)
    assert not left, f"waited {timeout:g} s for {what}: {left} of {len(threads)} still running"


def _samples(url: str, name: str) -> dict[tuple, float]:
    """{(replica, labels...): value} of the metric `name` on the deployment's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = get(url + "/metrics").text
    return {(s.labels.get("replica"), *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def held_questions(url: str) -> dict[str, float]:
    """{replica: questions admitted and not yet answered (queued or in a forward)} from /metrics."""
    held: dict[str, float] = {}
    for name in ("pixeltriage_queue_size", "pixeltriage_queue_running"):
        for (replica, *_), value in _samples(url, name).items():
            held[replica] = held.get(replica, 0.0) + value
    return held


def test_two_replicas_answer_as_the_library_and_survive_a_killed_replica(ray_server, library):
    """16 clients score without pause; once /metrics shows questions admitted on the replica to be killed (load on
    it, not a sleep), it is SIGKILLed; each client then sends one more request. Every request is answered as the
    library scores it or fails with a typed error, none hangs, and the survivor (and the replica Ray Serve starts
    again) answer."""
    from pixeltriage.serve import Client

    proc, url, _ = ray_server
    episodes = [episode(500 + i, 1 + i % 3, size=(200, 150)) for i in range(16)]
    expected = [library.score(q, m) for q, m in episodes]
    with Client(url, retries=2, timeout=60) as client:
        for (q, m), want in zip(episodes[:4], expected[:4]):
            assert_scores_close(client.score(q, m), want)
        instances = {client.info()["instance"]["pid"] for _ in range(24)}
        live = client.info()["ray"]["replicas_live"]
    assert len(instances) == 2                                # both replicas serve
    replicas = replica_pids(proc.pid)
    assert len(replicas) == 2 and set(replicas) == instances
    victim = next(r["replica"] for r in live if r["pid"] == replicas[0])

    killed = threading.Event()
    outcomes: list[list] = [[] for _ in episodes]            # per client: (sent after the kill, outcome)

    def one(i):
        with Client(url, retries=2, timeout=60) as c:
            while True:
                after = killed.is_set()
                try:
                    got = c.score(*episodes[i])
                    assert_scores_close(got, expected[i])
                    outcomes[i].append((after, "ok"))
                except PixelTriageError as e:                 # a clear, typed failure is allowed; a hang is not
                    outcomes[i].append((after, f"{type(e).__name__}: {e}"))
                except AssertionError as e:
                    outcomes[i].append((after, f"other scores: {e}"))
                if after:
                    return

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(episodes))]
    try:
        for t in threads:
            t.start()
        wait_for(f"questions admitted on replica {victim} (pid {replicas[0]})",
                 lambda: held_questions(url).get(victim, 0) > 0, 120)
        os.kill(replicas[0], signal.SIGKILL)
    finally:
        killed.set()
    join_all(threads, 180, "every client's requests to be answered or to fail after the kill")
    print("outcomes after killing a replica:", [o for client in outcomes for o in client if o[0]])
    assert all(client and client[-1][0] for client in outcomes), outcomes     # each sent one after the kill
    assert not [o for client in outcomes for o in client if o[1].startswith("other scores")], outcomes
    # the killed replica's requests were refused 503 with Retry-After by the proxy (serve.ray.proxy_guard), the
    # client retried them, and the surviving replica answered every one
    assert all(o[1] == "ok" for client in outcomes for o in client), outcomes
    with Client(url, retries=3, timeout=60) as client:
        assert_scores_close(client.score(*episodes[0]), expected[0])
        assert httpx.get(url + "/ready").status_code == 200


def _two_ready_replicas(url: str, timeout: float = 120.0) -> dict:
    """/info once it lists two live replicas, both ready (the killed one is restarted by Ray Serve)."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/info", timeout=30).json()
        live = info["ray"]["replicas_live"]
        if len(live) == 2 and all(r["status"] == "ready" for r in live):
            return info
        assert time.monotonic() < deadline, f"not two ready replicas after {timeout:.0f} s: {live}"
        time.sleep(1.0)


def _score_200s(text: str) -> dict[str, float]:
    """{replica: pixeltriage_requests_total of /v1/score with status 200} from a deployment's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "pixeltriage_requests_total" and sample.labels.get("route") == "/v1/score"
                    and sample.labels.get("status") == "200"):
                out[sample.labels["replica"]] = sample.value
    return out


def test_metrics_and_info_hold_every_replica(ray_server):
    """/metrics, wherever Ray routes it, counts the requests of both replicas (each series labelled `replica`);
    /info has every field of a single server's and the deployment's replicas."""
    _, url, _ = ray_server
    info = _two_ready_replicas(url)
    replicas = {r["replica"] for r in info["ray"]["replicas_live"]}
    assert info["ray"]["replica"] in replicas
    for field in ("version", "status", "checkpoint", "instance", "limits", "checkpoint_fingerprint",
                  "vision_fingerprint", "device", "dtype", "model", "kernels", "cache", "gates", "transport"):
        assert field in info, field
    assert info["transport"]["server"] == "ray-serve-proxy" and info["transport"].get("http")
    assert info["ray"]["replicas"] == 2 and info["ray"]["cpus_per_replica"] == 0.5
    assert {r["pid"] for r in info["ray"]["replicas_live"]} == set(replica_pids(ray_server[0].pid))
    assert {r["cache"] for r in info["ray"]["replicas_live"]} == {None}           # served without --cache

    before = httpx.get(url + "/metrics", timeout=30)
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    counted_before = _score_200s(before.text)
    assert "pixeltriage_replicas{outcome=\"answered\"} 2.0" in before.text
    sent = 24
    body = question_body(*episode(900, 1))

    def post(n):
        with httpx.Client(timeout=60) as c:
            for _ in range(n):
                assert c.post(url + "/v1/score", json=body).status_code == 200

    threads = [threading.Thread(target=post, args=(sent // 4,)) for _ in range(4)]
    for t in threads:
        t.start()
    join_all(threads, 120, f"{sent} scoring requests to be answered")
    after = httpx.get(url + "/metrics", timeout=30).text
    counted_after = _score_200s(after)
    assert set(counted_after) == replicas                        # one series per live replica
    assert sum(counted_after.values()) - sum(counted_before.values()) == sent
    print("score 200s per replica:", {r: counted_after[r] - counted_before.get(r, 0) for r in counted_after})


def _load(url: str, body: dict, stop: threading.Event, outcomes: list, signalled: list) -> None:
    """One client (its own keep-alive connection, like `hey`: Retry-After is not waited for) posting `body` until
    `stop`, or until the server refuses connections: (sent at, answered at, status or error, retry-after, error,
    the client's thread)."""
    me = threading.get_ident()
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                r = client.post(url, json=body)
            except httpx.ConnectError as e:
                refused = "refused" in str(e).lower() or "errno 111" in str(e).lower()
                outcomes.append((sent, time.monotonic(), "refused" if refused else f"ConnectError: {e}", None, None,
                                 me))
                if refused and signalled:
                    return                                         # the server has stopped listening
                continue
            except httpx.HTTPError as e:                           # a reset, a connection closed without an answer
                outcomes.append((sent, time.monotonic(), f"{type(e).__name__}: {e}", None, None, me))
                continue
            error = None if r.status_code == 200 else r.text        # Ray's own 404 is plain text
            outcomes.append((sent, time.monotonic(), r.status_code, r.headers.get("retry-after"), error, me))


def test_sigterm_under_load_drains_without_404_or_reset(ray_server):
    """SIGTERM while 6 clients post (2 of them batches that take a while), sent once every client has been answered
    and /metrics shows a batch's questions admitted (load on the replicas, not a sleep): requests admitted before it
    are answered 200 (a batch in flight at the signal among them), later ones 503 with Retry-After (while the proxy
    still accepts), then connections are refused; never a 404, a reset or a request left without an answer; the
    server exits 0 and every Ray process with it."""
    proc, url, log = ray_server
    _two_ready_replicas(url)
    small = question_body(*episode(901, 1))
    heavy = {"questions": [question_body(*episode(910 + i, 3, size=(320, 240))) for i in range(16)]}
    stop, signalled = threading.Event(), []
    outcomes: list = []
    threads = [threading.Thread(target=_load, args=(url + "/v1/score", small, stop, outcomes, signalled))
               for _ in range(4)]
    threads += [threading.Thread(target=_load, args=(url + "/v1/score/batch", heavy, stop, outcomes, signalled))
                for _ in range(2)]

    def loaded() -> bool:
        answered = {o[5] for o in outcomes if o[2] == 200}
        return len(answered) == len(threads) and sum(held_questions(url).values()) > 4   # > the 4 single ones

    for t in threads:
        t.start()
    try:
        wait_for("every client answered once and a batch's questions admitted (/metrics)", loaded, 180)
        signalled.append(time.monotonic())
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"waited {EXIT_TIMEOUT:g} s for the server to exit after SIGTERM")
        join_all(threads, 70, "every client to meet a refused connection after the server exited")
    finally:
        stop.set()
        join_all(threads, 70, "every client to stop")
    at = signalled[0]
    kinds = Counter(o[2] for o in outcomes)
    print("outcomes:", dict(kinds), f"exit {proc.returncode}")
    print("after the signal, s:", sorted((round(o[0] - signalled[0], 2), o[2]) for o in outcomes
                                         if o[2] not in (200, 503)))
    print("server log:", log.read_text(errors="replace")[-3000:])
    assert proc.returncode == 0
    assert set(kinds) <= {200, 503, "refused"}, kinds                  # no 404, no reset, no lost answer
    before = [o for o in outcomes if o[1] < at]                        # answered before the signal
    assert before and all(o[2] == 200 for o in before), Counter(o[2] for o in before)
    assert any(o[2] == 200 and o[0] < at < o[1] for o in outcomes)    # in flight at the signal, answered
    refusals = [o for o in outcomes if o[2] == 503]
    assert refusals, "no 503 seen while draining"
    late = [(round(o[0] - at, 2), o[4]) for o in refusals if o[3] is None or "before this request was scored" in o[4]]
    assert not late, late             # each with Retry-After, none for a request admitted before (none cut short)
    assert all(o[0] >= at for o in outcomes if o[2] == "refused")
