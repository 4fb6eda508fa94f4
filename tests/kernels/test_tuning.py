"""Choices measured once per machine (`kernels.tuning`) and the float32 GEMM library chosen by one."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from pixeltriage.kernels import linear, tuning

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path))
    monkeypatch.delenv(tuning.ENV)                  # the records in that cache, as outside the tests
    monkeypatch.setattr(tuning, "_memo", {})
    return tmp_path


def test_a_measured_choice_is_kept_and_read_back_without_measuring(cache, monkeypatch):
    calls = []
    record = tuning.measured("thing", lambda: calls.append(1) or {"library": "a", "ratio": 0.5})
    assert record == {"library": "a", "ratio": 0.5} and len(calls) == 1
    kept = json.loads((cache / tuning.FILE).read_text())
    assert kept == {f"thing @ {tuning.machine_key()}": record}
    assert tuning.measured("thing", lambda: calls.append(1) or {}) == record and len(calls) == 1   # in memory
    monkeypatch.setattr(tuning, "_memo", {})                                                           # a new process
    assert tuning.measured("thing", lambda: calls.append(1) or {}) == record and len(calls) == 1
    other = tuning.measured("other", lambda: {"library": "b"})                 # another name: measured, both kept
    assert other == {"library": "b"} and len(json.loads((cache / tuning.FILE).read_text())) == 2


def test_pixeltriage_tuning_names_the_records_file(cache, monkeypatch):
    """$PIXELTRIAGE_TUNING: the records go to that file (its directory made), none to the cache; unset, to the
    cache's tuning.json again. (The test run's own records: tests/conftest.py.)"""
    own = cache / "elsewhere" / "records.json"
    monkeypatch.setenv(tuning.ENV, str(own))
    assert tuning.path() == own
    record = tuning.measured("thing", lambda: {"library": "a"})
    assert json.loads(own.read_text()) == {f"thing @ {tuning.machine_key()}": record}
    assert not (cache / tuning.FILE).exists() and not [p for p in own.parent.iterdir() if p.name.endswith(".tmp")]
    assert tuning.kept("thi") == {"thing": record}
    monkeypatch.delenv(tuning.ENV)
    monkeypatch.setattr(tuning, "_memo", {})
    assert tuning.path() == cache / tuning.FILE and tuning.kept("thi") == {}


def test_the_test_run_keeps_its_records_apart_from_the_cache():
    """tests/conftest.py: this run's measurements go to a file of its own, not the cache's tuning.json that every
    forward on this machine follows."""
    from pixeltriage.paths import cache_dir

    own = tuning.path()
    assert os.environ.get(tuning.ENV) == str(own) and own != cache_dir() / tuning.FILE
    assert not own.is_relative_to(cache_dir())


def test_the_machine_key_names_the_cpu_torch_and_threads(monkeypatch):
    monkeypatch.delenv("PIXELTRIAGE_WORKSPACE", raising=False)
    key = tuning.machine_key()
    assert torch.__version__ in key and key.endswith(f"x{torch.get_num_threads()}")
    assert f", {tuning.malloc_condition()}, workspace on x" in key
    monkeypatch.setenv("PIXELTRIAGE_WORKSPACE", "0")           # forwards without a workspace: measured apart
    assert tuning.machine_key() == key.replace("workspace on", "workspace off")
    monkeypatch.delenv("PIXELTRIAGE_WORKSPACE")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert tuning.machine_key() != key                     # another thread count: measured again
    finally:
        torch.set_num_threads(threads)


def test_an_unreadable_file_is_measured_again_and_replaced(cache, caplog):
    (cache / tuning.FILE).write_text("{not json")
    with caplog.at_level("WARNING"):
        assert tuning.measured("thing", lambda: {"library": "a"}) == {"library": "a"}
    assert "unreadable" in caplog.text
    assert json.loads((cache / tuning.FILE).read_text()) == {f"thing @ {tuning.machine_key()}": {"library": "a"}}
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_an_unwritable_cache_measures_for_the_process_only(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(blocker / "cache"))          # under a file: mkdir fails
    monkeypatch.delenv("PIXELTRIAGE_TUNING")            # the records in that cache
    monkeypatch.setattr(tuning, "_memo", {})
    calls = []
    with caplog.at_level("WARNING"):
        assert tuning.measured("thing", lambda: calls.append(1) or {"library": "a"}) == {"library": "a"}
        assert tuning.measured("thing", lambda: calls.append(1) or {"library": "b"}) == {"library": "a"}
    assert len(calls) == 1 and "for this process only" in caplog.text


def readline(stream, timeout: float, what: str) -> str:
    """One line of `stream` (a child's pipe); fail the test naming `what` when none comes within `timeout` s."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"waited {timeout:g} s for {what}")


def test_processes_starting_together_measure_once(tmp_path):
    """Four processes ask at once, behind a barrier (each imported and waiting until all are, then all released):
    the first to take the lock measures, and holds it until all four are inside `measured`, so the other three
    contend for it; they wait, then read its record: one measurement in all, one record."""
    script = textwrap.dedent("""
        import json, sys, time
        from pathlib import Path
        from pixeltriage.kernels import tuning
        marks = Path(sys.argv[1])
        def measure():
            with open(marks, "a") as f:
                f.write("measured\\n")
            deadline = time.monotonic() + 120
            while marks.read_text().count("asking") < 4:        # the lock held until every process asks
                if time.monotonic() > deadline:
                    sys.exit(f"waited 120 s for the four processes to ask: {marks.read_text()!r}")
                time.sleep(0.01)
            return {"library": "a", "pid": __import__("os").getpid()}
        print("ready", flush=True)
        if sys.stdin.readline() != "go\\n":
            sys.exit("no go from the test")
        with open(marks, "a") as f:
            f.write("asking\\n")
        print(json.dumps(tuning.measured("together", measure)), flush=True)
    """)
    marks = tmp_path / "marks"
    marks.touch()
    env = {**os.environ, "PIXELTRIAGE_CACHE": str(tmp_path / "cache")}
    env.pop(tuning.ENV)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(marks)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for i, p in enumerate(procs):                                  # the barrier: all four imported and waiting
            assert readline(p.stdout, 120, f"process {i} to import tuning and wait") == "ready\n"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [readline(p.stdout, 120, f"process {i}'s record") for i, p in enumerate(procs)]
        for i, p in enumerate(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"waited 60 s for process {i} to exit after printing its record")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 4
    assert marks.read_text().count("asking") == 4 and marks.read_text().count("measured") == 1
    assert len({json.dumps(json.loads(o)) for o in outs}) == 1


def test_interleaved_ratio_alternates_the_order_and_divides_second_by_first(monkeypatch):
    clock, order = [0.0], []

    def step(name, seconds):
        def run():
            order.append(name)
            clock[0] += seconds
        return run

    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    ratios = tuning.interleaved_ratio(step("a", 1.0), step("b", 3.0), pairs=4, warmup=1)
    assert ratios == [3.0] * 4
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]     # warm-up, then alternating pairs


