"""Scoring over real HTTP on loopback: every response equals the library's `Scorer.score` on the same input (1e-5,
float32) whatever shared its forward; client batches split across forwards; policies; the write-time cache."""
import threading

import pytest
from serving import assert_scores_close, b64, episode, image_bytes, metric
from PIL import Image

from pixeltriage import Cache, InvalidMemoryError, Memory, RateGate
from pixeltriage.delivery.decision import decide
from pixeltriage.delivery.report import image_size
from pixeltriage.store.cache import CacheMissError


def test_score_equals_the_library(client, library):
    for seed, n in ((0, 0), (1, 1), (2, 3), (3, 6)):
        question, memories = episode(seed, n)
        assert_scores_close(client.score(question, memories), library.score(question, memories))


def test_local_images_pil_and_paths_are_sent_as_the_library_reads_them(client, library, tmp_path):
    rgba = Image.new("RGBA", (80, 60), (10, 200, 30, 120))
    cmyk = Image.new("CMYK", (50, 70), (0, 120, 200, 10))
    path = tmp_path / "photo.jpg"
    path.write_bytes(image_bytes((100, 80), (30, 30, 200), "JPEG"))
    memories = [Memory(image=rgba, note="rgba"), Memory(image=cmyk), Memory(image=str(path), dialogue="a photo")]
    assert_scores_close(client.score("which one?", memories), library.score("which one?", memories))


def test_32_concurrent_clients_each_get_their_own_answer(served, library):
    from pixeltriage.serve import Client

    episodes = [episode(100 + i, 1 + i % 4) for i in range(32)]
    expected = [library.score(q, m) for q, m in episodes]
    results, errors = [None] * 32, []

    def one(i):
        try:
            with Client(served.url, api_key=served.key, retries=0) as c:
                results[i] = c.decide(*episodes[i], id=f"request-{i}")
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and all(r is not None for r in results), errors
    for i, result in enumerate(results):
        assert result.id == f"request-{i}"
        assert_scores_close(result.scores, expected[i])
    assert max(r.timing["batch_questions"] for r in results) > 1          # batches were shared, and still exact


def test_a_client_batch_larger_than_one_forward_is_split_not_refused(client, http, library):
    episodes = [episode(200 + i, 8, size=(300, 300)) for i in range(6)]     # ~7,000 state tokens: two forwards
    budget = client.info()["limits"]["max_batch_tokens"]
    body = {"questions": [{"question": q, "memories": [{"image": b64(m.image), "note": m.note, "dialogue": m.dialogue,
                                                        "date": m.date} for m in ms], "id": str(i)}
                          for i, (q, ms) in enumerate(episodes)]}
    response = http.post("/v1/score/batch", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["id"] for r in results] == [str(i) for i in range(6)]
    assert sum(r["state_tokens"] for r in results) > budget               # more than one forward's worth
    assert all(r["timing"]["batch_tokens"] <= budget for r in results)
    for result, (q, ms) in zip(results, episodes):
        from pixeltriage.serve.client import scores_of

        assert_scores_close(scores_of(result), library.score(q, ms))
    assert_scores_close(client.score_batch(episodes[:3])[2], library.score(*episodes[2]))


def test_policies_match_the_library_delivery(client, library):
    question, memories = episode(7, 5, size=(200, 150))
    want = library.score(question, memories)
    sizes = [image_size(m, i) for i, m in enumerate(memories)]
    decided = client.decide(question, memories, k=2).decision
    assert decided.open == decide(want, 2, None, sizes).open and sum(decided.open) == 2
    assert decided.visual_tokens == decide(want, 2, None, sizes).visual_tokens
    budget = client.decide(question, memories, token_budget=100, answering_model="qwen3.5").decision
    assert budget.open == decide(want, None, None, sizes, "qwen3.5", 100).open
    assert budget.visual_tokens.delivery <= 100 < budget.visual_tokens.open_all
    gate = RateGate(0.5)
    for seed in range(6):                                # a stream of its own: one gate per (stream, rate)
        q, ms = episode(300 + seed, 2)
        got = client.decide(q, ms, k=1, gate_rate=0.5, gate_stream="test-policies").decision
        assert got.gate_open == gate.opens(library.score(q, ms).p_vis)
        assert got.gate_open or got.open == [False, False]
    every = client.decide(question, memories).decision                  # a policy without k or budget: all open
    assert every.open == [True] * 5 and every.visual_tokens.delivery == every.visual_tokens.open_all
    from pixeltriage.serve.client import decision_of, encode_memories

    plain = decision_of(client._score({"question": question, "memories": encode_memories(memories)}, None))
    assert plain.decision is None and len(plain.scores.gains) == 5


