"""A LangChain document compressor that decides which retrieved images deserve pixels (langchain-core).

    from pixeltriage.integrations import PixelTriageCompressor

    triage = PixelTriageCompressor(model="org/system-one", k=2)      # or scorer=Scorer.load(...), base_url=...
    documents = triage.compress_documents(retrieved, "what colour was the mug?")

A LangChain `Document` holds text and metadata only, so a document's image is read from its metadata: under
`image_field` (a local path, base64 or a `data:` URI, bytes, or a PIL image) or, stored at write time, a cache key
under `cache_key_field`; its note is `metadata[note_field]`, else its `page_content`; `dialogue_field` and
`date_field` likewise. The documents with an image are scored in one call and come back ordered by System One's
gain, with `relevance_score` (the gain, as LangChain's rerankers name it), `pixeltriage_open`, `pixeltriage_gain`,
`pixeltriage_p_vis` and `pixeltriage_relevance` in their metadata. The top `k` by gain keep their image; the others
lose `metadata[image_field]` (`keep_closed_images=True` keeps it), so a host that sends the images it finds sends
the k opened ones. Documents without an image are not scored and follow, unchanged, in their retrieval order. An
image given as a URL is fetched only with `allow_url_images=True`; otherwise it is refused, and nothing is fetched.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

try:
    from langchain_core.callbacks import Callbacks
    from langchain_core.documents import Document
    from langchain_core.documents.compressor import BaseDocumentCompressor
    from pydantic import ConfigDict, Field
except ImportError as e:                                # pragma: no cover - exercised in a subprocess test
    raise ImportError("pixeltriage.integrations.langchain needs LangChain: pip install langchain-core "
                      f"(or pip install 'pixeltriage[integrations]'); {e}") from e

from pixeltriage.delivery.decision import decide
from pixeltriage.engine.types import Scores
from pixeltriage.integrations import common


class PixelTriageCompressor(BaseDocumentCompressor):
    """Scores a query's image documents with System One and keeps the images of the top k by gain."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    scorer: Any = Field(default=None, exclude=True, description="A pixeltriage.Scorer, serve.Client or AsyncClient.")
    model: Optional[str] = Field(default=None, description="Checkpoint scored in process: a local path or a Hugging "
                                                           "Face hub id org/name[@revision].")
    base_url: Optional[str] = Field(default=None, description="URL of a `pixeltriage serve` server to score on.")
    api_key: Optional[str] = Field(default=None, exclude=True, repr=False, description="The server's API key.")
    revision: Optional[str] = Field(default=None, description="Hub revision of `model`.")
    allow_download: bool = Field(default=False, description="Download `model` from the hub when it is not cached.")
    device: str = Field(default="cpu", description="Device `model` is loaded on.")
    top_n: Optional[int] = Field(default=None, ge=0, description="Image documents returned, by descending gain "
                                                                 "(None: all).")
    k: int = Field(default=2, ge=0, description="Image documents that keep their image: the top k by gain.")
    keep_closed_images: bool = Field(default=False, description="Keep metadata[image_field] on the documents not "
                                                                "opened.")
    allow_url_images: bool = Field(default=False, description="Fetch images given as URLs (else refused).")
    image_field: str = Field(default="image", description="Metadata key of the image (path, base64, bytes).")
    cache_key_field: str = Field(default="pixeltriage_key", description="Metadata key of a write-time cache key.")
    note_field: str = Field(default="note", description="Metadata key of the note (default: page_content).")
    dialogue_field: str = Field(default="dialogue", description="Metadata key of the dialogue.")
    date_field: str = Field(default="date", description="Metadata key of the session date.")

    def model_post_init(self, context: Any) -> None:
        self.scorer = common.build_scorer(self.scorer, self.model, self.base_url, api_key=self.api_key,
                                          device=self.device, revision=self.revision,
                                          allow_download=self.allow_download)

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Optional[Callbacks] = None) -> Sequence[Document]:
        """The documents with an image by descending gain (at most top_n), then the others; see the module."""
        memories, scored = self._memories(documents)
        scores = common.score(self.scorer, query, memories) if memories else None
        return self._delivered(documents, scored, scores)

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Optional[Callbacks] = None) -> Sequence[Document]:
        """compress_documents, awaiting an AsyncClient (a synchronous scorer runs in a worker thread)."""
        memories, scored = self._memories(documents)
        scores = await common.ascore(self.scorer, query, memories) if memories else None
        return self._delivered(documents, scored, scores)

    def _memories(self, documents: Sequence[Document]):
        """(memories, positions of the scored documents)."""
        fields = common.Fields(self.image_field, self.cache_key_field, self.note_field, self.dialogue_field,
                               self.date_field)
        memories, scored = [], []
        for position, document in enumerate(documents):
            memory = common.memory_of(None, None, document.metadata, document.page_content, fields, position,
                                      self.allow_url_images)
            if memory is not None:
                memories.append(memory)
                scored.append(position)
        return memories, scored

    def _delivered(self, documents: Sequence[Document], scored: list[int], scores: Scores | None) -> list[Document]:
        scored_positions = set(scored)
        rest = [d for i, d in enumerate(documents) if i not in scored_positions]
        if scores is None:
            return rest
        decision = decide(scores, self.k)
        top_n = len(scored) if self.top_n is None else min(self.top_n, len(scored))
        out = []
        for rank in decision.order[:top_n]:
            document = documents[scored[rank]]
            metadata = {**document.metadata, "relevance_score": scores.gains[rank], **common.written(decision, rank)}
            if not decision.open[rank] and not self.keep_closed_images:
                metadata.pop(self.image_field, None)
            out.append(Document(page_content=document.page_content, metadata=metadata, id=document.id))
        return out + rest
