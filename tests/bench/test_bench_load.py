"""`pixeltriage bench load`: the per-process measurement and the report (timings are printed, never asserted)."""
import io
import time

import pytest
import torch

from pixeltriage.bench import load
from pixeltriage.weights.packed import pack_checkpoint


def _spy(monkeypatch, owner, name, spans, key):
    """Wrap `owner.name` so each call records its own (start, end) under spans[key]."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        spans.setdefault(f"{key} kwargs", []).append(kwargs)
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans.setdefault(key, []).append((t0, time.perf_counter()))

    monkeypatch.setattr(owner, name, timed)


@pytest.mark.parametrize("method", load.METHODS)
def test_child_measures_each_method(tiny_checkpoint, tmp_path, monkeypatch, method):
    """The two clocks bracket the work they name: `load_s` covers the load call, `first_s - load_s` the first
    score. The load and the score are timed from inside by spies; the child's windows must contain them. This is
    an order check on one clock, not a speed assertion (moving either stamp off its work fails it)."""
    path = tiny_checkpoint
    if method in ("packed", "packed_reordered"):
        path = tmp_path / "p.safetensors"
        pack_checkpoint(tiny_checkpoint, path, dtype=torch.bfloat16)
    spans: dict = {}
    if method == "transformers":
        import transformers

        from pixeltriage.bench import transformers_baseline

        cls = transformers.Qwen3_5ForConditionalGeneration
        _spy(monkeypatch, cls, "from_pretrained", spans, "load")
        _spy(monkeypatch, transformers_baseline, "transformers_hidden", spans, "score")
    else:
        from pixeltriage import Scorer

        _spy(monkeypatch, Scorer, "load", spans, "load")
        _spy(monkeypatch, Scorer, "score", spans, "score")
    t_call = time.perf_counter()
    out = load._child(method, str(path), "bfloat16")
    t_back = time.perf_counter()
    assert out["method"] == method
    assert len(spans["load"]) == 1 and len(spans["score"]) == 1, spans
    (load_a, load_b), (score_a, score_b) = spans["load"][0], spans["score"][0]
    # The child's clock starts (t_start) between our call and the load, and reads load_s and first_s from it.
    t_start_latest = load_a
    t_start_earliest = t_call + out["import_s"]
    assert t_start_earliest <= t_start_latest
    assert out["load_s"] >= load_b - load_a            # the load window holds the whole load call
    assert out["first_s"] - out["load_s"] >= score_b - score_a   # the first-score window holds the score call
    assert t_call + out["import_s"] + out["first_s"] <= t_back
    assert out["peak_rss"] > 50 * 2**20
    if method != "transformers":     # loaded as `pixeltriage score` loads for one question, or reordering
        assert spans["load kwargs"][0]["reorder_weights"] is (method == "packed_reordered")


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
