"""PixelTriageCompressor against the real langchain-core: the image comes from a document's metadata, its scores are
Scorer.score's on the same memories, the top k keep their image, and LangChain's ContextualCompressionRetriever
runs it, sync and async."""
import asyncio
import base64

import pytest

pytest.importorskip("langchain_core", reason="langchain-core is not installed (pip install langchain-core, or the "
                                             "integrations extra)")

from integration_inputs import COLORS, QUESTION, png  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from PIL import Image  # noqa: E402

from pixeltriage import Cache, InvalidMemoryError, Memory, top_k  # noqa: E402
from pixeltriage.integrations import PixelTriageCompressor  # noqa: E402

WRITTEN = ("relevance_score", "pixeltriage_open", "pixeltriage_gain", "pixeltriage_p_vis", "pixeltriage_relevance")


@pytest.fixture
def retrieved(tmp_path):
    """Documents whose metadata carries the image as a path, base64, a data: URI, bytes and a PIL image, a text-only
    document among them; the Memory of each image document, built the plain library way, in retrieval order."""
    images = [png(c) for c in COLORS]
    (tmp_path / "m0.png").write_bytes(images[0])
    b64 = [base64.b64encode(b).decode("ascii") for b in images]
    pil = Image.new("RGB", (64, 48), COLORS[4])
    documents = [
        Document(page_content="note 0", metadata={"image": str(tmp_path / "m0.png"), "date": "2024-03-01"}, id="d0"),
        Document(page_content="note 1", metadata={"image": b64[1], "dialogue": "A: which mug?"}, id="d1"),
        Document(page_content="a text memory", metadata={"source": "chat"}, id="d2"),
        Document(page_content="caption", metadata={"image": "data:image/png;base64," + b64[2], "note": "note 3"},
                 id="d3"),
        Document(page_content="note 4", metadata={"image": images[3]}, id="d4"),
        Document(page_content="note 5", metadata={"image": pil}, id="d5"),
    ]
    memories = [Memory(image=tmp_path / "m0.png", note="note 0", date="2024-03-01"),
                Memory(image=images[1], note="note 1", dialogue="A: which mug?"),
                Memory(image=images[2], note="note 3"),
                Memory(image=images[3], note="note 4"),
                Memory(image=pil, note="note 5")]
    return documents, memories, ["d0", "d1", "d3", "d4", "d5"]


def test_scores_are_the_scorers_and_the_top_k_keep_their_image(scorer, retrieved, no_network):
    documents, memories, ids = retrieved
    reference = scorer.score(QUESTION, memories)
    opened = top_k(reference, 2)
    out = PixelTriageCompressor(scorer=scorer, k=2).compress_documents(documents, QUESTION)

    by_gain = sorted(range(len(memories)), key=lambda i: (-reference.gains[i], i))
    assert [d.id for d in out] == [ids[i] for i in by_gain] + ["d2"]
    for document, i in zip(out, by_gain):
        metadata = document.metadata
        assert metadata["relevance_score"] == metadata["pixeltriage_gain"] == reference.gains[i]
        assert metadata["pixeltriage_p_vis"] == reference.p_vis
        assert metadata["pixeltriage_relevance"] == reference.relevance[i]
        assert metadata["pixeltriage_open"] is opened[i]
        assert ("image" in metadata) is opened[i]
        assert document.page_content == documents[["d0", "d1", "d2", "d3", "d4", "d5"].index(ids[i])].page_content
    text = out[-1]                               # no image: after every image, on the gains' scale (0.0)
    assert text.id == "d2" and text.page_content == documents[2].page_content
    assert {k: text.metadata[k] for k in WRITTEN} == {"relevance_score": 0.0, "pixeltriage_open": False,
                                                     "pixeltriage_gain": None, "pixeltriage_p_vis": reference.p_vis,
                                                     "pixeltriage_relevance": None}
    assert all("relevance_score" in d.metadata for d in out)
    assert all("pixeltriage_open" not in d.metadata and "image" in d.metadata for d in documents if d.id != "d2")
    assert no_network == []


def test_top_n_k_and_keeping_closed_images(scorer, retrieved):
    documents, memories, _ = retrieved
    gains = scorer.score(QUESTION, memories).gains
    out = PixelTriageCompressor(scorer=scorer, top_n=2, k=1, keep_closed_images=True).compress_documents(
        documents, QUESTION)
    assert [d.metadata["relevance_score"] for d in out[:2]] == sorted(gains, reverse=True)[:2]
    assert [d.metadata["pixeltriage_open"] for d in out[:2]] == [True, False]
    assert all("image" in d.metadata for d in out) and len(out) == 2             # top_n caps the whole ranking
    every = PixelTriageCompressor(scorer=scorer, top_n=6).compress_documents(documents, QUESTION)
    assert [d.metadata["relevance_score"] for d in every] == [*sorted(gains, reverse=True), 0.0]
    with pytest.raises(ValueError):
        PixelTriageCompressor(scorer=scorer, k=-1)


