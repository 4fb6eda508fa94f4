"""The rerank endpoints as their users meet them: TEI's POST /rerank over httpx, Cohere's own SDK (ClientV2 and the v1
Client, `base_url` pointed at a real server process) on /v2/rerank and /v1/rerank, Jina's and vLLM's multimodal
documents. Every score is `Scorer.score`'s gain on the same memories (1e-5, float32); documents without an image
score 0 after every image."""
import json

import httpx
import pytest
from serving import API_KEY, b64, episode

from pixeltriage import Memory

TOL = 1e-5


def memory_json(m: Memory) -> str:
    return json.dumps({"image": b64(m.image), "note": m.note, "dialogue": m.dialogue, "date": m.date})


def assert_ranked(results, gains, indexes, score="relevance_score"):
    """`results` are the documents at `indexes` (in request order, each with its library gain) by descending gain."""
    want = sorted(zip(indexes, gains), key=lambda p: (-p[1], p[0]))
    got = [(r["index"], r[score]) for r in results]
    assert [i for i, _ in got] == [i for i, _ in want], (got, want)
    assert all(abs(g - w) <= TOL for (_, g), (_, w) in zip(got, want)), (got, want)


@pytest.fixture(scope="module")
def stored(served, library):
    """Three images put into the server's write-time cache: (question, memories as the library scores them, keys)."""
    from pixeltriage.serve import Client

    question, memories = episode(41, 3)
    with Client(served.url, api_key=API_KEY, retries=0) as client:
        keys = [client.put_memory(m.image, note=m.note) for m in memories]
    # a key document carries the cached note and no dialogue or date
    by_key = [Memory(image=m.image, note=m.note) for m in memories]
    return question, by_key, keys, library.score(question, by_key)


def test_tei_rerank_scores_are_the_library_gains_sorted(http, library):
    question, memories = episode(40, 3)
    texts = [memory_json(memories[0]), "we once talked about a red mug", memory_json(memories[1]),
             memory_json(memories[2])]
    response = http.post("/rerank", json={"query": question, "texts": texts, "return_text": True})
    assert response.status_code == 200, response.text
    ranks = response.json()
    want = library.score(question, memories)
    assert_ranked(ranks[:3], want.gains, [0, 2, 3], score="score")
    assert ranks[3] == {**ranks[3], "index": 1, "score": 0.0, "text": texts[1]}     # no image: 0, after every image
    assert ranks[3]["pixeltriage"]["image"] is False and ranks[3]["pixeltriage"]["gain"] is None
    extra = {r["index"]: r["pixeltriage"] for r in ranks}
    assert all(abs(extra[j]["p_vis"] - want.p_vis) <= TOL for j in (0, 2, 3))
    assert all(abs(extra[j]["relevance"] - want.relevance[i]) <= TOL for i, j in enumerate((0, 2, 3)))
    assert sum(extra[j]["open"] for j in (0, 2, 3)) == 2                                # the default k = 2
    assert [r["index"] for r in ranks if r["pixeltriage"]["open"]] == [r["index"] for r in ranks[:2]]
    plain = http.post("/rerank", json={"query": question, "texts": texts[:1]}).json()
    assert "text" not in plain[0] and abs(plain[0]["score"] - library.score(question, memories[:1]).gains[0]) <= TOL


