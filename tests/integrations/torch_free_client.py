"""Run by test_client_without_torch.py with the python of a venv holding pixeltriage-client and the three
frameworks, and no torch: `python torch_free_client.py URL QUESTION IMAGE...` scores the images (local paths, each
with the note "note i") through Client, AsyncClient, Client.rerank and the three adapters in base_url mode, with
a text item after the images, and prints their scores as JSON, with the modules of the engine it imported."""
import asyncio
import base64
import importlib.util
import json
import sys
from pathlib import Path

ENGINE = ("torch", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn")


def main(url: str, question: str, paths: list[str]) -> dict:
    from pixeltriage import Memory
    from pixeltriage.serve import AsyncClient, Client

    memories = [Memory(image=path, note=f"note {i}") for i, path in enumerate(paths)]
    out = {"torch_found": importlib.util.find_spec("torch") is not None}
    with Client(url, retries=0) as client:
        out["client"] = client.score(question, memories).gains
        documents = [json.dumps({"image": base64.b64encode(Path(p).read_bytes()).decode(), "note": f"note {i}"})
                     for i, p in enumerate(paths)] + ["a text memory"]
        reranking = client.rerank(question, documents)
        out["rerank"] = {r.index: [r.relevance_score, r.status] for r in reranking.results}

    async def scored():
        async with AsyncClient(url, retries=0) as client:
            return (await client.score(question, memories)).gains
    out["async_client"] = asyncio.run(scored())

    from llama_index.core.schema import ImageNode, NodeWithScore, TextNode

    from pixeltriage.integrations import PixelTriageCompressor, PixelTriagePostprocessor, PixelTriageReranker
    nodes = [NodeWithScore(node=ImageNode(image_path=p, text=f"note {i}", id_=f"m{i}"), score=0.5)
             for i, p in enumerate(paths)] + [NodeWithScore(node=TextNode(text="a text memory", id_="text"), score=0.9)]
    ranked = PixelTriagePostprocessor(base_url=url, k=1).postprocess_nodes(nodes, query_str=question)
    out["llamaindex"] = [[n.node.node_id, n.score] for n in ranked]

    from langchain_core.documents import Document
    documents = [Document(page_content=f"note {i}", metadata={"image": p, "id": f"m{i}"})
                 for i, p in enumerate(paths)] + [Document(page_content="a text memory", metadata={"id": "text"})]
    compressed = PixelTriageCompressor(base_url=url, k=1).compress_documents(documents, question)
    out["langchain"] = [[d.metadata["id"], d.metadata["relevance_score"]] for d in compressed]

    hits = [{"id": f"m{i}", "memory": f"note {i}", "metadata": {"image": p}} for i, p in enumerate(paths)]
    reranked = PixelTriageReranker(base_url=url, k=1).rerank(question, hits + [{"id": "text", "memory": "text"}])
    out["mem0"] = [[m["id"], m["rerank_score"]] for m in reranked]
    import pixeltriage
    try:
        pixeltriage.Scorer
    except ImportError as e:
        out["scorer_refused"] = str(e)
    from pixeltriage.retrieval.types import Hit                      # what Client.retrieve returns
    out["hit_type"] = Hit.__name__
    out["engine_imported"] = sorted({m.split(".")[0] for m in sys.modules} & set(ENGINE))
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
