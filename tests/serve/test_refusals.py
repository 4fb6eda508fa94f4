"""Bad input, auth, paths outside the image root and the payload limit, over real HTTP: each refused with its status,
an error body naming the field, and the library's typed error in the client; good requests beside them unharmed."""
import socket
import threading

import httpx
import pytest
from serving import API_KEY, assert_scores_close, b64, episode, image_bytes

from pixeltriage import InvalidMemoryError, Memory, StateTooLongError
from pixeltriage.errors import AuthenticationError, InvalidRequestError

PNG = b64(image_bytes())


def body(*memories, **extra):
    return {"question": "q", "memories": list(memories), **extra}


@pytest.mark.parametrize("request_body, field, kind, needle", [
    (body({"image": "not base64!"}), "memories[0].image", "invalid_input", "not valid base64"),
    (body({"image": PNG}, {"image": "data:text/plain;base64,aGk="}), "memories[1].image", "invalid_input", "image/*"),
    (body({"image": PNG}, {"image": b64(b"GIF89a but not really")}), "memories[1].image", "invalid_memory",
     "memories[1].image: image bytes"),
    (body({"image": b64(image_bytes()[:60])}), "memories[0].image", "invalid_memory", "memories[0].image: image"),
    (body({"key": "a" * 64}), "memories[0].key", "invalid_memory", "is not in the cache"),
    (body({"key": "not-a-key"}), "memories[0].key", "invalid_input", "pattern"),
    (body({"image": PNG, "key": "a" * 64}), "memories[0]", "invalid_input", "exactly one of"),
    (body(*[{"image": PNG}] * 65), "memories", "invalid_input", "at most 64"),
    ({"question": 3}, "question", "invalid_input", "valid string"),
    (body({"image": PNG, "note": 7}), "memories[0].note", "invalid_input", "valid string"),
    (body({"image": PNG, "colour": "red"}), "memories[0].colour", "invalid_input", "Extra inputs"),
    (body({"image": PNG}, policy={"k": "2"}), "policy.k", "invalid_input", "valid integer"),
    (body({"image": PNG}, policy={"k": -1}), "policy.k", "invalid_input", "greater than or equal"),
    (body({"image": PNG}, policy={"gate_rate": 1.5}), "policy.gate_rate", "invalid_input", "less than or equal"),
    (body({"image": PNG}, policy={"answering_model": "gpt"}), "policy.answering_model", "invalid_input", "qwen"),
    (body({"image": PNG}, timeout_s=0), "timeout_s", "invalid_input", "greater than 0"),
    (body({"path": "photos/mug.png", "note": None}, priority=10), "priority", "invalid_input", "less than or equal"),
])
def test_bad_input_is_422_naming_the_field(http, served, request_body, field, kind, needle):
    response = http.post("/v1/score", json=request_body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert (error["field"], error["error_type"]) == (field, kind), error
    assert needle in error["error"] and error["error"].startswith(field)
    assert str(served.base) not in error["error"]                          # not even the cache file's path
    assert "Traceback" not in response.text and len(response.text) < 2000      # inputs are never echoed


@pytest.mark.parametrize("content", [b'{"question": "\xff\xfe"}', b'{"question": "q", "id": ' + b"9" * 5000 + b"}",
                                     b"[" * 100_000 + b"]" * 100_000])
def test_a_body_fastapi_cannot_parse_is_422_too(http, content):
    response = http.post("/v1/score", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error_type"] == "invalid_input", response.text


def test_a_fifo_under_the_image_root_is_refused_without_blocking(http, served):
    import os

    fifo = served.root / "photos" / "pipe.png"
    if not fifo.exists():
        os.mkfifo(fifo)
    response = http.post("/v1/score", json=body({"path": "photos/pipe.png"}), timeout=20)
    assert response.status_code == 422 and "not a regular file" in response.json()["error"]
    assert http.post("/v1/score", json=body({"path": "photos/mug.png"}), timeout=60).status_code == 200
    assert http.get("/ready").json()["status"] == "ready"


def test_malformed_json_and_a_state_too_long(http):
    response = http.post("/v1/score", content=b'{"question": "q", "memories": [', headers={
        "content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error_type"] == "invalid_input"
    square = b64(image_bytes((336, 336)))
    long_text = "word " * 400
    response = http.post("/v1/score", json=body(*[{"image": square, "dialogue": long_text, "note": long_text}] * 64))
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error_type"] == "state_too_long" and error["field"] == "memories"
    assert "the model accepts at most" in error["error"]                    # the library's own message


def test_client_raises_the_library_errors(client):
    with pytest.raises(InvalidMemoryError) as e:
        client.score("q", [Memory(image=image_bytes()), Memory(image=b"\x89PNG\r\n\x1a\nbroken")])
    assert e.value.index == 1 and str(e.value).startswith("memory 2: ")
    with pytest.raises(InvalidMemoryError, match="must be a string") as e:
        client.score("q", [Memory(image=image_bytes(), note=5)])             # refused before sending, as locally
    assert e.value.index == 0
    with pytest.raises(InvalidMemoryError, match="not in the cache"):
        client.score("q", [Memory(key="b" * 64)])
    square = image_bytes((336, 336))
    with pytest.raises(StateTooLongError, match="accepts at most"):
        client.score("q", [Memory(image=square, dialogue="w " * 600, note="n " * 600)] * 64)
    with pytest.raises(InvalidRequestError) as e:
        client.score("q", [Memory(image=image_bytes())] * 65)
    assert e.value.field == "memories" and e.value.status == 422


def test_one_bad_request_never_fails_the_good_ones_beside_it(served, library):
    from pixeltriage.serve import Client

    good = [episode(400 + i, 2) for i in range(8)]
    statuses, answers = [None] * 12, [None] * 12

    def send(i):
        with Client(served.url, api_key=API_KEY, retries=0) as c:
            try:
                if i < 8:
                    answers[i] = c.score(*good[i])
                else:
                    c.score("bad", [Memory(image=image_bytes()), Memory(image=b"RIFF....WEBPbroken")])
                statuses[i] = 200
            except InvalidMemoryError:
                statuses[i] = 422

    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert statuses == [200] * 8 + [422] * 4
    for got, (q, m) in zip(answers, good):
        assert_scores_close(got, library.score(q, m))


def test_a_split_client_batch_names_the_question_by_its_place_in_the_whole_list(client):
    client._batch_size = 2                                 # as a server with --max-client-batch 2 would have it
    good = ("q", [Memory(image=image_bytes())])
    bad = ("q", [Memory(image=image_bytes()), Memory(image=b"GIF89a not really")])
    with pytest.raises(InvalidMemoryError) as info:
        client.score_batch([good, good, good, bad])
    assert info.value.field == "questions[3].memories[1].image" and info.value.index == 1


def test_batch_errors_name_the_question(http):
    good = {"question": "q", "memories": [{"image": PNG}]}
    bad = {"question": "q", "memories": [{"image": PNG}, {"image": b64(b"nope")}]}
    response = http.post("/v1/score/batch", json={"questions": [good, good, bad]})
    assert response.status_code == 422
    assert response.json()["field"] == "questions[2].memories[1].image"
    response = http.post("/v1/score/batch", json={"questions": [good] * 33})
    assert response.status_code == 422 and response.json()["field"] == "questions"
    assert "at most 32" in response.json()["error"]
    assert http.post("/v1/score/batch", json={"questions": []}).status_code == 422


@pytest.mark.parametrize("path, needle", [
    ("../secret.png", "'..'"),
    ("photos/../../secret.png", "'..'"),
    ("/etc/passwd", "absolute"),
    ("photos/out.png", "leaves the image root"),
    ("photos/up/secret.png", "leaves the image root"),
    ("http://example.com/a.png", "URLs"),
    ("file:///etc/passwd", "URLs"),
    ("photos/missing.png", "not a file under the image root"),
    ("photos", "not a regular file"),
    ("photos/mug.png\x00.jpg", "NUL"),
])
def test_paths_outside_the_image_root_are_refused(http, served, path, needle):
    response = http.post("/v1/score", json=body({"path": path}))
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["field"] == "memories[0].path" and needle in error["error"], error
    assert str(served.base) not in error["error"]                          # the server's own paths stay private


def test_auth(served):
    url = served.url
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(url + path).status_code == 200                      # open
    assert httpx.post(url + "/v1/score", json=body({"image": PNG})).status_code == 401
    for headers in ({"authorization": "Bearer wrong"}, {"authorization": API_KEY},
                    {"authorization": f"Basic {API_KEY}"}):
        response = httpx.post(url + "/v1/score", json=body({"image": PNG}), headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"].startswith("Bearer")
    for path in ("/info", "/openapi.json"):
        assert httpx.get(url + path).status_code == 401
    second = httpx.post(url + "/v1/score", json=body({"image": PNG}),
                        headers={"authorization": "bearer second-key-abcdef"})
    assert second.status_code == 200                                         # every key of the file works
    from pixeltriage.serve import Client

    with Client(url, retries=0) as anonymous:
        with pytest.raises(AuthenticationError):
            anonymous.score("q", [])


def test_payload_limit_by_content_length_and_streamed(served):
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    big = b'{"question": "' + b"x" * (2 * 2 ** 20) + b'"}'
    response = httpx.post(served.url + "/v1/score", content=big, headers=headers)
    assert response.status_code == 413 and response.json()["error_type"] == "payload_too_large"

    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    response = httpx.post(served.url + "/v1/score", content=chunks(), headers=headers)   # chunked, no length
    assert response.status_code == 413
    from pixeltriage.serve import Client

    with Client(served.url, api_key=API_KEY, retries=0) as c:
        with pytest.raises(InvalidRequestError) as e:
            c.score("q", [Memory(image=image_bytes((2000, 2000), fmt="BMP"))])
        assert e.value.status == 413


def test_a_lying_content_length_is_not_trusted(served):
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + API_KEY.encode() + b"\r\ncontent-length: -5\r\n\r\n")
        reply = s.recv(4096)
    assert reply.split(b" ", 2)[1] in (b"400", b"413")


def test_a_decompression_bomb_is_refused_by_the_one_limit_and_pil_leaves_no_warning_in_the_log(served, http):
    """A 10000 x 10000 PNG (15 KB, 1-bit) on every route that takes an image: a 422 quoting media.policy's
    89,478,485 pixels (never PIL's 178,956,970), and no DecompressionBombWarning in the server's log."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (10000, 10000)).save(buffer, "PNG")
    bomb = b64(buffer.getvalue())
    answers = [http.post("/v1/score", json=body({"image": bomb})),
               http.post("/v2/rerank", json={"query": "q", "documents": [{"image": bomb, "text": "a"}]}),
               http.post("/v1/memories", json={"image": bomb, "note": "a"})]
    for answer in answers:
        assert answer.status_code == 422, answer.text
        assert "10000x10000 = 100,000,000 pixels exceeds the limit of 89,478,485 pixels" in answer.json()["error"]
        assert "178,956,970" not in answer.text
    log = (served.base / "server.log").read_text(errors="replace")
    assert "DecompressionBomb" not in log and "178,956,970" not in log
