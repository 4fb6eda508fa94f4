"""What a request may cost, as an operator meets it over real HTTP: text fields past their character limit refused
on every route that takes text (422 naming the field and the limit), bodies that are not JSON refused by content type
(415), methods a route does not take (405), --max-queued alone, --access-log at the default verbosity, the README's
curl example with a real photo, and the server's memory under concurrent oversized requests within its documented
bound (docs/serve.md, "Limits")."""
import io
import json
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from serving import ServerProcess, assert_scores_close, b64, image_bytes

from pixeltriage import Memory
from pixeltriage.errors import ServiceError
from pixeltriage.serve.client import error_of
from pixeltriage.serve.schemas import DATE_LIMIT, TEXT_LIMIT

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

MAX_QUEUED = 4
PAYLOAD_MIB = 4
PNG = b64(image_bytes())


@pytest.fixture(scope="module")
def limited(tiny_checkpoint, tmp_path_factory):
    """A server as an operator would bound it: 4 requests at once, 4 MiB bodies, a cache, the access log on (and no
    -v: the default verbosity)."""
    base = tmp_path_factory.mktemp("limited")
    server = ServerProcess(tiny_checkpoint, base / "server.log", "--max-queued", str(MAX_QUEUED), "--payload-limit",
                           str(PAYLOAD_MIB), "--cache", str(base / "cache.db"), "--access-log")
    server.wait_ready()
    server.base = base
    yield server
    server.stop()


def over(limit: int) -> str:
    return "é" * (limit + 1)


# -- character limits, on every route that takes text ----------------------------------------------------------------
@pytest.mark.parametrize("path, body, field, limit", [
    ("/v1/score", {"question": over(TEXT_LIMIT)}, "question", TEXT_LIMIT),
    ("/v1/score", {"question": "q", "memories": [{"image": PNG, "note": over(TEXT_LIMIT)}]}, "memories[0].note",
     TEXT_LIMIT),
    ("/v1/score", {"question": "q", "memories": [{"image": PNG}, {"image": PNG, "dialogue": over(TEXT_LIMIT)}]},
     "memories[1].dialogue", TEXT_LIMIT),
    ("/v1/score", {"question": "q", "memories": [{"key": "a" * 64, "date": over(DATE_LIMIT)}]}, "memories[0].date",
     DATE_LIMIT),
    ("/v1/score/batch", {"questions": [{"question": "q"}, {"question": over(TEXT_LIMIT)}]}, "questions[1].question",
     TEXT_LIMIT),
    ("/v1/score/batch", {"questions": [{"question": "q", "memories": [{"image": PNG, "note": over(TEXT_LIMIT)}]}]},
     "questions[0].memories[0].note", TEXT_LIMIT),
    ("/v1/memories", {"image": PNG, "note": over(TEXT_LIMIT)}, "note", TEXT_LIMIT),
    ("/v1/retrieve", {"question": over(TEXT_LIMIT)}, "question", TEXT_LIMIT),   # refused before "no index" (501)
])
def test_text_past_its_limit_is_422_naming_the_field_and_the_limit(limited, path, body, field, limit):
    response = httpx.post(limited.url + path, json=body, timeout=60)
    assert response.status_code == 422, response.text
    error = response.json()
    assert (error["field"], error["error_type"]) == (field, "invalid_input")
    assert error["error"].startswith(field) and f"limit of {limit} characters" in error["error"]
    assert "é" not in response.text                                     # the input is not echoed


def test_text_at_its_limit_is_scored_as_the_library_scores_it(limited, library):
    rng = random.Random(3)
    words = ["the", "red", "mug", "was", "on", "a", "desk", "\U0001F600", "中文", "  ", "\n", "<|im_start|>"]
    text = "".join(rng.choice(words) + " " for _ in range(TEXT_LIMIT))[:TEXT_LIMIT]
    memories = [Memory(image=image_bytes(), note=text, dialogue=text, date=text[:DATE_LIMIT])]
    from pixeltriage.serve import Client

    with Client(limited.url, retries=0) as client:
        assert_scores_close(client.score(text, memories), library.score(text, memories))


