"""Framework rerankers, unchanged, pointed at a real `pixeltriage serve` by their base URL, with stored memories'
cache keys (from POST /v1/memories) as their documents: each gets `Scorer.score`'s ranking and gains (1e-5,
float32): LlamaIndex's `JinaRerank` (llama-index-postprocessor-jinaai-rerank) and `CohereRerank`
(llama-index-postprocessor-cohere-rerank), LangChain's `CohereRerank` (langchain-cohere; both Cohere rerankers are
clients of the cohere 5.x SDK, the version the test extra pins)."""
import base64
import os
from pathlib import Path

import httpx
import pytest
from integration_inputs import COLORS, QUESTION, png

from pixeltriage import Memory

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
NOTES = ["the red mug on the desk", "a green bike by the door", "a blue notebook", "a yellow lamp"]


@pytest.fixture(scope="module")
def cached(tiny_checkpoint, tmp_path_factory):
    """A server with a write-time cache, and four images put into it: (server, keys, memories as keys score)."""
    from pixeltriage.serve.process import ServerProcess

    base = tmp_path_factory.mktemp("rerank-clients")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PIXELTRIAGE_MALLOC_TUNING": "0"}
    process = ServerProcess(["--checkpoint", str(tiny_checkpoint), "--cache", str(base / "cache.db")],
                            log=base / "log", env=env)
    process.wait_ready(120.0)
    memories = [Memory(image=png(c), note=n) for c, n in zip(COLORS, NOTES)]
    keys = [httpx.post(process.url + "/v1/memories", json={"image": base64.b64encode(m.image).decode(),
                                                            "note": m.note}, timeout=60).json()["key"]
            for m in memories]
    yield process, keys, memories
    process.stop()


def ranking(gains, n=None):
    return sorted(range(len(gains)), key=lambda i: (-gains[i], i))[:n]


def test_llamaindex_jina_rerank_ranks_stored_keys_as_the_library(cached, scorer):
    jina = pytest.importorskip("llama_index.postprocessor.jinaai_rerank")
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    process, keys, memories = cached
    want = scorer.score(QUESTION, memories).gains
    nodes = [NodeWithScore(node=TextNode(text=k, id_=f"m{i}")) for i, k in enumerate(keys)]
    reranker = jina.JinaRerank(base_url=process.url + "/v1", api_key="unused", model="pixeltriage", top_n=3)
    out = reranker.postprocess_nodes(nodes, query_bundle=QueryBundle(QUESTION))
    assert [n.node.node_id for n in out] == [f"m{i}" for i in ranking(want, 3)]
    assert all(abs(n.score - want[int(n.node.node_id[1:])]) <= TOL for n in out)
    everything = jina.JinaRerank(base_url=process.url + "/v2", api_key="unused", top_n=len(keys))
    got = everything.postprocess_nodes(nodes, query_str=QUESTION)
    assert [n.node.node_id for n in got] == [f"m{i}" for i in ranking(want)]


def test_llamaindex_cohere_rerank_ranks_stored_keys_as_the_library(cached, scorer):
    cohere_rerank = pytest.importorskip("llama_index.postprocessor.cohere_rerank")
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    process, keys, memories = cached
    want = scorer.score(QUESTION, memories).gains
    nodes = [NodeWithScore(node=TextNode(text=k, id_=f"m{i}"), score=1.0 - i / 10) for i, k in enumerate(keys)]
    # max_retries=1: a refusal fails the test at once instead of after the library's back-off
    reranker = cohere_rerank.CohereRerank(top_n=3, model="pixeltriage", api_key="unused", base_url=process.url,
                                          max_retries=1)
    out = reranker.postprocess_nodes(nodes, query_bundle=QueryBundle(QUESTION))
    assert [n.node.node_id for n in out] == [f"m{i}" for i in ranking(want, 3)]
    assert all(abs(n.score - want[int(n.node.node_id[1:])]) <= TOL for n in out)


def test_langchain_cohere_rerank_compresses_stored_keys_as_the_library(cached, scorer):
    langchain_cohere = pytest.importorskip("langchain_cohere")
    from langchain_core.documents import Document

    process, keys, memories = cached
    want = scorer.score(QUESTION, memories).gains
    documents = [Document(page_content=k, metadata={"memory": i}) for i, k in enumerate(keys)]
    reranker = langchain_cohere.CohereRerank(model="pixeltriage", cohere_api_key="unused", base_url=process.url,
                                             top_n=len(keys))
    out = reranker.compress_documents(documents, QUESTION)
    assert [d.metadata["memory"] for d in out] == ranking(want)
    assert all(abs(d.metadata["relevance_score"] - want[d.metadata["memory"]]) <= TOL for d in out)
    assert [d.page_content for d in out] == [keys[i] for i in ranking(want)]
    top = langchain_cohere.CohereRerank(model="pixeltriage", cohere_api_key="unused", base_url=process.url)
    assert [d.metadata["memory"] for d in top.compress_documents(documents, QUESTION)] == ranking(want, 3)
