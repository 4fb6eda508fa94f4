"""The chunked gated delta rule against the plain recurrence, and against transformers' torch version."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
import isa
from kernel_claims import claims, paths
from poison import NanPoisonedEmpty

from pixeltriage.kernels import native, registry
from pixeltriage.kernels.gated_delta import (bf16, chunk, chunk_gated_delta_rule, conv_chunk_gated_delta_rule,
                                             recurrent_gated_delta_rule)

TORCH_RULE, NATIVE_RULE = paths(chunk.TORCH_RULE, chunk.NATIVE_RULE)   # the delta rule's torch and C kernels


@contextlib.contextmanager
def torch_only():
    """No C kernel library inside the block: every op runs its torch kernels (the torch prep and loop)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        yield


def inputs(seq_len, heads=3, k_dim=12, v_dim=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(seq_len, heads, k_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(seq_len, heads, k_dim, generator=gen), dim=-1)
    v = torch.randn(seq_len, heads, v_dim, generator=gen)
    g = -F.softplus(torch.randn(seq_len, heads, generator=gen)) * 2.0    # log decay <= 0, some strong
    beta = torch.rand(seq_len, heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("kernel, dims", [     # the C kernel takes head dims that are multiples of 16 only
    pytest.param(*TORCH_RULE.values, (12, 20), id="torch-12x20", marks=TORCH_RULE.marks),
    pytest.param(*TORCH_RULE.values, (16, 32), id="torch-16x32", marks=TORCH_RULE.marks),
    pytest.param(*NATIVE_RULE.values, (16, 32), id="native-16x32", marks=NATIVE_RULE.marks)])
def test_chunk_matches_recurrent(seq_len, dims, kernel):
    args = inputs(seq_len, k_dim=dims[0], v_dim=dims[1])
    ref = recurrent_gated_delta_rule(*args)
    out = registry.run(kernel, *args)
    assert out.shape == ref.shape == (seq_len, 3, dims[1])
    assert (out - ref).abs().max().item() / ref.abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", [TORCH_RULE, NATIVE_RULE])
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_does_not_change_result(chunk_size, kernel):
    args = inputs(130, k_dim=16, v_dim=32, seed=1)
    ref = recurrent_gated_delta_rule(*args)
    out = registry.run(kernel, *args, chunk_size=chunk_size)
    assert (out - ref).abs().max().item() / ref.abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", [TORCH_RULE, NATIVE_RULE])
def test_matches_transformers_torch_chunk(kernel):
    from pixeltriage.bench.transformers_baseline import force_transformers_torch_path

    force_transformers_torch_path()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    q, k, v, g, beta = inputs(97, k_dim=16, v_dim=32, seed=2)
    ref, _ = m.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                            use_qk_l2norm_in_kernel=False)
    out = registry.run(kernel, q, k, v, g, beta)
    assert (out - ref[0]).abs().max().item() / ref.abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", [TORCH_RULE, NATIVE_RULE])
@pytest.mark.parametrize("seq_len", [1, 65, 300])
def test_l2norm_inside_equals_l2norm_before(seq_len, kernel):
    """qk_l2norm=True (the norm's scale multiplied in on the way into the chunk layout) against the layer's
    old separate norm, x * rsqrt(sum x^2 + 1e-6), then the chunked rule: <= 1e-6 relative, float32; varlen too."""
    gen = torch.Generator().manual_seed(seq_len)
    q, k = torch.randn(seq_len, 3, 16, generator=gen) * 3, torch.randn(seq_len, 3, 16, generator=gen) * 0.2
    _, _, v, g, beta = inputs(seq_len, v_dim=32, seed=seq_len)

    def l2(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    for bounds in (None, [0, seq_len // 3, seq_len]):
        with torch_only():
            want = chunk_gated_delta_rule(l2(q), l2(k), v, g, beta, chunk_size=64, cu_seqlens=bounds)
        got = registry.run(kernel, q, k, v, g, beta, chunk_size=64, cu_seqlens=bounds, qk_l2norm=True)
        assert (got - want).abs().max().item() / want.abs().max().item() <= 1e-6


@pytest.mark.parametrize("chunk_size", [16, 48, 64])
@pytest.mark.parametrize("varlen", [False, True])
@claims(chunk.NATIVE_RULE)
def test_c_chunk_kernels_match_torch_prep_and_loop(chunk_size, varlen):
    """`pt_delta_chunked` (per head, each chunk's matrices, triangular products by blocks, u and w written in place,
    then its step of the recurrence) against the torch prep and loop: <= 1e-6 relative in
    float32, and against the plain recurrence. Packed sequences restart the state mid-batch; decays strong enough
    to be cut to zero hit whole chunks; a chunk size not a multiple of 64 leaves the column tails to the kernel."""
    assert native.available(), native.status()
    q, k, v, g, beta = inputs(300, heads=4, k_dim=32, v_dim=48, seed=3)
    g[100:140] -= 25.0                                   # every decay across these tokens under the cut-off
    bounds = [0, 37, 101, 101, 300] if varlen else None
    with torch_only():
        want = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, cu_seqlens=bounds)
    got = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, cu_seqlens=bounds)
    assert (got - want).abs().max().item() / want.abs().max().item() <= 1e-6
    # against the recurrence run in float64 (its default is float32): the chunked form's own float32 error, which
    # both paths share, measured 3.4e-6 (chunk 16, packed) to 3.1e-5 (chunks 48 and 64, packed) on these inputs
    pieces = [(0, 300)] if bounds is None else [(b, e) for b, e in zip(bounds, bounds[1:]) if e > b]
    for b, e in pieces:
        ref = recurrent_gated_delta_rule(q[b:e], k[b:e], v[b:e], g[b:e], beta[b:e], compute_dtype=torch.float64)
        assert ref.dtype == torch.float64
        assert (got[b:e] - ref).abs().max().item() / ref.abs().max().item() <= 5e-5


def test_c_chunk_kernels_decline_what_they_do_not_handle():
    """Head dims that are not multiples of 16 (and chunks over 256) go to the torch prep and loop."""
    args = inputs(70, k_dim=12, v_dim=20)
    with registry.recording() as record:
        out = chunk_gated_delta_rule(*args)
    counts = record.snapshot()
    assert counts.ran("delta_rule", chunk.TORCH_RULE.name) == 1
    if native.available():
        assert counts.declined("delta_rule", chunk.NATIVE_RULE.name) == {"head dims not multiples of 16": 1}
    ref = recurrent_gated_delta_rule(*args)
    assert (out - ref).abs().max().item() / ref.abs().max().item() <= 1e-5


@pytest.mark.parametrize("qk_l2norm", [False, True])
@pytest.mark.parametrize("bounds", [None, [0, 37, 101, 101, 300]])
@claims(chunk.NATIVE_LAYOUT)
def test_c_chunk_layout_matches_the_torch_layout(qk_l2norm, bounds):
    """The torch rule's chunk layout gathered in C (`pt_chunk_gather`: q, k, k * beta, v * beta, the norms folded in)
    against torch's gather: the same rows to float32 rounding (<= 1e-6 relative), zero rows padding each sequence's
    last chunk, from strided token-major inputs."""
    q, k, v, g, beta = inputs(300, heads=3, k_dim=12, v_dim=20, seed=4)
    v = torch.cat([v, torch.randn(300, 3, 4)], dim=-1)[..., :20]                 # a strided v, as the layer's
    plan = chunk._plan(300, bounds, 32, False)
    got = registry.run(chunk.NATIVE_LAYOUT, q, k, v, beta, qk_l2norm, plan)
    want = registry.run(chunk.TORCH_LAYOUT, q, k, v, beta, qk_l2norm, plan)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape == (plan.num_chunks, 3, 32, a.shape[-1])
        assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item()


@claims(chunk.NATIVE_RULE)
def test_default_chunk_is_the_c_kernels_size_where_they_run(monkeypatch):
    """chunk_size=None: 32-token chunks through the C kernels, 64 on the torch path; either within the chunked
    form's float32 error of the recurrence (the two sizes round differently: 2.4e-6 apart here)."""
    calls, real = [], native.call
    monkeypatch.setattr(native, "call", lambda name, *args, **kw: calls.append((name, args)) or real(name, *args, **kw))
    args = inputs(200, k_dim=16, v_dim=32, seed=5)
    got = chunk_gated_delta_rule(*args)
    prep = [a for name, a in calls if name == "pt_delta_chunked"]
    assert prep and prep[0][0].C == chunk.NATIVE_CHUNK                 # its pt_delta_args' chunk
    ref = recurrent_gated_delta_rule(*args)
    with torch_only():
        torch_out = chunk_gated_delta_rule(*args)
    for out in (got, torch_out):                                       # NATIVE_CHUNK, TORCH_CHUNK
        assert (out - ref).abs().max().item() / ref.abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(*args, chunk_size=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("bounds", [None, [0, 5, 5, 77, 160]])
@pytest.mark.parametrize("dk", [16, 32])       # 32: q and k through the conv's AVX-512 loop too, where it is built
@claims(chunk.NATIVE)
def test_conv_chunk_rule_matches_conv_then_chunk_rule(dtype, group, bounds, dk):
    """The Gated DeltaNet's conv + SiLU, head split and chunked rule in one C pass (conv mode of
    `pt_delta_chunked`: q, k, v made from the projection where they are used) against `causal_conv1d_silu` then
    `chunk_gated_delta_rule` in torch: <= 1e-5 relative (float32 sums in other orders, the conv's multiply-adds
    fused). The projection is a strided slice of a wider one, as the layer's; packed sequences (an empty one too)
    keep the conv from reading across a boundary; key heads shared by `group` value heads."""
    gen = torch.Generator().manual_seed(group)
    t, hv, dv = 160, 4, 32
    hk = hv // group
    conv_dim = 2 * hk * dk + hv * dv
    x = torch.randn(t, conv_dim + 24, generator=gen).to(dtype)[:, :conv_dim]
    weight = torch.randn(conv_dim, 4, generator=gen) * 0.5
    g = -F.softplus(torch.randn(t, hv, generator=gen)) * 2.0
    beta = torch.rand(t, hv, generator=gen)
    got = conv_chunk_gated_delta_rule(x, weight, g, beta, hk, dk, dv, cu_seqlens=bounds)     # the C conv mode
    with torch_only():
        want = chunk.gated_delta_torch(x, weight, g, beta, hk, dk, hv, dv, bounds)
    assert got.shape == want.shape == (t, hv, dv)
    assert (got - want).abs().max().item() / want.abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="does not hold"):
        conv_chunk_gated_delta_rule(x, weight, g, beta, hk, dk + 1, dv)


@pytest.mark.parametrize("kernel", paths(chunk.TORCH, chunk.NATIVE))
@pytest.mark.parametrize("where", ["g", "beta", "projection"])
@pytest.mark.parametrize("d", [16, 32])            # 32: the conv's AVX-512 column walk, where it is built
def test_nans_reach_the_output_on_both_paths(where, d, kernel):
    """A NaN upstream comes out as NaN, not as plausible numbers: the C pass keeps NaN through its decay cut-off,
    the UT inverse's flush of tiny values and a state update whose decay is exactly zero, as torch's ops do."""
    gen = torch.Generator().manual_seed(9)
    t, h = 64, 2
    x = torch.randn(t, 3 * h * d, generator=gen)
    weight = torch.randn(3 * h * d, 4, generator=gen) * 0.5
    g = -F.softplus(torch.randn(t, h, generator=gen)) * 2.0
    g[30:33] = -80.0                                         # a whole-chunk decay of exactly 0 after the NaN too
    beta = torch.rand(t, h, generator=gen)
    {"g": g, "beta": beta, "projection": x}[where][10, 0] = float("nan")
    out = registry.run(kernel, x, weight, g, beta, h, d, h, d, None, chunk_size=16)
    assert out[10:, 0].isnan().any()


def test_shape_mismatches_raise_before_any_kernel_runs():
    q, k, v, g, beta = inputs(20, heads=2, k_dim=16, v_dim=16)
    with pytest.raises(ValueError, match=r"\[T, H, K\]"):
        chunk_gated_delta_rule(q[:, :1], k[:, :1], v, g, beta)            # one key head, two value heads
    with pytest.raises(ValueError, match=r"\[T, H, K\]"):
        chunk_gated_delta_rule(q, k, v, g[:10], beta)


def test_default_chunk_is_the_torch_size_where_the_c_pass_declines(monkeypatch):
    """Inputs the one-pass kernel does not take (bf16 q/k/v here) run the torch path at its own chunk size."""

    sizes, real = [], chunk._torch_prep
    monkeypatch.setattr(chunk, "_torch_prep", lambda q, *a: sizes.append(q.shape[-2]) or real(q, *a))
    q, k, v, g, beta = inputs(100, k_dim=16, v_dim=32)
    out = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
    assert sizes == [chunk.TORCH_CHUNK] and out.shape == (100, 3, 32)


def test_layers_share_one_chunk_plan_and_leave_it_as_it_was():
    """Every layer of a forward asks for the same packed layout: one plan, built once, unchanged by the runs that
    read it (two runs on the same layout give the same result, bit for bit, on both paths)."""

    bounds = [0, 37, 101, 101, 300]
    plan = chunk._plan(300, bounds, None, True)
    assert chunk._plan(300, list(bounds), None, True) is plan and chunk._plan(300, bounds, None, False) is not plan
    restart = plan.restart.clone()
    q, k, v, g, beta = inputs(300, heads=2, k_dim=16, v_dim=16, seed=11)
    for kernel in (chunk.NATIVE_RULE, chunk.TORCH_RULE):
        first = registry.run(kernel, q, k, v, g, beta, cu_seqlens=bounds)
        assert torch.equal(registry.run(kernel, q, k, v, g, beta, cu_seqlens=bounds), first)
    assert torch.equal(plan.restart, restart)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk._plan(300, [0, 400], None, True)


# ---- the bf16 pass on the matrix units (`gated_delta/bf16.py`, C `pt_delta_chunked_bf16`) ----------------------

BF16_ENGINES = isa.params("fma", "avx512_bf16", "amx")      # on this CPU, or emulated where it lacks them
# The bf16 pass against the float32 pass, max-abs error relative to the output's largest entry: each output is a sum
# of products of operands rounded to bf16 once each (q, k, kb, vb, T, w, the state, intra, v_new: 2^-9 relative
# apiece), flash-linear-attention's numerics. Measured 1.8e-3 to 8.8e-3 on the cases below (all engines alike); the
# bar is 2^-6 = 1.6e-2, four such roundings of the largest term. The float32 pass is within 5.6e-6 of the float64
# recurrence on the same cases, so the bf16 pass is held to the same bar against the float64 recurrence.
BF16_PASS_TOL = 2 ** -6
BF16_SEGMENTS = {"1": [0, 1], "63": [0, 63], "64": [0, 64], "65": [0, 65], "130": [0, 130],
                 "varlen": [0, 1, 1, 65, 66, 130]}      # a 1-token sequence, an empty one, a full chunk, 1 token, 64


def _as_torch_layout(layout, src, scale):
    """torch's own float32 -> bf16 conversion, laid out as `bf16.pack`'s layout says."""
    if scale is not None:
        src = src * scale[:, None]
    b = src.bfloat16()
    if layout == "rows":
        return b
    if layout == "rows_t":
        return b.t().contiguous()
    if layout == "pairs":
        return b.view(b.shape[0] // 2, 2, b.shape[1]).transpose(1, 2).reshape(b.shape[0] // 2, -1)
    return b.view(b.shape[0], b.shape[1] // 2, 2).transpose(0, 1).reshape(b.shape[1] // 2, -1)      # pairs_t


@pytest.mark.parametrize("unit", isa.params("avx512_bf16"))
@pytest.mark.parametrize("layout", ["rows", "pairs", "pairs_t", "rows_t"])
@pytest.mark.parametrize("shape", [(64, 96), (32, 32), (6, 10)], ids=["64x96", "32x32", "6x10"])
def test_bf16_packers_match_their_reference_and_torch(unit, layout, shape):
    """The bf16 pass's vector packers (AVX512-BF16, where built) against their scalar references, bit for bit, and
    both against torch's own conversion in the same layout: ties to even, signed zeros, infinities, the largest
    floats and NaN (kept NaN) included; denormal floats become zero on the vector packers (the tiles read bf16
    denormals as zero) and stay denormal on the references. 6x10 is not a whole block: the vector packers take the
    reference's path there."""
    from pixeltriage.errors import BackendUnavailableError
    from pixeltriage.kernels.gated_delta import bf16

    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    src = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[1])
    specials = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -0.0, 0.0, float("inf"), -float("inf"),
                             3.3e38, -3.3e38, float("nan"), 1e-40, -1e-40])       # two ties, ..., two denormals
    flat = src.view(-1)
    flat[:specials.numel()] = specials[:flat.numel()]
    scale = torch.rand(shape[0], generator=gen) + 0.5 if layout in ("rows", "rows_t") else None
    ref = bf16.pack(layout, src, scale, fast=False)
    want = _as_torch_layout(layout, src, scale)
    assert ref.shape == want.shape
    assert torch.equal(ref.isnan(), want.isnan())
    assert torch.equal(ref.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))
    try:
        fast = bf16.pack(layout, src, scale, fast=True)
    except BackendUnavailableError:
        pytest.skip("no vector packers in this build (AVX512-BF16)")
    denormal = (ref.float().abs() < torch.finfo(torch.float32).tiny) & (ref != 0)
    if shape == (6, 10):                               # not a whole block: the reference's own path
        denormal.zero_()
    assert denormal.sum() == (2 if shape != (6, 10) else 0)
    assert torch.equal(fast[~denormal].view(torch.int16), ref[~denormal].view(torch.int16))
    assert (fast[denormal] == 0).all()


