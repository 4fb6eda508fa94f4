"""mem0 (mem0ai), unchanged, against System One: mem0's own `cohere` reranker, built by mem0's RerankerFactory and
pointed at a real `pixeltriage serve` process by CO_API_URL (as a mem0 deployment sets it), and
`PixelTriageReranker` called as mem0's Memory.search calls a reranker. Every score is `Scorer.score`'s gain (1e-5)."""
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from integration_inputs import COLORS, QUESTION, png

from pixeltriage import Memory

os.environ.setdefault("MEM0_TELEMETRY", "False")          # mem0 reads it at import: no events sent
pytest.importorskip("mem0.reranker.base", reason="mem0ai is not installed")
pytest.importorskip("cohere", reason="cohere is not installed (mem0's cohere reranker needs it)")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
NOTES = ["a red mug on the desk", "a green plant", "a blue bike"]


def mem0_memories() -> list[dict]:
    """Three memories as mem0's search returns them, their images in metadata, and one text-only memory."""
    out = [{"id": f"m{i}", "memory": note, "score": 0.9 - i / 10, "metadata": {"image": png(COLORS[i])}}
           for i, note in enumerate(NOTES)]
    out.insert(1, {"id": "t", "memory": "Ann likes tea", "score": 0.85, "metadata": {}})
    return out


def library_gains(scorer) -> list[float]:
    return scorer.score(QUESTION, [Memory(image=png(COLORS[i]), note=note) for i, note in enumerate(NOTES)]).gains


def test_mem0s_cohere_reranker_reaches_the_server(server, scorer):
    """mem0's CohereReranker (cohere.Client, base_url from CO_API_URL read when cohere is imported) in a fresh
    interpreter; its documents are memory texts, here JSON memory objects carrying the image."""
    documents = [{"id": f"m{i}", "memory": json.dumps({"image": base64.b64encode(png(COLORS[i])).decode(),
                                                        "note": note})} for i, note in enumerate(NOTES)]
    documents.insert(2, {"id": "t", "memory": "Ann likes tea"})
    code = """
import json, sys
from mem0.utils.factory import RerankerFactory
reranker = RerankerFactory.create("cohere", {"api_key": "unused-by-this-server", "model": "pixeltriage"})
query, documents = json.load(sys.stdin)
print(json.dumps([(d["id"], d["rerank_score"]) for d in reranker.rerank(query, documents)]))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CO_API_URL": server.url, "MEM0_TELEMETRY": "False"}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps([QUESTION, documents]), capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranked = json.loads(done.stdout)
    gains = library_gains(scorer)
    want = sorted(((f"m{i}", g) for i, g in enumerate(gains)), key=lambda p: -p[1]) + [("t", 0.0)]
    # mem0 falls back to score 0.0 for every document when the call fails: the gains prove the server answered
    assert [d for d, _ in ranked] == [d for d, _ in want]
    assert all(abs(a - b) <= TOL for (_, a), (_, b) in zip(ranked, want)), (ranked, want)


def test_the_reranker_scores_as_the_library_in_process(scorer, no_network):
    from mem0.reranker.base import BaseReranker

    from pixeltriage.integrations import PixelTriageReranker

    reranker = PixelTriageReranker(scorer, k=1)
    assert isinstance(reranker, BaseReranker)
    memories = mem0_memories()
    ranked = reranker.rerank(QUESTION, memories, 10)            # as Memory.search calls it: (query, memories, limit)
    gains = library_gains(scorer)
    order = sorted(range(3), key=lambda i: (-gains[i], i))
    assert [d["id"] for d in ranked] == [f"m{i}" for i in order] + ["t"]
    assert all(abs(d["rerank_score"] - gains[i]) <= TOL for d, i in zip(ranked, order))
    assert [d["pixeltriage_open"] for d in ranked[:3]] == [True, False, False] and ranked[3]["rerank_score"] == 0.0
    assert "image" in ranked[0]["metadata"] and "image" not in ranked[1]["metadata"]   # closed: no pixels to send
    assert "image" in memories[order[1] + (order[1] >= 1)]["metadata"]                # the given dicts unchanged
    assert [d["id"] for d in reranker.rerank(QUESTION, memories, 2)] == [d["id"] for d in ranked[:2]]
    assert not no_network


def test_a_server_scores_as_in_process(scorer, server):
    from pixeltriage.integrations import PixelTriageReranker

    remote = PixelTriageReranker(base_url=server.url, k=2).rerank(QUESTION, mem0_memories())
    local = PixelTriageReranker(scorer, k=2).rerank(QUESTION, mem0_memories())
    assert [d["id"] for d in remote] == [d["id"] for d in local]
    assert all(abs(a["rerank_score"] - b["rerank_score"]) <= TOL for a, b in zip(remote, local))


def test_a_cache_key_in_metadata(scorer, tmp_path):
    from pixeltriage import Cache
    from pixeltriage.integrations import PixelTriageReranker

    with Cache(tmp_path / "cache.db") as cache:
        cached = scorer.with_cache(cache)
        key = cache.put(png(COLORS[0]), "the red mug")
        documents = [{"id": "a", "memory": "Ann's mug", "metadata": {"pixeltriage_key": key}},
                     {"id": "b", "memory": "a plant", "metadata": {"image": png(COLORS[1])}}]
        want = cached.score(QUESTION, [Memory(key=key, note="Ann's mug"), Memory(image=png(COLORS[1]),
                                                                                 note="a plant")])
        ranked = PixelTriageReranker(cached).rerank(QUESTION, documents)
        got = {d["id"]: d["rerank_score"] for d in ranked}
        assert abs(got["a"] - want.gains[0]) <= TOL and abs(got["b"] - want.gains[1]) <= TOL


def test_refusals_name_the_memory():
    from pixeltriage import InvalidMemoryError
    from pixeltriage.integrations import PixelTriageReranker

    reranker = PixelTriageReranker(scorer=_NeverCalled())
    with pytest.raises(InvalidMemoryError, match="URL") as refused:
        reranker.rerank(QUESTION, [{"memory": "t"}, {"memory": "x", "metadata": {"image": "https://a.example/b.png"}}])
    assert refused.value.index == 1
    with pytest.raises(ValueError, match="exactly one"):
        PixelTriageReranker()


class _NeverCalled:
    def score(self, question, memories):
        raise AssertionError("a refused memory is refused before scoring")


def test_a_missing_mem0_names_the_package():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", """
import sys
sys.modules["mem0"] = None                 # as if it were not installed
import pixeltriage.integrations as integrations
assert "PixelTriageReranker" in dir(integrations)
try:
    integrations.PixelTriageReranker
