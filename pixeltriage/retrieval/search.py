"""Top-n images by region similarity: exact brute force in torch (the reference) and a faiss index beside it.

An image's score is the max over its R region similarities (MaxSim, cosine of L2-normalised vectors) or, for
the whole-image control, the similarity of region 0 alone. `exact_search` computes every score. The faiss path
(`QuantizedSearch`) scans 8-bit scalar-quantized codes (a quarter of the float32 bytes) for the best
`candidate_factor * top * R` regions and hands their images to `exact_search`, so every score it returns is
exact and only the candidate set is approximate: with an exact scan, the images of the top top * R regions
always include the true top `top` (an image's best region is outranked only by regions of higher-ranked images,
at most R each), and the factor (2) absorbs the quantization error.

Chosen by measurement (docs/retrieval.md), on random unit vectors of D=768 (5 per image): IVF (2828 lists,
nprobe 1024) reached a recall@10 of 0.60 on 100k images and HNSW (M 32, efSearch 1024) 0.71 on 20k, HNSW took
209 s to build for 20k; sqlite-vec cannot load into a Python built without loadable SQLite extensions (this
machine's). The 8-bit scan kept recall@10 at 1.0 and ran 2.1x faster than the float32 brute force at 100k.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from pixeltriage.errors import BackendUnavailableError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "exact", "faiss")
# "auto" switches to faiss here: at D=768 it measured 1.0x the exact search at 1k images, 1.6x at 5k, 1.9x at 10k
# and 2.1x at 100k, for 25% more memory and a rebuild of ~0.1 s per 10k images when it goes stale
FAISS_MIN_IMAGES = 5_000
_QUERY_CHUNK = 64                  # queries per matmul: bounds the [N * R, m] similarity block


class Ranked(NamedTuple):
    """Per query, the best k images, best first: scores float32 [m, k], rows int64 [m, k] (the images' rows in
    the vectors given), regions int64 [m, k] (the winning region, 0 for the whole image)."""

    scores: torch.Tensor
    rows: torch.Tensor
    regions: torch.Tensor


def exact_search(vectors: torch.Tensor, queries: torch.Tensor, top: int, whole_image: bool = False) -> Ranked:
    """Exact top-`top` images per query.

    vectors: float32 [N, R, D], L2-normalised rows. queries: float32 [m, D]. Returns k = min(top, N) per query,
    ties in score broken by the lower row. Regions tie towards the lower region (the whole image first).
    """
    if vectors.dim() != 3 or queries.dim() != 2 or vectors.shape[2] != queries.shape[1]:
        raise ValueError(f"vectors [N, R, D] and queries [m, D] must agree in D, found {tuple(vectors.shape)} and "
                         f"{tuple(queries.shape)}")
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    parts = [_exact_chunk(vectors, queries[i:i + _QUERY_CHUNK], top, whole_image)
             for i in range(0, len(queries), _QUERY_CHUNK)]
    if not parts:
        empty = torch.zeros(0, min(top, len(vectors)))
        return Ranked(empty, empty.long(), empty.long())
    return Ranked(*(torch.cat(column) for column in zip(*parts)))


def _exact_chunk(vectors: torch.Tensor, queries: torch.Tensor, top: int, whole_image: bool) -> Ranked:
    n, r, d = vectors.shape
    if whole_image:
        scores = vectors[:, 0] @ queries.T                               # [N, m]
        regions = torch.zeros_like(scores, dtype=torch.long)
    else:
        scores, regions = (vectors.reshape(n * r, d) @ queries.T).view(n, r, -1).max(dim=1)   # [N, m] each
    k = min(top, n)
    by_query = scores.T                                                   # [m, N]
    kth = by_query.topk(k, dim=1).values[:, -1:]                          # [m, 1]
    # topk picks among scores equal to the k-th in no set order: every row tied with it is a candidate, and the
    # candidates are ordered by score, then by row, so ties at the cut-off go to the lower row as well
    picked = []
    for query, cut in zip(by_query, kth):
        candidates = (query >= cut).nonzero().squeeze(1)                  # ascending rows
        order = query[candidates].argsort(descending=True, stable=True)[:k]
        picked.append(candidates[order])
    rows = torch.stack(picked) if picked else torch.zeros(0, k, dtype=torch.long)
    return Ranked(by_query.gather(1, rows), rows, regions.T.gather(1, rows))


class QuantizedSearch:
    """faiss `IndexScalarQuantizer` (8 bits per dimension, inner product) over every region vector, proposing
    candidate images for `exact_search` (see the module docstring). Rows are appended as the store grows;
    replaced rows make it stale, and it is rebuilt (retrained) on the next search, as it is when the store has
    doubled since it was trained, or when appended rows fall outside the range its quantizer was trained on."""

    def __init__(self, candidate_factor: int = 2):
        self.faiss = import_faiss()
        self.candidate_factor = candidate_factor
        self.index = None
        self.rows = 0
        self.trained_rows = 0
        self.low = self.high = None        # per-dimension range the quantizer was trained on
        self.stale = True

    def sync(self, vectors: torch.Tensor) -> None:
        """Bring the index up to `vectors` [N, R, D] (rows only ever appended, unless marked stale)."""
        n = len(vectors)
        if self.stale or self.index is None or n < self.rows or n > 2 * max(self.trained_rows, 1) \
                or not self.trained_rows:
            self._build(vectors)
        elif n > self.rows:
            added = _flat(vectors[self.rows:])
            # the 8-bit codes cover each dimension's range seen at training: rows outside it would be clipped and
            # lose candidates, so they retrain the quantizer instead of being appended
            slack = 0.1 * (self.high - self.low)           # a little past the extremes costs nothing measurable
            if (added.min(axis=0) < self.low - slack).any() or (added.max(axis=0) > self.high + slack).any():
                self._build(vectors)
                return
            self.index.add(added)
            self.rows = n

    def _build(self, vectors: torch.Tensor) -> None:
        n, _, d = vectors.shape
        index = self.faiss.IndexScalarQuantizer(d, self.faiss.ScalarQuantizer.QT_8bit,
                                                self.faiss.METRIC_INNER_PRODUCT)
        if n:
            flat = _flat(vectors)
            index.train(flat)
            index.add(flat)
            self.low, self.high = flat.min(axis=0), flat.max(axis=0)
        self.index, self.rows, self.trained_rows, self.stale = index, n, n, False

    def search(self, vectors: torch.Tensor, queries: torch.Tensor, top: int) -> Ranked:
        """Top-`top` images per query, scored exactly: vectors [N, R, D] (what `sync` last saw), queries [m, D]."""
        n, r, _ = vectors.shape
        k = min(top, n)
        if len(queries) == 0:
            empty = torch.zeros(0, k)
            return Ranked(empty, empty.long(), empty.long())
        if k == 0 or self.index is None or self.rows != n:
            raise RuntimeError("QuantizedSearch.search before sync with these vectors")
        _, hits = self.index.search(queries.contiguous().numpy(), min(self.candidate_factor * top * r, n * r))
        results = []
        for query, found in zip(queries, torch.from_numpy(hits)):
            candidates = torch.unique(found[found >= 0] // r)              # sorted image rows
            ranked = exact_search(vectors[candidates], query[None], k)
            results.append(Ranked(ranked.scores, candidates[ranked.rows], ranked.regions))
        # every query has >= k candidates: 2 * top * R regions span >= 2 * top images (or all N of them)
        return Ranked(*(torch.cat(columns) for columns in zip(*results)))


def _flat(vectors: torch.Tensor):
    n, r, d = vectors.shape
    return vectors.reshape(n * r, d).contiguous().numpy()


def import_faiss():
    try:
        import faiss
    except ImportError as e:
        raise BackendUnavailableError(f"the faiss index needs faiss-cpu ({e}); pip install 'pixeltriage[retrieval]' "
                                      f"or use the exact search") from None
    return faiss


def faiss_available() -> bool:
    try:
        import_faiss()
    except BackendUnavailableError:
        return False
    return True
