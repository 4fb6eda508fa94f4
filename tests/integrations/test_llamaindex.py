"""PixelTriagePostprocessor against the real llama-index-core: its scores are Scorer.score's on the same memories,
the top k by gain keep their images, the rest become text nodes, and LlamaIndex's own query engine runs it."""
import asyncio
import base64

import pytest

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed (pip install llama-index-core, "
                                               "or the integrations extra)")

from integration_inputs import COLORS, QUESTION, hub_cache, png  # noqa: E402
from llama_index.core.schema import (ImageNode, MediaResource, Node, NodeWithScore, QueryBundle,  # noqa: E402
                                     TextNode)

from pixeltriage import InvalidMemoryError, Memory, top_k  # noqa: E402
from pixeltriage.integrations import PixelTriagePostprocessor  # noqa: E402

WRITTEN = ("pixeltriage_open", "pixeltriage_gain", "pixeltriage_p_vis", "pixeltriage_relevance")


@pytest.fixture
def retrieved(tmp_path):
    """Five image nodes, one of each way LlamaIndex carries an image, and a text node among them; the Memory of
    each image node, built the plain library way, in retrieval order."""
    images = [png(c) for c in COLORS]
    for i in (1, 3):
        (tmp_path / f"m{i}.png").write_bytes(images[i])
    b64 = [base64.b64encode(b).decode("ascii") for b in images]
    nodes = [
        ImageNode(image=b64[0], text="note 0", metadata={"date": "2024-03-01", "dialogue": "A: the red one?"}),
        ImageNode(image_path=str(tmp_path / "m1.png"), text="note 1"),
        TextNode(text="a text memory without an image"),
        TextNode(text="note 3", metadata={"image": str(tmp_path / "m3.png"), "date": "2024-03-04"}),
        Node(image_resource=MediaResource(data=images[2]), text_resource=MediaResource(text="note 4")),
        ImageNode(image_url="data:image/png;base64," + b64[4], metadata={"note": "note 5"}),
    ]
    memories = [Memory(image=images[0], note="note 0", dialogue="A: the red one?", date="2024-03-01"),
                Memory(image=tmp_path / "m1.png", note="note 1"),
                Memory(image=tmp_path / "m3.png", note="note 3", date="2024-03-04"),
                Memory(image=images[2], note="note 4"),
                Memory(image=images[4], note="note 5")]
    scored = [0, 1, 3, 4, 5]                     # the positions of the image nodes
    return [NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(nodes)], memories, scored


def test_scores_are_the_scorers_and_the_top_k_keep_their_images(scorer, retrieved, no_network):
    nodes, memories, scored = retrieved
    reference = scorer.score(QUESTION, memories)
    opened = top_k(reference, 2)
    out = PixelTriagePostprocessor(scorer, k=2).postprocess_nodes(nodes, query_str=QUESTION)

    by_gain = sorted(range(len(memories)), key=lambda i: (-reference.gains[i], i))
    assert [n.node.node_id for n in out] == [nodes[scored[i]].node.node_id for i in by_gain] + [nodes[2].node.node_id]
    for result, i in zip(out, by_gain):
        metadata = result.node.metadata
        assert result.score == reference.gains[i] == metadata["pixeltriage_gain"]
        assert metadata["pixeltriage_p_vis"] == reference.p_vis
        assert metadata["pixeltriage_relevance"] == reference.relevance[i]
        assert metadata["pixeltriage_open"] is opened[i]
        assert set(WRITTEN) <= set(result.node.excluded_llm_metadata_keys)
        assert set(WRITTEN) <= set(result.node.excluded_embed_metadata_keys)
        original = nodes[scored[i]].node
        if opened[i]:
            assert type(result.node) is type(original)
        else:                                    # closed: no pixels left to send, the note as text
            assert "image" not in metadata
            if isinstance(original, Node):
                assert result.node.image_resource is None and result.node.text_resource.text == "note 4"
            else:
                assert type(result.node) is TextNode and result.node.text == f"note {scored[i]}"
    assert sum(r.node.metadata["pixeltriage_open"] for r in out[:5]) == 2
    assert out[-1] is nodes[2]                   # the text node: not scored, unchanged, after the image nodes
    assert isinstance(nodes[0].node, ImageNode) and not set(WRITTEN) & set(nodes[0].node.metadata)  # inputs kept
    assert nodes[0].score == 1.0
    assert no_network == []


