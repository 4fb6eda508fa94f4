"""Fast CPU paths against the references beside them.

Tolerances (float32): conv1d + SiLU <= 1e-6 relative; the delta rule with strong decays (where the subnormal
cut-off acts) <= 1e-5 relative to the recurrent reference, as for mild decays in tests/test_gated_delta.py.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from pixeltriage.kernels import activation, attention, conv, native, norm, registry, rotary
from pixeltriage.kernels.conv import causal_conv1d_silu_reference, conv1d_silu_torch
from pixeltriage.kernels.gated_delta import chunk, recurrent_gated_delta_rule
import isa
from kernel_claims import claims, paths
from poison import NanPoisonedEmpty
from reference import rel

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

@contextlib.contextmanager
def torch_only():
    """No C kernel library inside the block: every op runs its torch kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        yield


RULE_PATHS = paths(chunk.TORCH_RULE, chunk.NATIVE_RULE)          # the delta rule's torch and C kernels
CONV_PATHS = paths(conv.TORCH, conv.NATIVE)
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@pytest.mark.parametrize("seq_len,width", [(1, 4), (3, 4), (4, 4), (97, 4), (50, 2), (20, 1), (200, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [1, 2, 3, 5, 64])      # blocks shorter than the kernel, awkward remainders
def test_conv_matches_reference(seq_len, width, dtype, block_rows):
    g = torch.Generator().manual_seed(seq_len * 10 + width)
    x = torch.randn(seq_len, 24, generator=g).to(dtype)
    w = torch.randn(24, width, generator=g).to(dtype)
    out = conv1d_silu_torch(x, w, block_rows=block_rows)                  # the torch kernel (tests/test_native.py: C)
    assert out.dtype == torch.float32 and out.shape == (seq_len, 24)
    assert rel(out, causal_conv1d_silu_reference(x, w)) <= 1e-6


@pytest.mark.parametrize("kernel", RULE_PATHS)
@pytest.mark.parametrize("seq_len", [65, 300])
def test_strong_decays_stay_exact(seq_len, kernel):
    g = torch.Generator().manual_seed(seq_len)
    h, dk, dv = 3, 16, 16                                          # head dims the C kernel takes (multiples of 16)
    q = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    v = torch.randn(seq_len, h, dv, generator=g)
    decay = -torch.rand(seq_len, h, generator=g) * 40              # down to e^-40 per token: subnormals without the cut
    beta = torch.rand(seq_len, h, generator=g)
    got = registry.run(kernel, q, k, v, decay, beta)
    assert rel(got, recurrent_gated_delta_rule(q, k, v, decay, beta)) <= 1e-5


@pytest.mark.parametrize("kernel", RULE_PATHS)
@pytest.mark.parametrize("qk_l2norm", [False, True])
def test_strided_inputs_and_infinite_decays(kernel, qk_l2norm):
    """The layer hands v over as a column slice of the conv output, and a decay can be -inf (A_log large):
    the result equals the reference on contiguous copies, the -inf steps erase the state exactly."""
    g = torch.Generator().manual_seed(11)
    seq_len, h, dk, dv = 150, 2, 16, 32
    wide = torch.randn(seq_len, h * (dk + dv) + 5, generator=g)
    v = wide[:, 5:5 + h * dv].view(seq_len, h, dv)                  # row stride wider than the tensor
    assert not v.is_contiguous()
    q = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    decay = -torch.rand(seq_len, h, generator=g) * 2
    decay[[3, 64, 100]] = -float("inf")
    beta = torch.rand(seq_len, h, generator=g)
    got = registry.run(kernel, q, k, v, decay, beta, qk_l2norm=qk_l2norm)
    assert torch.isfinite(got).all()
    assert rel(got, recurrent_gated_delta_rule(q, k, v.contiguous(), decay, beta)) <= 1e-5


# -- varlen: several sequences packed along T ----------------------------------------------------------------

def _rand_inputs(seq_len, h=2, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    v = torch.randn(seq_len, h, dv, generator=g)
    decay = -torch.rand(seq_len, h, generator=g) * 3
    beta = torch.rand(seq_len, h, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("kernel", RULE_PATHS)
@pytest.mark.parametrize("lengths", [[5, 70, 0, 64, 1], [200], [63, 65]])
def test_varlen_delta_rule_equals_separate_sequences(lengths, kernel):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v, decay, beta = _rand_inputs(bounds[-1], dk=16, dv=32, seed=len(lengths))
    packed = registry.run(kernel, q, k, v, decay, beta, cu_seqlens=bounds)
    for b, e in zip(bounds, bounds[1:]):
        if e > b:
            alone = recurrent_gated_delta_rule(q[b:e], k[b:e], v[b:e], decay[b:e], beta[b:e])
            assert rel(packed[b:e], alone) <= 1e-5


def test_varlen_rejects_bad_boundaries():
    q, k, v, decay, beta = _rand_inputs(10)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk.chunk_gated_delta_rule(q, k, v, decay, beta, cu_seqlens=[0, 4, 3, 10])
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk.chunk_gated_delta_rule(q, k, v, decay, beta, cu_seqlens=[0, 9])


@pytest.mark.parametrize("kernel", CONV_PATHS)
def test_varlen_conv_equals_separate_sequences(kernel):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 12, generator=g), torch.randn(12, 4, generator=g)
    bounds = [0, 2, 2, 17, 40]
    packed = registry.run(kernel, x, w, bounds)
    for b, e in zip(bounds, bounds[1:]):   # against the F.conv1d reference (the torch path splits into itself)
        if e > b:
            assert rel(packed[b:e], causal_conv1d_silu_reference(x[b:e], w)) <= 1e-6


def test_packed_forward_rows_equal_each_state_alone(tiny_checkpoint):
    from PIL import Image

    from pixeltriage import Memory, Scorer

    scorer = Scorer.load(tiny_checkpoint)
    states = [scorer.pack("first?", [Memory(image=Image.new("RGB", (64, 96), (9, 9, 9)), note="a")]),
              scorer.pack("no memories at all", []),
              scorer.pack("third, longer question with more words in it?",
                          [Memory(image=Image.new("RGB", (96, 64), (200, 9, 9))),
                           Memory(image=Image.new("RGB", (32, 32), (9, 200, 9)), dialogue="hello " * 30)])]
    packed = scorer.last_hidden_packed(states)
    offset = 0
    for s in states:
        alone = scorer.last_hidden(s)
        assert rel(packed[offset:offset + s.num_tokens], alone) <= 1e-5
        offset += s.num_tokens
    # a token budget smaller than the batch splits it into several varlen forwards, same scores
    episodes = [("q1?", [Memory(image=Image.new("RGB", (64, 64)))]), ("q2?", []),
                ("q3?", [Memory(image=Image.new("RGB", (40, 80), (1, 2, 3)))])]
    whole = scorer.score_batch(episodes)
    scorer.max_batch_tokens = 60
    assert len(scorer._token_groups([scorer.pack(q, m) for q, m in episodes])) == 3
    split = scorer.score_batch(episodes)
    for a, b in zip(whole, split):
        assert a.p_vis == pytest.approx(b.p_vis, abs=1e-6) and a.gains == pytest.approx(b.gains, abs=1e-6)


@pytest.mark.parametrize("last", ["full_attention", "linear_attention"])
def test_forward_at_rows_equals_full_forward_rows(tiny_checkpoint, last):
    """`decoder_forward(rows=...)` computes the last layer past its token mixer at those rows only; the rows equal
    the full forward's (float32, <= 1e-5 relative), alone and varlen-packed, in any order, repeats included."""
    import dataclasses

    from PIL import Image

    from pixeltriage import Memory, Scorer
    from pixeltriage.engine.model import decoder_forward

    scorer = Scorer.load(tiny_checkpoint)
    cfg, weights = scorer.model_config.text, scorer.weights.text
    assert cfg.layer_types[-1] == "full_attention"
    if last == "linear_attention":                 # the same checkpoint without its last (attention) layer
        cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:-1])
        weights = dataclasses.replace(weights, layers=weights.layers[:-1])
    states = [scorer.pack("first?", [Memory(image=Image.new("RGB", (64, 96), (9, 9, 9)), note="a")]),
              scorer.pack("a second, longer question?", [Memory(image=Image.new("RGB", (32, 32), (9, 200, 9)),
                                                                   dialogue="hello " * 30)])]
    with torch.inference_mode():
        for group in (states[:1], states):
            embeds = torch.cat([scorer._embeds(s) for s in group])
            positions = torch.cat([s.position_ids for s in group], dim=1)
            bounds = [0, states[0].num_tokens, embeds.shape[0]] if len(group) > 1 else None
            full = decoder_forward(embeds, positions, weights, cfg, cu_seqlens=bounds)
            t = embeds.shape[0]
            rows = torch.tensor([t - 1, 0, 5, states[0].num_tokens - 1, 5, t // 2])
            got = decoder_forward(embeds, positions, weights, cfg, cu_seqlens=bounds, rows=rows)
            assert got.shape == (len(rows), cfg.hidden_size)
            assert rel(got, full[rows]) <= 1e-5


@pytest.mark.parametrize("kernel", paths(rotary.TORCH_ROTARY, rotary.NATIVE_ROTARY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 3, 16), (50, 2, 4, 64), (1, 1, 2), (20, 1, 3, 8), "qk-of-qkv"])
def test_rotary_matches_reference(dtype, shape, kernel):
    from pixeltriage.kernels.rotary import apply_rotary_float_reference

    g = torch.Generator().manual_seed(len(str(shape)))
    if shape == "qk-of-qkv":                     # the ViT's q and k: a strided [N, 2, heads, dim] view of qkv
        x = torch.randn(40, 3, 4, 16, generator=g).to(dtype)[:, :2]
        shape = x.shape
    else:
        x = torch.randn(*shape, generator=g).to(dtype)
    angle = torch.randn(shape[0], shape[-1], generator=g) * 3
    got = registry.run(kernel, x, angle.cos(), angle.sin())
    want = apply_rotary_float_reference(x, angle.cos(), angle.sin())
    assert got.dtype == dtype and got.shape == x.shape
    # float32: one rounding apart at most (a multiply-add against a multiply then an add); bf16: at most one
    # bf16 step where that float32 difference straddles a rounding boundary
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert rel(got.float(), want.float()) <= tol


_ACTIVATIONS_F64 = {"gelu_pytorch_tanh": lambda y: F.gelu(y, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
                    "quick_gelu": lambda y: y * torch.sigmoid(1.702 * y)}


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "silu", "quick_gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("library", ["oneDNN", "F.linear"])
def test_fused_linear_activation_matches_reference(act, dtype, bias, library, monkeypatch):
    """bf16: the oneDNN epilogue; float32: the product on the machine's measured library (`library` here), then the
    activation (the tanh GELU in place, in C); each against F.linear + activation, both against float64: the fused
    one is never further from float64 than the reference plus one rounding of the output (it rounds once, the
    reference twice). quick_gelu has no oneDNN post-op: the epilogue kernel declines it and the product, then the
    activation, runs; only the float64 bound tests it."""
    from pixeltriage.kernels import linear
    from pixeltriage.kernels.linear import linear_act, linear_act_reference

    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 96, generator=g)
    w = torch.randn(200, 96, generator=g) * 0.2
    b = torch.randn(200, generator=g) if bias else None
    exact = _ACTIVATIONS_F64[act](F.linear(x.double(), w.double(), None if b is None else b.double()))
    cast = lambda t: None if t is None else t.to(dtype)
    want = linear_act_reference(cast(x), cast(w), cast(b), act)
    monkeypatch.setattr(linear, "_STATE", {})
    monkeypatch.setattr(linear, "float32_choice", lambda: {"library": library})
    monkeypatch.delenv("PIXELTRIAGE_ONEDNN", raising=False)
    with registry.recording() as record:
        got = linear_act(cast(x), cast(w), cast(b), act)
    fused = dtype == torch.bfloat16 and linear.onednn_available(dtype) and act in linear._POST_OPS
    after = not fused                   # the product's output, then the activation (tanh GELU: in place, in C)
    ran = record.snapshot()             # the path under test is the one that ran
    assert (ran.ran("linear", linear.ONEDNN.name), ran.ran("linear", linear.THEN_ACTIVATION.name)) == (fused, after)
    if after:
        on_onednn = library == "oneDNN" and linear.onednn_available(dtype)
        if dtype == torch.float32:
            assert linear.plain_onednn("cpu", dtype) is on_onednn
            product = (torch.ops.mkldnn._linear_pointwise(cast(x), cast(w), cast(b), "none", [], "") if on_onednn
                       else F.linear(cast(x), cast(w), cast(b)))
        else:
            product = linear.linear(cast(x), cast(w), cast(b))
        then = linear.activation(act, in_place=True)
        assert then is (linear.gelu_tanh_ if act == "gelu_pytorch_tanh" else linear.activation(act))
        assert torch.equal(got, then(product))
    assert got.dtype == dtype and got.shape == (300, 200)
    if not fused and not (after and act == "gelu_pytorch_tanh"):   # the reference's own values (the C tanh GELU's
        assert torch.equal(got, want)                               # differ by roundings: the bounds below)
    step = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert rel(got.double(), exact) <= rel(want.double(), exact) + step
    # both against float64 written out here (the reference's activation table is under test too): float32 within
    # 1e-6 (measured <= 4.1e-7); bf16 within 2^-7, the inputs' rounding and the output's (measured <= 4.7e-3)
    limit = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert rel(want.double(), exact) <= limit and rel(got.double(), exact) <= limit
    with pytest.raises(ValueError, match="unknown activation"):
        linear.linear_act(x, w, b, "relu6")


@pytest.mark.parametrize("kernel", paths(norm.TORCH_NORM_GATED, norm.NATIVE_NORM_GATED))
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_gated_rms_norm_matches_reference_and_leaves_its_inputs(gate_dtype, strided, kernel):
    from pixeltriage.kernels.norm import rms_norm_gated_reference

    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 3, 24, generator=g) * 1e-2                  # the delta rule's output is small
    gate = torch.randn(70, 3, 24, generator=g).to(gate_dtype)
    if strided:                                                      # the layer's gate: a column slice
        gate = torch.randn(70, 100, generator=g).to(gate_dtype)[:, 10:82].view(70, 3, 24)
    w = torch.rand(24, generator=g)
    x0, gate0 = x.clone(), gate.clone()
    got = registry.run(kernel, x, gate, w, 1e-6)                    # the AVX-512 pass: tested below
    want = rms_norm_gated_reference(x, gate, w, 1e-6)
    assert got.dtype == gate_dtype
    assert rel(got.float(), want.float()) <= (1e-6 if gate_dtype == torch.float32 else 2 ** -8)
    assert torch.equal(x, x0) and torch.equal(gate, gate0)


def _onednn_refuses(monkeypatch):
    """oneDNN's linear primitive raising as a build without it for this CPU/dtype would, its state reset."""
    from pixeltriage.kernels import linear

    def refuse(*args):
        raise RuntimeError("no such primitive here")

    class Ops:
        _linear_pointwise = staticmethod(refuse)

    monkeypatch.setattr(linear, "_STATE", {"ok": True, "bf16": True, "plain": True})
    monkeypatch.setattr(torch.ops, "mkldnn", Ops(), raising=False)


def test_fused_linear_falls_back_once_when_onednn_refuses(monkeypatch):
    """oneDNN's primitive raising declines the call (the record says why) and leaves the primitive unavailable from
    then on: the next calls go to F.linear without asking it."""
    from pixeltriage.kernels import linear

    _onednn_refuses(monkeypatch)
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    with registry.recording() as record:
        got = linear.linear_act(x, w, None, "gelu")
        again = linear.linear_act(x, w, None, "gelu")
    want = linear.linear_act_reference(x, w, None, "gelu")
    assert torch.equal(got, want) and torch.equal(again, want) and linear._STATE["ok"] is False
    counts = record.snapshot()
    assert counts.declined("projection", linear.ONEDNN_PROJECTION.name) == {
        "oneDNN's primitive raised RuntimeError; not used from now on": 1}
    assert counts.ran("projection", linear.TORCH_PROJECTION.name) == 2


def _rms_norm_zero_centred_f64(x, weight, eps):
    """x * rsqrt(mean(x^2) + eps) * (1 + w) in float64 (`rms_norm_zero_centred` computes in float32 whatever x is)."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.double())


@pytest.mark.parametrize("kernel", paths(norm.TORCH_ADD_NORM, norm.NATIVE_ADD_NORM))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_add_then_norm(out_dtype, delta_dtype, kernel):
    """h += delta, then the zero-centred RMSNorm: the same h and (within the output dtype's rounding: float32
    1e-6 relative, bf16 one ulp) the same normalised rows as the two torch steps."""
    from pixeltriage.kernels.norm import rms_norm_zero_centred

    g = torch.Generator().manual_seed(9)
    h = torch.randn(57, 40, generator=g) * 3
    delta = None if delta_dtype is None else torch.randn(57, 40, generator=g).to(delta_dtype)
    w = torch.randn(40, generator=g) * 0.1
    want_h = h + (0 if delta is None else delta.float())
    want = rms_norm_zero_centred(want_h, w, 1e-6, out_dtype)
    exact = _rms_norm_zero_centred_f64(want_h, w, 1e-6)    # the torch kernel runs the two torch steps themselves
    got = registry.run(kernel, h, delta, w, None, 1e-6, out_dtype)
    assert got.dtype == out_dtype and got.shape == (57, 40)
    assert rel(h, want_h) <= 1e-7
    assert rel(got.float(), want.float()) <= (1e-6 if out_dtype == torch.float32 else 2 ** -8)
    assert rel(got.double(), exact) <= (1e-6 if out_dtype == torch.float32 else 2 ** -8)


@pytest.mark.parametrize("kernel", paths(activation.TORCH, activation.NATIVE))
@pytest.mark.parametrize("inner", [40, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_float64(dtype, inner, kernel):
    """silu(gate) * up from a strided [T, 2I] projection: float32 within 1e-6 of float64; bf16 within one ulp. I
    under and over the C kernel's 64-value steps (and not a multiple of them)."""
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(33, 2 * inner + 10, generator=g) * 4).to(dtype)[:, 5:5 + 2 * inner]   # row stride 2I + 10
    got = registry.run(kernel, gate_up)                                    # the AVX-512 kernel: tested below
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (33, inner)
    assert rel(got.double(), exact) <= (1e-6 if dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("kernel", paths(activation.TORCH_GELU, activation.NATIVE_GELU))
def test_gelu_tanh_in_place_matches_float64(kernel):
    """The tanh GELU in place (the "gelu_tanh" op: the C kernel in float32 where built, torch's otherwise) against
    float64 torch: within 1e-6 of the largest value (measured: C 3.2e-8, torch 2.7e-8) and, for values of magnitude
    over 1e-3, within 2e-6 of each (C 1.3e-6; torch's 1 + tanh(u) cancels for negative inputs: 5e-5, so the torch
    kernel gets 1e-4); far tails finite and right (-100 -> 0 within 1e-30, 100 -> 100), NaN stays NaN; no elements
    at all."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 129, generator=g) * 3                  # odd sizes: partial vectors at the end
    x[0, :7] = torch.tensor([-100.0, -20.0, -5.0, 0.0, 5.0, 100.0, float("nan")])
    exact = F.gelu(x.double(), approximate="tanh")
    y = x.clone()
    assert registry.run(kernel, y) is y
    assert y[0, 6].isnan() and y[0, :6].isfinite().all() and y[0, 5] == 100.0 and abs(y[0, 0]) < 1e-30
    assert rel(y[1:].double(), exact[1:]) <= 1e-6
    big = exact.abs() > 1e-3
    c_kernel = kernel is activation.NATIVE_GELU
    assert ((y.double() - exact).abs()[big] / exact.abs()[big]).max() <= (2e-6 if c_kernel else 1e-4)
    assert registry.run(kernel, torch.empty(0, 5)).shape == (0, 5)


def test_gelu_tanh_op_takes_torch_for_what_the_c_kernel_declines():
    """The op on a non-contiguous tensor and on bf16 runs torch's in-place GELU (the C kernel declines the first,
    takes float32 only), in place too; the record names the decline."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 129, generator=g) * 3
    z = x.clone()
    strided = z.t()                                            # not contiguous: torch's, in place
    want = F.gelu(strided, approximate="tanh")
    with registry.recording() as record:
        assert activation.gelu_tanh_(strided) is strided and rel(z.t(), want) <= 1e-6
        half = x.bfloat16()
        assert rel(activation.gelu_tanh_(half.clone()).float(), F.gelu(half, approximate="tanh").float()) <= 2 ** -8
    counts = record.snapshot()
    assert counts.ran("gelu_tanh", "torch") == 2
    if native.available():
        assert counts.declined("gelu_tanh", activation.NATIVE_GELU.name) == {"x not contiguous float32": 1}


