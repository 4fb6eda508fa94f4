"""`pixeltriage bench latency`: the percentiles and one small end-to-end report (never a timing)."""
import io
import json

import pytest

from pixeltriage.bench import latency, workloads
from pixeltriage.bench.timing import cpu_machine
from pixeltriage.cli import main


def test_percentiles():
    p = latency.percentiles([float(i) for i in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"]) == (51.0, 90.0, 99.0)
    assert latency.percentiles([2.0])["p99"] == 2.0


def test_report_end_to_end(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tiny_checkpoint.parent.parent / "cache"))
    monkeypatch.setattr(workloads, "PHOTO_SIZES", [(64, 64), (96, 64), (56, 112)])     # small images: a quick run
    args = ["bench", "latency", "--questions", "3", "--batch", "2", "--k", "1", "--profile", str(tmp_path / "prof"),
            "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["machine"] == dict(cpu_machine(), torch_threads=r["threads"]) and "gpu" not in r["machine"]
    buf = io.StringIO()
    latency.print_report(r, buf)
    assert f"machine  {r['machine']['cpu']}, {r['machine']['logical_cpus']} logical CPUs" in buf.getvalue()
    s1 = r["system_one"]
    assert s1["batch_1"]["questions"] == 3 and s1["batch_2"]["batches"] == 1
    assert s1["batch_1"]["p50"] <= s1["batch_1"]["p99"]
    ans = r["answering"]
    assert ans["open_all"]["visual_tokens"] > ans["ours@1"]["visual_tokens"] > 0
    stages = r["profile"]["stages"]
    assert {"preprocess", "pack", "vision", "vision_attention", "gated_delta", "delta_rule", "mlp", "head",
            "total"} <= set(stages)
    assert stages["mlp"]["tflop"] > 0 and stages["total"]["seconds"] > 0
    # every timed stage of the forward carries its own FLOPs (none left at zero by a stale stage mapping)
    assert all(stages[s]["tflop"] > 0 for s in ("vision", "vision_attention", "gated_delta", "delta_rule", "head"))
    assert (tmp_path / "prof" / "trace.json").stat().st_size > 0


def test_plot_needs_matplotlib_or_draws(tmp_path):
    r = {"per_question_s": {"open_all": 1.0, "ours@1": 0.2}, "answering": {"scale": "tiny"}}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from pixeltriage.errors import PixelTriageError
        with pytest.raises(PixelTriageError, match="matplotlib"):
            latency.plot(r, str(tmp_path / "p.png"))
        return
    latency.plot(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
