"""Region retrieval (DeliverMem R1): which stored images arrive, before System One decides which get pixels.

Each stored image is embedded as a whole and as a 2 x 2 grid of overlapping tiles (SigLIP 2); a question is
scored against an image by the best of its five regions (MaxSim), so evidence confined to a small region is
not averaged away. See docs/retrieval.md.

    from pixeltriage import Cache
    from pixeltriage.retrieval import RegionIndex, SiglipEncoder

    encoder = SiglipEncoder.load("siglip2-base-patch16-224")
    with Cache("memories.db") as cache:
        index = RegionIndex(cache, encoder)
        index.add("photos/receipt.jpg", note="lunch receipt")      # write time
        hits = index.search("what did the sticker on the laptop say?", top=10)

The names below are imported on first use, so importing this package costs nothing until one is touched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pixeltriage.lazy import lazy_exports

_EXPORTS = {
    "Box": "pixeltriage.retrieval.types",
    "RegionGrid": "pixeltriage.retrieval.regions",
    "REGION_NAMES": "pixeltriage.retrieval.regions",
    "region_crops": "pixeltriage.retrieval.regions",
    "Encoder": "pixeltriage.retrieval.encoder",
    "SiglipEncoder": "pixeltriage.retrieval.encoder",
    "preprocess_images": "pixeltriage.retrieval.encoder",
    "Hit": "pixeltriage.retrieval.types",
    "RegionIndex": "pixeltriage.retrieval.index",
    "RegionRow": "pixeltriage.store.regions",
    "RegionStore": "pixeltriage.store.regions",
    "exact_search": "pixeltriage.retrieval.search",
    "QuantizedSearch": "pixeltriage.retrieval.search",
    "demo_encoder": "pixeltriage.retrieval.demo",
    "write_demo_encoder": "pixeltriage.retrieval.demo",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from pixeltriage.retrieval.demo import demo_encoder, write_demo_encoder
    from pixeltriage.retrieval.encoder import Encoder, SiglipEncoder, preprocess_images
    from pixeltriage.retrieval.index import RegionIndex
    from pixeltriage.retrieval.regions import REGION_NAMES, RegionGrid, region_crops
    from pixeltriage.store.regions import RegionRow, RegionStore
    from pixeltriage.retrieval.types import Box, Hit
    from pixeltriage.retrieval.search import QuantizedSearch, exact_search