def _vector_kernel():
    from pixeltriage.kernels import simd

    if not simd.available():
        pytest.skip(f"no AVX-512 BF16 build here: {simd.status()}")
    return simd


SIMD = isa.params("simd")       # the AVX-512 BF16 passes: on this CPU, or emulated where it lacks them


@pytest.mark.parametrize("rows,inner,stride", [(1, 1, 2), (7, 15, 30), (33, 16, 37), (5, 17, 40), (64, 40, 90),
                                               (3, 3072, 6144)])
@pytest.mark.parametrize("unit", SIMD)
@claims(activation.VECTOR, activation.NATIVE)
def test_vector_silu_mul_matches_float64_and_the_c_kernel(unit, rows, inner, stride):
    """The AVX-512 bf16 kernel (`kernels.simd`) on lane counts that are not multiples of 16 (masked tails), one
    row, and row strides wider than 2I, into a NaN-poisoned output: every element within one bf16 rounding of the
    float64 value (|got - exact| <= 2^-8 |exact|, plus 1e-30 for the values that underflow), and equal to the C
    kernel's, or one bf16 ulp from it where the float32 value sits next to a rounding boundary."""
    _vector_kernel()
    g = torch.Generator().manual_seed(rows * 1000 + inner)
    gate_up = (torch.randn(rows, stride, generator=g) * 4).bfloat16()[:, stride - 2 * inner:]
    gate_up[0, :inner] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-30, -9.0, 88.5, -88.5] * 384)[:inner].bfloat16()
    with NanPoisonedEmpty():
        got = registry.run(activation.VECTOR, gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inner) and not got.isnan().any()
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-30).all()
    c_kernel = registry.run(activation.NATIVE, gate_up)
    ulp = 2.0 ** (torch.floor(torch.log2(c_kernel.double().abs().clamp_min(1e-38))) - 7)
    assert ((got.double() - c_kernel.double()).abs() <= ulp).all()
    assert activation.silu_mul(gate_up).equal(got)         # the op's bf16 choice on this machine is this kernel


