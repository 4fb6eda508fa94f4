"""Overload over real HTTP, on a server whose queue holds 4 questions: 429 with Retry-After when full, 504 for a
request past its deadline (dropped from the queue), a client that disconnects has its queued work dropped.

The server runs through gated_serve.py (GatedServer) and each test holds the batcher's forwards at their gate while
it fills the queue: what it admitted stays admitted (one forward begun and waiting, the rest queued behind it) until
the test opens the gate, so no test depends on a batch taking long enough to outlast the next request."""
import contextlib
import json
import socket
import threading

import httpx
import pytest
from serving import GatedServer, b64, get, image_bytes, metric, wait_for

from pixeltriage.errors import DeadlineExceededError, OverloadedError

SQUARE = b64(image_bytes((336, 336)))


@pytest.fixture(scope="module")
def small(tiny_checkpoint, tmp_path_factory):
    server = GatedServer(tiny_checkpoint, tmp_path_factory.mktemp("small"), "--max-queued", "4",
                         "--max-client-batch", "4", "--request-timeout", "60")
    yield server.wait_ready()
    server.stop()


@contextlib.contextmanager
def held_forwards(server: GatedServer):
    """The batcher's forwards wait at their gate within the block (and it opens at the end, whatever happened)."""
    server.close("forward")
    try:
        yield
    finally:
        server.open("forward")


def in_background(url: str, path: str, body: dict) -> dict:
    """Post `body` on a thread; the dict holds the thread and, once answered, the response."""
    out = {}

    def send():
        out["response"] = httpx.post(url + path, json=body, timeout=120)

    out["thread"] = threading.Thread(target=send)
    out["thread"].start()
    return out


def batch(url: str, questions: int) -> dict:
    body = {"questions": [{"question": f"held {j}", "memories": []} for j in range(questions)]}
    return in_background(url, "/v1/score/batch", body)


def finish(sent: dict) -> httpx.Response:
    sent["thread"].join(120)
    assert "response" in sent, "no response within 120 s"
    return sent["response"]


def admitted(url: str) -> float:
    text = get(url + "/metrics").text
    return metric(text, "pixeltriage_queue_size") + metric(text, "pixeltriage_queue_running")


def metrics(url: str) -> str:
    return get(url + "/metrics").text


def questions_run(server: GatedServer, since: int) -> int:
    """Questions in the forwards begun after the first `since`."""
    return sum(states for states, _ in server.forwards()[since:])


def test_a_full_queue_answers_429_with_retry_after(small):
    from pixeltriage.serve import Client

    with held_forwards(small):
        full = batch(small.url, 4)
        wait_for("4 questions admitted", lambda: admitted(small.url) == 4)
        response = httpx.post(small.url + "/v1/score", json={"question": "q", "memories": []})
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error_type"] == "overloaded"
        with Client(small.url, retries=0) as c:
            with pytest.raises(OverloadedError) as e:
                c.score("q", [])
            assert e.value.retry_after >= 1 and e.value.status == 429
        assert admitted(small.url) == 4
    assert finish(full).status_code == 200                                # the admitted batch is unharmed
    wait_for("the queue to empty", lambda: admitted(small.url) == 0)
    assert httpx.post(small.url + "/v1/score", json={"question": "q", "memories": []}).status_code == 200


def test_a_request_needing_more_room_than_is_left_is_429_while_a_single_one_fits(small):
    with held_forwards(small):
        three = batch(small.url, 3)
        wait_for("3 questions admitted", lambda: admitted(small.url) == 3)
        two = {"questions": [{"question": "a", "memories": []}, {"question": "b", "memories": []}]}
        assert httpx.post(small.url + "/v1/score/batch", json=two, timeout=60).status_code == 429
        single = in_background(small.url, "/v1/score", {"question": "c", "memories": []})
        wait_for("the single question admitted beside the three", lambda: admitted(small.url) == 4)
    assert finish(single).status_code == 200
    assert finish(three).status_code == 200


def test_a_request_past_its_deadline_is_dropped_with_504(small):
    from pixeltriage.serve import Client

    before, start = metrics(small.url), len(small.forwards())
    with held_forwards(small):
        three = batch(small.url, 3)
        wait_for("3 questions admitted", lambda: admitted(small.url) == 3)
        # the worker is in a forward, held: a question admitted now cannot join it, and no other forward begins
        wait_for("the batch's first forward to begin", lambda: len(small.forwards()) > start)
        response = httpx.post(small.url + "/v1/score", json={"question": "late", "memories": [], "timeout_s": 0.02},
                              timeout=60)
        assert response.status_code == 504 and response.json()["error_type"] == "deadline"
        with Client(small.url, retries=0) as c:
            with pytest.raises(DeadlineExceededError):
                c.score("late", [], timeout_s=0.02)
        assert admitted(small.url) == 3                                   # the late ones left the queue
    assert finish(three).status_code == 200
    wait_for("the queue to empty", lambda: admitted(small.url) == 0)
    assert questions_run(small, start) == 3                               # the late ones never ran
    after = metrics(small.url)
    assert metric(after, "pixeltriage_questions_total") - metric(before, "pixeltriage_questions_total") == 3
    assert metric(after, "pixeltriage_request_failures_total", '{reason="deadline"}') - metric(
        before, "pixeltriage_request_failures_total", '{reason="deadline"}') == 2


def test_a_client_that_disconnects_has_its_queued_work_dropped(small):
    before, start = metrics(small.url), len(small.forwards())
    dropped = '{reason="disconnected"}'
    with held_forwards(small):
        three = batch(small.url, 3)
        wait_for("3 questions admitted", lambda: admitted(small.url) == 3)
        wait_for("the batch's first forward to begin", lambda: len(small.forwards()) > start)
        payload = json.dumps({"question": "gone", "memories": [{"image": SQUARE}]}).encode()
        host, port = small.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            wait_for("the question admitted", lambda: admitted(small.url) == 4)
        gone = metric(before, "pixeltriage_request_failures_total", dropped) + 1
        wait_for("the disconnect counted",
                 lambda: metric(metrics(small.url), "pixeltriage_request_failures_total", dropped) == gone)
        assert admitted(small.url) == 3                                   # dropped from the queue, before any forward
    assert finish(three).status_code == 200
    wait_for("the queue to empty", lambda: admitted(small.url) == 0)
    assert questions_run(small, start) == 3
    after = metrics(small.url)
    assert metric(after, "pixeltriage_questions_total") - metric(before, "pixeltriage_questions_total") == 3


def test_stalled_uploads_to_any_route_are_bounded(small):
    """Every /v1 body the server holds counts against --max-queued, not only scoring ones: stalled uploads to
    /v1/memories cannot pile up request bodies in memory. Unknown routes are answered without reading the body."""
    host, port = small.url.removeprefix("http://").split(":")
    stalled = []

    def refused():                                         # the four bodies are being read: the fifth is refused
        response = httpx.post(small.url + "/v1/retrieve", json={"question": "q"}, timeout=30)
        return response.status_code == 429 and response

    try:
        for _ in range(4):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"POST /v1/memories HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000000\r\n\r\n{\"image\": \"")
            stalled.append(sock)
        response = wait_for("a fifth request refused with 429 beside the four stalled uploads", refused, 30)
        assert response.headers["retry-after"]
        assert httpx.post(small.url + "/v1/nothing", content=b"x" * 100, timeout=30).status_code == 404
    finally:
        for sock in stalled:
            sock.close()
    wait_for("the slots to come back once the uploads went away",
             lambda: httpx.post(small.url + "/v1/score", json={"question": "q", "memories": []},
                                timeout=30).status_code == 200, 30)
