"""The region index (DeliverMem R1) over the write-time cache: region vectors in, ranked image keys out.

Write time: `add(image, note)` puts the image in the cache (thumbnail and note, as `Cache.put`), crops its five
regions (`RegionGrid`), encodes them in batches and stores the L2-normalised [5, D] vectors in the cache's file
(`RegionStore`) under the image's key and the index fingerprint (the encoder's fingerprint and the grid: another
encoder's or another grid's vectors are never read). An image whose row is already sound is not encoded again; a
corrupt row is deleted with a warning and recomputed, since the image is at hand.

Query time: `search(question)` encodes the question, scores every indexed image by the max of its region
similarities (or by the whole image alone, the control) and returns the top hits with the winning region. The
vectors are read from the file once and then refreshed incrementally: each search fetches only rows written
since the last one (by this or any other process) and, after rows of its fingerprint were deleted, lists the
keys still stored (no vectors) to drop the images that went. Corrupt rows, and rows of another shape than
[5, D], are deleted with a warning and those images are reported by `unindexed()`, never a crash.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Callable, Iterable, Sequence

import torch

from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media.sources import ImageSource
from pixeltriage.retrieval.encoder import Encoder
from pixeltriage.retrieval.regions import RegionGrid, region_crops
from pixeltriage.retrieval.search import (BACKENDS, FAISS_MIN_IMAGES, QuantizedSearch, Ranked, exact_search,
                                          faiss_available)
from pixeltriage.retrieval.types import Hit
from pixeltriage.store.cache import Cache
from pixeltriage.store.regions import RegionStore

_PAGE = 4096                  # rows per read while loading


def index_fingerprint(encoder_fingerprint: str, grid: RegionGrid) -> str:
    """What keys the stored vectors: the encoder and the region grid."""
    return hashlib.sha256(f"pixeltriage-regions-v1\0{encoder_fingerprint}\0{grid.spec()}".encode()).hexdigest()


class RegionIndex:
    """Region vectors of the images of one cache, for one encoder and grid.

    backend: "exact" (brute force in torch), "faiss" (8-bit scan proposing candidates, scored exactly) or "auto"
    (faiss from FAISS_MIN_IMAGES indexed images on, when installed). images_per_batch: images whose crops are
    encoded together at write time; by default as many as fill the encoder's `batch_size` crops per forward (8
    for an encoder without one). Thread-safe.
    """

    def __init__(self, cache: Cache, encoder: Encoder, grid: RegionGrid = RegionGrid(), *, backend: str = "auto",
                 images_per_batch: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if images_per_batch is None:
            crops = getattr(encoder, "batch_size", None)
            images_per_batch = max(1, crops // len(grid.names)) if isinstance(crops, int) else 8
        if images_per_batch < 1:
            raise ValueError(f"images_per_batch must be at least 1, got {images_per_batch}")
        self.cache = cache
        self.store = RegionStore(cache)
        self.encoder = encoder
        self.grid = grid
        self.backend = backend
        self.images_per_batch = images_per_batch
        self.fingerprint = index_fingerprint(encoder.fingerprint, grid)
        self._regions = len(grid.names)
        self._shape = (self._regions, encoder.dim)         # of every row of this fingerprint
        self._lock = threading.RLock()
        self._vectors = torch.zeros(0, *self._shape)       # [capacity, R, D]; rows [:n] in use
        self._keys: list[str] = []
        self._row_of: dict[str, int] = {}
        self._seq = 0                            # the last row read
        self._deletions: int | None = None       # the store's count of this fingerprint's deleted rows, as followed
        self._quantized: QuantizedSearch | None = None

    # -- write time ----------------------------------------------------------------------------------------------

    def add(self, image: ImageSource, note: str = "", *, recompute: bool = False) -> str:
        """Put `image` (PIL image, bytes or local path) and `note` in the cache and store its region vectors;
        returns its key. Idempotent: a sound stored row is kept unless `recompute`."""
        return self.add_many([image], [note], recompute=recompute)[0]

    def add_many(self, images: Sequence[ImageSource], notes: Sequence[str] | None = None, *,
                 recompute: bool = False, on_batch: Callable[[int, list[str]], None] | None = None) -> list[str]:
        """`add` for many images, their crops encoded in batches; returns their keys in order. An unreadable image
        raises InvalidMemoryError naming its position (from 1); the batches before its own are stored in full.
        on_batch(start, keys): called as each batch is stored (its first image's position from 0, its keys)."""
        notes = [""] * len(images) if notes is None else list(notes)
        if len(notes) != len(images):
            raise ValueError(f"{len(images)} images but {len(notes)} notes")
        keys: list[str] = []
        for start in range(0, len(images), self.images_per_batch):
            batch = range(start, min(start + self.images_per_batch, len(images)))
            stored = self._add_batch([(i, images[i], notes[i]) for i in batch], recompute)
            keys += stored
            if on_batch is not None:
                on_batch(start, stored)
        return keys

    def _add_batch(self, items: Iterable[tuple[int, ImageSource, str]], recompute: bool) -> list[str]:
        keys, pending = [], {}
        for index, image, note in items:
            key, source = self._put(image, note, index)
            keys.append(key)
            if key not in pending and (recompute or not self._sound(key)):       # a repeated image: encoded once
                pending[key] = region_crops(source, self.grid, index)
        if pending:
            crops = [crop for image_crops in pending.values() for crop in image_crops]
            vectors = self._checked(self.encoder.encode_images(crops), len(crops), "encode_images")  # normalised
            regions = self._regions
            self.store.put_many(self.fingerprint, [(key, vectors[i * regions:(i + 1) * regions])
                                                   for i, key in enumerate(pending)])
        return keys

    def _put(self, image: ImageSource, note: str, index: int) -> tuple[str, ImageSource]:
        """Store the thumbnail and note; returns (key, the source to crop: the very bytes that were keyed, a file
        read once)."""
        try:
            return self.cache.put_source(image, note, index)      # errors name the file
        except InvalidMemoryError as e:
            raise InvalidMemoryError(e.reason, index) from None

    def _sound(self, key: str) -> bool:
        # a corrupt row, or one of another shape: deleted, with a warning
        return self.store.get(key, self.fingerprint, self._shape) is not None

    def add_vectors(self, key: str, vectors: torch.Tensor) -> None:
        """Store precomputed region vectors [R, D] (region order of `grid.names`) for an image already in the
        cache; they are L2-normalised here."""
        self.store.put(key, self.fingerprint, self._normalised(vectors, self._regions, "vectors"))

    def _checked(self, vectors: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        vectors = torch.as_tensor(vectors, dtype=torch.float32)
        if tuple(vectors.shape) != (rows, self.encoder.dim):
            raise ValueError(f"{what}: expected [{rows}, {self.encoder.dim}] vectors, got {tuple(vectors.shape)}")
        return vectors

    def _normalised(self, vectors: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        """Vectors from outside (not from the encoder, whose contract is L2-normalised rows): checked, normalised."""
        return torch.nn.functional.normalize(self._checked(vectors, rows, what), dim=1)

    # -- query time ----------------------------------------------------------------------------------------------

    def search(self, question: str, top: int = 10, *, whole_image: bool = False) -> list[Hit]:
        """The `top` images best matching `question`, best first (fewer when fewer are indexed)."""
        return self.search_many([question], top, whole_image=whole_image)[0]

    def search_many(self, questions: Sequence[str], top: int = 10, *, whole_image: bool = False) -> list[list[Hit]]:
        """`search` for several questions, their text embeddings computed in one batch."""
        if isinstance(questions, str):
            raise TypeError("search_many takes a list of questions; use search for one")
        _check_top(top)
        queries = self._checked(self.encoder.encode_texts(list(questions)), len(questions), "encode_texts")
        return self._search(queries, top, whole_image)

    def search_vectors(self, queries: torch.Tensor, top: int = 10, *, whole_image: bool = False) -> list[list[Hit]]:
        """Rank the indexed images for query embeddings [m, D] (L2-normalised here)."""
        _check_top(top)
        return self._search(self._normalised(queries, len(queries), "queries"), top, whole_image)

    def _search(self, queries: torch.Tensor, top: int, whole_image: bool) -> list[list[Hit]]:
        with self._lock:
            self._refresh()
            n = len(self._keys)
            if n == 0:
                return [[] for _ in range(len(queries))]
            ranked = self._rank(self._vectors[:n], queries, top, whole_image)
            keys = list(self._keys)
        return self._hits(ranked, keys)

    def _rank(self, vectors: torch.Tensor, queries: torch.Tensor, top: int, whole_image: bool) -> Ranked:
        if whole_image or not self._use_faiss(len(vectors)):
            return exact_search(vectors, queries, top, whole_image)
        if self._quantized is None:
            self._quantized = QuantizedSearch()
        self._quantized.sync(vectors)
        return self._quantized.search(vectors, queries, top)

    def _use_faiss(self, n: int) -> bool:
        if self.backend == "faiss":
            return True
        return self.backend == "auto" and n >= FAISS_MIN_IMAGES and faiss_available()

    def _hits(self, ranked: Ranked, keys: list[str]) -> list[list[Hit]]:
        sizes: dict[str, tuple[int, int] | None] = {}
        results = []
        for scores, rows, regions in zip(ranked.scores.tolist(), ranked.rows.tolist(), ranked.regions.tolist()):
            hits = []
            for score, row, region in zip(scores, rows, regions):
                key = keys[row]
                if key not in sizes:
                    sizes[key] = self._size(key)
                size = sizes[key]
                box = self.grid.boxes(*size)[region] if size else None
                hits.append(Hit(key, float(score), self.grid.names[region], box))
            results.append(hits)
        return results

    def _size(self, key: str) -> tuple[int, int] | None:
        try:
            return self.cache.size(key)
        except KeyError:                          # deleted since the vectors were read
            return None

    # -- the stored vectors --------------------------------------------------------------------------------------

    def refresh(self) -> int:
        """Read rows written since the last read; returns how many were read. Searches call it."""
        with self._lock:
            return self._refresh()

    def _refresh(self) -> int:
        last, deletions = self.store.state(self.fingerprint)
        read = 0
        if last > self._seq:
            read = self._read_after(self._seq)
            deletions = self.store.state(self.fingerprint)[1]     # the read deletes damaged rows
        if deletions != self._deletions:          # rows held may be gone
            self._deletions = deletions           # first: a deletion after the listing below is seen next time
            self._drop_deleted()
        return read

    def _read_after(self, seq: int) -> int:
        read = 0
        for row in self.store.rows(self.fingerprint, after=seq, page=_PAGE, shape=self._shape):
            self._apply(row.key, row.vectors)
            self._seq = row.seq
            read += 1
        return read

    def _drop_deleted(self) -> None:
        """Drop the held images whose rows are no longer stored (deleted here or elsewhere, or as damaged). A held
        image whose row was rewritten since stays: its new row has a newer seq and is read as one."""
        if not self._keys:
            return
        stored = self.store.keys(self.fingerprint)
        for key in [key for key in self._keys if key not in stored]:
            self._remove(key)

    def _apply(self, key: str, vectors) -> None:
        row = self._row_of.get(key)
        if row is None:
            row = len(self._keys)
            self._grow(row + 1)
            self._keys.append(key)
            self._row_of[key] = row
        elif self._quantized is not None:
            self._quantized.stale = True          # its codes of this row are the old vectors
        self._vectors[row].numpy()[...] = vectors          # the row's one copy (the cache hands out read-only views)

    def _remove(self, key: str) -> None:
        row = self._row_of.pop(key, None)
        if row is None:
            return
        last = len(self._keys) - 1
        if row != last:                           # the last row takes its place
            self._vectors[row] = self._vectors[last]
            self._keys[row] = self._keys[last]
            self._row_of[self._keys[row]] = row
        self._keys.pop()
        if self._quantized is not None:
            self._quantized.stale = True

    def _grow(self, rows: int) -> None:
        if rows <= len(self._vectors):
            return
        grown = torch.zeros(max(rows, 2 * len(self._vectors), 64), self._regions, self.encoder.dim)
        grown[:len(self._keys)] = self._vectors[:len(self._keys)]
        self._vectors = grown

    def __len__(self) -> int:
        """Indexed images, as of the last refresh."""
        with self._lock:
            return len(self._keys)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._row_of

    def unindexed(self) -> list[str]:
        """Keys of cached images with no sound vectors for this index: they cannot be retrieved until indexed."""
        with self._lock:
            self._refresh()                       # deletes corrupt rows, so their images count here
        return self.store.keys_without(self.fingerprint)

    def __repr__(self) -> str:
        return f"RegionIndex({self.cache!r}, {len(self)} images, backend={self.backend!r})"


def _check_top(top) -> None:
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
