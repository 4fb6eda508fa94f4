"""The kernel registry: which kernel each op takes per device, dtype and availability, the test switch that gives
CPU tensors the CUDA kernels, the names it reports, and the slow-fallback refusal."""
import pytest
import torch

from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels import native, registry
from pixeltriage.kernels.gated_delta import fla


@pytest.fixture
def fresh(monkeypatch):
    """The registry's entries restored after the test (fake ops registered in it vanish)."""
    registry._load_ops()
    monkeypatch.setattr(registry, "_ENTRIES", {op: list(entries) for op, entries in registry._ENTRIES.items()})
    registry._candidates.cache_clear()
    yield registry
    registry._candidates.cache_clear()


@pytest.fixture
def no_switch(monkeypatch):
    monkeypatch.delenv(registry.EMULATE_CUDA, raising=False)


@pytest.fixture
def emulating(monkeypatch):
    monkeypatch.setenv(registry.EMULATE_CUDA, "1")
    monkeypatch.setenv(registry.TRITON_INTERPRET, "1")


def toy_op(reg, fast_ok=True, c_ok=True):
    """A fake op shaped like the real ones: a CUDA kernel for bf16/fp16 (priority 20), a CPU C kernel for
    float32/bf16 (10), torch on the CPU (0) and a slow torch fallback on CUDA (-10)."""
    state = {"fast": fast_ok, "c": c_ok}
    reg.register("toy", "cuda fast", lambda: "fast", devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
                 available=lambda: state["fast"], priority=20, package="toy-kernels")
    reg.register("toy", "C", lambda: "c", devices=("cpu",), dtypes=(torch.float32, torch.bfloat16),
                 available=lambda: state["c"], priority=10)
    reg.register("toy", "torch", lambda: "torch", devices=("cpu",))
    reg.register("toy", "torch", lambda: "torch", devices=("cuda",), dtypes=(torch.float32,))
    reg.register("toy", "torch (slow)", lambda: "slow", devices=("cuda",), priority=-10, slow=True)
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
    assert (kernel.op, kernel.name, kernel.slow, kernel.fn()) == ("toy", "torch (slow)", True, "slow")


def test_priority_then_registration_order(fresh, no_switch):
    fresh.register("order", "first", lambda: 1, devices=("cpu",))
    fresh.register("order", "second", lambda: 2, devices=("cpu",))
    assert fresh.choose("order", "cpu", torch.float32).name == "first"
    fresh.register("order", "better", lambda: 3, devices=("cpu",), priority=1)
    assert fresh.choose("order", "cpu", torch.float32).name == "better"


def test_nothing_fits_is_a_typed_error(fresh, no_switch):
    fresh.register("cuda_only", "k", lambda: 0, devices=("cuda",))
    with pytest.raises(BackendUnavailableError, match="no kernel of op 'cuda_only' runs torch.float32 on cpu"):
        fresh.choose("cuda_only", "cpu", torch.float32)
    with pytest.raises(KeyError, match="no kernels registered for op 'nope'"):
        fresh.choose("nope", "cpu", torch.float32)


def test_registration_errors(fresh):
    fresh.register("dup", "k", lambda: 0, devices=("cpu",), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="already registered"):
        fresh.register("dup", "k", lambda: 0, devices=("cpu", "cuda"))
    fresh.register("dup", "k", lambda: 0, devices=("cpu",), dtypes=(torch.bfloat16,))   # another dtype: allowed
    with pytest.raises(ValueError, match="devices must be some of"):
        fresh.register("dup", "x", lambda: 0, devices=("mps",))