def test_rerank_also_takes_the_cohere_body_as_vllm_infinity_and_mem0s_tei_provider_post_it(http, stored, library):
    question, memories, keys, _ = stored
    want = library.score(question, [memories[2], memories[0], memories[1]])      # the state is in request order
    body = {"model": "pixeltriage", "query": question, "documents": [keys[2], "text", keys[0], keys[1]], "top_n": 3}
    response = http.post("/rerank", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert_ranked(results, want.gains, [0, 2, 3])
    both = http.post("/rerank", json={**body, "texts": ["t"]})
    assert both.status_code == 422 and "exactly one of 'texts'" in both.json()["error"]
    assert http.post("/rerank", json={"query": "q"}).status_code == 422


def test_cohere_sdk_v2_ranks_stored_keys_as_the_library_does(served, stored):
    cohere = pytest.importorskip("cohere")
    question, _, keys, want = stored
    client = cohere.ClientV2(api_key=API_KEY, base_url=served.url)
    response = client.rerank(model="pixeltriage", query=question, documents=keys)
    assert_ranked([r.dict() for r in response.results], want.gains, [0, 1, 2])
    top = client.rerank(model="pixeltriage", query=question, documents=keys, top_n=2)
    assert [r.index for r in top.results] == [r.index for r in response.results[:2]]
    assert response.meta.api_version.version == "2"


def test_cohere_sdk_v1_returns_documents(served, stored):
    cohere = pytest.importorskip("cohere")
    question, _, keys, want = stored
    client = cohere.Client(api_key=API_KEY, base_url=served.url)
    documents = [keys[0], "a text memory", keys[1], keys[2]]
    response = client.rerank(model="pixeltriage", query=question, documents=documents, return_documents=True,
                             top_n=4)
    results = [r.dict() for r in response.results]
    assert_ranked(results[:3], want.gains, [0, 2, 3])
    assert [r.document.text for r in response.results] == [documents[r.index] for r in response.results]
    assert (results[3]["index"], results[3]["relevance_score"]) == (1, 0.0)


def test_jina_and_vllm_documents_carry_images(http, served, library):
    question, memories = episode(42, 3)
    mug = (served.root / "photos" / "mug.png").read_bytes()
    documents = [
        {"image": b64(memories[0].image), "text": memories[0].note},                        # Jina
        {"text": "only words"},
        {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(memories[1].image)}},
                     {"type": "text", "text": memories[1].note}]},                          # vLLM
        {"path": "photos/mug.png", "note": "a mug", "dialogue": "coffee", "date": "2026-01-02"},
        {"image": "data:image/png;base64," + b64(memories[2].image), "note": memories[2].note,
         "dialogue": memories[2].dialogue, "date": memories[2].date},
    ]
    response = http.post("/v1/rerank", json={"model": "m", "query": question, "documents": documents,
                                             "return_documents": True})
    assert response.status_code == 200, response.text
    body = response.json()
    scored = [Memory(image=memories[0].image, note=memories[0].note),
              Memory(image=memories[1].image, note=memories[1].note),
              Memory(image=mug, note="a mug", dialogue="coffee", date="2026-01-02"), memories[2]]
    want = library.score(question, scored)
    assert_ranked(body["results"][:4], want.gains, [0, 2, 3, 4])
    assert body["results"][4]["index"] == 1 and body["results"][4]["document"] == {"text": "only words"}
    assert body["model"] == "m" and body["usage"]["total_tokens"] == body["pixeltriage"]["state_tokens"] > 0
    assert abs(body["pixeltriage"]["p_vis"] - want.p_vis) <= TOL and len(body["id"]) == 32
    assert body["pixeltriage"]["opened"] == sorted(r["index"] for r in body["results"][:2])
    one = http.post("/v2/rerank", json={"query": question, "documents": documents, "policy": {"k": 1}}).json()
    assert one["pixeltriage"]["opened"] == [body["results"][0]["index"]] and "document" not in one["results"][0]


def test_long_texts_are_cut_as_the_library_cuts_them_and_refused_with_truncate_false(http, library):
    question, memories = episode(43, 2)
    long = Memory(image=memories[0].image, note=" ".join(["mug"] * 3000), dialogue=memories[0].dialogue)
    texts = [memory_json(long), memory_json(memories[1])]
    ranks = http.post("/rerank", json={"query": question, "texts": texts}).json()
    assert_ranked(ranks, library.score(question, [long, memories[1]]).gains, [0, 1], score="score")
    assert {r["index"]: r["pixeltriage"]["truncated"] for r in ranks} == {0: True, 1: False}
    refused = http.post("/rerank", json={"query": question, "texts": texts, "truncate": False})
    assert refused.status_code == 422 and refused.json()["field"] == "texts[0]"
    assert "256 tokens" in refused.json()["error"] and refused.json()["error_type"] == "invalid_input"
    long_query = http.post("/rerank", json={"query": "why " * 2000, "texts": texts[1:], "truncate": False})
    assert long_query.status_code == 422 and long_query.json()["field"] == "query"
    assert "512 tokens" in long_query.json()["error"]


def test_max_tokens_per_doc_cuts_each_document_first(http, library):
    question, memories = episode(44, 2)
    note = "a long note about the red mug on the desk " * 20
    document = {"image": b64(memories[0].image), "note": note}
    body = http.post("/v2/rerank", json={"query": question, "documents": [document], "max_tokens_per_doc": 8}).json()
    kept = library.packer.encoder.truncate(note, 8)
    assert kept != note and body["results"][0]["pixeltriage"]["truncated"]
    want = library.score(question, [Memory(image=memories[0].image, note=kept)])
    assert abs(body["results"][0]["relevance_score"] - want.gains[0]) <= TOL


