"""`pixeltriage bench cpu` end to end on the tiny preset (its figures are the benchmark's business, not a test's)."""
import functools
import io
import json
import statistics

import pytest
import torch
from cli_inputs import used_cache

from pixeltriage.bench import cpu
from pixeltriage.bench.models.flops import PROFILER_STAGES
from pixeltriage.bench.timing import cpu_machine, machine_line
from pixeltriage.cli import main
from pixeltriage.kernels import native, tuning

# a report as `cpu.bench` returns it, for print_table (figures made up)
_TABLE = {"preset": "tiny", "dtype": "float32", "threads": 1, "tokens": 600, "memories": 3, "tflop": 0.01,
          "engine_s": 0.1, "transformers_s": 0.3, "speedup": 3.0, "paired_speedups": [3.0], "gemm_tflops": 0.5,
          "gemm_tflops_before_after": [0.5, 0.5], "gemm_tflops_beside_runs": [0.5], "achieved_tflops": 0.1,
          "fraction_of_gemm": 0.2, "ceiling_speedup": 15.0, "gemm_bound_s": 0.02, "kernels": {}, "stages": []}


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_cpu_runs_and_reports_interleaved_timings(tmp_path, monkeypatch, capsys, restore_threads):
    # a cache of its own, with the test run's built C kernels
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(used_cache(tmp_path / "cache")))
    # the GEMM rate on 512 x 512 matrices (the command's 2048: 64 times the work, most of this test's time); what is
    # checked is how the samples make the run's rate, not the rate
    monkeypatch.setattr(cpu, "gemm_tflops", functools.partial(cpu.gemm_tflops, n=512))
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
    # the run's GEMM rate: the median of the samples before, beside each engine run and after
    assert len(r["gemm_tflops_beside_runs"]) == 2
    assert r["gemm_tflops"] == statistics.median(r["gemm_tflops_before_after"] + r["gemm_tflops_beside_runs"])
    # the C delta pass reports its conv + SiLU apart ("delta_conv") whenever it runs; the torch path cannot
    split = native.available()
    expected = [k for k in PROFILER_STAGES if split or k != "delta_conv"]
    assert set(expected) | {"other"} <= set(r["stages_s"]) and ("delta_conv" in r["stages_s"]) == split
    # the per-stage table: every stage in order, then "other"; their FLOPs are the forward's
    stages = r["stages"]
    assert [row["stage"] for row in stages] == [*expected, "other"]
    delta = ["delta conv + SiLU", "delta_rule (recurrence)"] if split else ["delta_rule (conv + recurrence)"]
    assert [row["name"] for row in stages][:3 + len(delta)] == ["vision matmuls (+ norms)", "vision attention",
                                                                "gated_delta projections", *delta]
    assert all(set(row) == {"stage", "name", "flops", "seconds", "tflops", "of_gemm"} for row in stages)
    assert sum(row["flops"] for row in stages) == pytest.approx(r["tflop"] * 1e12, rel=1e-12)
    assert all(row["flops"] > 0 for row in stages[:-1]) and stages[-1]["flops"] == 0
    for row in stages:
        assert row["seconds"] == r["stages_s"][row["stage"]]
        if row["tflops"] is not None:
            assert row["tflops"] == pytest.approx(row["flops"] / row["seconds"] / 1e12)
            assert row["of_gemm"] == pytest.approx(row["tflops"] / r["gemm_tflops"])
    assert len(r["paired_speedups"]) == 2
    from pixeltriage.kernels import registry

    # the Scorer's kernels: the registry's choices, the weights its first forward reordered (kernels.prepack) and
    # the C library's build
    assert r["kernels"]["native"] == (native.variant() or "none")
    assert ({op: k for op, k in r["kernels"].items() if op not in ("prepacked", "native")}
            == registry.choices("cpu", torch.float32))
    assert "gated_delta" in r["kernels"]
    # what the two timed engine runs ran: the C build loaded, and where it is, its delta pass, declining nothing
    assert r["native_variant"] == native.variant()
    ran = r["kernels_ran"]
    assert set(ran) == {"calls", "declines"} and ran["calls"]["gated_delta"]
    if native.available():
        assert set(ran["calls"]["gated_delta"]) == {"native C pt_delta_chunked"} and not ran["declines"]
    assert r["machine"] == dict(cpu_machine(), torch_threads=1) and r["machine"]["torch_threads"] == r["threads"]
    buf = io.StringIO()
    cpu.print_table(r, buf)
    assert f"machine       {r['machine']['cpu']}, {r['machine']['logical_cpus']} logical CPUs" in buf.getvalue()
    assert f"gated_delta kernel {r['kernels']['gated_delta']}" in buf.getvalue()
    assert f"projection kernel  {r['kernels']['projection']}" in buf.getvalue()
    assert f"C kernels build    {r['native_variant'] or 'none loaded'}" in buf.getvalue()
    # float32: the machine's measured GEMM library, the one the projections ran
    from pixeltriage.bench import tune
    from pixeltriage.kernels import linear

    assert r["float32_gemm"] == tune.kept_records(torch.float32)[0]["float32 GEMM"]
    if r["float32_gemm"] is not None:
        assert r["float32_gemm"] == linear.float32_choice()
        assert (r["float32_gemm"]["library"] == "oneDNN") is linear.plain_onednn("cpu", torch.float32)
        assert f"float32 GEMM       {r['float32_gemm']['library']}: oneDNN's primitive took" in buf.getvalue()
    assert tune.kept_records(torch.bfloat16)[0]["float32 GEMM"] is None
    from pixeltriage.kernels import attention

    assert r["float32_attention"] == tune.kept_records(torch.float32)[0]["float32 attention"]
    if r["float32_attention"] is not None:
        att = r["float32_attention"]
        assert att == attention.attention_choice(torch.float32) and {att["causal"], att["segments"]} <= {"C", "SDPA"}
        assert f"float32 attention  causal {att['causal']}" in buf.getvalue()
    assert tune.kept_records(torch.bfloat16)[0]["float32 attention"] is None
    assert r["bf16_attention"] is None and tune.kept_records(torch.float32)[0]["bf16 attention"] is None
    assert r["bf16_delta"] is None and tune.kept_records(torch.float32)[0]["bf16 delta pass"] is None
    assert r["bf16_prepack"] is None and tune.kept_records(torch.float32)[0]["bf16 prepacked weights"] is None
    assert "bf16 weights" not in buf.getvalue()
    from pixeltriage.kernels import prepack

    # float32: the weights reordered for oneDNN where its projections run the primitive (and measured faster)
    assert r["float32_prepack"] == tune.kept_records(torch.float32)[0]["float32 prepacked weights"]
    assert (r["float32_prepack"] is None) == (prepack.applies("cpu", torch.float32) is not None)
    assert ("prepacked" in r["kernels"]) == bool(prepack.chosen_roles("cpu", torch.float32))
    assert "speed-up" in buf.getvalue() and "before" in buf.getvalue() and "beside it" in buf.getvalue()
    assert "beside the engine runs" in buf.getvalue()
    assert f"ceiling       {r['ceiling_speedup']:.2f}x" in buf.getvalue()
    assert all(name in buf.getvalue() for name in delta) and "of GEMM" in buf.getvalue()
    drifted = dict(r, gemm_tflops_before_after=[0.7, 2.1])
    buf = io.StringIO()
    cpu.print_table(drifted, buf)
    assert "moved 3.0x" in buf.getvalue()


