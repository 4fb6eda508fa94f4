"""A server's life over real HTTP: one-line start-up errors, a kill -9 that loses no committed cache row, SIGTERM
that stops admitting (503 on /v1 and /ready), finishes admitted work and closes the cache cleanly.

The drains run through gated_serve.py (GatedServer) with the batcher's forwards held: the requests are certainly
admitted and unanswered when SIGTERM arrives, and answered when the test opens the gate, whatever the machine's
speed; it also exits without the interpreter's finalization, so a cache the server left open shows as its -wal."""
import io
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from PIL import Image
from serving import ENV, ServerProcess, b64, image_bytes, metric, wait_for

from pixeltriage import Cache

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)


def test_start_up_errors_are_one_line(tmp_path, tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "pixeltriage", "serve", "--checkpoint", str(tiny_checkpoint),
                              "--port", str(port)], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: address already in use"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "serve", "--checkpoint", str(broken), "--port", "0"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: ") and "broken" in out.stderr


def test_kill_9_loses_no_committed_row_and_sigterm_drains(tiny_checkpoint, tmp_path, gated):
    db = tmp_path / "cache.db"
    first = ServerProcess(tiny_checkpoint, tmp_path / "first.log", "--cache", str(db)).wait_ready()
    keys = []
    with httpx.Client(base_url=first.url, timeout=60) as http:
        for i in range(5):
            response = http.post("/v1/memories", json={"image": b64(image_bytes(seed=i)), "note": f"note {i}"})
            assert response.status_code == 200
            keys.append(response.json()["key"])                  # answered: committed
    first.proc.kill()
    first.proc.wait(30)
    with Cache(db) as cache:
        assert all(key in cache for key in keys) and cache.integrity_check() == "ok"
        assert cache.note(keys[3]) == "note 3"

    second = gated("second", "--cache", str(db), "--graceful-timeout", "60", "-vv",    # debug logging
                   hold=("forward",)).wait_ready()
    with httpx.Client(base_url=second.url, timeout=120) as http:
        assert [http.get(f"/v1/memories/{key}").json()["note"] for key in keys] == [f"note {i}" for i in range(5)]
        heavy = {"question": "private-question-4711", "memories": [
            {"image": b64(image_bytes((336, 336), seed=i)), "note": "private-note-0815"} for i in range(16)]}
        heavy["memories"][0]["image"] = b64(tiff_with_description("private-description-4711"))   # PIL logs tags
        answers = post_until_admitted(http, heavy, 3)             # admitted, none answered: forwards are held
        second.proc.send_signal(signal.SIGTERM)
        wait_for("/ready to stop answering 200", lambda: http.get("/ready").status_code != 200)
        assert http.get("/ready").json()["status"] == "draining"
        refused = http.post("/v1/score", json={"question": "new", "memories": []})
        assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
        assert http.get("/health").status_code == 200
        assert answers.received == []                             # the admitted work is still in the server
        second.open("forward")
        answers.wait(3)
    assert [a.status_code for a in answers.received] == [200, 200, 200]   # admitted work finished
    assert all(len(a.json()["gains"]) == 16 for a in answers.received)
    assert second.proc.wait(60) == 0
    output = second.output()
    assert "Traceback" not in output and "stopped" in output
    assert "DEBUG" in output and "16 memories" in output                # lengths are logged, never the text
    assert "private-" not in output and heavy["memories"][0]["image"][:40] not in output
    assert not Path(f"{db}-wal").exists()                        # closed cleanly: the last connection checkpointed
    with Cache(db) as cache:
        assert cache.integrity_check() == "ok" and len(cache) >= 5


class Answers:
    """The responses of requests sent from their own threads, as they arrive."""

    def __init__(self):
        self.received: list[httpx.Response] = []
        self._arrived = threading.Condition()

    def add(self, response: httpx.Response) -> None:
        with self._arrived:
            self.received.append(response)
            self._arrived.notify_all()

    def wait(self, count: int, timeout: float = 120.0) -> list[httpx.Response]:
        """Once `count` responses arrived (AssertionError after `timeout` s): those received so far."""
        with self._arrived:
            assert self._arrived.wait_for(lambda: len(self.received) >= count, timeout), \
                f"{len(self.received)} of {count} responses within {timeout:g} s"
            return list(self.received)


def post_until_admitted(http: httpx.Client, body: dict, count: int) -> Answers:
    """POST `body` to /v1/score from `count` threads; return once the server has admitted all of them (fails after
    60 s), with their responses to come."""
    answers = Answers()
    for _ in range(count):
        threading.Thread(target=lambda: answers.add(http.post("/v1/score", json=body)), daemon=True).start()
    wait_for(f"{count} questions admitted", lambda: admitted(http) >= count)
    return answers


def admitted(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return metric(text, "pixeltriage_queue_size") + metric(text, "pixeltriage_queue_running")


def tiff_with_description(text: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 30)).save(buffer, format="TIFF", tiffinfo={270: text})
    return buffer.getvalue()


def test_sigterm_past_the_graceful_timeout_refuses_the_rest_and_still_closes_cleanly(tmp_path, gated):
    db = tmp_path / "cache.db"
    server = gated("server", "--cache", str(db), "--graceful-timeout", "0.3", hold=("forward",)).wait_ready()
    heavy = {"question": "q", "memories": [{"image": b64(image_bytes((336, 336), seed=i))} for i in range(16)]}
    warm_up = len(server.forwards())                             # the load's own, before any request
    with httpx.Client(base_url=server.url, timeout=120) as http:
        answers = post_until_admitted(http, heavy, 4)
        wait_for("the batcher's first forward to begin", lambda: len(server.forwards()) > warm_up)
        running = server.forwards()[warm_up][0]                  # its questions, held in it
        assert 1 <= running < 4
        server.proc.send_signal(signal.SIGTERM)
        refused = answers.wait(4 - running)                     # the graceful timeout passed: the rest refused
        assert [a.status_code for a in refused] == [503] * (4 - running)
        server.open("forward")                                  # the forward in progress still finishes
        answers.wait(4)
    assert server.proc.wait(60) == 0
    codes = sorted(a.status_code for a in answers.received)
    assert codes == [200] * running + [503] * (4 - running), codes      # the rest refused, none lost
    # refused past the guard (admitted, then cut by the graceful timeout): still told when to retry, as the guard does
    assert all(a.headers.get("retry-after") == "1" for a in answers.received if a.status_code == 503)
    output = server.output()
    assert "Traceback" not in output and "shutdown failed" not in output.lower()
    assert not Path(f"{db}-wal").exists()                        # the cache was still closed