@pytest.mark.parametrize("unit", SIMD)
@claims(activation.VECTOR)
def test_vector_silu_mul_keeps_nan_and_inf(unit):
    """NaN in the gate or the up half stays NaN; silu(+inf) * 1 = inf."""
    _vector_kernel()
    gate_up = torch.tensor([[float("nan"), 1.0, float("inf"), 2.0, 1.0, float("nan"), 1.0, 3.0]]).bfloat16()
    got = registry.run(activation.VECTOR, gate_up)
    assert got[0, 0].isnan() and got[0, 1].isnan() and got[0, 2] == float("inf")
    assert got[0, 3].float() == pytest.approx(float(F.silu(torch.tensor(2.0)) * 3), rel=2 ** -8)


@pytest.mark.parametrize("unit", SIMD)
def test_vector_passes_decline_what_they_do_not_take(unit):
    """float32, a last dim that is not unit stride: declined, with the reason in the record; the op then runs its
    other kernels on them."""
    _vector_kernel()
    gate_up = torch.zeros(4, 6, dtype=torch.bfloat16)
    for bad in (gate_up.float(), gate_up.t()):
        with pytest.raises(registry.Declined, match="gate_up not a bf16 CPU"):
            registry.run(activation.VECTOR, bad)
    x, gate = torch.randn(5, 2, 8), torch.randn(5, 2, 8).bfloat16()
    for args in ((x, gate.float()), (x.bfloat16(), gate)):
        with pytest.raises(registry.Declined, match="not float32 x and a bf16 gate"):
            registry.run(norm.VECTOR_NORM_GATED, *args, torch.ones(8), 1e-6)
    with pytest.raises(registry.Declined, match="not bf16"):
        registry.run(activation.VECTOR_GATE, x, x)
    f32 = torch.randn(5, 8)
    assert rel(activation.silu_mul(f32).double(), F.silu(f32[:, :4].double()) * f32[:, 4:].double()) <= 1e-6