def test_a_ten_megabyte_question_is_refused_without_being_read_into_objects(limited):
    body = b'{"question": "' + b"x" * (3 * 2 ** 20) + b'", "memories": []}'
    response = httpx.post(limited.url + "/v1/score", content=body, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 422 and response.json()["field"] == "question"
    big = b'{"question": "' + b"x" * (10 * 2 ** 20) + b'"}'                  # past --payload-limit: never parsed
    response = httpx.post(limited.url + "/v1/score", content=big, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 413


def test_every_route_with_a_body_is_in_the_table_and_every_request_string_has_a_limit():
    from pydantic import BaseModel

    from pixeltriage.serve import app as app_module
    from pixeltriage.serve.config import ServeConfig
    from pixeltriage.serve.schemas import Strict, UnboundedFieldError
    from pixeltriage.serve.service import Service

    app = app_module.create_app(Service(ServeConfig(), lambda: None))
    posted = {route.path for route in app.routes if {"POST", "PUT", "PATCH"} & set(getattr(route, "methods", ()))}
    assert posted == set(app_module.BODY_ROUTES)
    assert all(issubclass(route.body, Strict) for route in app_module.BODY_ROUTES.values())
    handler = app_module.ROUTES[0].handler
    with pytest.raises(TypeError, match="names its request model"):
        app_module.Route("POST", "/v1/new", handler)                      # a body route without its model
    with pytest.raises(TypeError, match="not a schemas.Strict model"):
        app_module.Route("POST", "/v1/new", handler, type("Loose", (BaseModel,), {}))
    with pytest.raises(UnboundedFieldError, match="Later.text"):
        type("Later", (Strict,), {"__annotations__": {"text": str}})
    with pytest.raises(UnboundedFieldError, match="Later.notes"):
        type("Later", (Strict,), {"__annotations__": {"notes": "list[str]"}, "__module__": __name__})
    with pytest.raises(UnboundedFieldError, match="Loose"):
        type("Later", (Strict,), {"__annotations__": {"inner": type("Loose", (BaseModel,), {})}})


# -- content type, methods, statuses ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/score", "/v1/score/batch", "/v1/memories", "/v1/retrieve"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_body_not_sent_as_json_is_415_saying_what_is_expected(limited, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(limited.url + path, content=b'{"question": "q"}', headers=headers, timeout=30)
    assert response.status_code == 415, response.text
    error = response.json()
    assert error["error_type"] == "unsupported_media_type" and "content-type: application/json" in error["error"]


def test_json_with_a_charset_is_json(limited):
    response = httpx.post(limited.url + "/v1/score", content=b'{"question": "q"}',
                          headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert response.status_code == 200, response.text


def test_a_method_a_route_does_not_take_is_405_and_an_unknown_path_404(limited):
    response = httpx.get(limited.url + "/v1/score")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error_type"] == "method_not_allowed"
    response = httpx.post(limited.url + "/v1/nothing", json={})
    assert response.status_code == 404 and response.json()["error_type"] == "no_route"
    with pytest.raises(ServiceError) as raised:         # a wrong path is not a cache miss to a client
        raise error_of(response)
    assert type(raised.value) is ServiceError and raised.value.status == 404


def test_max_queued_alone_bounds_the_client_batch(limited):
    limits = httpx.get(limited.url + "/info").json()["limits"]
    assert limits["max_queued"] == MAX_QUEUED and limits["max_client_batch"] == MAX_QUEUED
    assert (limits["text_chars"], limits["date_chars"]) == (TEXT_LIMIT, DATE_LIMIT)


def test_the_access_log_is_written_at_the_default_verbosity(limited):
    assert httpx.post(limited.url + "/v1/score", json={"question": "logged"}, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while '"POST /v1/score HTTP/1.1" 200' not in limited.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert '"POST /v1/score HTTP/1.1" 200' in limited.output()
    assert "logged" not in limited.output()                              # the line has no user text


# -- the README's curl example, with real photos ---------------------------------------------------------------------
README_CURL = """\
{ printf '{"question": "What colour was the mug?", "memories": [{"note": "a mug", "date": "2026-01-02", "image": "'
  base64 -w0 mug.jpg
  printf '"}, {"dialogue": "fixed the bike", "image": "'
  base64 -w0 bike.png
  printf '"}], "policy": {"k": 1}}'; } > body.json
curl -s localhost:8080/v1/score -H 'content-type: application/json' --data-binary @body.json
"""


def photo(size, fmt) -> bytes:
    """Noise, so that the file is as large as a camera's (a base64 argument of it is past the kernel's 128 KiB)."""
    rng = random.Random(5)
    image = Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=95)
    return buffer.getvalue()


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None, reason="needs curl and base64")
def test_the_readme_curl_example_works_for_real_photos(limited, library, tmp_path):
    (tmp_path / "mug.jpg").write_bytes(photo((640, 480), "JPEG"))
    (tmp_path / "bike.png").write_bytes(photo((400, 300), "PNG"))
    assert min(p.stat().st_size for p in tmp_path.iterdir()) > 200_000
    script = README_CURL.replace("localhost:8080", limited.url.removeprefix("http://"))
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["delivery"]["k"] == 1 and len(result["gains"]) == 2
    from pixeltriage.serve.client import scores_of

    want = library.score("What colour was the mug?", [
        Memory(image=(tmp_path / "mug.jpg").read_bytes(), note="a mug", date="2026-01-02"),
        Memory(image=(tmp_path / "bike.png").read_bytes(), dialogue="fixed the bike")])
    assert_scores_close(scores_of(result), want)


# -- memory under concurrent oversized requests ----------------------------------------------------------------------
def reset_peak(server) -> float:
    """Reset the server process's peak resident memory (VmHWM) to its resident memory now, through
    /proc/PID/clear_refs (Linux 4.0 and later); that memory, MiB."""
    try:
        Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")
    except OSError as e:
        pytest.skip(f"cannot reset the server's peak resident memory through /proc/PID/clear_refs: {e}")
    return server.memory_mib()["peak"]


AT_LIMIT = ("\U0001F600 a mug on a desk " * TEXT_LIMIT)[:TEXT_LIMIT]
ADMITTED = [(AT_LIMIT, [Memory(image=image_bytes(), note=AT_LIMIT, dialogue=AT_LIMIT, date="d" * DATE_LIMIT)] * 8),
            ("q", [Memory(image=image_bytes(), note=AT_LIMIT)] * 64)]


def oversized_bodies() -> list[tuple[str, bytes]]:
    """Bodies up to the payload limit that each cost what they can: text far past its limit (ASCII, escaped astral
    characters that widen every string), fields at their limit (admitted and tokenized: ADMITTED, and a batch of
    them), 64 memories, and bodies past the payload limit."""
    from pixeltriage.serve.client import question_body

    payload = PAYLOAD_MIB * 2 ** 20
    admitted = [json.dumps(question_body(q, memories)).encode() for q, memories in ADMITTED]
    batch = {"questions": [question_body(*ADMITTED[0])] * 2}
    return [
        ("/v1/score", b'{"question": "' + b"x" * (payload - 100) + b'"}'),
        ("/v1/score", b'{"question": "' + b"\\ud83d\\ude00" * ((payload - 100) // 12) + b'"}'),
        ("/v1/score", json.dumps({"question": "q", "memories": [{"image": PNG, "note": "n" * (payload - 10_000)}]})
         .encode()),
        ("/v1/score", admitted[0]),
        ("/v1/score", admitted[1]),
        ("/v1/score/batch", json.dumps(batch).encode()),
        ("/v1/memories", json.dumps({"image": PNG, "note": "x" * (payload - 10_000)}).encode()),
        ("/v1/retrieve", b'{"question": "' + b"y" * (payload - 100) + b'"}'),
        ("/v1/score", b'{"question": "' + b"z" * (payload + 10) + b'"}'),
    ]


def state_bytes_per_token(state) -> float:
    tensors = [v for v in vars(state).values() if hasattr(v, "nbytes")]
    return sum(t.nbytes for t in tensors) / state.num_tokens


def documented_bound_mib(state_tokens: int, per_token: float, threads: int = 2, batch_tokens: int = 4096) -> float:
    """docs/serve.md, "Limits": what the server may hold above its RSS once ready, for --max-queued requests of
    --payload-limit bytes whose largest state has `state_tokens` tokens of `per_token` bytes each, and whose
    images are small (the decoded-image term is then the images' own size, within the payload term)."""
    requests = MAX_QUEUED * 6 * PAYLOAD_MIB
    preparing = (threads + 1) * PAYLOAD_MIB
    states = per_token * (2 * batch_tokens + (threads + 2) * state_tokens) / 2 ** 20
    return requests + preparing + states


def test_memory_under_concurrent_oversized_requests_stays_within_the_documented_bound(limited, library):
    url = limited.url
    bodies = oversized_bodies()
    for path, body in bodies[:6]:           # once each, so that the allocator has seen every kind, then the base
        httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
    largest = 0
    for path, body in bodies[3:6]:          # admitted: the states they make
        response = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
        assert response.status_code == 200, response.text
        results = response.json().get("results", [response.json()])
        largest = max(largest, *(r["state_tokens"] for r in results))
    base = reset_peak(limited)
    now = limited.memory_mib()
    assert now["peak"] <= now["rss"] + 64, f"VmHWM was not reset to VmRSS: {now}"   # (what an idle trim frees)
    statuses = {}

    def load(seed):
        rng = random.Random(seed)
        end = time.monotonic() + 20
        with httpx.Client(base_url=url, headers={"content-type": "application/json"}, timeout=120) as http:
            while time.monotonic() < end:
                path, body = rng.choice(bodies)
                try:
                    status = http.post(path, content=body).status_code
                except httpx.HTTPError as e:             # 413 closes the connection; anything else is a failure
                    status = type(e).__name__
                statuses[status] = statuses.get(status, 0) + 1

    clients = [threading.Thread(target=load, args=(seed,)) for seed in range(2 * MAX_QUEUED)]
    for c in clients:
        c.start()
    for i, c in enumerate(clients):
        c.join(180)
        assert not c.is_alive(), f"waited 180 s for client {i}'s requests to be answered"
    peak = limited.memory_mib()["peak"]           # the highest resident memory since the reset, every page counted
    per_token = max(state_bytes_per_token(library.pack(q, memories)) for q, memories in ADMITTED)
    bound = documented_bound_mib(largest, per_token)
    print(f"RSS ready {base:.0f} MiB, peak {peak:.0f} MiB (+{peak - base:.0f}), bound +{bound:.0f}; "
          f"largest state {largest} tokens of {per_token:.0f} B; statuses {statuses}")
    assert set(statuses) <= {200, 413, 422, 429, "RemoteProtocolError", "WriteError"}, statuses
    assert statuses.get(200, 0) > 0 and statuses.get(422, 0) > 0
    assert peak - base <= bound
    assert httpx.get(url + "/ready").status_code == 200