def test_the_table_says_why_float32_is_on_f_linear_where_the_primitive_refuses_the_cpu():
    # the record `linear.measure_float32_gemm` keeps when the primitive raises (tests/kernels/test_tuning.py)
    record = {"library": "F.linear", "error": "could not create a primitive descriptor", "shape": [16, 8, 8],
              "pairs": 1, "measured": "2026-12-02 23:00:00"}
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "float32_gemm": record}, buf)
    assert "float32 GEMM       F.linear: oneDNN's primitive failed here (could not create" in buf.getvalue()


def test_the_table_names_each_dtypes_attention_choice_per_mask():
    # the records `attention.measure_attention` keeps (tests/kernels/test_fast_paths.py)
    f32 = {"pairs": 7, "measured": "2026-12-03 01:00:00", "causal": "C", "causal_c_over_sdpa": 0.65,
           "segments": "SDPA", "segments_c_over_sdpa": 1.02}
    bf16 = {"pairs": 7, "measured": "2026-12-03 01:00:01", "causal": "SDPA", "causal_c_over_sdpa": 1.1,
            "segments": "C", "segments_c_over_sdpa": 0.7, "engine": "avx512_bf16"}
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "float32_attention": f32, "bf16_attention": bf16}, buf)
    assert ("float32 attention  causal C (C 0.65x SDPA's time); segments SDPA (C 1.02x SDPA's time); measured "
            "2026-12-03 01:00:00, kept per machine") in buf.getvalue()
    assert ("bf16 attention     causal SDPA (C 1.10x SDPA's time); segments C (C 0.70x SDPA's time); on "
            "avx512_bf16; measured 2026-12-03 01:00:01, kept per machine") in buf.getvalue()
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "bf16_attention": None}, buf)
    assert "attention  " not in buf.getvalue()


