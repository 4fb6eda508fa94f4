"""`pixeltriage bench cpu` end to end on the tiny preset (its figures are the benchmark's business, not a test's)."""
import io
import json
import statistics

import pytest
import torch

from pixeltriage.bench import cpu
from pixeltriage.cli import main


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_cpu_runs_and_reports_interleaved_timings(tmp_path, monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "cpu", "--preset", "tiny", "--dtype", "float32", "--repeats", "2", "--memories", "3",
                 "--tokens", "600", "--threads", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["threads"] == 1
    # the ceiling: transformers' time over the FLOPs at the GEMM rate; the speed-up is that times the fraction
    assert r["gemm_bound_s"] == pytest.approx(r["tflop"] / r["gemm_tflops"])
    assert r["speedup"] == pytest.approx(r["ceiling_speedup"] * r["fraction_of_gemm"])
    assert r["memories"] == 3 and 0 < r["tokens"] <= 600
    assert len(r["engine_times"]) == 2 and len(r["transformers_times"]) == 2
    assert r["speedup"] == r["transformers_s"] / r["engine_s"]
    assert len(r["gemm_tflops_before_after"]) == 2 and r["gemm_tflops"] > 0
    assert {"vision", "gated_delta", "mlp", "attention", "head"} <= set(r["stages_s"])
    assert len(r["paired_speedups"]) == 2
    buf = io.StringIO()
    cpu.print_table(r, buf)
    assert "speed-up" in buf.getvalue() and "before" in buf.getvalue() and "beside it" in buf.getvalue()
    assert f"ceiling       {r['ceiling_speedup']:.2f}x" in buf.getvalue()
    drifted = dict(r, gemm_tflops_before_after=[0.7, 2.1])
    buf = io.StringIO()
    cpu.print_table(drifted, buf)
    assert "moved 3.0x" in buf.getvalue()


def test_paired_speedups_cancel_a_steady_drift():
    """The machine slows down steadily (10% of its first speed per run); transformers always takes 3x the
    engine's time at the same moment. The ratio of the medians misses 3x; each neighbouring pair does not."""
    slowdown = [1.0 + 0.1 * t for t in range(9)]             # at times 0, 1, 2, ...: runs alternate
    engine = [1.0 * slowdown[2 * i] for i in range(5)]        # engine runs at even times
    hf = [3.0 * slowdown[2 * i + 1] for i in range(2)]        # transformers runs at odd times, between them
    assert cpu.paired_speedups(engine, hf) == pytest.approx([3.0, 3.0])
    assert abs(statistics.median(hf) / statistics.median(engine) - 3.0) > 0.4
    assert cpu.paired_speedups([1.0, 2.0], [3.0, 3.0, 3.0]) == [2.0, 1.5, 1.5]   # more transformers runs


@pytest.mark.parametrize("argv,message", [
    (["cpu", "--threads", "0"], "--threads: must be at least 1, got 0"),
    (["latency", "--threads", "0"], "--threads: must be at least 1, got 0"),
    (["cpu", "--repeats", "0"], "--repeats: must be at least 1, got 0"),
    (["cpu", "--memories", "-1"], "--memories: must be at least 0, got -1"),
    (["latency", "--batch", "0"], "--batch: must be at least 1, got 0"),
    (["load", "--repeats", "0"], "--repeats: must be at least 1, got 0"),
    (["cost", "--scenario", "custom", "--text-tokens", "-1"], "--text-tokens: must be at least 0, got -1"),
    (["cpu", "--threads", "two"], "--threads: invalid int value: 'two'"),
])
def test_bench_counts_out_of_range_are_usage_errors(argv, message, capsys):
    """Counts a benchmark cannot run with (no timed runs, no threads, negative sizes) stop at the command line."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