def test_errors_come_in_each_api_shape_naming_the_field_and_the_limit(http, served):
    url = http.post("/v2/rerank", json={"query": "q", "documents": [{"image": "https://example.com/a.png"}]})
    assert url.status_code == 422
    error = url.json()
    assert error["field"] == "documents[0].image" and "not fetched" in error["message"]
    assert error["message"] == error["error"] and error["error_type"] == "invalid_input"
    unknown = http.post("/v1/rerank", json={"query": "q", "documents": ["plain", "0" * 64], "strict": True})
    assert unknown.status_code == 422 and unknown.json()["field"] == "documents[0]"
    assert "documents[1] (unknown_key)" in unknown.json()["message"]
    bad = http.post("/v1/rerank", json={"query": "q", "documents": [{"content": [{"type": "image_url",
                                                                                  "image_url": {"url": "!!"}}]}]})
    assert bad.status_code == 422 and bad.json()["field"] == "documents[0].content[0].image_url.url"
    many = http.post("/rerank", json={"query": "q", "texts": ["t"] * 65})
    assert many.status_code == 422 and many.json()["field"] == "texts" and "--max-memories" in many.json()["error"]
    two = http.post("/v1/rerank", json={"query": "q", "documents": [{"key": "0" * 64, "image": "AAAA"}]})
    assert two.status_code == 422 and "one image" in two.json()["message"]
    wrong = http.post("/v1/rerank", json={"query": "q", "documents": [7]})
    assert wrong.status_code == 422 and wrong.json()["field"] == "documents[0]"
    tei = http.post("/rerank", json={"query": "q", "texts": ["t"], "raw_scores": True})
    assert tei.status_code == 422 and set(tei.json()) >= {"error", "error_type"} and "message" not in tei.json()
    broken = http.post("/rerank", json={"query": "q", "texts": ['{"image": 3}']})
    assert broken.status_code == 422 and broken.json()["field"] == "texts[0]"


