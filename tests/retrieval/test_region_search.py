"""MaxSim search: the exact brute force against hand-computed rankings, and the faiss index against the exact one
(recall@10 on 100k random images, its scores exact, incremental growth)."""
import pytest
import torch

from pixeltriage.retrieval.search import QuantizedSearch, exact_search, faiss_available

needs_faiss = pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed")


def unit(*rows) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def random_store(images: int, regions: int = 5, dim: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(images, regions, dim, generator=gen), dim=-1)


# three images of five regions in 3-d: image 0 is mostly about x, image 1 has one region right on y, image 2 leans
# towards y everywhere but never gets there
STORE = torch.stack([
    unit([1, 0, 0], [1, 0.1, 0], [1, 0, 0.1], [0.9, 0.1, 0.1], [1, 0.2, 0]),
    unit([0, 0, 1], [0, 0.2, 1], [0, 1, 0], [0.1, 0, 1], [0, 0.1, 1]),
    unit([0.5, 0.8, 0], [0.6, 0.7, 0], [0.5, 0.8, 0.1], [0.7, 0.7, 0], [0.6, 0.8, 0]),
])


def test_maxsim_against_a_hand_computed_ranking():
    query = unit([0, 1, 0])
    ranked = exact_search(STORE, query, top=3)
    # image 1: region 2 is (0, 1, 0) itself -> 1.0; image 2: best is (0.5, 0.8, 0)/|.| -> 0.8 / sqrt(0.89) = 0.848;
    # image 0: best is (1, 0.2, 0)/|.| -> 0.2 / sqrt(1.04) = 0.196
    assert ranked.rows.tolist() == [[1, 2, 0]]
    assert ranked.regions.tolist() == [[2, 0, 4]]
    torch.testing.assert_close(ranked.scores, torch.tensor([[1.0, 0.8 / 0.89 ** 0.5, 0.2 / 1.04 ** 0.5]]))
    # the whole-image control sees region 0 only: image 2's whole leans to y, image 1's whole is z
    whole = exact_search(STORE, query, top=3, whole_image=True)
    assert whole.rows.tolist() == [[2, 0, 1]] and whole.regions.tolist() == [[0, 0, 0]]
    torch.testing.assert_close(whole.scores, torch.tensor([[0.8 / 0.89 ** 0.5, 0.0, 0.0]]))


def test_several_queries_ties_and_a_short_store():
    queries = unit([1, 0, 0], [0, 0, 1])
    ranked = exact_search(STORE, queries, top=10)                    # top > N: every image
    assert ranked.rows.shape == (2, 3)
    assert ranked.rows[0, 0] == 0 and ranked.regions[0, 0] == 0     # image 0's whole image is (1, 0, 0) itself
    assert ranked.rows[1].tolist()[0] == 1
    same = torch.ones(4, 2, 2) / 2                                   # four identical images
    assert exact_search(same, unit([1, 1]), top=4).rows.tolist() == [[0, 1, 2, 3]]   # ties: the lower row
    assert exact_search(same, unit([1, 1]), top=4).regions.tolist() == [[0, 0, 0, 0]]  # the whole image first


def test_bad_arguments():
    with pytest.raises(ValueError, match="agree in D"):
        exact_search(STORE, unit([1, 0]), top=1)
    with pytest.raises(ValueError, match="top must be at least 1"):
        exact_search(STORE, unit([1, 0, 0]), top=0)
    assert exact_search(STORE, torch.zeros(0, 3), top=2).rows.shape == (0, 2)


def test_chunked_queries_match_one_by_one():
    gen = torch.Generator().manual_seed(4)                           # the same queries on every run
    store = random_store(300, dim=16)
    queries = torch.nn.functional.normalize(torch.randn(150, 16, generator=gen), dim=-1)
    together = exact_search(store, queries, top=7)                   # 150 queries: three chunks of 64
    for i in (0, 63, 64, 149):
        alone = exact_search(store, queries[i:i + 1], top=7)
        assert torch.equal(alone.rows, together.rows[i:i + 1]) and torch.equal(alone.regions, together.regions[i:i + 1])
        torch.testing.assert_close(alone.scores, together.scores[i:i + 1])


