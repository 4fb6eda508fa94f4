"""PixelTriage inside the frameworks memory systems already use (docs/integrations.md).

- `PixelTriagePostprocessor`: a LlamaIndex node postprocessor (llama-index-core).
- `PixelTriageCompressor`: a LangChain document compressor (langchain-core).
- `PixelTriageReranker`: a mem0 reranker (mem0ai), set as `memory.reranker`.

Each scores the retrieved items that carry an image with System One (a `pixeltriage.Scorer` in process, or a
`pixeltriage.serve.Client`), orders them by gain and keeps the pixels of the top k only. The names are imported on
first use: `import pixeltriage.integrations` imports no framework, and a framework that is not installed is an
ImportError naming the package to install when its class is first touched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pixeltriage.lazy import lazy_exports

_EXPORTS = {
    "PixelTriagePostprocessor": "pixeltriage.integrations.llamaindex",
    "PixelTriageCompressor": "pixeltriage.integrations.langchain",
    "PixelTriageReranker": "pixeltriage.integrations.mem0",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from pixeltriage.integrations.langchain import PixelTriageCompressor
    from pixeltriage.integrations.llamaindex import PixelTriagePostprocessor
    from pixeltriage.integrations.mem0 import PixelTriageReranker