def test_top_n_and_k_bounds(scorer, retrieved):
    nodes, memories, _ = retrieved
    reference = scorer.score(QUESTION, memories)
    best = max(range(len(memories)), key=lambda i: (reference.gains[i], -i))
    out = PixelTriagePostprocessor(scorer, top_n=1, k=0).postprocess_nodes(nodes, query_str=QUESTION)
    assert len(out) == 2 and out[0].score == reference.gains[best] and out[1] is nodes[2]
    assert out[0].node.metadata["pixeltriage_open"] is False and type(out[0].node) is TextNode

    everything = PixelTriagePostprocessor(scorer, k=10, keep_closed_images=True).postprocess_nodes(
        nodes, query_str=QUESTION)
    assert all(n.node.metadata["pixeltriage_open"] for n in everything[:5])
    kept = PixelTriagePostprocessor(scorer, k=1, keep_closed_images=True,
                                    keep_retrieval_score=True).postprocess_nodes(nodes, query_str=QUESTION)
    assert [type(n.node) for n in kept] == [type(n.node) for n in everything]   # annotated only
    assert sorted(n.node.metadata["retrieval_score"] for n in kept[:5]) == sorted(nodes[i].score
                                                                                  for i in (0, 1, 3, 4, 5))
    with pytest.raises(ValueError):
        PixelTriagePostprocessor(scorer, k=-1)
    with pytest.raises(ValueError):
        PixelTriagePostprocessor(scorer, top_n=-1)


def test_text_nodes_only_pass_through_unscored(scorer):
    nodes = [NodeWithScore(node=TextNode(text="one"), score=0.3), NodeWithScore(node=TextNode(text="two"), score=0.9)]
    assert PixelTriagePostprocessor(scorer).postprocess_nodes(nodes, query_str=QUESTION) == nodes
    assert PixelTriagePostprocessor(scorer).postprocess_nodes([], query_str=QUESTION) == []


def test_the_query_engine_runs_it_sync_and_async(scorer, retrieved):
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever

    nodes, _, _ = retrieved

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return list(nodes)

    triage = PixelTriagePostprocessor(scorer, k=2)
    direct = triage.postprocess_nodes(nodes, query_str=QUESTION)
    engine = RetrieverQueryEngine.from_args(Fixed(), llm=MockLLM(), node_postprocessors=[triage])
    response = engine.query(QUESTION)
    asynchronous = asyncio.run(engine.aretrieve(QueryBundle(QUESTION)))
    for got in (response.source_nodes, asynchronous):
        assert [(n.node.node_id, n.score, type(n.node)) for n in got] == \
            [(n.node.node_id, n.score, type(n.node)) for n in direct]


