"""A LlamaIndex node postprocessor that decides which retrieved images deserve pixels (llama-index-core).

    from pixeltriage.integrations import PixelTriagePostprocessor

    triage = PixelTriagePostprocessor(model="org/system-one", k=2)          # or scorer=Scorer.load(...), base_url=...
    engine = index.as_query_engine(node_postprocessors=[triage])

The image nodes of one query (`ImageNode.image` base64, `image_path`, `image_url`; a multimodal `Node`'s
`image_resource`; or a path, base64 or bytes under the metadata key `image_field`; or a write-time cache key under
`cache_key_field`) are scored in one call. They come back ordered by System One's gain, which is their score, with
`pixeltriage_open`, `pixeltriage_gain`, `pixeltriage_p_vis` and `pixeltriage_relevance` in their metadata (hidden
from the LLM and embedding views). The top `k` by gain keep their images; the rest become text nodes carrying their
note (`keep_closed_images=True` leaves them image nodes, only annotated), so a multimodal synthesizer sends the
model the k opened images and the others as text. Nodes without an image (text nodes of a mixed retrieval) are not
scored and follow the image nodes unchanged, in their retrieval order. A node's image URL is fetched only with
`allow_url_images=True`; otherwise it is refused, and nothing is fetched.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

try:
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.callbacks import CBEventType, EventPayload
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import BaseNode, ImageNode, MediaResource, Node, NodeWithScore, QueryBundle, TextNode
except ImportError as e:                                # pragma: no cover - exercised in a subprocess test
    raise ImportError("pixeltriage.integrations.llamaindex needs LlamaIndex: pip install llama-index-core "
                      f"(or pip install 'pixeltriage[integrations]'); {e}") from e

from pixeltriage.delivery.decision import decide
from pixeltriage.errors import InvalidMemoryError
from pixeltriage.integrations import common

dispatcher = get_dispatcher(__name__)


class PixelTriagePostprocessor(BaseNodePostprocessor):
    """Scores a query's image nodes with System One and keeps the pixels of the top k by gain."""

    model: Optional[str] = Field(default=None, description="Checkpoint scored in process: a local path or a Hugging "
                                                           "Face hub id org/name[@revision].")
    base_url: Optional[str] = Field(default=None, description="URL of a `pixeltriage serve` server to score on.")
    top_n: Optional[int] = Field(default=None, ge=0, description="Image nodes returned, by descending gain "
                                                                 "(None: all).")
    k: int = Field(default=2, ge=0, description="Image nodes that keep their pixels: the top k by gain "
                                                "(pixeltriage.top_k).")
    keep_closed_images: bool = Field(default=False, description="Leave the nodes not opened as image nodes "
                                                                "(annotated only) instead of text nodes.")
    keep_retrieval_score: bool = Field(default=False, description="Keep the retrieval score in metadata.")
    allow_url_images: bool = Field(default=False, description="Fetch images given only by URL (else refused).")
    image_field: str = Field(default="image", description="Metadata key of an image (path, base64, bytes) for a "
                                                          "node that carries none itself.")
    cache_key_field: str = Field(default="pixeltriage_key", description="Metadata key of a write-time cache key.")
    note_field: str = Field(default="note", description="Metadata key of the note (default: the node's text).")
    dialogue_field: str = Field(default="dialogue", description="Metadata key of the dialogue.")
    date_field: str = Field(default="date", description="Metadata key of the session date.")

    _scorer: Any = PrivateAttr()

    def __init__(self, scorer: Any = None, *, model: Optional[str] = None, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, revision: Optional[str] = None, allow_download: bool = False,
                 device: str = "cpu", **kwargs: Any):
        """scorer: a `pixeltriage.Scorer`, `pixeltriage.serve.Client` (or AsyncClient, for the async path);
        or model: a checkpoint path or hub id loaded here (revision, allow_download: `pixeltriage.hub`; device);
        or base_url (+ api_key): a server, scored through a Client."""
        super().__init__(model=model, base_url=base_url, **kwargs)
        self._scorer = common.build_scorer(scorer, model, base_url, api_key=api_key, device=device,
                                           revision=revision, allow_download=allow_download)

    @classmethod
    def class_name(cls) -> str:
        return "PixelTriagePostprocessor"

    @property
    def scorer(self) -> Any:
        return self._scorer

    def _postprocess_nodes(self, nodes: List[NodeWithScore],
                           query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        question, memories, scored = self._start(nodes, query_bundle)
        if not memories:
            return self._end(nodes, scored, None)
        with self._reranking(nodes, question) as event:
            scores = common.score(self._scorer, question, memories)
            out = self._end(nodes, scored, scores)
            event.on_end(payload={EventPayload.NODES: out})
        return out

    async def _apostprocess_nodes(self, nodes: List[NodeWithScore],
                                  query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        question, memories, scored = self._start(nodes, query_bundle)
        if not memories:
            return self._end(nodes, scored, None)
        with self._reranking(nodes, question) as event:
            scores = await common.ascore(self._scorer, question, memories)
            out = self._end(nodes, scored, scores)
            event.on_end(payload={EventPayload.NODES: out})
        return out

    # -- steps -----------------------------------------------------------------------------------------------------
    def _start(self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle]):
        """(question, memories, positions of the scored nodes in `nodes`)."""
        if query_bundle is None:
            raise ValueError("PixelTriagePostprocessor needs the query: postprocess_nodes(nodes, query_str=...) or a "
                             "query bundle")
        dispatcher.event(ReRankStartEvent(query=query_bundle, nodes=nodes, top_n=self._top_n(len(nodes)),
                                          model_name=self._model_name()))
        fields = common.Fields(self.image_field, self.cache_key_field, self.note_field, self.dialogue_field,
                               self.date_field)
        memories, scored = [], []
        for position, node_with_score in enumerate(nodes):
            memory = self._memory(node_with_score.node, position, fields)
            if memory is not None:
                memories.append(memory)
                scored.append(position)
        return query_bundle.query_str, memories, scored

    def _memory(self, node: BaseNode, position: int, fields: common.Fields):
        image, what = None, None
        if isinstance(node, ImageNode):
            if node.image:
                image, what = common.base64_image(node.image, position, "ImageNode.image"), "ImageNode.image"
            elif node.image_path:
                image, what = Path(node.image_path), "ImageNode.image_path"
            elif node.image_url:
                image, what = node.image_url, "ImageNode.image_url"
        elif isinstance(node, Node) and node.image_resource is not None:
            image, what = _resource_image(node.image_resource, position)
        memory = common.memory_of(image, what, node.metadata, _text(node), fields, position, self.allow_url_images)
        if memory is None and _is_image_node(node):
            raise InvalidMemoryError(f"{type(node).__name__} {node.node_id} has no image (no image, image_path or "
                                     f"image_url, no metadata[{self.image_field!r}] or "
                                     f"metadata[{self.cache_key_field!r}])", position)
        return memory

    def _end(self, nodes: List[NodeWithScore], scored: list[int], scores) -> List[NodeWithScore]:
        scored_positions = set(scored)
        text_nodes = [node for i, node in enumerate(nodes) if i not in scored_positions]
        if scores is None:
            dispatcher.event(ReRankEndEvent(nodes=text_nodes))
            return text_nodes
        decision = decide(scores, self.k)
        out = []
        for rank in decision.order[:self._top_n(len(scored))]:
            original = nodes[scored[rank]]
            metadata = {**original.node.metadata, **common.written(decision, rank)}
            if self.keep_retrieval_score:
                metadata["retrieval_score"] = original.score
            node = self._delivered(original.node, metadata, decision.open[rank])
            out.append(NodeWithScore(node=node, score=scores.gains[rank]))
        out += text_nodes
        dispatcher.event(ReRankEndEvent(nodes=out))
        return out

    def _delivered(self, node: BaseNode, metadata: dict, opened: bool) -> BaseNode:
        """A copy of `node` with `metadata`; a closed image node as a text node carrying its note (the nodes the
        retriever holds are not changed)."""
        hidden = {"excluded_llm_metadata_keys": _hide(node.excluded_llm_metadata_keys),
                  "excluded_embed_metadata_keys": _hide(node.excluded_embed_metadata_keys)}
        if opened or self.keep_closed_images:
            return node.model_copy(update={"metadata": metadata, **hidden})
        metadata.pop(self.image_field, None)
        note = metadata.get(self.note_field) if isinstance(metadata.get(self.note_field), str) else _text(node)
        if isinstance(node, ImageNode):
            fields = {name: getattr(node, name) for name in TextNode.model_fields if name not in ("embedding",)}
            return TextNode(**{**fields, "text": note or "", "metadata": metadata, **hidden})
        if isinstance(node, Node):
            text = node.text_resource or MediaResource(text=note or "")
            return node.model_copy(update={"image_resource": None, "text_resource": text, "metadata": metadata,
                                           **hidden})
        return node.model_copy(update={"metadata": metadata, **hidden})

    def _reranking(self, nodes: List[NodeWithScore], question: str):
        return self.callback_manager.event(
            CBEventType.RERANKING,
            payload={EventPayload.NODES: nodes, EventPayload.MODEL_NAME: self._model_name(),
                     EventPayload.QUERY_STR: question, EventPayload.TOP_K: self._top_n(len(nodes))})

    def _top_n(self, n: int) -> int:
        return n if self.top_n is None else min(self.top_n, n)

    def _model_name(self) -> str:
        return self.model or self.base_url or f"pixeltriage ({type(self._scorer).__name__})"


def _resource_image(resource: MediaResource, position: int):
    """A multimodal Node's image: its data (base64, as MediaResource stores it), path or URL."""
    if resource.data:
        return common.base64_image(resource.data.decode("ascii"), position, "Node.image_resource.data"), \
            "Node.image_resource.data"
    if resource.path is not None:
        return Path(resource.path), "Node.image_resource.path"
    if resource.url is not None:
        return str(resource.url), "Node.image_resource.url"
    return None, None


def _text(node: BaseNode) -> str:
    if isinstance(node, TextNode):
        return node.text
    if isinstance(node, Node) and node.text_resource is not None:
        return node.text_resource.text or ""
    return ""


def _is_image_node(node: BaseNode) -> bool:
    return isinstance(node, ImageNode) or (isinstance(node, Node) and node.image_resource is not None)


def _hide(keys: list[str]) -> list[str]:
    return [*keys, *(k for k in common.WRITTEN_KEYS if k not in keys)]