@pytest.mark.parametrize("kernel", paths(norm.TORCH_ADD_NORM, norm.NATIVE_ADD_NORM))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
def test_add_layer_norm_matches_add_then_layer_norm(out_dtype, delta_dtype, kernel):
    """The ViT's h += delta, then LayerNorm: the same h, and rows within 1e-5 relative (float32; one bf16 ulp in
    bf16) of the float64 LayerNorm of that h, with rows far off zero (h ~ 300: float32 rounding of h - mean is
    ~6e-6 of the result there, for the torch op too) included."""
    g = torch.Generator().manual_seed(8)
    h = torch.randn(45, 64, generator=g) * 2
    h[::3] += 300.0
    delta = None if delta_dtype is None else torch.randn(45, 64, generator=g).to(delta_dtype)
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    want_h = h + (0 if delta is None else delta.float())
    exact = F.layer_norm(want_h.double(), (64,), w.double(), b.double(), 1e-6)
    got = registry.run(kernel, h, delta, w, b, 1e-6, out_dtype)
    assert got.dtype == out_dtype and rel(h, want_h) <= 1e-7
    assert rel(got.double(), exact) <= (1e-5 if out_dtype == torch.float32 else 2 ** -8)


def _segment_attention_reference(q, k, v, lengths, causal):
    """Dense float64 attention with a block-diagonal (and causal) mask: [T, Hq, D] -> [T, Hq, D]."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(q.shape[0])
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    rep = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * q.shape[-1] ** -0.5
    return torch.einsum("hts,shd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)


@pytest.mark.parametrize("lengths", [[37], [16, 16, 16], [0, 5, 5, 9, 0, 9, 9, 3], [12, 0]])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_matches_masked_attention(lengths, causal, dtype):
    """Runs of equal-length segments go to SDPA as one strided batch: each token still sees its own segment
    only, empty segments included; GQA (4 query heads on 2 key heads) and strided token-major inputs."""
    from pixeltriage.kernels.attention import segment_attention

    torch.manual_seed(0)
    t = sum(lengths)
    qkv = torch.randn(t, 8, 16).to(dtype)                 # q (4 heads) | k (2) | v (2) as views of one buffer
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = segment_attention(q, k, v, lengths, causal)
    assert out.shape == (t, 4, 16) and out.dtype == dtype
    # bf16: one rounding of the output, 2^-8 relative (measured 1.7e-3 to 3.2e-3, equal to the float64 result's own
    # rounding to bf16 in 7 of the 8 cases: SDPA accumulates in float32 here); float32: measured <= 1.9e-7
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert rel(out, _segment_attention_reference(q, k, v, lengths, causal)) < tol


def _rounding_only(out: torch.Tensor, exact: torch.Tensor) -> None:
    """A bf16 attention output whose only error is its own rounding: its relative RMS error against float64
    within 1% of the float64 result rounded to bf16 (measured: equal to four digits in every case), and at most
    one element in a thousand more than one bf16 step (at the exact value) off (measured 0 to 2.6e-4, all near
    zero, where a step is tiny). e rounded to bf16 before a single e V product misses both: 1.05-1.14x the
    rounding's error, 9-13% of the elements more than a step off."""
    rounding = rel_rms(exact.bfloat16(), exact)
    assert rel_rms(out, exact) <= 1.01 * rounding
    step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.bfloat16().double())[1] - 8)
    assert ((out.double() - exact).abs() > step).double().mean() <= 1e-3


def rel_rms(x: torch.Tensor, exact: torch.Tensor) -> float:
    return ((x.double() - exact).norm() / exact.norm()).item()


ATTENTION_ENGINES = isa.params("fma", "amx")   # AMX on this CPU, or emulated where it has none


@pytest.mark.parametrize("engine", ATTENTION_ENGINES)
@pytest.mark.parametrize("lengths", [[37], [0, 5, 33, 0, 64], [417, 1], [1], [1100, 70]],
                         ids=["37", "mixed", "417+1", "1", "1100+70"])
