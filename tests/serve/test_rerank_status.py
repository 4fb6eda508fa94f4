"""What became of each rerank document, as a client reads it: every result's `pixeltriage.status` (scored, or why
not) and `detail`, the summary's count of each status and the `x-pixeltriage-documents` header, on every rerank
route; `strict: true` turns a document not scored into a 422 naming it. A string document is read the way the
frameworks send one: a key alone or inside its text (LlamaIndex's metadata lines above it), a raw base64 image, a
data URI; a near miss of a key is said to be one. Scores are `Scorer.score`'s on the documents scored (1e-5)."""
import pytest
from serving import b64, image_bytes

from pixeltriage import Memory
from pixeltriage.serve.schemas import DOCUMENT_STATUSES

TOL = 1e-5
QUERY = "which picture shows the red mug?"
LLAMAINDEX_METADATA = ("file_name: mug.png\nfile_path: /photos/2026/mug.png\nfile_type: image/png\nfile_size: 5120\n"
                       "creation_date: 2026-01-02\nlast_modified_date: 2026-01-03\npage_label: 3\n\n")


@pytest.fixture(scope="module")
def kept(served):
    """Two images in the server's cache: (their bytes, notes, keys)."""
    from pixeltriage.serve import Client

    images = [image_bytes((80, 60), (200, 40, 40), seed=7), image_bytes((60, 80), (40, 40, 200), seed=8)]
    notes = ["a red mug", "a blue bike"]
    with Client(served.url, api_key=served.key, retries=0) as client:
        keys = [client.put_memory(i, note=n) for i, n in zip(images, notes)]
    return images, notes, keys


def by_index(results, score="relevance_score"):
    return {r["index"]: (r[score], r["pixeltriage"]) for r in results}


def test_every_string_a_framework_sends_gets_a_status_and_the_scored_ones_the_library_gains(http, kept, library):
    images, notes, keys = kept
    raw = image_bytes((50, 40), (40, 200, 40), seed=9)
    documents = [
        keys[0],                                           # 0 a key
        keys[0][:-1],                                      # 1 one digit short
        keys[1].upper(),                                   # 2 upper case
        "https://example.com/photos/mug.png",              # 3 a bare image URL
        b64(raw),                                          # 4 a raw base64 image
        LLAMAINDEX_METADATA + keys[1],                     # 5 a key under LlamaIndex's metadata lines
        "we talked about a red mug",                       # 6 text
        f"{keys[0]} and {keys[1]}",                        # 7 two keys in one document
        "f" * 64,                                          # 8 a key the cache does not hold
        {"text": "a note, no image"},                      # 9 Jina's text object
        "data:image/png;base64," + b64(raw),               # 10 a data URI
        {"key": "e" * 64, "note": "unknown"},              # 11 an unknown key as an object
    ]
    response = http.post("/v2/rerank", json={"query": QUERY, "documents": documents})
    assert response.status_code == 200, response.text
    body = response.json()
    got = by_index(body["results"])
    status = {i: extra["status"] for i, (_, extra) in got.items()}
    assert status == {0: "scored", 1: "near_miss_key", 2: "near_miss_key", 3: "url", 4: "scored", 5: "scored",
                      6: "not_a_key_or_memory", 7: "several_keys", 8: "unknown_key", 9: "no_image", 10: "scored",
                      11: "unknown_key"}
    detail = {i: extra["detail"] for i, (_, extra) in got.items()}
    assert "63 hex digits where a cache key has 64" in detail[1] and "upper-case" in detail[2]
    assert "fetches nothing" in detail[3] and keys[1] in detail[5] and "2 cache keys" in detail[7]
    assert "not in this server's write-time cache" in detail[8] and detail[0] is None and detail[4] is None
    counts = body["pixeltriage"]["statuses"]
    assert set(counts) == set(DOCUMENT_STATUSES) and sum(counts.values()) == len(documents)
    assert counts == {**dict.fromkeys(DOCUMENT_STATUSES, 0), "scored": 4, "near_miss_key": 2, "url": 1,
                      "not_a_key_or_memory": 1, "several_keys": 1, "unknown_key": 2, "no_image": 1}
    assert response.headers["x-pixeltriage-documents"] == ", ".join(f"{k}={v}" for k, v in counts.items() if v)
    # the scored ones, in request order: a key's note is the cached one; a base64 image has none
    want = library.score(QUERY, [Memory(image=images[0], note=notes[0]), Memory(image=raw),
                                 Memory(image=images[1], note=notes[1]), Memory(image=raw)])
    for position, index in enumerate((0, 4, 5, 10)):
        assert abs(got[index][0] - want.gains[position]) <= TOL and got[index][1]["image"]
    assert [r["index"] for r in body["results"][:4]] == sorted((0, 4, 5, 10), key=lambda i: -got[i][0])
    assert all(got[i][0] == 0.0 and got[i][1]["gain"] is None for i in status if status[i] != "scored")


def test_tei_and_cohere_v1_answer_the_same_statuses(http, kept):
    _, _, keys = kept
    texts = [keys[0], keys[0][1:], "plain text", LLAMAINDEX_METADATA + keys[1]]
    tei = http.post("/rerank", json={"query": QUERY, "texts": texts})
    assert tei.status_code == 200, tei.text
    assert {r["index"]: r["pixeltriage"]["status"] for r in tei.json()} == {
        0: "scored", 1: "near_miss_key", 2: "not_a_key_or_memory", 3: "scored"}
    assert tei.headers["x-pixeltriage-documents"] == "scored=2, not_a_key_or_memory=1, near_miss_key=1"
    v1 = http.post("/v1/rerank", json={"query": QUERY, "documents": texts, "top_n": 1}).json()
    assert len(v1["results"]) == 1 and v1["pixeltriage"]["statuses"]["near_miss_key"] == 1   # counted past top_n


@pytest.mark.parametrize("path, collection", [("/v2/rerank", "documents"), ("/v1/rerank", "documents"),
                                              ("/rerank", "texts")])
def test_strict_refuses_a_document_not_scored_naming_it(http, kept, path, collection):
    _, _, keys = kept
    documents = [keys[0], keys[0].upper(), "plain text"]
    response = http.post(path, json={"query": QUERY, collection: documents, "strict": True})
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["field"] == f"{collection}[1]" and error["error_type"] == "invalid_input"
    assert error["error"].startswith(f"{collection}[1]: not scored (near_miss_key)")
    assert f"1 more not scored: {collection}[2] (not_a_key_or_memory)" in error["error"]
    assert http.post(path, json={"query": QUERY, collection: documents[:1], "strict": True}).status_code == 200

