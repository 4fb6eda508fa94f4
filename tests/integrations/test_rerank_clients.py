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


# reader-like metadata, as LlamaIndex's SimpleDirectoryReader and LangChain's loaders attach it to what they read
READER_METADATA = [{"file_name": f"photo-{i}.png", "file_path": f"/photos/2026/photo-{i}.png", "file_type": "image/png",
                    "file_size": 5120 + i, "creation_date": "2026-01-02", "last_modified_date": "2026-01-03",
                    "page_label": str(i + 1)} for i in range(len(NOTES))]


def test_llamaindex_cohere_rerank_finds_the_key_under_reader_metadata(cached, scorer):
    """LlamaIndex sends `key: value` lines of a node's metadata, a blank line, then its text (MetadataMode.EMBED):
    the key is found in the text as its content, or in the metadata with the note as the content."""
    cohere_rerank = pytest.importorskip("llama_index.postprocessor.cohere_rerank")
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode

    process, keys, memories = cached
    want = scorer.score(QUESTION, memories).gains
    as_text = [TextNode(text=k, id_=f"m{i}", metadata=READER_METADATA[i]) for i, k in enumerate(keys)]
    in_metadata = [TextNode(text=NOTES[i], id_=f"m{i}", metadata={**READER_METADATA[i], "pixeltriage_key": k})
                   for i, k in enumerate(keys)]
    assert READER_METADATA[0]["file_name"] in as_text[0].get_content(metadata_mode=MetadataMode.EMBED)
    reranker = cohere_rerank.CohereRerank(top_n=len(keys), model="pixeltriage", api_key="unused",
                                          base_url=process.url, max_retries=1)
    for nodes in (as_text, in_metadata):
        out = reranker.postprocess_nodes([NodeWithScore(node=n, score=0.5) for n in nodes],
                                         query_bundle=QueryBundle(QUESTION))
        assert [n.node.node_id for n in out] == [f"m{i}" for i in ranking(want)]
        assert all(abs(n.score - want[int(n.node.node_id[1:])]) <= TOL for n in out)


def test_langchain_cohere_rerank_finds_the_key_in_documents_and_in_yaml_dicts(cached, scorer):
    """LangChain sends a Document's page_content, and a dict document as YAML of its fields (`rank_fields`)."""
    langchain_cohere = pytest.importorskip("langchain_cohere")
    from langchain_core.documents import Document

    process, keys, memories = cached
    want = scorer.score(QUESTION, memories).gains
    reranker = langchain_cohere.CohereRerank(model="pixeltriage", cohere_api_key="unused", base_url=process.url,
                                             top_n=len(keys))
    documents = [Document(page_content=k, metadata=READER_METADATA[i]) for i, k in enumerate(keys)]
    out = reranker.compress_documents(documents, QUESTION)
    assert [d.metadata["file_name"] for d in out] == [READER_METADATA[i]["file_name"] for i in ranking(want)]
    assert all(abs(d.metadata["relevance_score"] - want[int(d.metadata["page_label"]) - 1]) <= TOL for d in out)
    records = [{"source": READER_METADATA[i]["file_path"], "page": i + 1, "pixeltriage_key": k}
               for i, k in enumerate(keys)]
    ranked = reranker.rerank(records, QUESTION)
    assert [r["index"] for r in ranked] == ranking(want)
    assert all(abs(r["relevance_score"] - want[r["index"]]) <= TOL for r in ranked)


def test_a_near_miss_key_through_the_cohere_sdk_is_said_to_be_one(cached):
    """The SDK drops what it does not model, so the status is read from the route's JSON as the SDK got it."""
    cohere = pytest.importorskip("cohere")
    process, keys, _ = cached
    client = cohere.ClientV2(api_key="unused", base_url=process.url)
    answer = client.rerank(model="pixeltriage", query=QUESTION, documents=[keys[0], keys[1][:-1], keys[2].upper()])
    extra = {r.index: r.model_extra or {} for r in answer.results}
    assert [extra[i].get("pixeltriage", {}).get("status") for i in range(3)] == \
        ["scored", "near_miss_key", "near_miss_key"]
    with pytest.raises(cohere.core.ApiError) as refused:
        client.rerank(model="pixeltriage", query=QUESTION, documents=[keys[0], keys[1][:-1]],
                      request_options={"additional_body_parameters": {"strict": True}, "max_retries": 0})
    assert refused.value.status_code == 422 and "documents[1]" in refused.value.body["message"]