@pytest.mark.parametrize("dim", [32, 64])
@claims(attention.BF16_SEGMENTS)
def test_segment_attention_bf16_matches_masked_attention_and_sdpa(engine, lengths, dim):
    """`pt_segment_attention_bf16` (non-causal, the vision tower's) on each engine ("fma": the same bf16 operands
    through float32 multiply-adds, any machine; "amx": the tiles) against float64 attention and against SDPA in
    bf16, on strided views of one token-major buffer, segments of 0, 1, 417 and 1100 tokens (not multiples of 32:
    padded keys masked; several 64-query blocks, the last one partial). Tolerance 2^-8 relative to the largest
    output, as SDPA's bf16 above, and `_rounding_only`: e V in two bf16 products (e's bf16 part, then what that
    rounding left), so the output's one rounding is its error, as SDPA's."""
    from pixeltriage.kernels.attention import segment_attention_bf16

    torch.manual_seed(len(lengths) * 7 + dim)
    t = sum(lengths)
    qkv = (torch.randn(t, 9, dim) * 1.5).bfloat16()
    q, k, v = qkv[:, :3], qkv[:, 3:6], qkv[:, 6:]
    out = segment_attention_bf16(q, k, v, lengths, engine=engine)
    assert out is not None and out.shape == (t, 3, dim) and out.dtype == torch.bfloat16
    want = _segment_attention_reference(q, k, v, lengths, causal=False)
    assert rel(out, want) < 2 ** -8
    _rounding_only(out, want)
    sdpa = torch.cat([F.scaled_dot_product_attention(*(x[s:s + n].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
                      for s, n in zip([0, *torch.tensor(lengths).cumsum(0).tolist()], lengths)])
    assert rel(out, sdpa) < 2 ** -7               # two bf16 results, each within 2^-8 of float64's


def _far_scores_bad_lengths_long_segments(kernel, causal, length, limit):
    """What both C attention kernels owe, on the "fma" engine: scores all far below zero (-360 +- 20, differing
    between keys) stay finite and right (the softmax shifts by the row's max, its last partial vector included);
    lengths that do not cover the tokens are an error, not a read past them; a segment over `limit` is declined;
    no tokens at all (no segments, or empty ones) give an empty output."""
    u = torch.randn(1, 1, 32).expand(length, 1, 32)
    q, k = (-8 * u).bfloat16(), (8 * u + 2 * torch.randn(length, 1, 32)).bfloat16()
    v = torch.randn(length, 1, 32).bfloat16()
    far = kernel(q, k, v, [length], engine="fma")
    assert far.isfinite().all() and rel(far, _segment_attention_reference(q, k, v, [length], causal)) < 2 ** -8
    with pytest.raises(ValueError, match="do not cover"):
        kernel(q, k, v, [length + 1], engine="fma")
    x = torch.zeros(limit + 1, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(registry.Declined, match=f"a segment over {limit} tokens"):
        kernel(x, x, x, [limit + 1], engine="fma")
    for lengths in ([], [0], [0, 0]):                 # no tokens: an empty output, nothing read
        empty = kernel(x[:0], x[:0], x[:0], lengths, engine="fma")
        assert empty.shape == (0, 1, 32) and empty.dtype == torch.bfloat16


def test_segment_attention_bf16_keeps_nans_and_declines_what_it_does_not_take():
    """A NaN key poisons its own segment's outputs only (exp of a NaN score stays NaN); scores all far below zero
    stay finite (the softmax shifts by the row's max, its last partial vector included); float32, key heads unlike
    the query's, head dims not a multiple of 32 and segments over MAX_SEGMENT are declined (None: SDPA runs);
    lengths that do not cover the tokens are an error, not a read past them."""
    from pixeltriage.kernels import attention

    torch.manual_seed(3)
    q, k, v = (torch.randn(70, 2, 32).bfloat16() for _ in range(3))
    k[40, 1, 5] = float("nan")
    out = attention.segment_attention_bf16(q, k, v, [30, 40], engine="fma")
    assert out[:30].isfinite().all() and out[30:, 1].isnan().all() and out[30:, 0].isfinite().all()
    for args, reason in (((q.float(), k.float(), v.float()), "not bfloat16"), ((q, k[:, :1], v[:, :1]), "unlike"),
                         ((q[..., :16], k[..., :16], v[..., :16]), "head dims")):
        with pytest.raises(registry.Declined, match=reason):
            attention.segment_attention_bf16(*args, [30, 40], engine="fma")
    _far_scores_bad_lengths_long_segments(attention.segment_attention_bf16, False, 33, attention.MAX_SEGMENT)


CAUSAL_CASES = {                # lengths, query heads, key/value heads, head dim
    "short": ([1, 5, 31, 33, 64, 65, 130], 4, 2, 32),       # around the 32-key blocks and the 64-query blocks
    "gqa4": ([300, 0, 97], 8, 2, 64),                       # several query blocks, an empty segment
    "wide": ([250], 3, 3, 256),                             # the decoder's head dim, no grouping
    "long": ([600], 2, 1, 256),                             # e V over three of its 256-key blocks (EV_BYTES)
}


@pytest.mark.parametrize("engine", ATTENTION_ENGINES)
@pytest.mark.parametrize("case", sorted(CAUSAL_CASES))
@claims(attention.BF16_CAUSAL)
def test_causal_attention_bf16_matches_masked_attention_and_sdpa(engine, case):
    """`pt_causal_attention_bf16` (the decoder's) on each engine against float64 causal attention within segments
    and against SDPA in bf16, on strided views of one token-major buffer (q | k | v heads). Tolerances as the
    vision kernel's: 2^-8 of the largest output against float64, `_rounding_only`, 2^-7 against SDPA. A diagonal
    left out of the mask fails every case, a query head given the wrong key/value head fails the grouped ones."""
    from pixeltriage.kernels.attention import causal_attention_bf16

    lengths, hq, hkv, dim = CAUSAL_CASES[case]
    torch.manual_seed(hq * 10 + dim)
    t = sum(lengths)
    qkv = (torch.randn(t, hq + 2 * hkv, dim) * 1.5).bfloat16()
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    out = causal_attention_bf16(q, k, v, lengths, engine=engine)
    assert out is not None and out.shape == (t, hq, dim) and out.dtype == torch.bfloat16
    want = _segment_attention_reference(q, k, v, lengths, causal=True)
    assert rel(out, want) < 2 ** -8
    _rounding_only(out, want)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    sdpa = torch.cat([F.scaled_dot_product_attention(*(x[s:s + n].transpose(0, 1)[None] for x in (q, k, v)),
                                                     is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                      for s, n in zip(starts, lengths)])
    assert rel(out, sdpa) < 2 ** -7


def test_causal_attention_bf16_keeps_nans_and_declines_what_it_does_not_take():
    """A NaN key poisons only the queries that see it: its own key/value head's query heads, from its position to
    its segment's end; scores all far below zero stay finite; float32, query heads not a multiple of the key/value
    heads, head dims not a multiple of 32 and segments over MAX_CAUSAL are declined (None: SDPA runs); lengths that
    do not cover the tokens are an error."""
    from pixeltriage.kernels import attention

    torch.manual_seed(5)
    q = torch.randn(170, 4, 32).bfloat16()
    k, v = (torch.randn(170, 2, 32).bfloat16() for _ in range(2))
    k[100, 1, 3] = float("nan")                      # segment 2 (tokens 70-169), position 30, key head 1
    out = attention.causal_attention_bf16(q, k, v, [70, 100], engine="fma")
    assert out[:100].isfinite().all() and out[100:, :2].isfinite().all() and out[100:, 2:].isnan().all()
    for args, reason in (((q.float(), k.float(), v.float()), "not bfloat16"), ((q[:, :3], k, v), "multiple"),
                         ((q[..., :16], k[..., :16], v[..., :16]), "head dims")):
        with pytest.raises(registry.Declined, match=reason):
            attention.causal_attention_bf16(*args, [70, 100], engine="fma")
    _far_scores_bad_lengths_long_segments(attention.causal_attention_bf16, True, 65, attention.MAX_CAUSAL)


F32_CASES = {                   # lengths, query heads, key/value heads, head dim
    "vit": ([400, 400, 17], 3, 3, 64),                      # the ViT's images (and a short one), no grouping
    "edges": ([1, 15, 16, 17, 23, 24, 25, 63, 64, 65], 2, 1, 32),   # around the 16-key, 24-column, 64-query blocks
    "gqa4": ([300, 0, 97], 8, 2, 48),                       # several query blocks, an empty segment, 3 panels of 16
    "wide": ([250], 4, 2, 256),                             # the decoder's head dim
    "widest": ([70], 1, 1, 512),
}


F32_MASKS = [pytest.param(False, id="full", marks=claims(attention.F32_SEGMENTS)),
             pytest.param(True, id="causal", marks=claims(attention.F32_CAUSAL))]


@needs_native
@pytest.mark.parametrize("case", sorted(F32_CASES))
@pytest.mark.parametrize("causal", F32_MASKS)
def test_attention_f32_matches_float64_and_sdpa(case, causal):
    """`pt_attention_f32` (float32 attention within segments: the ViT's images and the decoder's questions) against
    float64 attention and against SDPA, on strided views of one token-major buffer (q | k | v heads), segments of
    0 to 400 tokens across the kernel's block edges. Tolerance 1e-5 of the largest output, as SDPA's float32 above
    (measured 4.6e-7 to 1.6e-6; SDPA's own 4.2e-7 to 1.3e-6). A diagonal left out of the causal mask, a
    query head given the wrong key/value head or a key past a segment's end fails every case it touches."""
    from pixeltriage.kernels.attention import attention_f32

    lengths, hq, hkv, dim = F32_CASES[case]
    torch.manual_seed(hq * 10 + dim + causal)
    t = sum(lengths)
    qkv = torch.randn(t, hq + 2 * hkv, dim) * 1.5
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    out = attention_f32(q, k, v, lengths, causal)
    assert out is not None and out.shape == (t, hq, dim) and out.dtype == torch.float32
    assert rel(out, _segment_attention_reference(q, k, v, lengths, causal)) < 1e-5
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    sdpa = torch.cat([F.scaled_dot_product_attention(*(x[s:s + n].transpose(0, 1)[None] for x in (q, k, v)),
                                                     is_causal=causal, enable_gqa=True)[0].transpose(0, 1)
                      for s, n in zip(starts, lengths)])
    assert rel(out, sdpa) < 1e-5


@needs_native
@pytest.mark.parametrize("causal", F32_MASKS)
def test_attention_f32_schedules_give_the_same_bits(causal):
    """`pt_attention_f32` packs every K^T and V panel first where it has few (segment, key/value head) tasks per
    thread, and packs each task's panels just before its query blocks where it has many (ATTENTION_F32_TASKS_PER_
    THREAD = 4): the same blocks either way, so the same bits. At one thread, segments [70, 33, 17] of one key/value
    head (3 tasks) take the first schedule and the same segments with a fourth after them the second; the first
    three segments' outputs must be equal to the bit, and within 1e-5 of float64."""
    from pixeltriage.kernels.attention import attention_f32

    torch.manual_seed(7 + causal)
    lengths, hq, dim = [70, 33, 17], 2, 32
    qkv = torch.randn(sum(lengths) + 40, hq + 2, dim) * 1.5
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + 1], qkv[:, hq + 1:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        few = attention_f32(q[:120], k[:120], v[:120], lengths, causal)
        many = attention_f32(q, k, v, lengths + [40], causal)
    finally:
        torch.set_num_threads(threads)
    assert few is not None and many is not None
    assert torch.equal(few, many[:120])
    assert rel(few, _segment_attention_reference(q[:120], k[:120], v[:120], lengths, causal)) < 1e-5


@pytest.fixture(scope="module", params=[16, 32, 64], ids=["sse", "avx2", "avx512"])
def register_width_library(request, tmp_path_factory):
    """The C library's float32 attention, conv and delta rule (attention.c, conv.c, delta.c: what the test below
    runs, a third of the whole library's compile time) built with its products' vector registers (`vr`) as wide as
    another machine's: 16, 32 or 64 bytes, whatever this CPU has (a 64-byte vector on an AVX2 machine is two
    registers: slow, but the same code). The block shapes, panel widths and tails of the float32 attention and the
    delta rule's products differ by width, and each CPU runs only its own. An entry point the test reaches and these
    sources lack fails it (no such symbol), it does not fall back."""
    import ctypes
    import dataclasses

    from pixeltriage.kernels import native

    cc = native._compiler()
    if cc is None or not native.available():
        pytest.skip("no C compiler or no native build here")
    build = dataclasses.replace(native.chosen(False), sources=tuple(
        native.variants.HERE / name for name in ("attention.c", "conv.c", "delta.c")))
    names = ("pt_attention_f32", "pt_attention_f32_scratch", "pt_causal_conv1d_silu", "pt_chunk_gather",
             "pt_delta_chunked")
    path = tmp_path_factory.mktemp("width") / f"pt_{request.param}.so"
    native.variants.compile(cc, build, path, native.abi.load().check_source(names),
                            extra=[f"-DPT_VR_BYTES={request.param}"])
    return native.abi.load().bind(ctypes.CDLL(str(path)), names)


@pytest.mark.parametrize("case", ["edges", "gqa4", "wide"])
@claims(attention.F32_CAUSAL, attention.F32_SEGMENTS, chunk.NATIVE)
def test_float32_products_at_every_register_width(register_width_library, case, monkeypatch):
    """At each register width: the float32 attention (both masks) within 1e-5 of float64, and the conv + delta
    pass within 1e-5 of the torch kernels, as at this CPU's own width above."""
    from pixeltriage.kernels.gated_delta import conv_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    t, hk, hv, dk, dv = 150, 2, 4, 32, 48
    x = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen)
    weight = torch.randn(x.shape[1], 4, generator=gen) * 0.5
    g, beta = -F.softplus(torch.randn(t, hv, generator=gen)) * 2.0, torch.rand(t, hv, generator=gen)
    with torch_only():
        want = chunk.gated_delta_torch(x, weight, g, beta, hk, dk, hv, dv, [0, 70, 150])
    monkeypatch.setattr(native, "library", lambda: register_width_library)
    lengths, hq, hkv, dim = F32_CASES[case]
    torch.manual_seed(dim)
    qkv = torch.randn(sum(lengths), hq + 2 * hkv, dim) * 1.5
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    for causal in (False, True):
        out = attention.attention_f32(q, k, v, lengths, causal)
        assert rel(out, _segment_attention_reference(q, k, v, lengths, causal)) < 1e-5
    got = conv_chunk_gated_delta_rule(x, weight, g, beta, hk, dk, dv, cu_seqlens=[0, 70, 150])
    assert rel(got, want) <= 1e-5


MASK_CHOICES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("causal_c, segments_c", MASK_CHOICES)
def test_float32_attention_runs_the_kernel_measured_faster_per_mask(causal_c, segments_c, monkeypatch):
    """float32 on the CPU: `segment_attention` runs the C kernel for each mask where it measured faster than SDPA on
    this machine (`attention.attention_choice`, here set), SDPA for the other; where SDPA won both the registry
    names SDPA. The C kernel's output does not depend on the thread count (each query block is one thread's, the
    packed K^T and V are complete before any is read)."""
    if not native.available():
        pytest.skip(f"no C kernels: {native.status()}")
    monkeypatch.setattr(attention, "_CHOICE", {(torch.float32, False): {"causal": causal_c, "segments": segments_c}})
    assert (registry.choose("attention", "cpu", torch.float32) is attention.F32_CAUSAL) is causal_c
    assert (registry.choose("vision_attention", "cpu", torch.float32) is attention.F32_SEGMENTS) is segments_c
    torch.manual_seed(4)
    q, k, v = torch.randn(3, 500, 4, 64).unbind(0)
    lengths = [200, 0, 300]
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attention.attention_f32(q, k, v, lengths, causal=True))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for causal, c_wins in ((True, causal_c), (False, segments_c)):
        want = (attention.attention_f32(q, k, v, lengths, causal) if c_wins
                else attention.sdpa_segments(q, k, v, lengths, causal))
        with registry.recording() as record:
            assert torch.equal(attention.segment_attention(q, k, v, lengths, causal=causal), want)
        op = "attention" if causal else "vision_attention"
        assert record.snapshot().calls == {(op, "native C pt_attention_f32" if c_wins else "torch SDPA"): 1}


@pytest.mark.parametrize("unit", isa.params("avx512_bf16", "amx"))
@pytest.mark.parametrize("causal_c, segments_c", MASK_CHOICES)
def test_bf16_attention_runs_the_kernels_measured_faster_per_mask(unit, causal_c, segments_c, monkeypatch):
    """bf16 on a CPU with AMX or AVX512-BF16 (the engine here set to `unit`): each mask on the kernels where they
    measured faster than SDPA (here set), SDPA for the other; where SDPA won both the registry names SDPA. Under the
    ISA emulation nothing is measured (its speed means nothing): both masks run the kernels, so the emulated forward
    checks them."""
    from pixeltriage.kernels import tuning

    if native.fast_bf16_engine() == "amx" and unit == "avx512_bf16" and not native.isa_emulated():
        assert "avx512_bf16" in native.bf16_engines()              # every CPU with AMX has AVX512-BF16
    monkeypatch.setattr(native, "fast_bf16_engine", lambda: unit)
    key = (torch.bfloat16, native.isa_emulated())
    monkeypatch.setattr(attention, "_CHOICE", {key: {"causal": causal_c, "segments": segments_c}})
    assert (registry.choose("attention", "cpu", torch.bfloat16) is attention.BF16_CAUSAL) is causal_c
    assert (registry.choose("vision_attention", "cpu", torch.bfloat16) is attention.BF16_SEGMENTS) is segments_c
    torch.manual_seed(5)
    q, k, v = (torch.randn(3, 150, 4, 32) * 1.5).bfloat16().unbind(0)
    lengths = [70, 0, 80]
    for causal, c_wins in ((True, causal_c), (False, segments_c)):
        kernel = attention.causal_attention_bf16 if causal else attention.segment_attention_bf16
        want = kernel(q, k, v, lengths) if c_wins else attention.sdpa_segments(q, k, v, lengths, causal)
        with registry.recording() as record:
            assert torch.equal(attention.segment_attention(q, k, v, lengths, causal=causal), want)
        c_name = "native C pt_causal_attention_bf16" if causal else "native C pt_segment_attention_bf16"
        op = "attention" if causal else "vision_attention"
        assert record.snapshot().calls == {(op, c_name if c_wins else "torch SDPA"): 1}
    if key[1]:
        monkeypatch.setattr(attention, "_CHOICE", {})
        monkeypatch.setattr(tuning, "measured", lambda name, measure: pytest.fail(f"{name} measured under emulation"))
        assert registry.choose("attention", "cpu", torch.bfloat16) is attention.BF16_CAUSAL
        assert registry.choose("vision_attention", "cpu", torch.bfloat16) is attention.BF16_SEGMENTS
        assert attention.c_wins(torch.bfloat16, True) and attention.c_wins(torch.bfloat16, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_choice_is_measured_per_mask(dtype, monkeypatch, tmp_path):
    """The record, per dtype: per mask, "C" where the kernel's median time is under MARGIN of SDPA's, else "SDPA",
    with the ratio; a mask the kernel declines here (no library; in bf16, neither AMX nor AVX512-BF16) is SDPA's
    without a measurement; bf16's record names its engine.
    The choice follows the kept record."""
    from pixeltriage.kernels import tuning

    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path))
    monkeypatch.delenv("PIXELTRIAGE_TUNING")            # the records in that cache
    monkeypatch.setattr(tuning, "_memo", {})
    timed = []
    ratios = iter([[0.5, 0.6, 0.7], [0.96, 1.1, 1.2]])
    monkeypatch.setattr(tuning, "interleaved_ratio", lambda first, second, pairs: timed.append(1) or next(ratios))
    record = attention.measure_attention(dtype, pairs=3)
    takes = native.available() and (dtype == torch.float32 or native.fast_bf16_engine() is not None)
    assert record.get("engine") == (native.fast_bf16_engine() if dtype == torch.bfloat16 else None)
    if takes:
        assert record["causal"] == "C" and record["causal_c_over_sdpa"] == 0.6
        assert record["segments"] == "SDPA" and record["segments_c_over_sdpa"] == 1.1 and len(timed) == 2
    else:
        assert record["causal"] == record["segments"] == "SDPA" and not timed
    monkeypatch.setattr(attention, "_CHOICE", {})
    monkeypatch.setattr(attention, "measure_attention", lambda d, pairs=7: dict(record, dtype=str(d)))
    assert attention.attention_choice(dtype) == dict(record, dtype=str(dtype))
    if dtype == torch.bfloat16 and native.isa_emulated():      # the emulation runs the kernels, unmeasured
        assert attention.c_wins(dtype, True) and attention.c_wins(dtype, False)
    else:
        assert attention.c_wins(dtype, True) is (record["causal"] == "C") and not attention.c_wins(dtype, False)
    kept = tuning.measured(attention.RECORDS[dtype], lambda: pytest.fail("measured twice"))
    assert kept == attention.attention_choice(dtype)
    with pytest.raises(ValueError, match="no C attention kernel"):
        attention.c_kernel(torch.float16)


def test_attention_f32_keeps_nans_and_declines_what_it_does_not_take():
    """A NaN key poisons only the queries that see it (causal: from its position to its segment's end, in its own
    key/value head's query heads); scores all far below zero stay finite and right (the softmax shifts by the row's
    max); bf16, query heads not a multiple of the key/value heads, head dims not a multiple of 16 or over 512, a
    last stride other than 1 and segments over MAX_ATTENTION_F32 are declined (`registry.Declined`; the op runs SDPA
    on them); lengths that do not cover the tokens are an error, not a read past them; no tokens give an empty
    output."""
    if not native.available():
        pytest.skip(f"no C kernels: {native.status()}")
    f32 = attention.attention_f32
    torch.manual_seed(5)
    q = torch.randn(170, 4, 32)
    k, v = torch.randn(170, 2, 32), torch.randn(170, 2, 32)
    k[100, 1, 3] = float("nan")                      # segment 2 (tokens 70-169), position 30, key head 1
    out = f32(q, k, v, [70, 100], causal=True)
    assert out[:100].isfinite().all() and out[100:, :2].isfinite().all() and out[100:, 2:].isnan().all()
    full = f32(q, k, v, [70, 100], causal=False)
    assert full[:70].isfinite().all() and full[70:, :2].isfinite().all() and full[70:, 2:].isnan().all()
    u = torch.randn(1, 1, 32).expand(65, 1, 32)
    qf, kf, vf = -8 * u, 8 * u + 2 * torch.randn(65, 1, 32), torch.randn(65, 1, 32)
    for causal in (False, True):
        far = f32(qf, kf, vf, [65], causal)
        assert far.isfinite().all() and rel(far, _segment_attention_reference(qf, kf, vf, [65], causal)) < 1e-5
    wide = torch.zeros(4, 1, 528)
    for args, reason in (((q.bfloat16(), k.bfloat16(), v.bfloat16(), [70, 100], True), "not float32"),
                         ((q[:, :3], k, v, [70, 100], True), "multiple"),
                         ((q[..., :24], k[..., :24], v[..., :24], [70, 100], True), "head dims"),
                         ((wide, wide, wide, [4], False), "head dims"),
                         ((q[..., ::2], k[..., ::2], v[..., ::2], [70, 100], True), "unit last strides")):
        with pytest.raises(registry.Declined, match=reason):
            f32(*args)
    with pytest.raises(ValueError, match="do not cover"):
        f32(q, k, v, [70, 101], True)
    x = torch.zeros(attention.MAX_ATTENTION_F32 + 1, 1, 16)
    with pytest.raises(registry.Declined, match="a segment over"):
        f32(x, x, x, [x.shape[0]], True)
    for lengths in ([], [0], [0, 0]):
        empty = f32(x[:0], x[:0], x[:0], lengths, False)
        assert empty.shape == (0, 1, 16) and empty.dtype == torch.float32


def test_segment_attention_rejects_lengths_that_miss_tokens():
    from pixeltriage.kernels.attention import segment_attention

    x = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="do not cover"):
        segment_attention(x, x, x, [4, 5], causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear(dtype, bias, monkeypatch):
    """`linear` (oneDNN's primitive on the CPU for a bf16 layer with a bias, and for every float32 layer where
    `plain_onednn` says) against F.linear: the same sums in another order, the bias added in the epilogue instead of copied into the
    output first; float32 within 1e-6 relative (bit-identical on the AVX2 machine measured), bf16 within one
    rounding of the output. Its fallback when oneDNN refuses is F.linear itself."""
    from pixeltriage.kernels import linear

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(300, 96, generator=g).to(dtype), (torch.randn(200, 96, generator=g) * 0.2).to(dtype)
    b = torch.randn(200, generator=g).to(dtype) if bias else None
    want = F.linear(x, w, b)
    got = linear.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (300, 200)
    assert rel(got.double(), want.double()) <= (1e-6 if dtype == torch.float32 else 2 ** -8)

    _onednn_refuses(monkeypatch)            # float32 layers without a bias take the primitive too in this state
    asks = bias or dtype == torch.float32
    assert torch.equal(linear.linear(x, w, b), want)
    assert linear._STATE["ok"] is (not asks)
    assert not linear.plain_onednn("cpu", dtype)


@pytest.mark.parametrize("case", ["one row", "odd sizes", "weight row slice", "strided x", "3-d x", "empty"])
def test_float32_projection_matches_float64_on_awkward_shapes(case, monkeypatch):
    """The decoder's float32 projections (`linear` without a bias, on oneDNN's primitive whatever the CPU's vendor:
    PIXELTRIAGE_ONEDNN=1) on the shapes a forward meets: one decision row, sizes no block divides, a row slice of
    a fused weight (in_proj, qkv), a strided activation, a batch axis, no rows. Against float64, within 1e-6
    relative of the output, as F.linear (both measured <= 3.9e-7). Where torch has the primitive, its bits are what
    ran."""
    from pixeltriage.kernels import linear as module
    from pixeltriage.kernels.linear import linear, plain_onednn

    monkeypatch.setattr(module, "_STATE", {})
    monkeypatch.setenv("PIXELTRIAGE_ONEDNN", "1")

    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(37, 129, generator=g), torch.randn(77, 129, generator=g) * 0.1
    if case == "one row":
        x = x[:1]
    elif case == "weight row slice":
        w = torch.randn(300, 129, generator=g)[40:117]
    elif case == "strided x":
        x = torch.randn(37, 300, generator=g)[:, 3:132]
    elif case == "3-d x":
        x = x[:36].view(4, 9, 129)
    elif case == "empty":
        x = x[:0]
    exact = F.linear(x.double(), w.double())
    got = linear(x, w)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert plain_onednn("cpu", torch.float32) is module.onednn_available(torch.float32)
    if plain_onednn("cpu", torch.float32):
        assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    if exact.numel():
        assert rel(got.double(), exact) <= 1e-6 and rel(F.linear(x, w).double(), exact) <= 1e-6


@pytest.mark.parametrize("library, switch, plain", [("oneDNN", None, True), ("F.linear", None, False),
                                                    ("F.linear", "auto", False), ("F.linear", "1", True),
                                                    ("oneDNN", "0", False)])
def test_float32_layers_take_the_measured_library_unless_switched(library, switch, plain, monkeypatch):
    """float32 layers, with a bias or without, run the library measured faster on this machine (`float32_choice`),
    unless PIXELTRIAGE_ONEDNN says 1 or 0 (then nothing is measured); the bits are those of the library named.
    bf16 without a bias is F.linear's everywhere."""
    from pixeltriage.kernels import linear

    measured = []
    monkeypatch.setattr(linear, "_STATE", {})
    monkeypatch.setattr(linear, "float32_choice", lambda: measured.append(1) or {"library": library})
    if switch is None:
        monkeypatch.delenv("PIXELTRIAGE_ONEDNN", raising=False)
    else:
        monkeypatch.setenv("PIXELTRIAGE_ONEDNN", switch)
    available = switch != "0" and linear.onednn_available(torch.float32)
    assert linear.plain_onednn("cpu", torch.float32) is (plain and available)
    assert len(measured) == (1 if switch in (None, "auto") and available else 0)
    assert not linear.plain_onednn("cpu", torch.bfloat16)
    x, w, b = torch.randn(40, 70), torch.randn(30, 70), torch.randn(30)
    for bias in (None, b):
        want = (torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "") if plain and available
                else F.linear(x, w, bias))
        assert torch.equal(linear.linear(x, w, bias), want)
    assert torch.equal(linear.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    assert len(measured) <= 1                      # decided once per process


def test_cpuinfo_fields():
    """One reader of /proc/cpuinfo (`native.cpuinfo_fields`: each key's first value, the first CPU's) behind the
    tuning's machine key, the native build's key and the bench's machine record."""
    from pixeltriage.kernels import native

    intel = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2\n\n"
             "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n")
    assert native.cpuinfo_fields(intel) == {"processor": "0", "vendor_id": "GenuineIntel",
                                            "model name": "Intel(R) Xeon(R)", "flags": "fpu avx2"}
    assert native.cpuinfo_fields("processor : 0\nvendor_id : AuthenticAMD\n")["vendor_id"] == "AuthenticAMD"
    assert "vendor_id" not in native.cpuinfo_fields("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")
    assert native.cpuinfo_fields("") == {}
    here = native.cpuinfo_fields()
    assert native._cpu_flags() == (here.get("flags") or here.get("Features") or native._cpu_flags())