def test_a_cache_key_in_metadata(scorer, tmp_path):
    cache = Cache(tmp_path / "cache.db")
    cached = scorer.with_cache(cache)
    key = cache.put(png(COLORS[0]), "the red mug")
    documents = [Document(page_content="", metadata={"pixeltriage_key": key}),
                 Document(page_content="note 1", metadata={"image": png(COLORS[1])})]
    reference = cached.score(QUESTION, [Memory(key=key), Memory(image=png(COLORS[1]), note="note 1")])
    out = PixelTriageCompressor(scorer=cached, k=1).compress_documents(documents, QUESTION)
    assert sorted(d.metadata["pixeltriage_gain"] for d in out) == sorted(reference.gains)
    with pytest.raises(InvalidMemoryError, match="no cache"):      # a key needs the scorer's cache
        PixelTriageCompressor(scorer=scorer).compress_documents(documents, QUESTION)
    cache.close()


def test_contextual_compression_retriever_runs_it_sync_and_async(scorer, retrieved):
    retrievers = pytest.importorskip("langchain_classic.retrievers",
                                     reason="langchain-classic (ContextualCompressionRetriever) is not installed")
    from langchain_core.runnables import RunnableLambda

    documents, _, _ = retrieved
    triage = PixelTriageCompressor(scorer=scorer, k=2)
    direct = triage.compress_documents(documents, QUESTION)
    retriever = retrievers.ContextualCompressionRetriever(base_compressor=triage,
                                                          base_retriever=RunnableLambda(lambda query: documents))
    for got in (retriever.invoke(QUESTION), asyncio.run(retriever.ainvoke(QUESTION))):
        assert [(d.id, {k: d.metadata.get(k) for k in WRITTEN}) for d in got] == \
            [(d.id, {k: d.metadata.get(k) for k in WRITTEN}) for d in direct]


def test_a_server_scores_the_same_sync_and_async(scorer, retrieved, server):
    from pixeltriage.serve import AsyncClient

    documents, _, _ = retrieved
    local = PixelTriageCompressor(scorer=scorer, k=2).compress_documents(documents, QUESTION)
    remote = PixelTriageCompressor(base_url=server.url, k=2).compress_documents(documents, QUESTION)

    async def through_async_client():
        async with AsyncClient(server.url) as client:
            return await PixelTriageCompressor(scorer=client, k=2).acompress_documents(documents, QUESTION)

    for got in (remote, asyncio.run(through_async_client())):
        assert [(d.id, d.metadata.get("pixeltriage_gain"), d.metadata.get("pixeltriage_open")) for d in got] == \
            [(d.id, d.metadata.get("pixeltriage_gain"), d.metadata.get("pixeltriage_open")) for d in local]


def test_refusals(scorer, tmp_path, no_network):
    triage = PixelTriageCompressor(scorer=scorer)
    with pytest.raises(InvalidMemoryError, match="allow_url_images=True") as error:
        triage.compress_documents([Document(page_content="x"),
                                   Document(page_content="y", metadata={"image": "https://example.com/a.png"})],
                                  QUESTION)
    assert error.value.index == 1
    with pytest.raises(InvalidMemoryError, match="no such file"):
        triage.compress_documents([Document(page_content="x", metadata={"image": "photos/gone.png"})], QUESTION)
    with pytest.raises(InvalidMemoryError, match="neither an existing file"):
        triage.compress_documents([Document(page_content="x", metadata={"image": "!" * 100})], QUESTION)
    with pytest.raises(InvalidMemoryError, match="an image must be"):
        triage.compress_documents([Document(page_content="x", metadata={"image": 3})], QUESTION)
    with pytest.raises(TypeError, match="coroutine"):
        from pixeltriage.serve import AsyncClient

        PixelTriageCompressor(scorer=AsyncClient("http://127.0.0.1:1")).compress_documents(
            [Document(page_content="x", metadata={"image": png(COLORS[0])})], QUESTION)
    with pytest.raises(ValueError, match="exactly one of"):
        PixelTriageCompressor()
    with pytest.raises(TypeError, match="score"):
        PixelTriageCompressor(scorer=object())
    assert triage.compress_documents([], QUESTION) == []
    assert no_network == []