@pytest.mark.parametrize("ratios, library", [([0.90, 0.91, 0.92], "oneDNN"), ([0.96, 0.98, 1.2], "F.linear"),
                                             ([1.1, 1.2, 1.3], "F.linear")])
def test_float32_gemm_takes_onednn_only_where_clearly_faster(ratios, library, monkeypatch):
    """oneDNN only where its median time is under MARGIN of F.linear's (F.linear's sums are transformers' own);
    the record says why."""
    monkeypatch.setattr(tuning, "interleaved_ratio", lambda first, second, pairs: sorted(ratios))
    record = linear.measure_float32_gemm(pairs=3)
    assert record["library"] == library and record["onednn_over_f_linear"] == pytest.approx(sorted(ratios)[1])
    assert record["shape"] == list(linear.MEASURE_SHAPE) and json.loads(json.dumps(record)) == record


def test_float32_gemm_where_the_primitive_refuses_the_cpu_is_f_linear_and_says_why(monkeypatch):
    class Ops:
        @staticmethod
        def _linear_pointwise(*args):
            raise RuntimeError("could not create a primitive descriptor\nmore")

    monkeypatch.setattr(torch.ops, "mkldnn", Ops(), raising=False)
    record = linear.measure_float32_gemm((16, 8, 8), pairs=1)
    assert record["library"] == "F.linear" and record["error"] == "could not create a primitive descriptor"


def test_float32_gemm_measures_both_products_here(cache):
    if not linear.onednn_available(torch.float32):
        pytest.skip("this torch has no oneDNN linear primitive")
    record = linear.measure_float32_gemm((64, 32, 48), pairs=3)
    assert record["library"] in ("oneDNN", "F.linear") and record["onednn_over_f_linear"] > 0
    assert record["quartiles"][0] <= record["onednn_over_f_linear"] <= record["quartiles"][1]
    assert Path(tuning.path()).parent == cache