def test_onednn_switch_off_runs_f_linear(monkeypatch):
    """PIXELTRIAGE_ONEDNN=0: no oneDNN primitive (F.linear's bits, the fused activations' reference); another
    value is an error that names the variable."""
    from pixeltriage.kernels import linear

    x, w, b = torch.randn(9, 16), torch.randn(5, 16), torch.randn(5)
    monkeypatch.setattr(linear, "_STATE", {})
    monkeypatch.setenv("PIXELTRIAGE_ONEDNN", "0")
    assert torch.equal(linear.linear(x, w, b), F.linear(x, w, b)) and torch.equal(linear.linear(x, w), F.linear(x, w))
    assert torch.equal(linear.linear_act(x, w, b, "gelu"), linear.linear_act_reference(x, w, b, "gelu"))
    assert not linear.plain_onednn("cpu", torch.float32)
    monkeypatch.setattr(linear, "_STATE", {})
    monkeypatch.setenv("PIXELTRIAGE_ONEDNN", "sometimes")
    with pytest.raises(ValueError, match="PIXELTRIAGE_ONEDNN='sometimes': expected auto"):
        linear.linear(x, w)


@pytest.mark.parametrize("kernel", paths(rotary.TORCH_NORM_ROTARY, rotary.NATIVE_NORM_ROTARY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [0, 16, 64])
def test_norm_partial_rotary_matches_float64(dtype, rotary_dim, kernel):
    """The decoder attention's q/k norm + partial rotary, read from a strided [query | gate] projection as the
    layer's q is: against float64, each path within its roundings (the C pass rounds once, the torch path after
    the norm and after each rotary product: 3 bf16 roundings of unit-scale values, 2^-8 each)."""
    from pixeltriage.kernels.rotary import apply_partial_rotary

    g = torch.Generator().manual_seed(rotary_dim)
    t, heads, dim = 37, 3, 64
    x = (torch.randn(t, heads, 2 * dim, generator=g) * 3).to(dtype)[..., :dim]
    weight = torch.randn(dim, generator=g) * 0.2
    angles = torch.randn(t, rotary_dim, generator=g)
    cos, sin = angles.cos(), angles.sin()
    got = registry.run(kernel, x, weight, 1e-6, cos, sin)
    exact = apply_partial_rotary(_rms_norm_zero_centred_f64(x, weight, 1e-6), cos.double(), sin.double())
    assert exact.dtype == torch.float64
    assert got.dtype == dtype and got.shape == (t, heads, dim)
    tol = 1e-6 if dtype == torch.float32 else (2 ** -8 if kernel is rotary.NATIVE_NORM_ROTARY else 3 * 2 ** -8)
    assert rel(got.double(), exact) <= tol


@pytest.mark.parametrize("rows,heads,dim,gate_stride", [(1, 1, 1, 1), (7, 3, 24, 100), (33, 2, 17, 40),
                                                        (5, 16, 128, 8192), (2, 1, 130, 130)])
@pytest.mark.parametrize("unit", SIMD)
@claims(norm.VECTOR_NORM_GATED, norm.NATIVE_NORM_GATED)
def test_vector_rms_norm_gated_matches_reference_and_the_c_kernel(unit, rows, heads, dim, gate_stride):
    """The AVX-512 output norm (`kernels.simd`) on head dims that are not multiples of 16 (masked tails), one row,
    the layer's strided gate (a column slice of the projection) and a strided x, into a NaN-poisoned output:
    within one bf16 rounding of the float32 reference (2^-8 relative), and equal to the C kernel's or one bf16 ulp
    from it."""
    _vector_kernel()
    from pixeltriage.kernels.norm import rms_norm_gated, rms_norm_gated_reference

    g = torch.Generator().manual_seed(rows * 100 + dim)
    x = (torch.randn(rows, heads, dim + 3, generator=g) * 1e-2)[..., 3:]              # the delta rule's output is small
    width = max(gate_stride, heads * dim)
    gate = (torch.randn(rows, width, generator=g) * 3).bfloat16()[:, width - heads * dim:].view(rows, heads, dim)
    w = torch.rand(dim, generator=g)
    x0, gate0 = x.clone(), gate.clone()
    with NanPoisonedEmpty():
        got = registry.run(norm.VECTOR_NORM_GATED, x, gate, w, 1e-6)
    want = rms_norm_gated_reference(x, gate, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, heads, dim) and not got.isnan().any()
    assert rel(got.float(), want.float()) <= 2 ** -8
    c_kernel = registry.run(norm.NATIVE_NORM_GATED, x, gate, w, 1e-6)
    ulp = 2.0 ** (torch.floor(torch.log2(c_kernel.double().abs().clamp_min(1e-38))) - 7)
    assert ((got.double() - c_kernel.double()).abs() <= ulp).all()
    assert rms_norm_gated(x, gate, w, 1e-6).equal(got)      # the op's bf16 choice on this machine is this kernel
    assert torch.equal(x, x0) and torch.equal(gate, gate0)


@pytest.mark.parametrize("rows,heads,dim", [(1, 1, 1), (7, 3, 17), (33, 8, 256), (5, 2, 130)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("unit", SIMD)
@claims(activation.VECTOR_GATE)
def test_vector_sigmoid_gate_matches_float64_and_torch(unit, rows, heads, dim, transposed):
    """o *= sigmoid(gate) by the AVX-512 pass (`kernels.simd`), the gate a strided half of the projection and o
    contiguous or head-major (the last layer's rows): each element within two bf16 roundings of float64 (2^-7
    relative: the sigmoid's and the product's, as torch rounds them), and equal to torch's or one bf16 ulp from it
    where its float32 sigmoid sits next to a rounding boundary; NaN and inf kept; elements outside o untouched."""
    _vector_kernel()
    from pixeltriage.kernels.activation import sigmoid_gate_, sigmoid_gate_torch

    g = torch.Generator().manual_seed(rows * 10 + dim)
    gate = (torch.randn(rows, heads, 2 * dim + 5, generator=g) * 4).bfloat16()[..., dim + 5:]
    base = torch.randn(heads, rows, dim + 2, generator=g).bfloat16()
    o = base[..., 1:-1].transpose(0, 1) if transposed else base[..., 1:-1].transpose(0, 1).contiguous()
    special = o.numel() > 1                          # an inf in o and a NaN in the gate, at two elements
    if special:
        o[0, 0, 0], gate[-1, -1, -1] = float("inf"), float("nan")
    o0, base0 = o.clone(), base.clone()
    got = sigmoid_gate_(o, gate)
    assert got is o and got.shape == (rows, heads, dim)
    exact = o0.double() * torch.sigmoid(gate.double())
    finite = exact.isfinite()
    assert ((got.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-30)[finite].all()
    assert not special or (got[0, 0, 0] == float("inf") and got[-1, -1, -1].isnan())
    torch_path = sigmoid_gate_torch(o0.clone(), gate)
    ulp = 2.0 ** (torch.floor(torch.log2(torch_path.double().abs().clamp_min(1e-38))) - 7)
    assert ((got.double() - torch_path.double()).abs() <= ulp)[finite].all()
    assert (got == torch_path)[finite].double().mean() >= 0.99
    if transposed:                                   # the columns around o's slice of the buffer
        assert torch.equal(base[..., 0], base0[..., 0]) and torch.equal(base[..., -1], base0[..., -1])
