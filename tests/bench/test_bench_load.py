"""`pixeltriage bench load`: the per-process measurement and the report (timings are printed, never asserted)."""
import io

import pytest
import torch

from pixeltriage.bench import load
from pixeltriage.weights.packed import pack_checkpoint


@pytest.mark.parametrize("method", load.METHODS)
def test_child_measures_each_method(tiny_checkpoint, tmp_path, method):
    path = tiny_checkpoint
    if method == "packed":
        path = tmp_path / "p.safetensors"
        pack_checkpoint(tiny_checkpoint, path, dtype=torch.bfloat16)
    out = load._child(method, str(path), "bfloat16")
    assert out["method"] == method
    assert 0 < out["load_s"] <= out["first_s"]
    assert out["peak_rss"] > 50 * 2**20


def test_weights_bytes_counts_what_is_loaded(tiny_checkpoint):
    from safetensors import safe_open

    n = 0
    for f in tiny_checkpoint.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            n += sum(h.get_tensor(k).numel() for k in h.keys() if k != "lm_head.weight")
    assert load.weights_bytes(tiny_checkpoint, 2) == 2 * n


def test_table():
    row = {"load_s": 1.0, "first_s": 2.0, "peak_rss": 2**30, "peak_rss_over_weights": 1.1}
    report = {"preset": "tiny", "dtype": "bfloat16", "repeats": 1, "weights_bytes": 2**30,
              "methods": {m: dict(row) for m in load.METHODS}, "first_score_speedup_vs_transformers": 1.0,
              "first_score_speedup_vs_directory": 1.0, "load_speedup_vs_directory": 1.0,
              "load_speedup_vs_transformers": 1.0}
    buf = io.StringIO()
    load.print_table(report, buf)
    assert "packed" in buf.getvalue() and "transformers" in buf.getvalue()
