"""Overload over real HTTP, on a server whose queue holds 4 questions: 429 with Retry-After when full, 504 for a
request past its deadline (dropped from the queue), a client that disconnects has its queued work dropped."""
import json
import socket
import threading
import time

import httpx
import pytest
from serving import ServerProcess, b64, image_bytes, metric

from pixeltriage.errors import DeadlineExceededError, OverloadedError

SQUARE = b64(image_bytes((336, 336)))


@pytest.fixture(scope="module")
def small(tiny_checkpoint, tmp_path_factory):
    server = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("small") / "server.log", "--max-queued", "4",
                           "--max-client-batch", "4", "--request-timeout", "60")
    yield server.wait_ready()
    server.stop()


def heavy_batch(url: str, questions: int) -> dict:
    """Start a batch that keeps the worker busy for several forwards; returns a dict filled with its response."""
    memories = [{"image": SQUARE, "dialogue": f"memory {i}"} for i in range(16)]
    body = {"questions": [{"question": f"heavy {j}", "memories": memories} for j in range(questions)]}
    out = {}

    def send():
        out["response"] = httpx.post(url + "/v1/score/batch", json=body, timeout=120)

    out["thread"] = threading.Thread(target=send)
    out["thread"].start()
    return out


def admitted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return metric(text, "pixeltriage_queue_size") + metric(text, "pixeltriage_queue_running")


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def finish(batch: dict) -> httpx.Response:
    batch["thread"].join(120)
    return batch["response"]


def test_a_full_queue_answers_429_with_retry_after(small):
    from pixeltriage.serve import Client

    batch = heavy_batch(small.url, 4)
    wait_for(lambda: admitted(small.url) == 4)
    response = httpx.post(small.url + "/v1/score", json={"question": "q", "memories": []})
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error_type"] == "overloaded"
    with Client(small.url, retries=0) as c:
        with pytest.raises(OverloadedError) as e:
            c.score("q", [])
        assert e.value.retry_after >= 1 and e.value.status == 429
    assert finish(batch).status_code == 200                               # the admitted batch is unharmed
    wait_for(lambda: admitted(small.url) == 0)
    assert httpx.post(small.url + "/v1/score", json={"question": "q", "memories": []}).status_code == 200


def test_a_request_needing_more_room_than_is_left_is_429_while_a_single_one_fits(small):
    batch = heavy_batch(small.url, 3)
    wait_for(lambda: admitted(small.url) == 3)
    two = {"questions": [{"question": "a", "memories": []}, {"question": "b", "memories": []}]}
    assert httpx.post(small.url + "/v1/score/batch", json=two, timeout=60).status_code == 429
    assert httpx.post(small.url + "/v1/score", json={"question": "c", "memories": []}, timeout=60).status_code == 200
    assert finish(batch).status_code == 200


def test_a_request_past_its_deadline_is_dropped_with_504(small):
    from pixeltriage.serve import Client

    before = httpx.get(small.url + "/metrics").text
    batch = heavy_batch(small.url, 3)
    wait_for(lambda: admitted(small.url) == 3)
    response = httpx.post(small.url + "/v1/score", json={"question": "late", "memories": [], "timeout_s": 0.02},
                          timeout=60)
    assert response.status_code == 504 and response.json()["error_type"] == "deadline"
    with Client(small.url, retries=0) as c:
        with pytest.raises(DeadlineExceededError):
            c.score("late", [], timeout_s=0.02)
    assert finish(batch).status_code == 200
    after = httpx.get(small.url + "/metrics").text
    scored = metric(after, "pixeltriage_questions_total") - metric(before, "pixeltriage_questions_total")
    assert scored == 3                                                      # the late ones never ran
    assert metric(after, "pixeltriage_request_failures_total", '{reason="deadline"}') - metric(
        before, "pixeltriage_request_failures_total", '{reason="deadline"}') == 2


def test_a_client_that_disconnects_has_its_queued_work_dropped(small):
    before = httpx.get(small.url + "/metrics").text
    batch = heavy_batch(small.url, 3)
    wait_for(lambda: admitted(small.url) == 3)
    payload = json.dumps({"question": "gone", "memories": [{"image": SQUARE}]}).encode()
    host, port = small.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        wait_for(lambda: admitted(small.url) == 4)
    dropped = '{reason="disconnected"}'
    wait_for(lambda: metric(httpx.get(small.url + "/metrics").text, "pixeltriage_request_failures_total", dropped)
             == metric(before, "pixeltriage_request_failures_total", dropped) + 1)
    assert finish(batch).status_code == 200
    wait_for(lambda: admitted(small.url) == 0)
    after = httpx.get(small.url + "/metrics").text
    assert metric(after, "pixeltriage_questions_total") - metric(before, "pixeltriage_questions_total") == 3


def test_stalled_uploads_to_any_route_are_bounded(small):
    """Every /v1 body the server holds counts against --max-queued, not only scoring ones: stalled uploads to
    /v1/memories cannot pile up request bodies in memory. Unknown routes are answered without reading the body."""
    host, port = small.url.removeprefix("http://").split(":")
    stalled = []
    try:
        for _ in range(4):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"POST /v1/memories HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000000\r\n\r\n{\"image\": \"")
            stalled.append(sock)
        deadline = time.monotonic() + 30
        while True:                                        # the four bodies are being read: the fifth is refused
            response = httpx.post(small.url + "/v1/retrieve", json={"question": "q"}, timeout=30)
            if response.status_code == 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert response.status_code == 429 and response.headers["retry-after"]
        assert httpx.post(small.url + "/v1/nothing", content=b"x" * 100, timeout=30).status_code == 404
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 30
    while httpx.post(small.url + "/v1/score", json={"question": "q", "memories": []}, timeout=30).status_code != 200:
        assert time.monotonic() < deadline                 # the slots come back when the uploads go away
        time.sleep(0.05)