def test_the_table_names_the_measured_bf16_delta_pass():
    # the record `gated_delta.bf16.measure_delta` keeps (tests/kernels/test_gated_delta.py)
    record = {"pass": "bf16", "bf16_over_float32": 0.744, "engine": "avx512_bf16", "shape": [1024, 16, 128],
              "pairs": 7, "measured": "2026-12-03 05:03:22"}
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "bf16_delta": record}, buf)
    assert ("bf16 delta pass    bf16 (the bf16 pass 0.74x the float32 pass's time) on avx512_bf16; measured "
            "2026-12-03 05:03:22, kept per machine") in buf.getvalue()
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "bf16_delta": {"pass": "float32", "engine": None, "measured": "2026-12-03 05:03:22"}},
                    buf)
    assert "bf16 delta pass    float32; measured 2026-12-03 05:03:22, kept per machine" in buf.getvalue()
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "bf16_delta": None}, buf)
    assert "bf16 delta pass" not in buf.getvalue()


def test_the_table_names_the_bf16_weights_layout():
    # the record `prepack.measure` keeps (tests/kernels/test_prepack.py) and the roles a Scorer reordered
    record = {"layout": "packed", "packed_over_plain": 0.9486, "quartiles": [0.83, 0.96], "shape": [2048, 1024, 4096],
              "pairs": 7, "measured": "2026-12-03 14:30:48"}
    kernels = {**_TABLE.get("kernels", {}), "prepacked": "oneDNN's layout, reordered by the first forward: down"}
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "bf16_prepack": record, "kernels": kernels}, buf)
    assert ("bf16 weights       packed (packed 0.95x plain's time); measured 2026-12-03 14:30:48, kept per "
            "machine") in buf.getvalue()
    assert "weights            oneDNN's layout, reordered by the first forward: down" in buf.getvalue()
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "bf16_prepack": {"layout": "plain", "error": "refused", "measured": "x"},
                     "float32_prepack": {**record, "packed_over_plain": 0.93}}, buf)
    assert "bf16 weights       plain; measured x, kept per machine" in buf.getvalue()
    assert "float32 weights    packed (packed 0.93x plain's time)" in buf.getvalue()


def test_the_machine_a_figure_comes_from():
    """/proc/cpuinfo's first model name and the bf16 units among its flags (x86's lscpu names, aarch64's Features);
    none listed where the text has none, the platform's name where it has no model name."""
    x86 = ("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\n"
           "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu\n")
    m = cpu_machine(x86)
    assert m["cpu"] == "Some Xeon" and m["bf16_units"] == ["amx_bf16", "avx512_bf16"]
    assert m["torch"] == torch.__version__ and m["logical_cpus"] >= 1 and m["torch_threads"] == torch.get_num_threads()
    assert cpu_machine("model name\t: Zen\nflags\t\t: fpu avx2 fma\n")["bf16_units"] == []
    arm = cpu_machine("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd4f\n")
    assert arm["bf16_units"] == ["bf16"] and arm["cpu"]
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "machine": cpu_machine("model name : Zen\nflags : fpu avx2\n")}, buf)
    assert "machine       Zen," in buf.getvalue() and "bf16 units: none (bf16 matmuls emulated)" in buf.getvalue()
    assert m["malloc"] == tuning.malloc_condition() and f"; {m['malloc']}" in buf.getvalue()   # tuned or not
    assert m["workspace"] == "workspace on" and "; workspace on" in buf.getvalue()


def test_the_machine_record_says_when_the_workspace_is_off(monkeypatch):
    monkeypatch.setenv("PIXELTRIAGE_WORKSPACE", "0")
    m = cpu_machine("model name : Zen\nflags : fpu avx2\n")
    assert m["workspace"] == "workspace off"
    assert machine_line(m).endswith("; workspace off")


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


def test_stage_rows_put_unknown_stages_before_other_and_skip_rates_without_time():
    rows = cpu.stage_rows({"mlp": 4e12, "vision": 1e12}, {"mlp": 2.0, "vision": 0.0, "pack": 0.5, "other": 0.25},
                          gemm_rate=4.0)
    assert [r["stage"] for r in rows] == [*(k for k in PROFILER_STAGES if k != "delta_conv"), "pack", "other"]
    by_stage = {r["stage"]: r for r in rows}
    assert by_stage["delta_rule"]["name"] == "delta_rule (conv + recurrence)"      # no conv part: both in it
    mlp = by_stage["mlp"]
    assert mlp["tflops"] == 2.0 and mlp["of_gemm"] == 0.5
    assert rows[0]["tflops"] is None and rows[0]["of_gemm"] is None          # vision: no time recorded
    assert rows[-1] == {"stage": "other", "name": "other", "flops": 0, "seconds": 0.25, "tflops": 0.0,
                        "of_gemm": 0.0}