def test_the_api_key_is_a_bearer_token_on_every_rerank_route(served):
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": "q", "texts": ["t"]} if path == "/rerank" else {"query": "q", "documents": ["t"]}
        assert httpx.post(served.url + path, json=body, timeout=60).status_code == 401
        ok = httpx.post(served.url + path, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert ok.status_code == 200, ok.text
    cohere = pytest.importorskip("cohere")
    with pytest.raises(cohere.core.ApiError) as refused:
        cohere.ClientV2(api_key="wrong", base_url=served.url).rerank(model="m", query="q", documents=["t"])
    assert refused.value.status_code == 401 and "API key" in refused.value.body["message"]


def test_a_document_image_is_decoded_by_the_library(http):
    response = http.post("/v2/rerank", json={"query": "q", "documents": ["plain", {"image": b64(b"not an image" * 8)}]})
    assert response.status_code == 422 and response.json()["error_type"] == "invalid_memory"
    assert response.json()["field"] == "documents[1].image" and "memory" not in response.json()["message"]
    assert response.json()["message"].startswith("documents[1].image: image bytes")


def test_the_guard_refuses_rerank_bodies_as_any_other(served):
    headers = {"authorization": f"Bearer {API_KEY}"}
    form = httpx.post(served.url + "/v2/rerank", content=b"query=q", timeout=60,
                      headers={**headers, "content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and form.json()["message"] == form.json()["error"]
    big = httpx.post(served.url + "/rerank", content=b'{"query": "' + b"x" * (3 * 2 ** 20) + b'"}', timeout=60,
                     headers={**headers, "content-type": "application/json"})       # past the 2 MiB --payload-limit
    assert big.status_code == 413 and big.json()["error_type"] == "payload_too_large" and "message" not in big.json()


def test_pixeltriage_score_relevance_answers_the_library_relevance(http, stored, library):
    question, _, keys, want = stored
    documents = [keys[0], "no image", keys[1], keys[2]]
    body = http.post("/v2/rerank", json={"query": question, "documents": documents,
                                         "pixeltriage_score": "relevance"}).json()
    assert_ranked(body["results"][:3], want.relevance, [0, 2, 3])
    assert (body["results"][3]["index"], body["results"][3]["relevance_score"]) == (1, 0.0)
    assert all(r["relevance_score"] == r["pixeltriage"]["relevance"] for r in body["results"][:3])
    tei = http.post("/rerank", json={"query": question, "texts": keys, "pixeltriage_score": "relevance"}).json()
    assert_ranked(tei, want.relevance, [0, 1, 2], score="score")
    gain = http.post("/v1/rerank", json={"query": question, "documents": keys, "pixeltriage_score": "gain"}).json()
    assert_ranked(gain["results"], want.gains, [0, 1, 2])
    bad = http.post("/v1/rerank", json={"query": question, "documents": keys, "pixeltriage_score": "p_vis"})
    assert bad.status_code == 422 and bad.json()["field"] == "pixeltriage_score"


def test_rerank_score_and_strict_flags_set_the_defaults_and_a_request_overrides_them(tiny_checkpoint, tmp_path,
                                                                                       library):
    from serving import ServerProcess

    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--rerank-score", "relevance",
                           "--rerank-strict").wait_ready()
    try:
        question, memories = episode(45, 3)
        texts = [memory_json(m) for m in memories]
        want = library.score(question, memories)
        with httpx.Client(base_url=server.url, timeout=60) as http_:
            ranks = http_.post("/rerank", json={"query": question, "texts": texts}).json()
            assert_ranked(ranks, want.relevance, [0, 1, 2], score="score")
            cohere = http_.post("/v2/rerank", json={"query": question, "documents": texts}).json()
            assert_ranked(cohere["results"], want.relevance, [0, 1, 2])
            gain = http_.post("/v2/rerank", json={"query": question, "documents": texts,
                                                  "pixeltriage_score": "gain"}).json()
            assert_ranked(gain["results"], want.gains, [0, 1, 2])
            strict = http_.post("/v2/rerank", json={"query": question, "documents": [*texts, "no image"]})
            assert strict.status_code == 422 and strict.json()["field"] == "documents[3]"
            assert "not_a_key_or_memory" in strict.json()["message"]
            tei = http_.post("/rerank", json={"query": question, "texts": ["0" * 64]})
            assert tei.status_code == 422 and tei.json()["field"] == "texts[0]" and "no_cache" in tei.json()["error"]
            lenient = http_.post("/v2/rerank", json={"query": question, "documents": [*texts, "no image"],
                                                     "strict": False})
            assert lenient.status_code == 200 and lenient.json()["pixeltriage"]["statuses"]["not_a_key_or_memory"] == 1
            assert http_.get("/info").json()["limits"] | {"rerank_score": "relevance", "rerank_strict": True} == \
                http_.get("/info").json()["limits"]
    finally:
        assert server.stop() == 0


def test_client_rerank_and_async_client_rerank_answer_as_the_route(served, stored, library):
    import asyncio
    from dataclasses import asdict

    from pixeltriage.errors import InvalidRequestError
    from pixeltriage.serve import AsyncClient, Client
    from pixeltriage.serve.client import RankedDocument, Reranking

    question, memories, keys, want = stored
    documents = [keys[0], Memory(image=memories[1].image, note=memories[1].note), "no image", keys[2]]
    with Client(served.url, api_key=API_KEY, retries=0) as client:
        ranked = client.rerank(question, documents, k=1)
        assert type(ranked) is Reranking and all(type(r) is RankedDocument for r in ranked.results)
        assert_ranked([asdict(r) for r in ranked.results[:3]], want.gains, [0, 1, 3])
        image_rank = {r.index: r for r in ranked.results if r.image}
        assert all(abs(image_rank[j].gain - want.gains[i]) <= TOL and abs(image_rank[j].relevance - want.relevance[i])
                   <= TOL for i, j in enumerate((0, 1, 3)))
        text = ranked.results[3]
        assert (text.index, text.relevance_score, text.image, text.gain, text.relevance) == (2, 0.0, False, None, None)
        assert ranked.opened == [ranked.results[0].index] and [r.open for r in ranked.results] == [True] + [False] * 3
        assert abs(ranked.p_vis - want.p_vis) <= TOL and abs(ranked.relevance_none - want.relevance_none) <= TOL
        assert ranked.state_tokens == ranked.raw["usage"]["total_tokens"] > 0 and not ranked.query_truncated
        assert ranked.id == ranked.raw["id"] and len(ranked.id) == 32 and ranked.model is None
        assert [r["index"] for r in ranked.raw["results"]] == [r.index for r in ranked.results]
        assert all(r.document is None and not r.truncated for r in ranked.results)
        relevance = client.rerank(question, documents, top_n=2, score="relevance", return_documents=True)
        top = sorted(zip([0, 1, 3], want.relevance), key=lambda p: (-p[1], p[0]))[:2]
        assert [r.index for r in relevance.results] == [i for i, _ in top]
        assert all(abs(r.relevance_score - w) <= TOL for r, (_, w) in zip(relevance.results, top))
        texts = {0: keys[0], 1: memories[1].note, 3: keys[2]}
        assert [r.document for r in relevance.results] == [texts[i] for i, _ in top]
        assert text.status == "not_a_key_or_memory" and ranked.results[0].status == "scored"
        assert ranked.statuses == {**dict.fromkeys(ranked.statuses, 0), "scored": 3, "not_a_key_or_memory": 1}
        unknown = client.rerank(question, [keys[0], "0" * 64])
        assert [r.status for r in unknown.results] == ["scored", "unknown_key"] and "0" * 64 in unknown.results[1].detail
        with pytest.raises(InvalidRequestError) as strict:           # a 422 naming the document
            client.rerank(question, [keys[0], "0" * 64], strict=True)
        assert strict.value.field == "documents[1]" and "unknown_key" in str(strict.value)

    async def remote():
        async with AsyncClient(served.url, api_key=API_KEY, retries=0) as client:
            return await client.rerank(question, documents, score="gain")

    answer = asyncio.run(remote())
    assert type(answer) is Reranking and [r.open for r in answer.results] == [True, True, False, False]
    assert_ranked([asdict(r) for r in answer.results[:3]], want.gains, [0, 1, 3])
