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
    assert search.get("faiss_recall_at_10", 1.0) == 1.0
    assert report["load"]["stored"] == 20
    assert main(argv) == 0
    assert "images/s" in capsys.readouterr().out
