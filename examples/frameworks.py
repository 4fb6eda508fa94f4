"""PixelTriage inside LlamaIndex, LangChain and mem0: the same retrieved memories through each one's reranker slot.

    pip install llama-index-core langchain-core mem0ai       # or: pip install ".[integrations]"
    python examples/frameworks.py                            # the built-in demo checkpoint (random weights)
    python examples/frameworks.py --checkpoint path/to/system-one   # a directory, packed file or hub id

It turns examples/episode.json's four memories into LlamaIndex image nodes, LangChain documents and mem0 search
results, runs PixelTriagePostprocessor, PixelTriageCompressor and PixelTriageReranker (what mem0's Memory.search
calls as its reranker) on them, and prints, per framework, what comes back: the items by descending gain, which
keep their pixels (the top k) and which go on as text.
"""
import argparse
import sys
from pathlib import Path

from pixeltriage import PixelTriageError, load_episodes

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="System One checkpoint (default: the demo checkpoint, built once)")
    p.add_argument("--episode", default=str(HERE / "episode.json"))
    p.add_argument("--k", type=int, default=1, help="memories that keep their pixels (default 1)")
    args = p.parse_args()
    if args.k < 0:
        p.error("--k must be >= 0")
    try:
        run(args)
    except (PixelTriageError, ImportError) as e:   # a bad checkpoint or episode, a framework not installed: exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    from pixeltriage import Scorer

    if args.checkpoint is None:
        from pixeltriage.weights.demo import demo_checkpoint

        args.checkpoint = demo_checkpoint("tiny")
    question, memories = load_episodes(args.episode)[0]
    scorer = Scorer.load(args.checkpoint)                      # one scorer for the three frameworks
    llamaindex(scorer, question, memories, args.k)
    langchain(scorer, question, memories, args.k)
    mem0(scorer, question, memories, args.k)


def llamaindex(scorer, question, memories, k: int) -> None:
    from llama_index.core.schema import ImageNode, NodeWithScore

    from pixeltriage.integrations import PixelTriagePostprocessor

    # what a retriever hands over: image nodes with the retriever's own scores, notes and dates in metadata
    nodes = [NodeWithScore(node=ImageNode(image_path=str(m.image), text=m.note,
                                          metadata={"dialogue": m.dialogue, "date": m.date}), score=1.0 - i / 10)
             for i, m in enumerate(memories)]
    out = PixelTriagePostprocessor(scorer, k=k).postprocess_nodes(nodes, query_str=question)
    print("LlamaIndex (node, gain, form):")
    for n in out:
        form = "pixels" if type(n.node).__name__ == "ImageNode" else "text"
        print(f"  {n.node.metadata.get('note', n.node.get_content())!r:40} {n.score:.3f}  {form}")


def langchain(scorer, question, memories, k: int) -> None:
    from langchain_core.documents import Document

    from pixeltriage.integrations import PixelTriageCompressor

    documents = [Document(page_content=m.note, metadata={"image": str(m.image), "dialogue": m.dialogue,
                                                         "date": m.date}) for m in memories]
    out = PixelTriageCompressor(scorer=scorer, k=k).compress_documents(documents, question)
    print("LangChain (document, relevance_score, form):")
    for d in out:
        form = "pixels" if d.metadata["pixeltriage_open"] else "text"
        print(f"  {d.page_content!r:40} {d.metadata['relevance_score']:.3f}  {form}")


def mem0(scorer, question, memories, k: int) -> None:
    from pixeltriage.integrations import PixelTriageReranker

    # mem0's search results: the memory text, its retrieval score, and metadata where the host keeps the image
    results = [{"id": str(i), "memory": m.note, "score": 1.0 - i / 10,
                "metadata": {"image": str(m.image), "dialogue": m.dialogue, "date": m.date}}
               for i, m in enumerate(memories)]
    out = PixelTriageReranker(scorer, k=k).rerank(question, results)    # memory.reranker = PixelTriageReranker(...)
    print("mem0 (memory, rerank_score, form):")
    for r in out:
        form = "pixels" if r["pixeltriage_open"] else "text"
        print(f"  {r['memory']!r:40} {r['rerank_score']:.3f}  {form}")


if __name__ == "__main__":
    main()