def test_a_hub_id_loads_from_the_cache(tiny_checkpoint, scorer, retrieved, tmp_path, monkeypatch, no_network):
    hub_cache(tmp_path / "hub", "pixeltriage/tiny", tiny_checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    nodes, memories, _ = retrieved
    triage = PixelTriagePostprocessor(model="pixeltriage/tiny")
    out = triage.postprocess_nodes(nodes, query_str=QUESTION)
    assert sorted(n.score for n in out[:5]) == sorted(scorer.score(QUESTION, memories).gains)
    assert triage.to_dict()["model"] == "pixeltriage/tiny"
    assert no_network == []


def test_a_server_scores_the_same(scorer, retrieved, server):
    nodes, memories, _ = retrieved
    remote = PixelTriagePostprocessor(base_url=server.url, k=2).postprocess_nodes(nodes, query_str=QUESTION)
    local = PixelTriagePostprocessor(scorer, k=2).postprocess_nodes(nodes, query_str=QUESTION)
    assert [(n.node.node_id, n.score, n.node.metadata.get("pixeltriage_open")) for n in remote] == \
        [(n.node.node_id, n.score, n.node.metadata.get("pixeltriage_open")) for n in local]


def test_encoded_images_are_decoded_as_the_server_decodes_them(scorer, no_network):
    """The adapters decode base64 with the routes' one decoder (media.sources.decode_base64): base64 wrapped in MIME
    lines, a data URI's scheme in any case; a data URI of another media type is refused as the server refuses it."""
    images = [png(c) for c in COLORS[:2]]
    wrapped = base64.encodebytes(images[0]).decode("ascii")                  # lines of 76 characters
    upper = "DATA:image/png;BASE64," + base64.b64encode(images[1]).decode("ascii")
    nodes = [NodeWithScore(node=ImageNode(image=wrapped, text="note 0", id_="n0")),
             NodeWithScore(node=TextNode(text="note 1", metadata={"image": upper}, id_="n1"))]
    out = PixelTriagePostprocessor(scorer, k=2).postprocess_nodes(nodes, query_str=QUESTION)
    want = scorer.score(QUESTION, [Memory(image=images[0], note="note 0"), Memory(image=images[1], note="note 1")])
    assert {n.node.node_id: n.score for n in out} == {"n0": want.gains[0], "n1": want.gains[1]}
    text = NodeWithScore(node=TextNode(text="x", metadata={"image": "data:text/plain;base64,aGVsbG8="}))
    with pytest.raises(InvalidMemoryError, match=r"of type 'text/plain'; expected image/\*") as refused:
        PixelTriagePostprocessor(scorer).postprocess_nodes([NodeWithScore(node=TextNode(text="y")), text],
                                                           query_str=QUESTION)
    assert refused.value.index == 1


def test_refusals(scorer, tmp_path, no_network):
    triage = PixelTriagePostprocessor(scorer)
    url = NodeWithScore(node=ImageNode(image_url="https://example.com/mug.png"))
    with pytest.raises(InvalidMemoryError, match="allow_url_images=True") as error:
        triage.postprocess_nodes([NodeWithScore(node=TextNode(text="x")), url], query_str=QUESTION)
    assert error.value.index == 1
    with pytest.raises(InvalidMemoryError, match="has no image"):
        triage.postprocess_nodes([NodeWithScore(node=ImageNode(text="no pixels"))], query_str=QUESTION)
    with pytest.raises(InvalidMemoryError, match="not found"):
        triage.postprocess_nodes([NodeWithScore(node=ImageNode(image_path=str(tmp_path / "gone.png")))],
                                 query_str=QUESTION)
    with pytest.raises(InvalidMemoryError, match="not valid base64"):
        triage.postprocess_nodes([NodeWithScore(node=ImageNode(image="not base64 at all!"))], query_str=QUESTION)
    with pytest.raises(InvalidMemoryError, match="must be a string"):
        triage.postprocess_nodes([NodeWithScore(node=TextNode(text="x", metadata={"image": str(tmp_path / "x.png"),
                                                                                  "date": 2024}))],
                                 query_str=QUESTION)
    with pytest.raises(ValueError, match="needs the query"):
        triage.postprocess_nodes([NodeWithScore(node=ImageNode(image_path="x.png"))])
    with pytest.raises(ValueError, match="exactly one of"):
        PixelTriagePostprocessor()
    with pytest.raises(ValueError, match="exactly one of"):
        PixelTriagePostprocessor(scorer, base_url="http://127.0.0.1:1")
    assert no_network == []


def test_a_url_image_is_fetched_only_when_allowed(scorer, monkeypatch):
    import http.server
    import threading

    data, requests = png(COLORS[0]), []

    class Images(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        nodes = [NodeWithScore(node=ImageNode(image_url=f"http://127.0.0.1:{server.server_port}/mug.png",
                                              text="note 0"))]
        with pytest.raises(InvalidMemoryError, match="allow_url_images=True"):
            PixelTriagePostprocessor(scorer).postprocess_nodes(nodes, query_str=QUESTION)
        assert requests == []
        out = PixelTriagePostprocessor(scorer, allow_url_images=True).postprocess_nodes(nodes, query_str=QUESTION)
        assert requests == ["/mug.png"]
        assert out[0].score == scorer.score(QUESTION, [Memory(image=data, note="note 0")]).gains[0]
    finally:
        server.shutdown()
        server.server_close()