@needs_faiss
def test_the_index_against_exact_on_100k_random_images():
    store = random_store(100_000)                                    # 500k region vectors
    queries = torch.nn.functional.normalize(torch.randn(40, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
    index = QuantizedSearch()
    index.sync(store)
    found, exact = index.search(store, queries, top=10), exact_search(store, queries, top=10)
    recall = sum(len(set(f) & set(e)) for f, e in zip(found.rows.tolist(), exact.rows.tolist())) / exact.rows.numel()
    assert recall >= 0.99
    # its scores and regions are exact: the candidates are re-scored by exact_search
    for f_scores, f_rows, f_regions, e_scores, e_rows, e_regions in zip(*found, *exact):
        truth = {row: (score, region) for row, score, region in zip(e_rows.tolist(), e_scores.tolist(),
                                                                    e_regions.tolist())}
        for row, score, region in zip(f_rows.tolist(), f_scores.tolist(), f_regions.tolist()):
            if row in truth:
                assert score == pytest.approx(truth[row][0], abs=1e-6) and region == truth[row][1]
        assert f_scores.tolist() == sorted(f_scores.tolist(), reverse=True)


@needs_faiss
def test_the_index_grows_with_the_store_and_rebuilds_when_stale():
    store = random_store(3000, dim=32)
    queries = torch.nn.functional.normalize(torch.randn(8, 32, generator=torch.Generator().manual_seed(2)), dim=-1)
    index = QuantizedSearch()
    index.sync(store[:2000])
    assert index.rows == index.trained_rows == 2000
    index.sync(store)                                                # appended, not retrained
    assert index.rows == 3000 and index.trained_rows == 2000 and index.index.ntotal == 15000
    assert torch.equal(index.search(store, queries, 5).rows, exact_search(store, queries, 5).rows)
    changed = store.clone()
    changed[17] = queries[0]                                         # image 17 now holds query 0 in every region
    index.stale = True
    index.sync(changed)
    assert index.trained_rows == 3000
    assert index.search(changed, queries, 5).rows[0, 0] == 17
    with pytest.raises(RuntimeError, match="before sync"):
        index.search(store[:10], queries, 5)


def test_ties_at_the_cut_off_go_to_the_lower_rows():
    same = unit([1, 0, 0]).expand(40, 5, 3).contiguous()                 # 40 identical images
    for top in (1, 3, 39):
        assert exact_search(same, unit([1, 0, 0]), top=top).rows.tolist() == [list(range(top))]


@needs_faiss
def test_faiss_ties_and_no_queries_match_exact():
    same = unit([1, 0, 0]).expand(40, 5, 3).contiguous()
    index = QuantizedSearch()
    index.sync(same)
    assert index.search(same, unit([1, 0, 0]), top=3).rows.tolist() == [[0, 1, 2]]
    empty = index.search(same, torch.zeros(0, 3), top=3)
    assert empty.rows.shape == (0, 3) and empty.scores.shape == (0, 3)


@needs_faiss
def test_rows_outside_the_trained_range_retrain_the_quantizer():
    """Rows appended from another part of the space than the index was trained on would be clipped by the 8-bit
    codes and lose candidates (recall@10 0.77 on this data when appended): they retrain it instead."""
    gen = torch.Generator().manual_seed(3)

    def spread_over(dims: slice, n: int) -> torch.Tensor:      # large in `dims`, small elsewhere
        x = torch.randn(n, 5, 32, generator=gen) * 0.05
        x[..., dims] = torch.randn(n, 5, 16, generator=gen)
        return torch.nn.functional.normalize(x, dim=-1)

    first, shifted = spread_over(slice(0, 16), 600), spread_over(slice(16, 32), 400)
    index = QuantizedSearch()
    index.sync(first)
    store = torch.cat([first, shifted])
    index.sync(store)
    assert index.trained_rows == len(store)                               # retrained, not appended
    queries = torch.nn.functional.normalize(shifted[:50, 1] + 0.05 * torch.randn(50, 32, generator=gen), dim=-1)
    got, want = index.search(store, queries, top=10).rows, exact_search(store, queries, top=10).rows
    assert sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, want)) / want.numel() >= 0.99
    grown = torch.cat([store, spread_over(slice(16, 32), 30)])
    index.sync(grown)
    assert index.trained_rows == len(store) and index.rows == len(grown)  # within the range: appended


@needs_faiss
def test_an_index_built_empty_trains_on_its_first_rows():
    index = QuantizedSearch()
    index.sync(torch.zeros(0, 5, 8))
    store = random_store(2, dim=8)
    index.sync(store)                                                     # was: add() to an untrained index
    assert index.search(store, store[:1, 0], top=2).rows[0, 0] == 0
