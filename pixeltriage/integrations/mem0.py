"""A mem0 reranker that decides which retrieved images deserve pixels (mem0ai).

    from pixeltriage.integrations import PixelTriageReranker

    memory = Memory.from_config(config)                            # mem0's own Memory
    memory.reranker = PixelTriageReranker(base_url="http://127.0.0.1:8080", k=2)   # or scorer=, model=
    hits = memory.search("what colour was the mug?", user_id="ann", rerank=True)

mem0 builds its reranker from a closed table of providers, so this one is set on the Memory after it is made; mem0
then calls `rerank(query, memories, limit)` as it calls its own. A mem0 memory is a dict whose text is
`memory["memory"]`; its image is read from `memory["metadata"]`: under `image_field` (a local path, base64 or a
`data:` URI, bytes) or, stored at write time (`POST /v1/memories`, `Cache.put`), a cache key under
`cache_key_field`; its note is `metadata[note_field]`, else the memory's text. The memories with an image are
scored in one call and come back by System One's gain, each with `rerank_score` (the gain, the key mem0's rerankers
write), `pixeltriage_open`, `pixeltriage_gain`, `pixeltriage_p_vis` and `pixeltriage_relevance`; the top `k` keep
their image, the others lose `metadata[image_field]` (`keep_closed_images=True` keeps it). Memories without an image
follow with `rerank_score` 0.0 (nothing to open), in their retrieval order, as the server's rerank endpoints rank
them; the whole list is cut at `top_k`. URL images are fetched only with `allow_url_images=True`.

mem0's own `cohere` reranker also reaches a `pixeltriage serve` server: docs/integrations.md, "mem0".
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

try:
    from mem0.reranker.base import BaseReranker
except ImportError as e:                                # pragma: no cover - exercised in a subprocess test
    raise ImportError("pixeltriage.integrations.mem0 needs mem0: pip install mem0ai; " f"{e}") from e

from pixeltriage.delivery.decision import Decision, decide, rerank_order
from pixeltriage.integrations import common


class PixelTriageReranker(BaseReranker):
    """Scores a query's image memories with System One and keeps the images of the top k by gain."""

    def __init__(self, scorer: Any = None, *, model: Optional[str] = None, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, revision: Optional[str] = None, allow_download: bool = False,
                 device: str = "cpu", k: int = 2, top_k: Optional[int] = None, keep_closed_images: bool = False,
                 allow_url_images: bool = False, fields: common.Fields = common.Fields()):
        if k < 0 or (top_k is not None and top_k < 0):
            raise ValueError(f"k and top_k must be >= 0, got k={k}, top_k={top_k}")
        self.scorer = common.build_scorer(scorer, model, base_url, api_key=api_key, device=device, revision=revision,
                                          allow_download=allow_download)
        self.k, self.top_k = k, top_k
        self.keep_closed_images, self.allow_url_images, self.fields = keep_closed_images, allow_url_images, fields

    def rerank(self, query: str, documents: Sequence[dict], top_k: Optional[int] = None) -> list[dict]:
        """The memories with an image by descending gain, then the others (rerank_score 0.0), at most top_k (else
        the reranker's own top_k, else all); copies, the given dicts are not changed."""
        memories, rank_of = [], {}              # rank_of: a scored document's position -> its memory's
        for position, document in enumerate(documents):
            metadata = document.get("metadata") or {}
            memory = common.memory_of(None, None, metadata, document.get("memory"), self.fields, position,
                                      self.allow_url_images)
            if memory is not None:
                rank_of[position] = len(memories)
                memories.append(memory)
        decision = decide(common.score(self.scorer, query, memories), self.k) if memories else None
        gains = [decision.scores.gains[rank_of[i]] if i in rank_of else None for i in range(len(documents))]
        out = [self._reranked(documents[i], decision, rank_of.get(i)) for i in rerank_order(gains)]
        limit = top_k if top_k is not None else self.top_k
        return out if limit is None else out[:limit]

    def _reranked(self, document: dict, decision: Optional[Decision], rank: Optional[int]) -> dict:
        """A copy of the document with its rerank_score (0.0 when it was not scored) and, when scored, what
        PixelTriage writes; a closed image loses `metadata[image_field]` unless keep_closed_images."""
        if rank is None:
            return {**document, "rerank_score": 0.0}
        reranked = {**document, "rerank_score": decision.scores.gains[rank], **common.written(decision, rank)}
        if not decision.open[rank] and not self.keep_closed_images and reranked.get("metadata"):
            reranked["metadata"] = {k: v for k, v in reranked["metadata"].items() if k != self.fields.image}
        return reranked