def bf16_projection(seq_len, hk, hv, dk, dv, seed=0):
    """A bf16 projection [T, conv_dim] (a strided slice of a wider one, as the layer's), conv weight, g (some strong
    decays) and beta."""
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    x = torch.randn(seq_len, conv_dim + 40, generator=gen).bfloat16()[:, :conv_dim]
    weight = torch.randn(conv_dim, 4, generator=gen) * 0.5
    g = -F.softplus(torch.randn(seq_len, hv, generator=gen)) * 2.0
    beta = torch.rand(seq_len, hv, generator=gen)
    return x, weight, g, beta


def float64_rule(x, weight, g, beta, hk, dk, dv, bounds):
    """The conv + SiLU (float32, the torch path), L2 norms and the recurrence in float64, sequence by sequence."""
    from pixeltriage.kernels.gated_delta import conv_heads

    hv = beta.shape[1]
    with torch_only():
        q, k, v = conv_heads(x, weight, hk, dk, hv, dv, bounds)
    q, k = (F.normalize(t.double(), dim=-1, eps=0) for t in (q, k))
    out = torch.zeros(x.shape[0], hv, dv, dtype=torch.float64)
    for b, e in zip(bounds, bounds[1:]):
        if e > b:
            out[b:e] = recurrent_gated_delta_rule(q[b:e], k[b:e], v[b:e], g[b:e], beta[b:e],
                                                  compute_dtype=torch.float64)
    return out


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("segments", sorted(BF16_SEGMENTS))
@claims(bf16.BF16)
@pytest.mark.parametrize("heads", [(2, 2, 32, 64), (2, 4, 32, 64), (1, 2, 8, 24)], ids=["v1k", "v2k", "padded"])
def test_bf16_pass_matches_float32_pass_and_float64_recurrence(engine, segments, heads):
    """`pt_delta_chunked_bf16` on each engine against the float32 pass on the same bf16 projection and against the
    float64 recurrence, within BF16_PASS_TOL of the largest output, on T = 1, 63, 64, 65, 130 and packed sequences
    with a 1-token and an empty one; value heads = 2x key heads; head dims that are not multiples of 32 (padded
    with zero columns inside). Allocations are NaN-poisoned, so an output row the kernel did not write fails."""
    from pixeltriage.kernels.gated_delta import bf16

    hk, hv, dk, dv = heads
    bounds = BF16_SEGMENTS[segments]
    x, weight, g, beta = bf16_projection(bounds[-1], hk, hv, dk, dv, seed=len(bounds) + hv)
    with NanPoisonedEmpty():
        got = bf16.conv_chunk_rule_bf16(x, weight, g, beta, hk, dk, dv, cu_seqlens=bounds, engine_name=engine)
    assert got.shape == (bounds[-1], hv, dv) and got.dtype == torch.float32 and torch.isfinite(got).all()
    # the float32 pass where its C kernel takes the heads, its chunked composition for the padded ones
    float32_pass = chunk.NATIVE if dk % 16 == 0 and dv % 16 == 0 else chunk.TORCH
    want = registry.run(float32_pass, x, weight, g, beta, hk, dk, hv, dv, bounds)
    exact = float64_rule(x, weight, g, beta, hk, dk, dv, bounds)
    assert (got - want).abs().max().item() / want.abs().max().item() <= BF16_PASS_TOL
    assert (got - exact).abs().max().item() / exact.abs().max().item() <= BF16_PASS_TOL
    assert (want - exact).abs().max().item() / exact.abs().max().item() <= 5e-5     # the float32 pass: exact


