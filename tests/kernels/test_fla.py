"""What reaches flash-linear-attention's gated delta rule (the CUDA path, as `kernels.registry` registers it) in a
bf16 / fp16 model, run on CPU tensors in Triton's interpreter (tests/triton_interpreter.py), and the device-side
varlen chunk table it builds.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import fla_interpreter  # noqa: F401  (the fixture)

from pixeltriage.kernels import registry

HK, HV, DK, DV, WIDTH = 2, 4, 16, 32, 4          # value heads > key heads: each key head serves two
CONV_DIM = 2 * HK * DK + HV * DV


class NanPoisonedEmpty(TorchDispatchMode):
    """Fills every floating tensor that empty()/empty_like()/new_empty() returns with NaN."""

    EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
             torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty_strided.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and out.is_floating_point():
            out.fill_(float("nan"))
        return out


def make_inputs(seq_len, dtype=torch.float32, seed=0):
    """qkv [T, conv_dim], conv weight [conv_dim, W] in `dtype`; g (some strong decays), beta [T, Hv] float32."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq_len, CONV_DIM, generator=gen).to(dtype)
    conv_weight = (0.5 * torch.randn(CONV_DIM, WIDTH, generator=gen)).to(dtype)
    g = -F.softplus(torch.randn(seq_len, HV, generator=gen)) * 2.0
    beta = torch.rand(seq_len, HV, generator=gen)
    return qkv, conv_weight, g, beta


def fla_kernel(dtype=torch.float32):
    kernel = registry.choose("gated_delta", "cpu", dtype)
    assert kernel.name == "fla chunk_gated_delta_rule"
    return kernel


def run_fla(qkv, conv_weight, g, beta, bounds):
    cu_device = None if bounds is None else torch.tensor(bounds, dtype=torch.long)
    with NanPoisonedEmpty():
        return fla_kernel(qkv.dtype).fn(qkv, conv_weight, g, beta, HK, DK, HV, DV, bounds, cu_device)


def rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_hands_fla_its_dtype_and_grouped_heads(fla_interpreter, monkeypatch, dtype):  # noqa: F811
    """In a bf16 / fp16 model, q, k and v reach fla's chunk_gated_delta_rule in the model's dtype, q and k with their
    key heads as they are ([1, T, Hk, K]: fla takes more value heads than key heads), g and beta in float32 (as
    fla's own layer hands them: its gate and beta-sigmoid kernels write float32), the boundaries as the device
    tensor. The interpreter cannot run bf16 dots, so the recorded call then runs fla on float32 copies, whose
    output must equal the torch chunked rule on the same (rounded) q, k and v."""
    import fla.ops.gated_delta_rule as fla_ops

    real, calls = fla_ops.chunk_gated_delta_rule, []

    def recording(q, k, v, g, beta, **kwargs):
        calls.append({"q": q, "k": k, "v": v, "g": g, "beta": beta, **kwargs})
        o, state = real(q.float(), k.float(), v.float(), g, beta.float(), **kwargs)
        return o.to(q.dtype), state

    monkeypatch.setattr(fla_ops, "chunk_gated_delta_rule", recording)
    bounds = [0, 1, 40]
    qkv, conv_weight, g, beta = make_inputs(40, dtype=dtype, seed=7)
    out = run_fla(qkv, conv_weight, g, beta, bounds)

    assert len(calls) == 1
    call = calls[0]
    assert {name: call[name].dtype for name in ("q", "k", "v", "g", "beta")} == {
        "q": dtype, "k": dtype, "v": dtype, "g": torch.float32, "beta": torch.float32}
    assert call["q"].shape == call["k"].shape == (1, 40, HK, DK)
    assert call["v"].shape == (1, 40, HV, DV)
    assert call["g"].shape == call["beta"].shape == (1, 40, HV)
    assert call["use_qk_l2norm_in_kernel"] is True
    assert torch.equal(call["cu_seqlens"], torch.tensor(bounds)) and call["cu_seqlens"].device == qkv.device
    assert out.shape == (40, HV, DV) and out.dtype == torch.float32 and torch.isfinite(out).all()

    from pixeltriage.kernels.gated_delta import chunk_gated_delta_rule

    q, k = (call[name][0].float().repeat_interleave(HV // HK, dim=1) for name in ("q", "k"))
    want = chunk_gated_delta_rule(q, k, call["v"][0].float(), g, beta, cu_seqlens=bounds, qk_l2norm=True,
                                  native=False)
    # fla returns o in the model's dtype: one rounding of the output
    assert rel(out, want) <= torch.finfo(dtype).eps


@pytest.mark.parametrize("bounds", [[0, 1, 33, 33, 97], [0, 64, 128], [0, 0, 5], [0, 200, 201, 265]])
def test_varlen_chunk_indices_match_fla(bounds):
    """The chunk table built on the device from the boundaries tensor equals fla's own (which it replaces because
    fla's reads the counts back to the host)."""
    from fla.ops.utils.index import prepare_chunk_indices

    from pixeltriage.kernels.gated_delta.fla import varlen_chunk_indices

    for dtype in (torch.int64, torch.int32):
        cu = torch.tensor(bounds, dtype=dtype)
        got = varlen_chunk_indices(bounds, cu)
        assert got.dtype == dtype and torch.equal(got, prepare_chunk_indices(cu, 64))


def test_fla_wrapper_refuses_what_it_cannot_run(monkeypatch):
    from pixeltriage.errors import BackendUnavailableError
    from pixeltriage.kernels.gated_delta.fla import gated_delta_fla

    args = make_inputs(10)
    monkeypatch.delenv(registry.EMULATE_CUDA, raising=False)
    with pytest.raises(BackendUnavailableError, match="runs on CUDA, found cpu"):
        gated_delta_fla(*args, HK, DK, HV, DV, None)
    monkeypatch.setenv(registry.EMULATE_CUDA, "1")
    monkeypatch.setenv(registry.TRITON_INTERPRET, "1")
    with pytest.raises(ValueError, match="pass cu_seqlens_device"):
        gated_delta_fla(*args, HK, DK, HV, DV, [0, 4, 10])
    with pytest.raises(ValueError, match="does not hold 2 key heads of 16 and 3 value heads"):
        gated_delta_fla(*args, HK, DK, 3, DV, None)
