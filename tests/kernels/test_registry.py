"""The kernel registry: one entry point per op that runs the first fitting, available kernel accepting the call,
the next where one declines (its `accepts`, or its C entry point's non-zero return), what it counts and logs, the
test switch that gives CPU tensors the CUDA kernels, the names it reports, and the slow-fallback refusal."""
import logging

import pytest
import torch

from kernel_claims import claims
from pixeltriage import settings
from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels import activation, native, registry
from pixeltriage.kernels.gated_delta import fla


@pytest.fixture
def fresh(monkeypatch):
    """The registry's ops restored after the test (fake ops made in it vanish)."""
    registry._load_ops()
    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))
    yield registry


@pytest.fixture
def no_switch(monkeypatch):
    monkeypatch.delenv("PIXELTRIAGE_EMULATE_CUDA", raising=False)


@pytest.fixture
def emulating(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PIXELTRIAGE_EMULATE_CUDA", "1")


def device_dtype(x, *args):
    return x.device, x.dtype


def toy_op(reg, fast_ok=True, c_ok=True):
    """A fake op shaped like the real ones: a CUDA kernel for bf16/fp16 (priority 20), a CPU C kernel for
    float32/bf16 (10), torch on the CPU (0) and a slow torch fallback on CUDA (-10)."""
    state = {"fast": fast_ok, "c": c_ok}
    op = reg.op("toy", device_dtype)
    op.register("cuda fast", lambda x: "fast", devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
                available=lambda: state["fast"], priority=20, package="toy-kernels")
    op.register("C", lambda x: "c", devices=("cpu",), dtypes=(torch.float32, torch.bfloat16),
                available=lambda: state["c"], priority=10)
    op.register("torch", lambda x: "torch", devices=("cpu",))
    op.register("torch", lambda x: "torch", devices=("cuda",), dtypes=(torch.float32,))
    op.register("torch (slow)", lambda x: "slow", devices=("cuda",), priority=-10, slow=True)
    return state


def test_choice_per_device_dtype_and_availability(fresh, no_switch):
    state = toy_op(fresh)
    assert fresh.choose("toy", "cpu", torch.float32).name == "C"
    assert fresh.choose("toy", torch.device("cpu"), torch.bfloat16).name == "C"
    assert fresh.choose("toy", "cpu", torch.float16).name == "torch"          # the C kernel has no fp16
    assert fresh.choose("toy", "cuda", torch.bfloat16).name == "cuda fast"
    assert fresh.choose("toy", torch.device("cuda", 1), torch.float16).name == "cuda fast"
    assert fresh.choose("toy", "cuda", torch.float32).name == "torch"         # float32 stays exact on CUDA
    state["c"] = state["fast"] = False                                         # asked at every choice
    assert fresh.choose("toy", "cpu", torch.float32).name == "torch"
    kernel = fresh.choose("toy", "cuda", torch.bfloat16)
    assert (kernel.op, kernel.name, kernel.slow, kernel.fn(None)) == ("toy", "torch (slow)", True, "slow")
    x = torch.zeros(2)
    assert fresh.get("toy")(x) == "torch"                                      # and at every call
    state["c"] = True
    assert fresh.get("toy")(x) == "c"


def test_priority_then_registration_order(fresh, no_switch):
    op = fresh.op("order", device_dtype)
    op.register("first", lambda x: 1)
    op.register("second", lambda x: 2)
    assert fresh.choose("order", "cpu", torch.float32).name == "first"
    op.register("better", lambda x: 3, priority=1)
    assert fresh.choose("order", "cpu", torch.float32).name == "better" and op(torch.zeros(1)) == 3


def test_a_declined_call_runs_the_next_kernel_and_is_counted_and_logged_once(fresh, no_switch, caplog):
    """A kernel whose `accepts` gives a reason, or whose function raises Declined (a C entry point's non-zero
    return), leaves the call to the next kernel in priority order; each decline is counted under its reason, in the
    process's counts and the active record, and the first of each (op, kernel, reason) logs one WARNING."""
    op = fresh.op("picky", device_dtype)
    declining = op.register("declines at run", lambda x: (_ for _ in ()).throw(registry.Declined("pt_x returned 3")),
                            priority=30)
    shaped = op.register("2-D only", lambda x: "2-D", accepts=lambda x: None if x.dim() == 2 else "not 2-D",
                         priority=20)
    last = op.register("torch", lambda x: "torch")
    before = registry.counts()
    with caplog.at_level(logging.WARNING, logger="pixeltriage.kernels.registry"), registry.recording() as record:
        assert op(torch.zeros(2, 2)) == "2-D"
        assert op(torch.zeros(2)) == "torch"
        assert op(torch.zeros(3)) == "torch"
    counts = record.snapshot()
    assert counts.calls == {("picky", "2-D only"): 1, ("picky", "torch"): 2}
    assert counts.declines == {("picky", "declines at run", "pt_x returned 3"): 3, ("picky", "2-D only", "not 2-D"): 2}
    assert counts.ran("picky", "torch") == 2 and counts.declined("picky", "2-D only") == {"not 2-D": 2}
    assert registry.counts().since(before) == counts                 # the process counted the same calls
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "'declines at run' declined a call (pt_x returned 3)" in warnings[0]
    assert counts.to_dict() == {"calls": {"picky": {"2-D only": 1, "torch": 2}},
                                "declines": {"picky": {"2-D only": {"not 2-D": 2},
                                                       "declines at run": {"pt_x returned 3": 3}}}}
    with pytest.raises(registry.Declined, match="picky: 2-D only declined: not 2-D"):
        registry.run(shaped, torch.zeros(2))
    with pytest.raises(registry.Declined, match="pt_x returned 3"):
        registry.run(declining, torch.zeros(2))
    assert registry.run(last, torch.zeros(2)) == "torch"
    only = fresh.op("nothing takes it", device_dtype)
    only.register("2-D only", lambda x: x, accepts=lambda x: "never")
    with pytest.raises(BackendUnavailableError, match="declined: 2-D only: never"):
        only(torch.zeros(1))


def test_records_nest_and_scorers_keep_their_own(fresh, no_switch, tiny_checkpoint):
    """A record counts the calls made in its block, nested blocks' included; a Scorer counts its own forwards' calls,
    apart from other scorers', once however its methods nest."""
    op = fresh.op("counted", device_dtype)
    op.register("k", lambda x: x)
    with registry.recording() as outer:
        op(torch.zeros(1))
        with registry.recording() as inner:
            op(torch.zeros(1))
        op(torch.zeros(1))
        with registry.recording(outer):                     # active already: counted once
            op(torch.zeros(1))
    assert outer.snapshot().ran("counted", "k") == 4 and inner.snapshot().ran("counted", "k") == 1

    from pixeltriage import Scorer
    from pixeltriage.episode import sample_episode

    first, second = Scorer.load(tiny_checkpoint), Scorer.load(tiny_checkpoint)
    assert first.kernel_counts().calls == {}
    with registry.recording() as around:
        first.score(*sample_episode())
    assert around.snapshot() == first.kernel_counts()
    ran = first.kernel_counts()
    assert ran.ran("head", "torch reference") == 1 and ran.ran("gated_delta", first.kernels()["gated_delta"]) > 0
    assert second.kernel_counts().calls == {}
    first.with_cache(None).score(*sample_episode())                 # the same loaded model: the same record
    assert first.kernel_counts().ran("head", "torch reference") == 2


def test_the_profiler_trace_names_each_kernel(fresh, no_switch):
    op = fresh.op("traced", device_dtype)
    op.register("my kernel", lambda x: x + 1)
    with torch.profiler.profile() as prof:
        op(torch.zeros(4))
    assert "traced: my kernel" in {e.name for e in prof.events()}


def test_nothing_fits_is_a_typed_error(fresh, no_switch):
    fresh.op("cuda_only", device_dtype).register("k", lambda x: 0, devices=("cuda",))
    with pytest.raises(BackendUnavailableError, match="no kernel of op 'cuda_only' runs torch.float32 on cpu"):
        fresh.choose("cuda_only", "cpu", torch.float32)
    with pytest.raises(KeyError, match="no kernels registered for op 'nope'"):
        fresh.choose("nope", "cpu", torch.float32)


def test_registration_errors(fresh):
    op = fresh.op("dup", device_dtype)
    op.register("k", lambda x: 0, dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="already registered"):
        op.register("k", lambda x: 0, devices=("cpu", "cuda"))
    op.register("k", lambda x: 0, dtypes=(torch.bfloat16,))                    # another dtype: allowed
    with pytest.raises(ValueError, match="devices must be some of"):
        op.register("x", lambda x: 0, devices=("mps",))
    with pytest.raises(ValueError, match="op 'dup' exists already"):
        fresh.op("dup", device_dtype)


def test_emulation_switch_needs_the_interpreter(fresh, monkeypatch):
    toy_op(fresh)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PIXELTRIAGE_EMULATE_CUDA", "1")
    for call in (lambda: fresh.kernel_device("cpu"), lambda: fresh.choose("toy", "cpu", torch.float32),
                 lambda: fresh.choices("cpu", torch.float32)):
        with pytest.raises(ValueError, match="PIXELTRIAGE_EMULATE_CUDA=1.*TRITON_INTERPRET=1"):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fresh.kernel_device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PIXELTRIAGE_EMULATE_CUDA", "maybe")
    with pytest.raises(ValueError, match="PIXELTRIAGE_EMULATE_CUDA='maybe'"):
        fresh.kernel_device("cpu")
    monkeypatch.setenv("PIXELTRIAGE_EMULATE_CUDA", "0")
    assert fresh.kernel_device("cpu") == "cpu"
    assert fresh.kernel_device("cuda") == "cuda"


def test_emulation_gives_cpu_tensors_the_cuda_kernels(fresh, emulating):
    toy_op(fresh)
    assert fresh.kernel_device("cpu") == fresh.kernel_device(torch.device("cuda")) == "cuda"
    # float32 takes the CUDA kernels registered for bf16 too: checked at float32's tolerance (see the module)
    assert fresh.choose("toy", "cpu", torch.float32).name == "cuda fast"
    assert fresh.choose("toy", "cpu", torch.bfloat16).name == "cuda fast"
    assert fresh.get("toy")(torch.zeros(1)) == "fast"
    # on a real CUDA device float32 keeps its own kernel, switch or not
    assert fresh.choose("toy", "cuda", torch.float32).name == "torch"


def test_check_fast_names_the_missing_package(fresh, no_switch):
    state = toy_op(fresh)
    for name in [name for name in fresh._OPS if name != "toy"]:
        del fresh._OPS[name]                     # the real ops' availability is this machine's business
    fresh.check_fast("cuda", torch.bfloat16, allow_slow=False)
    state["fast"] = False
    with pytest.raises(BackendUnavailableError, match="CUDA needs toy-kernels .*toy: torch \\(slow\\)"):
        fresh.check_fast("cuda", torch.bfloat16, allow_slow=False)
    fresh.check_fast("cuda", torch.bfloat16, allow_slow=True)
    fresh.check_fast("cuda", torch.float32, allow_slow=False)     # float32's torch kernel is its own, not slow
    fresh.check_fast("cpu", torch.bfloat16, allow_slow=False)


def test_real_ops_cpu(monkeypatch, no_switch):
    names = registry.choices("cpu", torch.float32)
    assert set(names) >= {"gated_delta", "delta_rule", "chunk_layout", "conv1d", "add_norm", "rms_norm_gated",
                          "norm_rotary", "rotary", "silu_mul", "sigmoid_gate", "gelu_tanh", "linear", "projection",
                          "prepacked_linear", "attention", "vision_attention", "rows_attention", "head"}
    c = native.available()
    assert names["gated_delta"] == ("native C pt_delta_chunked" if c else "chunked (conv1d, then delta_rule)")
    assert names["conv1d"] == ("native C pt_causal_conv1d_silu" if c else "torch shifted multiply-adds")
    assert names["head"] == "torch reference"
    monkeypatch.setattr(native, "library", lambda: None)
    names = registry.choices("cpu", torch.float32)
    assert names["gated_delta"] == "chunked (conv1d, then delta_rule)" and names["silu_mul"] == "torch"
    assert names["add_norm"] == "torch" and names["rotary"] == "torch"
    registry.check_fast("cpu", torch.float32, allow_slow=False)


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
@pytest.mark.parametrize("measured", ["bf16", "float32"])
def test_bf16_gated_delta_takes_the_bf16_units_only_where_the_cpu_has_them(monkeypatch, no_switch, measured):
    """A bf16 forward on the CPU takes the bf16 pass where the CPU has AMX tiles or AVX512-BF16 dot products (the
    build's engines come from this CPU's flags) and PIXELTRIAGE_DELTA_BF16 is auto (unset or empty) and the pass
    measured faster here (here set), or it is 1 / true / on / yes; never where it says 0 / false / off / no.
    float32 forwards, and CPUs with neither ("fma" runs anywhere, for tests, slower than the float32 pass), take the
    float32 pass. Under the ISA emulation auto takes it without a measurement. Other values are an error."""
    from pixeltriage.kernels.gated_delta import bf16

    flags = native._cpu_flags().split()
    have = native.bf16_engines()
    if native.isa_emulated():                      # PIXELTRIAGE_NATIVE_ISA=emulated: every engine, whatever the CPU
        assert have == set(native.BF16_ENGINES)
    else:
        assert "fma" in have
        assert "amx" not in have or "amx_bf16" in flags
        assert "avx512_bf16" not in have or "avx512_bf16" in flags
    monkeypatch.setattr(bf16, "_CHOICE", {})
    monkeypatch.setattr(bf16, "delta_choice", lambda: {"pass": measured})
    bf16_pass, f32_pass = "native C pt_delta_chunked_bf16", "native C pt_delta_chunked"
    units = bool(have & {"amx", "avx512_bf16"})
    auto = bf16_pass if units and (measured == "bf16" or native.isa_emulated()) else f32_pass
    for value, want in ((None, auto), ("", auto), ("auto", auto), ("1", bf16_pass if units else f32_pass),
                        ("on", bf16_pass if units else f32_pass), (" Yes ", bf16_pass if units else f32_pass)):
        if value is None:
            monkeypatch.delenv(bf16.SWITCH, raising=False)
        else:
            monkeypatch.setenv(bf16.SWITCH, value)
        assert registry.choose("gated_delta", "cpu", torch.bfloat16).name == want, value
    monkeypatch.setenv(bf16.SWITCH, "1")
    for engines, name in (({"fma", "amx"}, bf16_pass), ({"fma", "avx512_bf16"}, bf16_pass), ({"fma"}, f32_pass)):
        monkeypatch.setattr(native, "bf16_engines", lambda e=frozenset(engines): e)
        assert registry.choose("gated_delta", "cpu", torch.bfloat16).name == name
        assert registry.choose("gated_delta", "cpu", torch.float32).name == f32_pass
    monkeypatch.setattr(native, "bf16_engines", lambda: frozenset({"fma", "amx"}))
    for off in ("0", "false", "Off", " no "):
        monkeypatch.setenv(bf16.SWITCH, off)
        assert registry.choose("gated_delta", "cpu", torch.bfloat16).name == f32_pass
    monkeypatch.delenv(bf16.SWITCH)
    with pytest.raises(ValueError, match="PIXELTRIAGE_DELTA_BF16='sometimes'"):
        with settings.environment(PIXELTRIAGE_DELTA_BF16="sometimes"):
            pass


def test_real_ops_cuda(monkeypatch, no_switch):
    monkeypatch.setattr(fla, "available", lambda: True)
    names = registry.choices("cuda", torch.bfloat16)
    assert names["gated_delta"] == "fla chunk_gated_delta_rule" and names["head"] == "triton fused head"
    assert names["add_norm"] == names["silu_mul"] == "torch"
    assert registry.choices("cuda", torch.float32)["gated_delta"] == "chunked (conv1d, then delta_rule)"
    registry.check_fast("cuda", torch.bfloat16, allow_slow=False)
    monkeypatch.setattr(fla, "available", lambda: False)
    assert registry.choices("cuda", torch.bfloat16)["gated_delta"] == "chunked (conv1d, then delta_rule; slow)"
    with pytest.raises(BackendUnavailableError, match="CUDA needs flash-linear-attention>=0.6 .*allow_slow=True"):
        registry.check_fast("cuda", torch.bfloat16, allow_slow=False)
    registry.check_fast("cuda", torch.float32, allow_slow=False)


def test_head_auto_follows_the_registry(emulating):
    from pixeltriage.kernels.head import resolve_head_backend

    assert registry.choices("cpu", torch.float32)["head"] == "triton fused head"
    assert resolve_head_backend("auto", torch.device("cpu")) == "triton"
    assert resolve_head_backend("torch", torch.device("cpu")) == "torch"


def test_emulated_cpu_ops_call_no_c_kernel(emulating):
    """Under the switch the CPU tensors take the CUDA choices, which for these ops are torch: no C kernel runs (the
    conv's is fla's, tests/kernels/test_fla.py)."""
    from pixeltriage.kernels.norm import add_rms_norm, rms_norm_gated
    from pixeltriage.kernels.rotary import apply_rotary_float

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, generator=gen)
    with registry.recording() as record:
        add_rms_norm(torch.randn(8, 16, generator=gen), None, torch.zeros(16), 1e-6, torch.float32)
        rms_norm_gated(x, torch.randn(8, 2, 16, generator=gen), torch.ones(16), 1e-6)
        activation.silu_mul(torch.randn(8, 32, generator=gen))
        apply_rotary_float(x, torch.ones(8, 16), torch.zeros(8, 16))
    counts = record.snapshot()
    assert counts.declines == {} and len(counts.calls) == 4
    assert all(not kernel.startswith(("native", "AVX-512")) for _, kernel in counts.calls), counts.calls
    assert registry.choose("conv1d", "cpu", torch.float32).name == "fla causal_conv1d"


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
@claims(activation.NATIVE)
def test_cpu_ops_take_the_c_kernels_the_registry_names(no_switch):
    assert registry.choose("silu_mul", "cpu", torch.float32) is activation.NATIVE
    activation.silu_mul(torch.randn(8, 32))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
