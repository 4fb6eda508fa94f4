"""The native C kernels (kernels/native) against the torch paths beside them, and the build's fallbacks.

Tolerance: conv1d + SiLU <= 1e-6 relative to the reference, as its torch path (tests/test_fast_paths.py); the
kernel's exp differs from torch's by at most a few ulp.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pixeltriage.kernels import activation, conv, native, norm, registry, rotary
from pixeltriage.kernels.gated_delta import chunk
from pixeltriage.kernels.conv import causal_conv1d_silu, causal_conv1d_silu_reference, conv1d_silu_torch
import isa
from cli_inputs import used_cache
from kernel_claims import claims
from reference import rel

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@needs_native
@claims(conv.NATIVE)
@pytest.mark.parametrize("seq_len,width", [(1, 4), (3, 4), (4, 4), (97, 4), (50, 2), (20, 1), (200, 6), (33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [40, 96])      # 96: whole 32-channel steps, the AVX-512 loop where it is built
def test_native_conv_matches_reference_and_torch_path(seq_len, width, dtype, channels):
    g = torch.Generator().manual_seed(seq_len * 10 + width)
    x = torch.randn(seq_len, channels, generator=g).mul_(3).to(dtype)       # SiLU's both tails, not just its middle
    w = torch.randn(channels, width, generator=g).to(dtype)
    out = causal_conv1d_silu(x, w)
    assert out.dtype == torch.float32 and out.shape == (seq_len, channels)
    assert rel(out, causal_conv1d_silu_reference(x, w)) <= 1e-6
    assert rel(out, conv1d_silu_torch(x, w)) <= 1e-6


@needs_native
@claims(conv.NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_conv_reads_strided_rows_and_packed_sequences(dtype):
    """The layer hands the conv a column slice of its projection (row stride > C), several sequences packed."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(120, 80, generator=g).to(dtype)
    x, w = full[:, 7:71], torch.randn(64, 4, generator=g).to(dtype)
    bounds = [0, 1, 1, 40, 41, 120]
    out = causal_conv1d_silu(x, w, bounds)
    for b, e in zip(bounds, bounds[1:]):
        if e > b:
            assert rel(out[b:e], causal_conv1d_silu_reference(x[b:e], w)) <= 1e-6


@needs_native
@claims(conv.NATIVE)
def test_native_silu_extremes_match_torch():
    """SiLU's tails and exact zeros: finite; within 1e-6 relative of torch's SiLU down to y = -80. Below -87 the
    kernel returns 0 (e^-y leaves float's range; torch's value is under 2e-36 there), including for y = -1e30
    and -3e38, where a clamped exp alone would have given y / e^88, up to -1.8."""
    x = torch.tensor([[-80.0], [-30.0], [-1e-30], [0.0], [1e-30], [1.0], [30.0], [90.0], [3e38]])
    far = torch.tensor([[-90.0], [-200.0], [-1e30], [-3e38]])
    # the scalar loop (1 channel, or width 1), and the vector one down the rows (32 channels of width 4, the taps
    # reading only the current row): AVX-512's where it is built, else the machine vector's
    for channels, width in ((1, 1), (32, 1), (32, 4)):
        w = torch.zeros(channels, width)
        w[:, -1] = 1.0
        rows = x.expand(-1, channels).contiguous()             # the C kernel reads contiguous rows
        out, want = causal_conv1d_silu(rows, w), torch.nn.functional.silu(rows)
        assert torch.isfinite(out).all()
        assert torch.allclose(out, want, rtol=1e-6, atol=0.0)
        tail = causal_conv1d_silu(far.repeat(2, channels), w)
        assert torch.isfinite(tail).all() and (tail <= 0).all() and (tail.abs() < 1e-34).all()
    assert (torch.nn.functional.silu(far).abs() < 1e-34).all()