def test_emulation_switch_needs_the_interpreter(fresh, monkeypatch):
    toy_op(fresh)
    monkeypatch.setenv(registry.EMULATE_CUDA, "1")
    monkeypatch.delenv(registry.TRITON_INTERPRET, raising=False)
    for call in (lambda: fresh.kernel_device("cpu"), lambda: fresh.choose("toy", "cpu", torch.float32),
                 lambda: fresh.choices("cpu", torch.float32)):
        with pytest.raises(ValueError, match="PIXELTRIAGE_EMULATE_CUDA=1.*TRITON_INTERPRET=1"):
            call()
    monkeypatch.setenv(registry.TRITON_INTERPRET, "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fresh.kernel_device("cpu")
    monkeypatch.setenv(registry.EMULATE_CUDA, "maybe")
    with pytest.raises(ValueError, match="PIXELTRIAGE_EMULATE_CUDA='maybe'"):
        fresh.kernel_device("cpu")
    monkeypatch.setenv(registry.EMULATE_CUDA, "0")
    assert fresh.kernel_device("cpu") == "cpu"
    assert fresh.kernel_device("cuda") == "cuda"


def test_emulation_gives_cpu_tensors_the_cuda_kernels(fresh, emulating):
    toy_op(fresh)
    assert fresh.kernel_device("cpu") == fresh.kernel_device(torch.device("cuda")) == "cuda"
    # the interpreter cannot run bf16 dots: float32 stands in for the CUDA kernels' dtypes
    assert fresh.choose("toy", "cpu", torch.float32).name == "cuda fast"
    assert fresh.choose("toy", "cpu", torch.bfloat16).name == "cuda fast"
    # on a real CUDA device float32 keeps its own kernel, switch or not
    assert fresh.choose("toy", "cuda", torch.float32).name == "torch"


def test_check_fast_names_the_missing_package(fresh, no_switch):
    state = toy_op(fresh)
    for op in [op for op in fresh._ENTRIES if op != "toy"]:
        del fresh._ENTRIES[op]                   # the real ops' availability is this machine's business
    fresh.check_fast("cuda", torch.bfloat16, allow_slow=False)
    state["fast"] = False
    with pytest.raises(BackendUnavailableError, match="CUDA needs toy-kernels .*toy: torch \\(slow\\)"):
        fresh.check_fast("cuda", torch.bfloat16, allow_slow=False)
    fresh.check_fast("cuda", torch.bfloat16, allow_slow=True)
    fresh.check_fast("cuda", torch.float32, allow_slow=False)     # float32's torch kernel is its own, not slow
    fresh.check_fast("cpu", torch.bfloat16, allow_slow=False)


def test_real_ops_cpu(monkeypatch, no_switch):
    names = registry.choices("cpu", torch.float32)
    assert set(names) >= {"gated_delta", "conv1d", "add_norm", "rms_norm_gated", "norm_rotary", "rotary",
                          "silu_mul", "linear", "projection", "attention", "head"}
    c = native.available()
    assert names["gated_delta"] == ("native C pt_delta_chunked" if c else "torch chunked")
    assert names["conv1d"] == ("native C pt_causal_conv1d_silu" if c else "torch shifted multiply-adds")
    assert names["head"] == "torch reference"
    monkeypatch.setattr(native, "library", lambda: None)
    names = registry.choices("cpu", torch.float32)
    assert names["gated_delta"] == "torch chunked" and names["silu_mul"] == "torch"
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
    monkeypatch.setenv(bf16.SWITCH, "sometimes")
    with pytest.raises(ValueError, match="PIXELTRIAGE_DELTA_BF16='sometimes'"):
        bf16.available()


def test_real_ops_cuda(monkeypatch, no_switch):
    monkeypatch.setattr(fla, "available", lambda: True)
    names = registry.choices("cuda", torch.bfloat16)
    assert names["gated_delta"] == "fla chunk_gated_delta_rule" and names["head"] == "triton fused head"
    assert names["add_norm"] == names["silu_mul"] == "torch"
    assert registry.choices("cuda", torch.float32)["gated_delta"] == "torch chunked"
    registry.check_fast("cuda", torch.bfloat16, allow_slow=False)
    monkeypatch.setattr(fla, "available", lambda: False)
    assert registry.choices("cuda", torch.bfloat16)["gated_delta"] == "torch chunked (slow)"
    with pytest.raises(BackendUnavailableError, match="CUDA needs flash-linear-attention>=0.6 .*allow_slow=True"):
        registry.check_fast("cuda", torch.bfloat16, allow_slow=False)
    registry.check_fast("cuda", torch.float32, allow_slow=False)


def test_head_auto_follows_the_registry(emulating):
    from pixeltriage.kernels.head import resolve_head_backend

    assert registry.choices("cpu", torch.float32)["head"] == "triton fused head"
    assert resolve_head_backend("auto", torch.device("cpu")) == "triton"
    assert resolve_head_backend("torch", torch.device("cpu")) == "torch"


def test_emulated_cpu_ops_call_no_c_kernel(emulating, native_calls):
    """Under the switch the CPU tensors take the CUDA choices, which for these ops are torch: no C kernel runs."""
    from pixeltriage.kernels.activation import silu_mul
    from pixeltriage.kernels.conv import causal_conv1d_silu
    from pixeltriage.kernels.norm import add_rms_norm, rms_norm_gated
    from pixeltriage.kernels.rotary import apply_rotary_float

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, generator=gen)
    add_rms_norm(torch.randn(8, 16, generator=gen), None, torch.zeros(16), 1e-6, torch.float32)
    rms_norm_gated(x, torch.randn(8, 2, 16, generator=gen), torch.ones(16), 1e-6)
    silu_mul(torch.randn(8, 32, generator=gen))
    causal_conv1d_silu(torch.randn(8, 16, generator=gen), torch.randn(16, 4, generator=gen))
    apply_rotary_float(x, torch.ones(8, 16), torch.zeros(8, 16))
    assert native_calls == []


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
def test_cpu_ops_take_the_c_kernels_the_registry_names(no_switch, native_calls):
    from pixeltriage.kernels.activation import silu_mul

    assert registry.choose("silu_mul", "cpu", torch.float32).name == "native C pt_silu_mul"
    silu_mul(torch.randn(8, 32))
    assert [name for name, _ in native_calls] == ["pt_silu_mul"]


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