except ImportError as e:
    print(e)
"""], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "pip install mem0ai" in done.stdout, done.stderr[-3000:]


class _HashEmbedder:
    """A deterministic embedder for mem0 (its own calls: embed(text, memory_action)), so that Memory runs offline."""

    def embed(self, text, memory_action=None):
        import hashlib

        return [b / 255 for b in hashlib.sha256(text.encode()).digest()[:8]]


def test_memory_search_returns_one_ranking_with_the_keys_where_mem0_puts_a_rerankers(scorer, tmp_path, no_network):
    """mem0's own Memory (a local faiss store, the history in SQLite), memories added as a host adds them, then
    Memory.search(rerank=True) with the reranker set on it: the hits as mem0 hands them to the host."""
    from mem0 import Memory as Mem0

    from pixeltriage.integrations import PixelTriageReranker

    memory = Mem0.from_config({
        "vector_store": {"provider": "faiss", "config": {"path": str(tmp_path / "faiss"), "embedding_model_dims": 8,
                                                         "collection_name": "t"}},
        "embedder": {"provider": "openai", "config": {"api_key": "unused", "embedding_dims": 8}},
        "llm": {"provider": "openai", "config": {"api_key": "unused"}},
        "history_db_path": str(tmp_path / "history.db")})
    memory.embedding_model = _HashEmbedder()
    images = {note: base64.b64encode(png(COLORS[i])).decode() for i, note in enumerate(NOTES)}
    for note, image in images.items():
        memory.add(note, user_id="ann", infer=False, metadata={"image": image})
    memory.add("Ann likes tea", user_id="ann", infer=False)
    memory.reranker = PixelTriageReranker(scorer, k=1)

    hits = memory.search(QUESTION, filters={"user_id": "ann"}, top_k=10, rerank=True)["results"]
    assert len(hits) == 4 and hits[-1]["memory"] == "Ann likes tea"
    scored = [h for h in hits if h["memory"] in images]
    want = scorer.score(QUESTION, [Memory(image=png(COLORS[NOTES.index(h["memory"])]), note=h["memory"])
                                   for h in sorted(scored, key=lambda h: -h["score"])])
    assert sorted(h["rerank_score"] for h in scored) == pytest.approx(sorted(want.gains), abs=TOL)
    assert [h["rerank_score"] for h in hits] == sorted((h["rerank_score"] for h in hits), reverse=True)
    for hit in hits:                              # beside mem0's own rerank_score, the host's metadata as stored
        assert {"rerank_score", "pixeltriage_open", "pixeltriage_gain", "pixeltriage_p_vis",
                "pixeltriage_relevance"} <= set(hit) and "score" in hit
        assert not any(k.startswith("pixeltriage_") for k in hit.get("metadata") or {})
    assert [h["pixeltriage_open"] for h in hits] == [True, False, False, False]
    assert "image" in hits[0]["metadata"] and all("image" not in (h.get("metadata") or {}) for h in hits[1:])
    assert (hits[-1]["rerank_score"], hits[-1]["pixeltriage_gain"]) == (0.0, None)
    two = memory.search(QUESTION, filters={"user_id": "ann"}, top_k=2, rerank=True)["results"]
    assert len(two) == 2 and all(h["memory"] in images for h in two)
    assert no_network == []