@needs_native
@claims(conv.NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_conv_vector_rows_equal_the_row_loop(dtype):
    """Width 4 over a whole number of vector pairs of channels runs down the rows a column of vectors at a time
    (`conv_silu_chunk`); other channel counts run the row loop (`conv_silu_span`). Without AVX-512 the two are the
    same operations in the same order: equal bit for bit, NaN included, across packed sequences (each one's first
    three rows are the row loop's in both). With AVX-512 the vector SiLU divides by rcp14 and a Newton step: within
    2 ulp of the row loop's."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(150, 104, generator=g).mul_(4).to(dtype)
    x[77, 5] = float("nan")
    w = torch.randn(104, 4, generator=g)
    bounds = [0, 2, 70, 150]
    vector = causal_conv1d_silu(x[:, :96], w[:96], bounds)          # 96: pairs of 8, 16 or 32 lanes
    rows = causal_conv1d_silu(x, w, bounds)[:, :96]                 # 104: none of them
    assert vector.isnan().sum() == rows.isnan().sum() == 4          # the NaN row and the three after it
    if native.vec_math("exp", torch.zeros(1)) is None:
        assert torch.equal(vector.nan_to_num(7.0), rows.nan_to_num(7.0))
    else:
        assert rel(vector.nan_to_num(7.0), rows.nan_to_num(7.0)) <= 3e-7


@needs_native
@pytest.mark.parametrize("unit", isa.params("avx512"))
def test_vector_math_against_float64(unit):
    """vec_math.h's functions against float64 over their ranges, with their stated bounds (measured: exp 1.2e-7,
    exp2_bf16 2.7e-6, silu 2.4e-7, silu_bf16 6.4e-6 relative): the bf16-accuracy two under 1e-5, far under the
    2e-3 step of the bf16 their results are rounded to. Their edges: 2^x is 2^-126 (give or take its polynomial's
    error) below -126 and at -inf, NaN stays NaN (the attention softmax relies on it to poison a row); silu_bf16 is 0
    below -87 and at -inf, inf at inf, NaN at NaN."""
    probe = native.vec_math("exp", torch.zeros(1))
    if probe is None:
        pytest.skip("the native build has no AVX-512")
    with pytest.raises(ValueError, match="not one of"):
        native.vec_math("tanh", torch.zeros(1))
    g = torch.Generator().manual_seed(0)

    def worst(name, x, want):
        got = native.vec_math(name, x).double()
        return ((got - want).abs() / want.abs()).max().item()

    e = torch.linspace(-87, 88, 100003)                    # 100003: a partial last vector of 16
    assert worst("exp", e, e.double().exp()) <= 3e-7
    x = torch.cat([torch.linspace(-126, 0, 100003), -5 * torch.rand(1000, generator=g)])
    assert worst("exp2_bf16", x, torch.exp2(x.double())) <= 1e-5
    y = torch.cat([torch.linspace(-87, 87, 100003), 3 * torch.randn(1000, generator=g)])
    y = y[y != 0]
    silu = torch.nn.functional.silu(y.double())
    assert worst("silu", y, silu) <= 1e-6
    assert worst("silu_bf16", y, silu) <= 1e-5
    inf, nan = float("inf"), float("nan")
    low = native.vec_math("exp2_bf16", torch.tensor([-126.5, -200.0, -inf, nan]))
    assert ((low[:3] - 2.0 ** -126).abs() <= 1e-5 * 2.0 ** -126).all() and low[3].isnan()
    ends = native.vec_math("silu_bf16", torch.tensor([-87.5, -1e30, -inf, inf, nan, 0.0, 3e38]))
    assert (ends[:3] == 0).all() and ends[3] == inf and ends[4].isnan() and ends[5] == 0 and ends[6] == 3e38


@needs_native
def test_native_paths_decline_what_they_do_not_handle():
    """Inputs the C kernels were not written for take the torch kernels and give their result (no out-of-bounds
    reads), each decline counted with its reason: broadcast rotary angles, a delta rule whose head dims the C pass
    does not take (q, k and v one tensor), a zero-width norm."""
    from pixeltriage.kernels import norm, rotary
    from pixeltriage.kernels.gated_delta import chunk

    g = torch.Generator().manual_seed(1)
    x, angle = torch.randn(64, 3, 8, generator=g), torch.randn(1, 8, generator=g)
    qkv = torch.randn(70, 2, 8, generator=g)
    decay, beta = -torch.rand(70, 2, generator=g), torch.rand(70, 2, generator=g)
    h = torch.empty(5, 0)
    with registry.recording() as record:
        assert torch.equal(rotary.apply_rotary_float(x, angle.cos(), angle.sin()),
                           rotary.apply_rotary_float_torch(x, angle.cos(), angle.sin()))
        got = chunk.chunk_gated_delta_rule(qkv, qkv, qkv, decay, beta, qk_l2norm=True)
        assert norm.add_rms_norm(h, None, torch.empty(0), 1e-6, torch.float32).shape == (5, 0)
    want = chunk.delta_rule_torch(qkv, qkv, qkv, decay, beta, qk_l2norm=True)
    assert torch.isfinite(got).all() and rel(got, want) <= 1e-5
    assert record.snapshot().declines == {
        ("rotary", rotary.NATIVE_ROTARY.name, "cos/sin broadcast, not [N, D]"): 1,
        ("delta_rule", chunk.NATIVE_RULE.name, "head dims not multiples of 16"): 1,
        ("add_norm", norm.NATIVE_ADD_NORM.name, "h not a contiguous float32 [T, D] with D > 0"): 1}


@needs_native
@claims(chunk.NATIVE, norm.NATIVE_ADD_NORM, norm.NATIVE_NORM_GATED, activation.NATIVE, activation.NATIVE_GELU,
        rotary.NATIVE_ROTARY, rotary.NATIVE_NORM_ROTARY)
def test_scores_with_and_without_native_kernels(tiny_checkpoint, monkeypatch):
    """The whole forward on the C kernels (those the float32 forward runs whatever this machine measured: the
    attention's and the GEMM library's choices are its own) and on the torch implementations they replace: the same
    scores within 1e-5 (the kernels' float32 roundings differ from torch's in order, not in precision)."""
    from pixeltriage import Scorer
    from pixeltriage.bench.gpu_check import max_diff
    from pixeltriage.episode import sample_episode

    episode = sample_episode()
    scorer = Scorer.load(tiny_checkpoint)
    assert scorer.kernels()["native"] == native.variant() == native.chosen(native.isa_emulated()).name
    with_native = scorer.score(*episode)
    monkeypatch.setattr(native, "library", lambda: None)
    without = Scorer.load(tiny_checkpoint)
    assert without.kernels()["native"] == "none"
    assert max_diff(with_native, without.score(*episode)) <= 1e-5


# A subprocess's code that takes the package's prebuilt libraries away, as in a source checkout nobody installed
NO_PREBUILT = ("from pathlib import Path; from pixeltriage.kernels.native import variants; "
               "variants.PREBUILT = Path('/')\n")


def _library_in_subprocess(env_extra: dict, tmp_path, prebuilt: bool = False) -> str:
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n" + ("" if prebuilt else NO_PREBUILT)
            + "from pixeltriage.kernels import native; print(native.available()); print(native.status())")
    env = {**os.environ, "PIXELTRIAGE_CACHE": str(tmp_path), native.ISA_SWITCH: "native", **env_extra}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def _prebuilt_here() -> bool:
    return native.variants.prebuilt(native.chosen(False)) is not None


def test_native_off_switch(tmp_path):
    out = _library_in_subprocess({"PIXELTRIAGE_NATIVE": "0"}, tmp_path, prebuilt=True)
    assert out.startswith("False") and "disabled by PIXELTRIAGE_NATIVE=0" in out
    assert not (tmp_path / "native").exists()                        # nothing built


def test_missing_compiler_falls_back_with_a_warning(tmp_path):
    """No prebuilt library (a source checkout) and no compiler: the torch implementations, said once."""
    out = _library_in_subprocess({"CC": str(tmp_path / "no-such-cc")}, tmp_path)
    assert out.startswith("False") and "using the torch implementations" in out and "no-such-cc" in out
    out = _library_in_subprocess({"CC": "", "PATH": str(tmp_path)}, tmp_path)
    assert out.startswith("False") and "no prebuilt library and no C compiler found (set CC)" in out


def test_a_prebuilt_library_needs_no_compiler(tmp_path):
    """Installed, the package's own build of this CPU's level loads with no compiler to be found."""
    if not _prebuilt_here():
        pytest.skip("no prebuilt libraries here (a source checkout nobody installed)")
    out = _library_in_subprocess({"CC": str(tmp_path / "no-such-cc")}, tmp_path, prebuilt=True)
    assert out.startswith("True") and f"loaded {native.chosen(False).name} (prebuilt)" in out
    assert not (tmp_path / "native").exists()


def test_conv_without_native_library_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(30, 8, generator=g), torch.randn(8, 4, generator=g)
    assert torch.equal(causal_conv1d_silu(x, w), conv1d_silu_torch(x, w))


@pytest.fixture(scope="module")
def first_use_build(tmp_path_factory) -> tuple[Path, str]:
    """A cache in which a process without prebuilt libraries built the probe and this CPU's build on first use, and
    what that process said."""
    cache = tmp_path_factory.mktemp("first-use")
    return cache, _library_in_subprocess({}, cache)


@needs_native
def test_first_use_build_is_cached_per_sources_compiler_and_flags(first_use_build):
    """Without prebuilt libraries the probe and this CPU's build are built on first use; a second process loads the
    same files instead of building again."""
    tmp_path, first = first_use_build
    built = sorted((tmp_path / "native").glob("*.so"))
    assert first.startswith("True") and f"loaded {native.chosen(False).name} (built on first use)" in first
    assert sorted(p.name.rsplit("_", 1)[0] for p in built) == ["pixeltriage_" + native.chosen(False).name,
                                                               "pixeltriage_probe"]
    mtimes = [p.stat().st_mtime_ns for p in built]
    second = _library_in_subprocess({}, tmp_path)
    assert second.startswith("True") and sorted((tmp_path / "native").glob("*.so")) == built
    assert [p.stat().st_mtime_ns for p in built] == mtimes
    assert not list((tmp_path / "native").glob("*.tmp"))


def test_edited_sources_are_a_new_build_and_make_the_prebuilt_stale(tmp_path, monkeypatch):
    """The sources' digest covers every header (`#include "vec_math.h"`): editing one keys a new first-use build, and
    a prebuilt library whose manifest names other sources, flags or another architecture is not used."""
    from pixeltriage.kernels.native import variants

    header = tmp_path / "extra.h"
    header.write_text("#define PROBE 1\n")
    monkeypatch.setattr(variants, "HEADERS", (*variants.HEADERS, header))
    before = variants.sources_key()
    header.write_text("#define PROBE 2\n")
    assert variants.sources_key() != before
    build = variants.portable()
    (tmp_path / build.filename).write_bytes(b"")
    manifest = {"sources": variants.sources_key(), "machine": variants.machine(),
                "builds": {build.name: {"file": build.filename, "flags": list(build.flags)}}}

    def found(**change) -> bool:
        entry = {**manifest, **change}
        (tmp_path / variants.MANIFEST).write_text(json.dumps(entry))
        return variants.prebuilt(build, tmp_path) == tmp_path / build.filename

    assert found()
    assert not found(sources=before)
    assert not found(machine="riscv64")
    assert not found(builds={build.name: {"file": build.filename, "flags": ["-O0"]}})
    (tmp_path / variants.MANIFEST).unlink()
    assert variants.prebuilt(build, tmp_path) is None


@needs_native
def test_a_new_build_prunes_all_but_the_newest_builds(first_use_build, tmp_path):
    """First-use builds of other sources or compilers pile up across upgrades: a new one keeps the KEEP_BUILDS
    newest of its own build. Here the new build is the probe's (this CPU's build is in the cache already, as
    `first_use_build` left it, and loads from there: the probe is the one compiled, in a second)."""
    name = "probe"
    builds = tmp_path / "native"
    builds.mkdir()
    (kept,) = (first_use_build[0] / "native").glob(f"pixeltriage_{native.chosen(False).name}_*.so")
    shutil.copy2(kept, builds / kept.name)
    for i in range(native.KEEP_BUILDS + 3):
        old = builds / f"pixeltriage_{name}_old{i:02d}.so"
        old.write_bytes(b"")
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    unrelated = builds / "notes.txt"
    unrelated.write_text("kept")
    other_library = builds / "pixeltriage_emulated_old.so"     # another build: not this one's to prune
    other_library.write_bytes(b"")
    os.utime(other_library, (1_000_000, 1_000_000))
    assert _library_in_subprocess({}, tmp_path).startswith("True")
    left = sorted(p.name for p in builds.glob(f"pixeltriage_{name}_*.so"))
    assert len(left) == native.KEEP_BUILDS
    newest_old = [f"pixeltriage_{name}_old{i:02d}.so" for i in range(4, native.KEEP_BUILDS + 3)]
    assert set(newest_old) <= set(left) and unrelated.exists() and other_library.exists()
    assert (builds / kept.name).exists() and not list(builds.glob("*.tmp"))


@needs_native
def test_emulated_isa_build_runs_every_path_and_a_bad_switch_is_an_error(tmp_path):
    """PIXELTRIAGE_NATIVE_ISA=emulated loads the emulated build (isa_emulation.h in place of the CPU's AVX-512 and
    AMX instructions), which has all three bf16 engines and the AVX-512 passes on any CPU; a value other than
    native / emulated is an error that names both. The cache holds the emulated build this process loads (the suite
    builds it for the AVX-512 and AMX paths a CPU lacks); its first-use build is that of any build, tested above."""
    code = ("from pixeltriage.kernels import native, simd; print(native.available(), sorted(native.bf16_engines()),"
            " simd.available(), native.variant(), 'emulated' in native.build_features());"
            " print(native.status())")
    env = {**os.environ, "PIXELTRIAGE_CACHE": str(used_cache(tmp_path, emulated=True)), native.ISA_SWITCH: "emulated"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "True ['amx', 'avx512_bf16', 'fma'] True emulated True"
    assert "emulated" in r.stdout.splitlines()[1]
    env[native.ISA_SWITCH] = "avx512"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "PIXELTRIAGE_NATIVE_ISA='avx512': expected one of 'native', 'emulated'" in r.stderr


def test_builds_are_chosen_best_first_from_the_cpus_instruction_sets():
    """`variants.choose`: the first build whose instruction sets the CPU has, as CPUID reports them for a few CPUs;
    another architecture runs the portable build."""
    from pixeltriage.kernels.native import variants

    haswell = set(variants.V3)
    cooper_lake = variants.V4 | {"avx512_bf16"}
    sapphire_rapids = cooper_lake | {"amx"}
    assert variants.choose(set(), "x86_64").name == "portable"
    assert variants.choose(haswell - {"movbe"}, "x86_64").name == "portable"
    assert variants.choose(haswell, "x86_64").name == "x86-64-v3"
    assert variants.choose(variants.V4, "x86_64").name == "x86-64-v4"
    assert variants.choose(cooper_lake, "x86_64").name == "avx512bf16"
    assert variants.choose(sapphire_rapids, "x86_64").name == "amx"
    assert variants.choose(sapphire_rapids, "aarch64").name == "portable"
    assert [v.name for v in variants.kernels("aarch64")] == ["portable"]
    assert variants.portable("aarch64").target == ()


@needs_native
def test_cpu_features_agree_with_proc_cpuinfo():
    """pt_cpu_features (CPUID, and what the OS saves) names the instruction sets the Linux kernel lists for this
    CPU; AMX only where the kernel also granted the tile state."""
    flags = set(native._cpu_flags().split())
    if "avx" not in flags:
        pytest.skip("not an x86 CPU with AVX")
    named = {"avx2": "avx2", "fma": "fma", "bmi1": "bmi1", "bmi2": "bmi2", "f16c": "f16c", "lzcnt": "abm",
             "movbe": "movbe", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512cd": "avx512cd",
             "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512_bf16": "avx512_bf16"}
    have = native.cpu_features()
    assert {key for key, flag in named.items() if flag in flags} == have - {"amx"}
    assert "amx" not in have or {"amx_tile", "amx_bf16"} <= flags


@needs_native
def test_the_build_in_use_is_the_best_this_cpu_runs():
    """The library in use is `variants.choose` of this CPU's instruction sets, compiled for no instruction set the
    CPU lacks; the emulated build sits beside it."""
    from pixeltriage.kernels.native import variants

    with native.emulated_isa(False):
        assert native.variant() == variants.choose(native.cpu_features()).name
        assert native.build_features() <= native.cpu_features()
        assert native.status().startswith(f"loaded {native.variant()} (")
    with native.emulated_isa(True):
        assert native.variant() == "emulated"


def test_each_build_is_compiled_for_what_the_cpu_runs(tmp_path):
    """Each prebuilt library reports (pt_build_features) exactly the instruction sets `variants` says a CPU needs
    to run it (so the choice never loads one this CPU lacks), the emulated one all AVX-512 and AMX paths. Asking a
    build what it was compiled for runs none of its instructions."""
    import ctypes

    from pixeltriage.kernels.native import abi, variants

    if not _prebuilt_here():
        pytest.skip("no prebuilt libraries here (a source checkout nobody installed)")
    emulation = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx", "emulated"}
    for build in (*variants.kernels(), variants.emulated(), variants.probe()):
        path = variants.prebuilt(build)
        assert path is not None, build.name
        bits = ctypes.c_uint64()
        ctypes.CDLL(str(path)).pt_build_features(ctypes.byref(bits))
        reported = native._feature_keys(bits.value)
        assert reported == (build.needs | emulation if build.emulated else build.needs), build.name
    assert abi.load().functions.keys() >= set(native.PROBE)


def test_a_build_for_instruction_sets_the_cpu_lacks_is_refused(monkeypatch):
    """Were `variants` to choose a build for an instruction set this CPU lacks, its library is refused (after
    asking it what it was built for, which runs none of its instructions) and the torch implementations run."""
    from pixeltriage.kernels.native import variants

    amx = variants.X86_64[0]
    if "amx" in native.cpu_features() or variants.prebuilt(amx) is None:
        pytest.skip("a CPU with AMX, or no prebuilt AMX build here")
    monkeypatch.setattr(native, "chosen", lambda emulated: amx)
    assert native.library.of.__wrapped__(False) is None
    assert native.build_status(False).startswith("refused: amx is built for ['amx']")


@needs_native
def test_the_library_shares_torchs_openmp_runtime(tmp_path):
    """Loaded after torch, a GCC build's libgomp.so.1 resolves to the copy torch already loaded: one OpenMP runtime
    (one thread pool) in the process."""
    code = ("import torch\nfrom pixeltriage.kernels import native\nassert native.available()\n"
            "maps = open('/proc/self/maps').read().split()\n"
            "import json; print(json.dumps(sorted({p for p in maps if 'gomp' in p or 'omp.so' in p})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, native.ISA_SWITCH: "native"})
    assert r.returncode == 0, r.stderr
    runtimes = json.loads(r.stdout)
    assert len(runtimes) == 1 and os.path.dirname(torch.__file__) in runtimes[0], runtimes


def test_emulated_isa_block_switches_and_restores():
    """`emulated_isa()` switches the libraries in use inside the block and back after it, nested or not."""
    before = native.isa_emulated()          # the environment's (PIXELTRIAGE_NATIVE_ISA)
    with native.emulated_isa():
        assert native.isa_emulated()
        with native.emulated_isa(False):
            assert not native.isa_emulated()
        assert native.isa_emulated()
    assert native.isa_emulated() == before


def test_every_entry_point_names_its_reference_and_its_tests():
    """abi.h's comment tags are a map from each C function to the Python it is compared with and the test that
    compares them: every reference resolves to a Python object, every test exists, every kernel is in the library."""
    import importlib
    from pathlib import Path

    header = native.abi.load()
    root = Path(__file__).parents[2]
    assert len(header.functions) >= 20
    for fn in header.functions.values():
        if fn.reference is not None:
            for dotted in (r.split()[0] for r in fn.reference.split(", ")):
                module, _, rest = dotted.partition(".")
                obj = importlib.import_module(module)
                for part in rest.split("."):
                    try:
                        obj = getattr(obj, part)
                    except AttributeError:
                        obj = importlib.import_module(f"{obj.__name__}.{part}")
                assert callable(obj), f"{fn.name}: reference {dotted} is not a function"
        for test in fn.tests:
            path, _, name = test.partition("::")
            assert f"def {name}(" in (root / path).read_text(), f"{fn.name}: no test {test}"
        if native.available():
            assert getattr(native.library(), fn.name).argtypes is not None


def test_a_header_the_bindings_misread_fails_the_build(tmp_path):
    """The checks every build compiles (`abi.check_source`) hold the bindings' reading of abi.h against the
    compiler's: a field read in another order, a parameter of another type or an enum value read wrong each fail
    to compile, naming what differs; the true reading compiles."""
    if native._compiler() is None:
        pytest.skip("no C compiler")
    text = native.abi.HEADER.read_text()

    def compiles(header_text: str) -> subprocess.CompletedProcess:
        check = tmp_path / "check.c"
        check.write_text(native.abi.parse(header_text).check_source())
        return subprocess.run([native._compiler(), "-std=c11", "-fsyntax-only", f"-I{native.abi.HEADER.parent}",
                               str(check)], capture_output=True, text=True)

    assert compiles(text).returncode == 0
    swapped = text.replace("    int64_t delta_t;\n    int delta_bf16;", "    int delta_bf16;\n    int64_t delta_t;")
    assert swapped != text
    assert "pt_add_norm_args.delta_t" in compiles(swapped).stderr
    retyped = text.replace("PT_API int pt_gelu_tanh(float *x, int64_t n,", "PT_API int pt_gelu_tanh(float *x, int n,")
    assert retyped != text
    r = compiles(retyped)
    assert r.returncode != 0 and "pt_gelu_tanh" in r.stderr
    renumbered = text.replace("PT_DECLINE_DTYPE = 5,", "PT_DECLINE_DTYPE = 6,")
    assert "PT_DECLINE_DTYPE" in compiles(renumbered).stderr
    with pytest.raises(ValueError, match="long"):
        native.abi.parse(text.replace("    int64_t x_t;\n    int x_bf16;\n    const float *taps;",
                                      "    long x_t;\n    int x_bf16;\n    const float *taps;"))


@needs_native
def test_a_decline_returns_its_code_and_abi_h_says_why():
    """Every entry point returns 0 or one of abi.h's pt_status codes, and `decline_reason` reads the entry point's
    own words for it from the header."""
    x = torch.ones(8)
    assert native.call("pt_gelu_tanh", x.data_ptr(), -1) == native.DECLINE["shape"]
    assert native.decline_reason("pt_gelu_tanh", native.DECLINE["shape"]) == "shape (n < 0)"
    gu, out = torch.ones(2, 8), torch.empty(2, 4)
    assert native.call("pt_silu_mul", gu.data_ptr(), 2, 8, 2, 4, out.data_ptr()) == native.DECLINE["dtype"]
    assert native.decline_reason("pt_silu_mul", native.DECLINE["dtype"]).startswith("dtype")
    assert native.call("pt_vec_math", 9, x.data_ptr(), 8, x.data_ptr()) == native.DECLINE["argument"]
    assert native.decline_reason("pt_gelu_tanh", 0) == "ran"
    assert "not one of" in native.decline_reason("pt_gelu_tanh", 99)
    assert native.call("pt_gelu_tanh", x.data_ptr(), 8) == 0 and torch.allclose(x, torch.nn.functional.gelu(
        torch.ones(8), approximate="tanh"))


def test_argument_blocks_take_every_field_and_no_other():
    with pytest.raises(TypeError, match=r"missing \['eps'\]"):
        native.struct("pt_add_norm_args", h=None, delta=None, delta_t=0, delta_bf16=0, w=None, b=None, layer_norm=0,
                      T=0, D=0)
    with pytest.raises(TypeError, match=r"unknown \['epsilon'\]"):
        native.struct("pt_add_norm_args", h=None, delta=None, delta_t=0, delta_bf16=0, w=None, b=None, layer_norm=0,
                      T=0, D=0, eps=0.0, epsilon=0.0)
    with pytest.raises(TypeError, match="no struct"):
        native.struct("pt_nothing")
