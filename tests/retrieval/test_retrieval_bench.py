"""`pixeltriage bench retrieval` runs end to end on the tiny demo encoder (its figures are not checked: tests never
assert timings; no --threads here, which would set torch's threads for the rest of the session)."""
import json

from pixeltriage.cli import main


def test_bench_retrieval_runs(tiny_encoder_dir, capsys):
    argv = ["bench", "retrieval", "--encoder", str(tiny_encoder_dir), "--images", "2", "--image-size", "200x150",
            "--batch", "2", "--repeats", "1", "--stored", "300", "--queries", "2", "--load", "20"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["threads"] >= 1 and report["image_size"] == [200, 150]
    assert set(report["stages"]) == {"put_ms", "crop_ms", "preprocess_ms", "encode_ms", "store_ms", "total_ms"}
    assert set(report["add"]) == {"images_per_batch_1", "images_per_batch_2", "batched_speedup"}
    search = report["search"][0]
    assert search["stored"] == 300 and search["vector_bytes"] == 300 * 5 * 32 * 4
    from pixeltriage.retrieval.search import faiss_available

    faiss_keys = {"faiss_build_s", "faiss_ms", "faiss_recall_at_10", "faiss_speedup"}
    if faiss_available():      # the quantized index finds the exact top 10 at this size
        assert faiss_keys <= set(search) and search["faiss_recall_at_10"] == 1.0
    else:                      # no faiss: no faiss figures, rather than a made-up recall
        assert not faiss_keys & set(search)
    assert report["load"]["stored"] == 20
    assert main(argv) == 0
    assert "images/s" in capsys.readouterr().out


def test_search_latency_recall_is_measured_against_exact(monkeypatch):
    """The recall is counted from the index's own answers: an index that returns other rows lowers it."""
    import pytest

    from pixeltriage.bench.retrieval_speed import search_latency
    from pixeltriage.retrieval import search as search_mod

    if not search_mod.faiss_available():
        pytest.skip("faiss is not installed (the extra `retrieval`)")
    assert search_latency(300, 32, 4)["faiss_recall_at_10"] == 1.0
    original = search_mod.QuantizedSearch.search

    def shifted(self, vectors, queries, k, *args, **kwargs):       # a wrong index: answers the next rows
        found = original(self, vectors, queries, k, *args, **kwargs)
        found.rows[:] = (found.rows + 1) % vectors.shape[0]
        return found

    monkeypatch.setattr(search_mod.QuantizedSearch, "search", shifted)
    assert search_latency(300, 32, 4)["faiss_recall_at_10"] < 0.5