def _bf16(t):
    return t.bfloat16().to(t.dtype)


def _heads64(x, weight, hk, dk, hv, dv, rnd=lambda t: t):
    """q, k, v [T, Hv, D] in float64 from the conv + SiLU (float32, the torch path), q and k L2-normalised; with
    rnd=_bf16, as a bf16 model hands them to its delta rule: the conv's outputs rounded to bf16, then the norms'."""
    from pixeltriage.kernels.gated_delta import conv_heads

    with torch_only():
        heads = conv_heads(x, weight, hk, dk, hv, dv)
    q, k, v = (rnd(t).double() for t in heads)
    q, k = (rnd(F.normalize(t, dim=-1, eps=0)) for t in (q, k))
    return q, k, v


def fla_bf16_numerics(q, k, v, g, beta, rnd=_bf16, chunk=64):
    """flash-linear-attention's chunk_gated_delta_rule in a bf16 model (what transformers runs on a GPU), in
    float64 with fla's roundings to bf16 (`rnd`) where its kernels round (q, k, v arrive rounded, `_heads64`): kb
    before kb k^T, the UT inverse T, v beta and k beta exp(gamma) before their products with T, u and w, the state
    before w S and q S, v_new before intra v_new, the decayed v_new before the state update, and the masked q k^T.
    With `rnd` the identity it is the exact chunked rule. q, k [T, Hv, K], v [T, Hv, V] float64 -> [T, Hv, V]."""
    seq_len, hv, dk = k.shape
    g, beta, scale = g.double(), beta.double(), dk ** -0.5
    out = torch.zeros(seq_len, hv, v.shape[-1], dtype=torch.float64)
    for h in range(hv):
        state = torch.zeros(dk, v.shape[-1], dtype=torch.float64)
        for c0 in range(0, seq_len, chunk):
            c1 = min(c0 + chunk, seq_len)
            qc, kc, vc, b = q[c0:c1, h], k[c0:c1, h], v[c0:c1, h], beta[c0:c1, h, None]
            gamma = g[c0:c1, h].cumsum(0)
            decay = (gamma[:, None] - gamma[None, :]).tril().exp().tril()
            t = rnd(torch.linalg.inv(torch.eye(c1 - c0, dtype=torch.float64) + (rnd(kc * b) @ kc.T * decay).tril(-1)))
            u, w = rnd(t @ rnd(vc * b)), rnd(t @ rnd(kc * b * gamma.exp()[:, None]))
            v_new = u - w @ rnd(state)
            intra = rnd((qc @ kc.T * decay).tril())
            out[c0:c1, h] = ((qc @ rnd(state)) * gamma.exp()[:, None] + intra @ rnd(v_new)) * scale
            state = state * gamma[-1].exp() + kc.T @ rnd(v_new * (gamma[-1] - gamma).exp()[:, None])
    return out


