"""The CUDA path's gated delta rule (flash-linear-attention's Triton kernels, as `kernels.registry` registers them),
run on CPU tensors in Triton's interpreter (tests/triton_interpreter.py), against the torch chunked rule and the
plain recurrence, on fla-style awkward shapes; and what reaches fla in a bf16 / fp16 model.

Runs are float32, and bf16 / fp16 with the harness's tensor-core `tl.dot`. Tolerances are max abs error over
max |ref|, per tensor, about twice the largest error measured on 18 inputs of these shapes (the test's seeds among
them):
- o against the float64 recurrence (conv, norms and recurrence in float64): measured <= 5.9e-6, bound 1.2e-5;
- o against the torch chunked rule (float32): measured <= 4.2e-6, bound 8e-6 (fla's dots sum in another order
  and its decays are exp2 of log2-scaled cumulative sums; the torch rule itself is <= 1.8e-6 from float64);
- the fla conv's output against the torch shifted multiply-adds: measured <= 1.2e-7 (6 inputs), bound 2.5e-7;
- bf16 / fp16 fla against the float64 recurrence: LOW_PRECISION_TOL below.
Every float tensor allocated with empty() during a kernel call is filled with NaN first, so an output element a
kernel leaves unwritten shows up as NaN.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from poison import NanPoisonedEmpty
from triton_interpreter import fla_interpreter  # noqa: F401  (the fixture)

from kernel_claims import claims
from pixeltriage.kernels import conv, registry
from pixeltriage.kernels.gated_delta import chunk, fla, recurrent_gated_delta_rule

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

HK, HV, DK, DV, WIDTH = 2, 4, 16, 32, 4          # value heads > key heads: each key head serves two
CONV_DIM = 2 * HK * DK + HV * DV
O_TOL_EXACT = 1.2e-5      # against the float64 recurrence
O_TOL_TORCH = 8e-6        # against the torch chunked rule
CONV_TOL = 2.5e-7
# fla in the model's dtype against the float64 recurrence on the same (rounded) inputs: fla rounds q, k, v, its
# intermediates (the WY factors, the chunk states it multiplies) and o to that dtype; measured on 6 inputs of these
# shapes (T = 40, 63, 64, 65, 97 varlen, 130): bf16 <= 2.7e-2 (3.4 bf16 eps), fp16 <= 1.3e-3; bounds about twice that
LOW_PRECISION_TOL = {torch.bfloat16: 5e-2, torch.float16: 2.6e-3}


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


def device_bounds(bounds):
    return None if bounds is None else torch.tensor(bounds, dtype=torch.long)


def run_fla(qkv, conv_weight, g, beta, bounds, cu_device=None):
    """The "gated_delta" op, whose kernel here is the registered CUDA one; cu_device: the boundaries as a tensor
    (made here when not given)."""
    cu_device = device_bounds(bounds) if cu_device is None else cu_device
    fla_kernel(qkv.dtype)
    with NanPoisonedEmpty():
        return chunk.GATED_DELTA(qkv, conv_weight, g, beta, HK, DK, HV, DV, bounds, cu_device)


def torch_chunked(qkv, conv_weight, g, beta, bounds):
    """The torch kernels' conv (shifted multiply-adds) and chunked rule, q and k L2-normalised inside it."""
    from pixeltriage.kernels.conv import conv1d_silu_torch

    seq_len = qkv.shape[0]
    q, k, v = conv1d_silu_torch(qkv, conv_weight, bounds).split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k = (x.reshape(seq_len, HK, DK).repeat_interleave(HV // HK, dim=1) for x in (q, k))
    return chunk.delta_rule_torch(q, k, v.reshape(seq_len, HV, DV), g, beta, cu_seqlens=bounds, qk_l2norm=True)


def recurrence64(qkv, conv_weight, g, beta, bounds):
    """The ground truth: sequence by sequence, the textbook conv (F.conv1d), L2 norms x / sqrt(sum x^2 + 1e-6) and
    the plain recurrence, all in float64."""
    seq_len = qkv.shape[0]
    bounds = [0, seq_len] if bounds is None else bounds
    out = torch.zeros(seq_len, HV, DV, dtype=torch.float64)
    for b, e in zip(bounds, bounds[1:]):
        if e == b:
            continue
        x, w = qkv[b:e].double(), conv_weight.double()
        mixed = F.silu(F.conv1d(x.t()[None], w[:, None], padding=WIDTH - 1, groups=CONV_DIM)[0, :, :e - b].t())
        q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
        q, k = (x.reshape(e - b, HK, DK) for x in (q, k))
        q, k = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        q, k = (x.repeat_interleave(HV // HK, dim=1) for x in (q, k))
        out[b:e] = recurrent_gated_delta_rule(q, k, v.reshape(e - b, HV, DV), g[b:e], beta[b:e],
                                              compute_dtype=torch.float64)
    return out


def rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def check_against_references(bounds, seq_len, seed, syncs=None):
    args = make_inputs(seq_len, seed=seed)
    cu_device = device_bounds(bounds)                 # made before the forward, as the engine does
    with syncs or contextlib.nullcontext():
        out = run_fla(*args, bounds, cu_device)
    assert out.shape == (seq_len, HV, DV) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN-poisoned or non-finite output rows"
    assert rel(out, torch_chunked(*args, bounds)) <= O_TOL_TORCH
    assert rel(out, recurrence64(*args, bounds)) <= O_TOL_EXACT


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 130])
@claims(fla.FLA, fla.FLA_CONV)
def test_fla_matches_torch_chunked_and_recurrence(fla_interpreter, seq_len):  # noqa: F811
    check_against_references(None, seq_len, seed=seq_len)


@claims(fla.FLA, fla.FLA_CONV)
def test_fla_varlen_boundaries_as_a_device_tensor(fla_interpreter):  # noqa: F811
    """Packed sequences, the first of a single token, one empty, the last over two chunks, boundaries on the
    tensors' device: no state or conv window crosses a boundary, and the kernel makes no host sync."""
    from sync_guard import HostSyncs

    bounds = [0, 1, 33, 33, 97]
    syncs = HostSyncs()
    check_against_references(bounds, bounds[-1], seed=len(bounds), syncs=syncs)
    # and no host sync or upload on the way (fla's own chunk table would read its counts back to the host)
    assert syncs.events == [], [str(e) for e in syncs.events]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@claims(fla.FLA, fla.FLA_CONV)
def test_low_precision_model_runs_fla_in_its_dtype(fla_interpreter, monkeypatch, dtype):  # noqa: F811
    """In a bf16 / fp16 model, q, k and v reach fla's chunk_gated_delta_rule in the model's dtype, q and k with their
    key heads as they are ([1, T, Hk, K]: fla takes more value heads than key heads), g and beta in float32 (as
    fla's own layer hands them: its gate and beta-sigmoid kernels write float32), the boundaries as the device
    tensor; fla then runs in that dtype (its dots as tensor cores compute them, the harness's `tl.dot`), and its
    output is within LOW_PRECISION_TOL[dtype] of the float64 recurrence."""
    import fla.ops.gated_delta_rule as fla_ops

    real, calls = fla_ops.chunk_gated_delta_rule, []

    def recording(q, k, v, g, beta, **kwargs):
        calls.append({"q": q, "k": k, "v": v, "g": g, "beta": beta, **kwargs})
        return real(q, k, v, g, beta, **kwargs)

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
    assert rel(out, recurrence64(qkv, conv_weight, g, beta, bounds)) <= LOW_PRECISION_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@claims(fla.FLA, fla.FLA_CONV)
def test_low_precision_fla_on_longer_inputs(fla_interpreter, dtype):  # noqa: F811
    """Two chunks and packed sequences (one of a single token, one empty) in the model's dtype, against the float64
    recurrence on the same rounded inputs."""
    bounds = [0, 1, 33, 33, 97]
    args = make_inputs(97, dtype=dtype, seed=3)
    out = run_fla(*args, bounds)
    assert torch.isfinite(out).all()
    assert rel(out, recurrence64(*args, bounds)) <= LOW_PRECISION_TOL[dtype]


@pytest.mark.parametrize("bounds", [None, [0, 1, 33, 33, 97]], ids=["one-sequence", "varlen"])
@claims(fla.FLA_CONV)
def test_fla_conv_matches_torch_conv(fla_interpreter, bounds):  # noqa: F811
    """fla's causal conv1d + SiLU (the registered CUDA conv) against the torch shifted multiply-adds, float32."""
    from pixeltriage.kernels.conv import conv1d_silu_torch

    assert registry.choose("conv1d", "cpu", torch.float32) is fla.FLA_CONV
    qkv, conv_weight, _, _ = make_inputs(97, seed=11)
    qkv = torch.cat([qkv, torch.randn(97, 5)], dim=1)[:, :CONV_DIM]      # strided rows, as the projection's split
    cu_device = None if bounds is None else torch.tensor(bounds)
    with NanPoisonedEmpty():
        out = conv.CONV1D(qkv, conv_weight, bounds, cu_device)
    assert out.shape == qkv.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel(out, conv1d_silu_torch(qkv, conv_weight, bounds)) <= CONV_TOL


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
    monkeypatch.delenv("PIXELTRIAGE_EMULATE_CUDA", raising=False)
    with pytest.raises(BackendUnavailableError, match="runs on CUDA, found cpu"):
        gated_delta_fla(*args, HK, DK, HV, DV, None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PIXELTRIAGE_EMULATE_CUDA", "1")
    with pytest.raises(ValueError, match="pass cu_seqlens_device"):
        gated_delta_fla(*args, HK, DK, HV, DV, [0, 4, 10])
    with pytest.raises(ValueError, match="does not hold 2 key heads of 16 and 3 value heads"):
        gated_delta_fla(*args, HK, DK, 3, DV, None)


def test_harness_fails_loudly_on_other_versions(monkeypatch):
    """A triton or fla other than the pinned ones is an error naming what was found, never a skip."""
    import importlib.metadata

    import triton_interpreter

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "3.10.0" if name == "triton" else real(name))
    with pytest.raises(triton_interpreter.InterpreterHarnessError, match=r"triton 3\.10\.0 \(expected 3\.9\.0\)"):
        triton_interpreter._check_versions()


def test_harness_fails_loudly_when_an_internal_changes(monkeypatch):
    import triton_interpreter
    from triton.runtime import autotuner, interpreter

    def run(self, *args, **kwargs):
        return None

    monkeypatch.setattr(autotuner.Autotuner, "run", run)
    monkeypatch.setattr(interpreter.ASTTransformer, "visit_For", lambda self, node: node, raising=False)
    with pytest.raises(triton_interpreter.InterpreterHarnessError,
                       match="rewrites for loops itself.*no longer runs a single pruned config"):
        triton_interpreter._check_internals()


def test_harness_restores_what_it_patched(monkeypatch):
    import triton_interpreter
    from triton.runtime import autotuner, interpreter

    if not triton_interpreter.interpreting():
        pytest.skip("Triton is not interpreting here (a GPU machine)")
    monkeypatch.delenv("PIXELTRIAGE_EMULATE_CUDA", raising=False)
    prune = autotuner.Autotuner.prune_configs
    with triton_interpreter.fla_interpreter_mode():
        with triton_interpreter.fla_interpreter_mode():           # nested: the outer block restores
            assert registry.kernel_device("cpu") == "cuda"
        assert registry.kernel_device("cpu") == "cuda" and autotuner.Autotuner.prune_configs is not prune
    assert autotuner.Autotuner.prune_configs is prune
    assert "visit_For" not in vars(interpreter.ASTTransformer)
    assert registry.kernel_device("cpu") == "cpu"


def _dot_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        b_a = tl.load(a + o_m[:, None] * K + o_k[None, :])
        b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
        b_c = tl.dot(b_a, b_b)
        b_c = tl.dot(b_a, b_b, b_c)                  # into an accumulator too
        tl.store(c + o_m[:, None] * N + o_n[None, :], b_c.to(c.dtype.element_ty))
    return dot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dot_computes_as_tensor_cores_do(dtype, out_dtype):
    """Under the harness, tl.dot of bf16 / fp16 tiles is the float32 product of the rounded operands, summed in
    float32 (twice: 2 A B), cast as the kernel asks; without it the interpreter multiplies bf16's raw bits."""
    import triton_interpreter

    if not triton_interpreter.interpreting():
        pytest.skip("Triton is not interpreting here (a GPU machine)")
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((16, 32), (32, 16)))
    want = (2 * (a.double() @ b.double())).to(out_dtype)       # products of two bf16 are exact in float32
    kernel = _dot_kernel()
    with triton_interpreter.fla_interpreter_mode():
        c = torch.empty(16, 16, dtype=out_dtype)
        kernel[(1,)](a, b, c, 16, 16, 32)
    float32_sums = 32 * 2 * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs()).max().item()
    assert (c.double() - want.double()).abs().max().item() <= (
        float32_sums if out_dtype == torch.float32 else torch.finfo(out_dtype).eps * want.double().abs().max().item())
    if dtype == torch.bfloat16:
        raw = torch.empty(16, 16, dtype=out_dtype)
        kernel[(1,)](a, b, raw, 16, 16, 32)
        assert not torch.allclose(raw.double(), want.double(), atol=1.0), "the interpreter's own bf16 dot"


def test_the_poison_reaches_every_empty_allocation():
    """The NaN poison covers the allocation calls fla's wrappers make (empty, empty_like, new_empty, strided)."""
    x = torch.zeros(3, 4)
    with NanPoisonedEmpty():
        made = [torch.empty(3, 4), torch.empty_like(x), x.new_empty(2, 2), torch.empty_strided((2, 3), (1, 2)),
                torch.empty_like(x, memory_format=torch.contiguous_format)]
        untouched = [torch.zeros(2), torch.empty(2, dtype=torch.long)]
    assert all(t.isnan().all() for t in made)
    assert not untouched[0].isnan().any()
