"""Ray Serve on a real local Ray instance: `pixeltriage serve --ray --replicas 2` with CPU replicas of the tiny demo
checkpoint; responses equal the library's, both replicas answer, a replica killed mid-load leaves every request
answered or failed with a typed error (none hangs), and SIGTERM shuts it all down."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving import ENV, assert_scores_close, episode

from pixeltriage.errors import PixelTriageError

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pixeltriage[ray]')")

START_TIMEOUT = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (Ray's raylet and its workers, started by the server process)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        todo += children
    return found


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
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while b"ready on" not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"Ray Serve not ready in {START_TIMEOUT:.0f} s:\n{log.read_text()}"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)       # the session started for it: Ray's own processes
                proc.wait(30)
    assert proc.returncode == 0, log.read_text(errors="replace")


def test_two_replicas_answer_as_the_library_and_survive_a_killed_replica(ray_server, library):
    from pixeltriage.serve import Client

    proc, url = ray_server
    episodes = [episode(500 + i, 1 + i % 3, size=(200, 150)) for i in range(16)]
    expected = [library.score(q, m) for q, m in episodes]
    with Client(url, retries=2, timeout=60) as client:
        for (q, m), want in zip(episodes[:4], expected[:4]):
            assert_scores_close(client.score(q, m), want)
        instances = {client.info()["instance"]["pid"] for _ in range(24)}
    assert len(instances) == 2                                # both replicas serve
    replicas = replica_pids(proc.pid)
    assert len(replicas) == 2 and set(replicas) == instances

    outcomes = [None] * len(episodes)

    def one(i):
        with Client(url, retries=2, timeout=60) as c:
            try:
                got = c.score(*episodes[i])
                assert_scores_close(got, expected[i])
                outcomes[i] = "ok"
            except PixelTriageError as e:                     # a clear, typed failure is allowed; a hang is not
                outcomes[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(episodes))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(replicas[0], signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert all(o is not None for o in outcomes), outcomes
    print("outcomes after killing a replica:", outcomes)
    with Client(url, retries=3, timeout=60) as client:
        assert_scores_close(client.score(*episodes[0]), expected[0])
        assert httpx.get(url + "/ready").status_code == 200