def _rms_rel(got, exact):
    return ((got.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()


BF16_BUDGET_CASES = [(384, 2, 4, 64, 64, 0), (200, 1, 2, 128, 128, 1), (130, 2, 2, 32, 64, 1), (384, 2, 2, 8, 24, 0),
                     (1000, 1, 1, 128, 128, 0)]


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("case", BF16_BUDGET_CASES, ids=lambda c: "T{}-{}x{}-{}x{}".format(*c[:5]))
@claims(bf16.BF16)
def test_bf16_pass_error_within_what_bf16_models_already_pay(engine, case):
    """The bf16 pass's root-mean-square error against the float64 recurrence, beside two others' on the same bf16
    projection: flash-linear-attention's bf16 numerics (`fla_bf16_numerics`, what a bf16 model runs on a GPU) and
    transformers' bf16 torch path on the CPU (q, k, v rounded as `_heads64` rounds them, the recurrence exact).
    Measured on these cases (two seeds each, every engine alike): 0.72-0.84x fla's, 0.87-1.16x transformers'. Bars:
    no larger than fla's, at most 1.25x transformers'. The emulation itself, without its roundings, is the exact
    rule (<= 1e-9 of the float64 recurrence), so the comparison is with the right algebra."""
    from pixeltriage.kernels.gated_delta import bf16, recurrent_gated_delta_rule

    seq_len, hk, hv, dk, dv, seed = case
    x, weight, g, beta = bf16_projection(seq_len, hk, hv, dk, dv, seed=seed)
    exact = float64_rule(x, weight, g, beta, hk, dk, dv, [0, seq_len])
    algebra = fla_bf16_numerics(*_heads64(x, weight, hk, dk, hv, dv), g, beta, rnd=lambda t: t)
    assert (algebra - exact).abs().max().item() / exact.abs().max().item() <= 1e-9
    ours = _rms_rel(bf16.conv_chunk_rule_bf16(x, weight, g, beta, hk, dk, dv, engine_name=engine), exact)
    rounded = _heads64(x, weight, hk, dk, hv, dv, rnd=_bf16)
    fla = _rms_rel(fla_bf16_numerics(*rounded, g, beta), exact)
    cpu = _rms_rel(recurrent_gated_delta_rule(*rounded, g, beta, compute_dtype=torch.float64), exact)
    assert ours <= fla
    assert ours <= 1.25 * cpu


@pytest.mark.parametrize("engine", BF16_ENGINES[1:])
@claims(bf16.BF16)
def test_bf16_engines_agree(engine):
    """The matrix units' engines against the float32 multiply-adds of the same bf16 operands: only the order of
    float32 sums differs, and with it, rarely, the rounding of an intermediate (w, v_new) to bf16. Measured, of the
    largest output over 300 tokens, 4 value heads over 2 key heads: AVX512-BF16 5.4e-8, AMX 2.2e-5; bar 2^-12."""
    from pixeltriage.kernels.gated_delta import bf16

    x, weight, g, beta = bf16_projection(300, 2, 4, 64, 32, seed=7)
    ref = bf16.conv_chunk_rule_bf16(x, weight, g, beta, 2, 64, 32, cu_seqlens=[0, 100, 300], engine_name="fma")
    got = bf16.conv_chunk_rule_bf16(x, weight, g, beta, 2, 64, 32, cu_seqlens=[0, 100, 300], engine_name=engine)
    assert (got - ref).abs().max().item() / ref.abs().max().item() <= 2 ** -12


def test_bf16_pass_declines_what_it_does_not_take():
    """The bf16 pass declines a float32 projection, a conv wider than 16 and an engine this machine lacks: a typed
    decline naming why, never a silent substitute."""
    x, weight, g, beta = bf16_projection(70, 2, 2, 32, 32)
    wide = torch.randn(weight.shape[0], 17)
    assert bf16.refusal(x, wide, 32, 32) == "conv width over 16"
    assert bf16.refusal(x.float(), weight, 32, 32) == "projection not bf16 on the CPU with a unit last stride"
    with pytest.raises(registry.Declined, match="conv width over 16"):
        bf16.conv_chunk_rule_bf16(x, wide, g, beta, 2, 32, 32)
    if native.available():
        assert bf16.refusal(x, weight, 32, 32, engine_name="fma") is None
        with pytest.raises(registry.Declined, match="no such bf16 engine on this machine"):
            bf16.conv_chunk_rule_bf16(x, weight, g, beta, 2, 32, 32, engine_name="tiles")


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
def test_bf16_op_falls_back_to_the_float32_pass(monkeypatch):
    """The "gated_delta" op on a float32 projection takes the float32 pass; on a bf16 one whose bf16 pass declines
    (its entry point forced to, here) it takes the float32 pass too, the decline counted with its reason."""
    x, weight, g, beta = bf16_projection(70, 2, 2, 32, 32)
    monkeypatch.setenv(bf16.SWITCH, "1")
    monkeypatch.setattr(native, "fast_bf16_engine", lambda: "fma")     # a bf16 pass on any machine
    monkeypatch.setenv("PIXELTRIAGE_TEST_DECLINE", "pt_delta_chunked_bf16")
    with registry.recording() as record:
        on_float32 = chunk.GATED_DELTA(x.float(), weight, g, beta, 2, 32, 2, 32, None)
        on_bf16 = chunk.GATED_DELTA(x, weight, g, beta, 2, 32, 2, 32, None)
    counts = record.snapshot()
    assert counts.ran("gated_delta", chunk.NATIVE.name) == 2 and counts.ran("gated_delta", bf16.BF16.name) == 0
    assert counts.declined("gated_delta", bf16.BF16.name) == {
        "pt_delta_chunked_bf16: forced by PIXELTRIAGE_TEST_DECLINE": 1}
    assert torch.equal(on_float32, conv_chunk_gated_delta_rule(x.float(), weight, g, beta, 2, 32, 32))
    assert torch.equal(on_bf16, conv_chunk_gated_delta_rule(x, weight, g, beta, 2, 32, 32))


@pytest.mark.parametrize("ratios, chosen", [([0.5, 0.6, 0.7], "bf16"), ([0.96, 0.98, 1.2], "float32")])
def test_bf16_pass_is_measured_against_the_float32_pass(ratios, chosen, monkeypatch, tmp_path):
    """The record, where this CPU has a fast engine: "bf16" where the pass's median time is under MARGIN of the
    float32 pass's on MEASURE_SHAPE, else "float32", with the ratio and the engine; both passes run on the same
    inputs before they are timed. Without an engine, "float32" and nothing timed. The choice follows the kept
    record; one kept from another engine than this process's is measured anew."""
    from pixeltriage.kernels import tuning

    if not native.available():
        pytest.skip(f"no C kernels: {native.status()}")
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path))
    monkeypatch.delenv("PIXELTRIAGE_TUNING")            # the records in that cache
    monkeypatch.setattr(tuning, "_memo", {})
    monkeypatch.setattr(bf16, "_CHOICE", {})
    monkeypatch.delenv(bf16.SWITCH, raising=False)
    timed = []

    def interleaved(first, second, pairs):
        assert first().shape == second().shape == (bf16.MEASURE_SHAPE[0], *bf16.MEASURE_SHAPE[1:])
        timed.append(pairs)
        return ratios

    monkeypatch.setattr(tuning, "interleaved_ratio", interleaved)
    for name in ("fma", None):                     # "fma" stands in for a fast engine: it runs anywhere
        monkeypatch.setattr(native, "fast_bf16_engine", lambda n=name: n)
        record = bf16.measure_delta(pairs=3)
        assert record["engine"] == name and record["shape"] == list(bf16.MEASURE_SHAPE) and record["pairs"] == 3
        if name is None:
            assert record["pass"] == "float32" and "bf16_over_float32" not in record and timed == [3]
        else:
            assert record["pass"] == chosen and record["bf16_over_float32"] == ratios[1] and timed == [3]
    monkeypatch.setattr(native, "fast_bf16_engine", lambda: "fma")
    monkeypatch.setattr(bf16, "measure_delta", lambda pairs=7: {"pass": chosen, "engine": "fma"})
    assert bf16.delta_choice() == {"pass": chosen, "engine": "fma"}
    assert tuning.measured(bf16.RECORD, lambda: pytest.fail("measured twice")) == bf16.delta_choice()
    assert bf16.available() is (chosen == "bf16" or native.isa_emulated())
    monkeypatch.setattr(native, "fast_bf16_engine", lambda: "amx")             # kept from another engine: measured anew
    monkeypatch.setattr(bf16, "measure_delta", lambda pairs=7: {"pass": "float32", "engine": "amx"})
    assert bf16.delta_choice() == {"pass": "float32", "engine": "amx"}


@pytest.mark.parametrize("where", ["g", "beta", "projection"])
@claims(bf16.BF16)
def test_bf16_pass_keeps_nans(where):
    """A NaN upstream comes out as NaN on the bf16 pass too (bf16 rounding keeps NaN; a zero decay times a NaN
    state stays NaN)."""
    from pixeltriage.kernels.gated_delta import bf16

    x, weight, g, beta = bf16_projection(64, 2, 2, 32, 32, seed=9)
    g[30:33] = -80.0
    {"g": g, "beta": beta, "projection": x}[where][10, 0] = float("nan")
    out = bf16.conv_chunk_rule_bf16(x, weight, g, beta, 2, 32, 32, chunk_size=32, engine_name="fma")
    assert out[10:, 0].isnan().any()