def test_a_part_a_kernel_reports_is_its_own_stage(monkeypatch):
    """A part of a kernel's call that the kernel measured inside it (`native.part_recorder`) counts to itself and
    out of the stage around the call; nobody records it when no profiler records (the kernel then measures
    nothing), nor while a profiler is paused."""
    from pixeltriage.engine import profiling

    clock = iter(range(100))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: float(next(clock)))
    assert native.part_recorder() is None
    with profiling.record() as stages:
        with profiling.stage("gated_delta"):           # reads 0 ...
            with profiling.stage("delta_rule"):        # 1 ...
                native.part_recorder()("delta_conv", 0.25)
                with profiling.paused():
                    assert native.part_recorder() is None
                                                       # ... 2: 1 s, of which 0.25 s the part
                                                       # ... 3: 3 s, of which 1 s nested
    assert dict(stages) == {"gated_delta": 2.0, "delta_rule": 0.75, "delta_conv": 0.25}
    assert native.part_recorder() is None


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
@pytest.mark.parametrize("bf16_pass", [False, True])
def test_the_c_delta_passes_report_their_conv_without_changing_their_output(bf16_pass):
    """While a profiler records, the C delta passes (float32 pass, bf16 pass on the "fma" engine) report the conv +
    SiLU's share of their time as "delta_conv" (a positive part of the call, not all of it); their output is the
    same bit for bit as without a profiler."""
    from pixeltriage.engine import profiling
    from pixeltriage.kernels.gated_delta import bf16, conv_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2 * 2 * 32 + 2 * 64, generator=gen).bfloat16()
    weight, g, beta = torch.randn(x.shape[1], 4, generator=gen), -torch.rand(200, 2) * 2, torch.rand(200, 2)

    def run():
        if bf16_pass:
            return bf16.conv_chunk_rule_bf16(x, weight, g, beta, 2, 32, 64, engine_name="fma")
        return conv_chunk_gated_delta_rule(x, weight, g, beta, 2, 32, 64)

    plain = run()
    with profiling.record() as stages:
        with profiling.stage("delta_rule"):
            profiled = run()
    assert torch.equal(plain, profiled)
    assert set(stages) == {"delta_rule", "delta_conv"} and stages["delta_conv"] > 0 and stages["delta_rule"] > 0


def test_a_nested_stage_is_exclusive(monkeypatch):
    """A stage inside another counts its own time only to itself; the stages of a block add up to the time
    they cover (a clock that moves 1 s per reading)."""
    from pixeltriage.engine import profiling

    clock = iter(range(100))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: float(next(clock)))
    with profiling.record() as stages:
        with profiling.stage("gated_delta"):           # reads 0 ...
            with profiling.stage("delta_rule"):        # 1, 2: 1 s
                pass
            with profiling.stage("delta_rule"):        # 3 ...
                with profiling.stage("inner"):         # 4, 5: 1 s
                    pass
                                                       # ... 6: 3 s, of which 1 s in "inner"
                                                       # ... 7: 7 s, of which 1 + 3 s nested
        with profiling.stage("mlp"):                   # 8, 9: 1 s
            pass
    assert dict(stages) == {"gated_delta": 3.0, "delta_rule": 3.0, "inner": 1.0, "mlp": 1.0}
    assert sum(stages.values()) == 9.0 - 1.0           # all but the 1 s between the two top-level stages
    with profiling.stage("mlp"):                       # nothing records: no clock read
        pass
    assert next(clock) == 10


def test_the_table_says_which_mlps_ran_in_row_blocks():
    # the records `linear.measure_row_blocks` keeps (tests/kernels/test_tuning.py), as a forward followed them
    rows = {"decoder MLP [2048 -> 6144] torch.bfloat16": {"rows": 1024, "blocks_over_whole": 0.9027, "tokens": 2296,
                                                         "pairs": 5, "measured": "2026-12-03 08:49:31"},
            "ViT MLP [1024 -> 4096] torch.bfloat16": {"rows": 0, "blocks_over_whole": 1.0319, "tokens": 4000,
                                                     "pairs": 5, "measured": "2026-12-03 08:49:25"}}
    buf = io.StringIO()
    cpu.print_table({**_TABLE, "row_blocks": rows}, buf)
    assert ("MLP rows           decoder MLP [2048 -> 6144] torch.bfloat16: in blocks of 1024 rows (blocks 0.90x the "
            "whole's time at 2296 tokens; measured 2026-12-03 08:49:31, kept per machine)") in buf.getvalue()
    assert "ViT MLP [1024 -> 4096] torch.bfloat16: whole (blocks 1.03x" in buf.getvalue()
