"""The GPU check script's logic, run on the CPU with tiny shapes (its GPU figures come only from a GPU run)."""
import json

from pixeltriage.bench import gpu_check


def test_gpu_check_runs_end_to_end_on_the_cpu(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path / "cache"))
    rc = gpu_check.main(["--device", "cpu", "--parity-presets", "tiny", "--timing-preset", "tiny", "--iters", "3",
                         "--batch", "2", "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert "error" not in r, r.get("error")
    assert rc == 0
    assert set(r["parity"]) == {"tiny/float32", "tiny/bfloat16"}
    assert r["parity"]["tiny/float32"]["max_abs_diff"] == 0.0            # CPU against itself: identical
    t = r["timing"]
    assert t["batch_1_cached_vision"]["vision_counts"]["cached"] >= 10
    assert t["batch_2"]["questions_per_s"] > 0 and t["tflop_per_question_cached"] < t["tflop_per_question"]
    g = t["batch_1_cuda_graphs"]                                # on the CPU: the padded static path, eagerly
    assert g["ok"] and not g["captured"] and g["max_abs_diff_vs_eager"] <= 1e-5 and g["replays"]["graph"] >= 4
    capsys.readouterr()


def test_no_cuda_is_a_clear_exit(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