def test_a_kept_record_that_does_not_fit_this_process_is_measured_anew(cache):
    """`fits` says whether a kept record applies to this process (the bf16 kernels' records: the engine they were
    measured on): one that does is read back unmeasured, from the file as from memory; one that does not is
    measured anew and replaces it in both."""
    tuning.measured("engine record", lambda: {"engine": "amx", "x": 1})
    tuning._memo.clear()
    same = tuning.measured("engine record", lambda: pytest.fail("measured again"), lambda r: r["engine"] == "amx")
    assert same == {"engine": "amx", "x": 1}
    other = tuning.measured("engine record", lambda: {"engine": "avx512_bf16", "x": 2},
                            lambda r: r["engine"] == "avx512_bf16")
    assert other == {"engine": "avx512_bf16", "x": 2}
    kept = json.loads((cache / tuning.FILE).read_text())
    assert kept == {f"engine record @ {tuning.machine_key()}": other}
    assert tuning.measured("engine record", lambda: pytest.fail("measured again")) == other


def test_forget_drops_this_machines_records_only(cache):
    tuning.measured("a", lambda: {"x": 1})
    tuning.measured("b", lambda: {"x": 2})
    data = json.loads((cache / tuning.FILE).read_text())
    data["a @ another machine"] = {"x": 3}
    (cache / tuning.FILE).write_text(json.dumps(data))
    assert sorted(tuning.forget()) == ["a", "b"]
    assert json.loads((cache / tuning.FILE).read_text()) == {"a @ another machine": {"x": 3}}
    assert tuning.measured("a", lambda: {"x": 4}) == {"x": 4}                 # measured anew, memory included
    assert tuning.forget() == ["a"] and tuning.forget() == []