def test_memories_put_get_and_score_by_key(client, library, served):
    data = image_bytes((150, 100), (9, 99, 199), "JPEG")
    key = client.put_memory(data, note="a blue thing")
    assert client.put_memory(data) == key                                  # idempotent; the note stays
    info = client.memory(key)
    assert (info["note"], info["width"], info["height"], info["thumbnail_width"]) == ("a blue thing", 150, 100, 150)
    with Cache(served.base / "cache.db") as cache:
        assert key in cache
    by_key = client.score("what is blue?", [Memory(key=key, dialogue="look")])
    assert_scores_close(by_key, library.score("what is blue?", [Memory(image=data, note="a blue thing",
                                                                         dialogue="look")]))
    assert client.memory(key)["features_cached"]
    with pytest.raises(CacheMissError):
        client.memory("0" * 64)


def test_path_memories_under_the_image_root(client, library, served):
    memories = [Memory(image=str(served.root / "photos" / "mug.png"), note="mug"),
                Memory(image=str(served.root / "photos" / "bike.jpg"))]
    want = library.score("which?", memories)
    body = {"question": "which?", "memories": [{"path": "photos/mug.png", "note": "mug"},
                                               {"path": "photos/./bike.jpg"}]}
    got = client._score(body, None)
    from pixeltriage.serve.client import scores_of

    assert_scores_close(scores_of(got), want)
    inside = client._score({"question": "which?", "memories": [{"path": "photos/inside.png", "note": "mug"},
                                                               {"path": "photos/bike.jpg"}]}, None)
    assert_scores_close(scores_of(inside), want)                          # a symlink that stays inside is fine


def test_metrics_count_what_happened(http):
    page = http.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    text = page.text
    for name in ("pixeltriage_queue_size", "pixeltriage_batch_questions_bucket", "pixeltriage_batch_tokens_sum",
                 "pixeltriage_queue_duration_seconds_count", "pixeltriage_preprocess_duration_seconds_count",
                 "pixeltriage_forward_duration_seconds_count", "pixeltriage_request_duration_seconds_count",
                 "pixeltriage_request_failures_total", "pixeltriage_vision_images_total", "pixeltriage_ready"):
        assert name in text, name
    assert metric(text, "pixeltriage_ready") == 1.0
    assert metric(text, "pixeltriage_questions_total") == metric(text, "pixeltriage_batch_questions_sum")
    build = next(line for line in text.splitlines() if line.startswith("pixeltriage_build_info{"))
    assert 'device="cpu"' in build and 'dtype="float32"' in build, build


def test_info_and_openapi(http, served):
    info = http.get("/info").json()
    assert info["status"] == "ready" and info["device"] == "cpu" and info["dtype"] == "float32"
    assert len(info["vision_fingerprint"]) == 64 and info["cache"] is True
    assert info["limits"]["payload_limit_bytes"] == 2 * 2 ** 20 and info["limits"]["auth"] is True
    assert {"gated_delta", "attention", "head"} <= set(info["kernels"])
    assert info["model"]["layers"] == 4
    schema = http.get("/openapi.json").json()
    assert {"/v1/score", "/v1/score/batch", "/v1/memories", "/v1/memories/{key}", "/health", "/ready"} <= set(
        schema["paths"])
    docs = http.get("/docs")                      # off: Swagger's page loads its scripts from a CDN
    assert docs.status_code == 404 and "/openapi.json" in docs.json()["error"]


def test_async_client(served, library):
    import asyncio

    from pixeltriage.serve import AsyncClient

    episodes = [episode(600 + i, 1 + i % 3) for i in range(6)]

    async def run():
        async with AsyncClient(served.url, api_key=served.key, retries=0) as c:
            singles = await asyncio.gather(*(c.score(q, m) for q, m in episodes))
            batch = await c.score_batch(episodes)
            decided = await c.decide(*episodes[0], k=1)
            with pytest.raises(InvalidMemoryError):
                await c.score("q", [Memory(image=b"not an image")])
            return singles, batch, decided, await c.ready(), await c.health()

    singles, batch, decided, ready, health = asyncio.run(run())
    for got, again, (q, m) in zip(singles, batch, episodes):
        want = library.score(q, m)
        assert_scores_close(got, want)
        assert_scores_close(again, want)
    assert sum(decided.decision.open) == 1 and ready and health == {"status": "ok"}


def test_score_batch_splits_a_long_list_into_requests_the_server_takes(client, library):
    episodes = [(f"question {i}", []) for i in range(35)]              # more than --max-client-batch (32)
    results = client.score_batch(episodes)
    assert len(results) == 35
    assert_scores_close(results[34], library.score("question 34", []))


def test_timing_headers(http):
    response = http.post("/v1/score", json={"question": "q", "memories": [{"image": b64(image_bytes())}]})
    assert response.status_code == 200
    timing = response.json()["timing"]
    for header, key in (("x-queue-time", "queue_ms"), ("x-inference-time", "forward_ms"),
                        ("x-preprocess-time", "preprocess_ms")):
        assert abs(float(response.headers[header]) - timing[key]) < 1e-2
    assert float(response.headers["x-total-time"]) >= float(response.headers["x-inference-time"])
