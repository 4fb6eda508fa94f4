"""`pixeltriage bench cpu` end to end on the tiny preset (its figures are the benchmark's business, not a test's)."""
import io
import json

from pixeltriage.bench import cpu
from pixeltriage.cli import main


def test_bench_cpu_runs_and_reports_interleaved_timings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "cpu", "--preset", "tiny", "--dtype", "float32", "--repeats", "2", "--memories", "3",
                 "--tokens", "600", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["memories"] == 3 and 0 < r["tokens"] <= 600
    assert len(r["engine_times"]) == 2 and len(r["transformers_times"]) == 2
    assert r["speedup"] == r["transformers_s"] / r["engine_s"]
    assert len(r["gemm_tflops_before_after"]) == 2 and r["gemm_tflops"] > 0
    assert {"vision", "gated_delta", "mlp", "attention", "head"} <= set(r["stages_s"])
    buf = io.StringIO()
    cpu.print_table(r, buf)
    assert "speed-up" in buf.getvalue() and "before" in buf.getvalue()