def test_bench_tune_shows_the_kept_choices_and_measures_them_again(tmp_path):
    """`pixeltriage bench tune`, a real process: measures what is not kept yet, shows what is kept without
    measuring (a record edited in the file comes back as written), and with --again measures anew. The cache is the
    test's own (its records file) with the test run's built C kernels in it, which it would otherwise build anew."""
    from cli_inputs import used_cache

    env = {**os.environ, "PIXELTRIAGE_CACHE": str(used_cache(tmp_path))}
    env.pop(tuning.ENV)
    env.pop("PIXELTRIAGE_ONEDNN", None)
    env.pop("PIXELTRIAGE_DELTA_BF16", None)

    def tune(*extra):
        out = subprocess.run([sys.executable, "-m", "pixeltriage", "bench", "tune", "--threads", "1", "--json", *extra],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = tune()
    assert first["file"] == str(tmp_path / tuning.FILE) and first["machine"].endswith(" x1") and not first["forgotten"]
    kept = json.loads((tmp_path / tuning.FILE).read_text())
    measured = {name: record for name, record in first["records"].items() if record is not None}
    assert kept == {f"{name} @ {first['machine']}": record for name, record in measured.items()}
    assert set(first["not_measured"]) == set(first["records"]) - set(measured)
    from pixeltriage.kernels import native

    if native.isa_emulated():                      # PIXELTRIAGE_NATIVE_ISA=emulated: nothing bf16 to measure
        assert first["not_measured"]["bf16 attention"].startswith("AMX emulated")
        assert first["not_measured"]["bf16 delta pass"].startswith("AMX emulated")
    elif native.fast_bf16_engine() is None:
        assert first["not_measured"]["bf16 attention"] == ("no bf16 units on this CPU (AMX, AVX512-BF16): bf16 "
                                                           "attention is SDPA's")
        assert first["not_measured"]["bf16 delta pass"].startswith("no bf16 units on this CPU")
    else:
        assert first["records"]["bf16 attention"]["engine"] == native.fast_bf16_engine()
        assert first["records"]["bf16 delta pass"]["engine"] == native.fast_bf16_engine()
    from pixeltriage.kernels import linear as lin

    if lin.onednn_available(torch.bfloat16):             # the bf16 weights' layout: oneDNN's against plain
        assert first["records"]["bf16 prepacked weights"]["layout"] in ("packed", "plain")
    else:
        assert first["not_measured"]["bf16 prepacked weights"] == "no oneDNN bf16 linear primitive for this CPU"
    if first["records"]["float32 GEMM"] and first["records"]["float32 GEMM"]["library"] == "oneDNN":
        assert first["records"]["float32 prepacked weights"]["layout"] in ("packed", "plain")
    else:
        assert first["not_measured"]["float32 prepacked weights"].startswith("float32 projections on F.linear")
    edited = {key: {**record, "edited": True} for key, record in kept.items()}
    (tmp_path / tuning.FILE).write_text(json.dumps(edited))
    second = tune()
    assert all(record["edited"] for record in second["records"].values() if record is not None)
    third = tune("--again")
    assert sorted(third["forgotten"]) == sorted(measured)
    assert not any("edited" in record for record in third["records"].values() if record is not None)
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "bench", "tune", "--threads", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and f"kept in {tmp_path / tuning.FILE}" in out.stdout


def _row_wise(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return linear.linear(torch.nn.functional.silu(linear.linear(x, w1)), w2)


@pytest.mark.parametrize("blocks", [True, False])
def test_an_mlp_runs_in_row_blocks_where_measured_faster_and_the_choice_is_kept(cache, monkeypatch, blocks):
    """`in_row_blocks`: measured once per layer name on the first call's own rows (blocks where their median time
    is under MARGIN of the whole's), kept, and followed after; the blocks' output matches the whole's (float32
    products of other row counts: within 1e-6 of the largest value) and covers every row, a last short block too;
    under twice ROW_BLOCK rows nothing is measured. `tuning.kept` and `row_block_records` (`bench tune`'s) show it,
    `row_block_records(followed=True)` (what `bench cpu` prints) too once followed."""
    monkeypatch.setattr(linear, "ROW_BLOCK", 16)
    monkeypatch.setattr(tuning, "malloc_tuned", False)
    linear.linear(torch.ones(2, 2), torch.ones(2, 2))      # the float32 projection's own choice, measured first
    ratios = [0.8, 0.85, 0.9] if blocks else [0.96, 1.0, 1.1]
    seen = []
    monkeypatch.setattr(tuning, "interleaved_ratio",
                        lambda first, second, pairs, warmup: seen.append((first(), second())) or sorted(ratios))
    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(70, 24, generator=gen), torch.randn(40, 24, generator=gen),
                 torch.randn(24, 40, generator=gen))
    calls = []

    def fn(t):
        calls.append(t.shape[0])
        return _row_wise(t, w1, w2)

    assert linear.in_row_blocks(fn, x[:31], "test MLP") is not None and not seen    # under 2 x 16 rows: whole
    out = linear.in_row_blocks(fn, x, "test MLP")
    assert len(seen) == 1 and seen[0][1].shape == seen[0][0].shape == (70, 24)
    whole, parts = seen[0]
    assert (parts - whole).abs().max() <= 1e-6 * whole.abs().max()
    record = tuning.kept(linear.ROW_BLOCKS)["row blocks: test MLP"]
    assert record["rows"] == (16 if blocks else 0) and record["blocks_over_whole"] == (0.85 if blocks else 1.0)
    assert record["tokens"] == 70 and linear.row_block_records() == {"test MLP": record}
    assert linear.row_block_records(followed=True)["test MLP"] == record
    calls.clear()
    again = linear.in_row_blocks(fn, x, "test MLP")                     # kept: not measured again
    assert len(seen) == 1 and calls == ([16, 16, 16, 16, 6] if blocks else [70])
    assert torch.equal(again, out) and (again - _row_wise(x, w1, w2)).abs().max() <= 1e-6 * out.abs().max()
    # a process whose malloc keeps freed memory (tune_malloc) is another machine (`machine_key`): it measures its own
    # record, and both are kept
    as_is = tuning.machine_key()
    monkeypatch.setattr(tuning, "malloc_tuned", True)
    assert tuning.machine_key() == as_is.replace("malloc as is", "malloc tuned") != as_is
    ratios = [0.96, 1.0, 1.1] if blocks else [0.8, 0.85, 0.9]
    linear.in_row_blocks(fn, x, "test MLP")
    assert len(seen) == 2
    tuned = linear.row_block_records()["test MLP"]
    assert tuned["rows"] == (0 if blocks else 16)
    kept = json.loads((cache / tuning.FILE).read_text())
    assert kept[f"row blocks: test MLP @ {as_is}"] == record
    assert kept[f"row blocks: test MLP @ {tuning.machine_key()}"] == tuned
    monkeypatch.setattr(tuning, "malloc_tuned", False)
    assert linear.row_block_records() == {"test MLP": record}
    calls.clear()
    linear.in_row_blocks(fn, x, "test MLP")                             # its own record again, unmeasured
    assert len(seen) == 2 and calls == ([16, 16, 16, 16, 6] if blocks else [70])