def test_forced_declines_are_declines_with_their_reason(monkeypatch):
    """PIXELTRIAGE_TEST_DECLINE names C entry points that `native.call` declines without calling (a code of its
    own): the op records the decline with `native.decline_reason`'s words and runs the next kernel. A name that is
    not an entry point's shape is an error naming the variable."""
    x = torch.randn(8, 32)
    want = activation.silu_mul_torch(x)
    monkeypatch.setenv("PIXELTRIAGE_TEST_DECLINE", "pt_silu_mul, pt_add_norm")
    assert native.call("pt_silu_mul") == native.FORCED_DECLINE
    with registry.recording() as record:
        got = activation.silu_mul(x)
    assert torch.equal(got, want)
    counts = record.snapshot()
    assert counts.declined("silu_mul", "native C pt_silu_mul") == {
        "pt_silu_mul: forced by PIXELTRIAGE_TEST_DECLINE": 1}
    assert counts.ran("silu_mul", "torch") == 1
    # a kernel's own decline codes read as abi.h says them
    assert native.decline_reason("pt_rotary", native.DECLINE["shape"]).startswith("shape")
    assert native.decline_reason("pt_rotary", 99) == "code 99, not one of abi.h's pt_status"
    monkeypatch.setenv("PIXELTRIAGE_TEST_DECLINE", "silu")
    with pytest.raises(ValueError, match="PIXELTRIAGE_TEST_DECLINE='silu'"):
        activation.silu_mul(x)


def test_an_older_fla_is_not_available(monkeypatch):
    """fla before 0.6 takes neither more value heads than key heads nor a precomputed chunk table."""
    import fla as fla_package

    check = fla.available.__wrapped__
    assert check()
    for old in ("0.5.9", "0.3.2"):
        monkeypatch.setattr(fla_package, "__version__", old)
        assert not check()
    for new in ("0.6.0", "0.6.1.dev3", "0.10.0", "1.0"):
        monkeypatch.setattr(fla_package, "__version__", new)
        assert check()
