"""bf16 weights reordered for oneDNN once (`kernels.prepack`, `kernels.onednn_weights`): the packed product against
torch's on the plain weight, the parts a sliced weight is kept in, which roles are packed, and a Scorer's forward
with them against one without.

Tolerance of a packed product against the plain one: both are a bf16 rounding of a float32 sum over K, the same
kernel here (equal bits on the AVX512-BF16 EPYC these figures come from), but oneDNN may sum in another order on
another CPU: |packed - plain| <= 2^-8 |exact| + 2 K 2^-24 (|x| |w|^T), one bf16 step of the output and the float32
sums' reordering."""
import gc
import time
import weakref

import pytest
import torch

from pixeltriage.kernels import linear as lin
from pixeltriage.kernels import prepack
from pixeltriage.kernels.onednn_weights import Packed, Rows, packed_label, row_slice

needs_bf16_primitive = pytest.mark.skipif(not lin.onednn_available(torch.bfloat16),
                                          reason="no oneDNN bf16 linear primitive for this CPU")


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    bound = 2.0 ** -8 * exact.abs() + 2 * x.shape[-1] * 2.0 ** -24 * magnitude
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert ((got.double() - lin.linear(x, w).double()).abs() <= bound).all()
    assert ((got.double() - exact).abs() <= bound).all()


@needs_bf16_primitive
@pytest.mark.parametrize("m, k, n", [(1, 48, 96), (70, 48, 33), (17, 1000, 130), (300, 64, 2048), (0, 32, 16)])
def test_a_packed_product_is_the_plain_product(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    packed = Packed(w)
    assert packed.shape == (n, k) and packed.dtype == torch.bfloat16
    _within_one_rounding(packed(x), x, w)
    _within_one_rounding(lin.linear(x, packed, into="qkv"), x, w)          # linear runs it; `into` has no use
    bias = torch.randn(n, generator=g).bfloat16()
    assert torch.allclose(packed(x, bias).double(), lin.linear(x, w, bias).double(), rtol=2 ** -7, atol=2 ** -7)


@needs_bf16_primitive
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "quick_gelu", "silu"])
def test_a_packed_layer_with_bias_and_activation(act):
    """The vision tower's layers: `linear_act` on a packed weight runs the activation in the primitive's epilogue
    where oneDNN has it (after the product where not: quick_gelu) and gives what it gives on the plain weight (the
    same primitive, one rounding: within 2^-7 of the output, as the bias test above); the reference path (taken
    should oneDNN fail later) runs the plain weight again, exactly."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    packed = Packed(w)
    assert torch.equal(packed.plain(), w)
    got, want = lin.linear_act(x, packed, b, act), lin.linear_act(x, w, b, act)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.double(), want.double(), rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(lin.linear_act_reference(x, packed, b, act), lin.linear_act_reference(x, w, b, act))


@pytest.mark.parametrize("m, k, n", [(1, 48, 96), (70, 48, 33), (17, 1000, 130), (0, 32, 16)])
def test_a_packed_float32_product(m, k, n):
    """float32 (packed where its projections run oneDNN's primitive): within the float32 sums' reordering,
    2 K 2^-24 (|x| |w|^T), of the plain weight's product and of the exact one."""
    g = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g) * k ** -0.5
    got = Packed(w)(x)
    bound = 2 * k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - lin.linear(x, w).double()).abs() <= bound).all()
    assert ((got.double() - x.double() @ w.double().t()).abs() <= bound).all()


@needs_bf16_primitive
def test_packed_refuses_what_it_cannot_run():
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="2-D bf16 or float32 CPU"):
        Packed(torch.randn(8, 4, generator=g).half())
    with pytest.raises(ValueError, match="2-D bf16 or float32 CPU"):
        Packed(torch.randn(2, 8, 4, generator=g).bfloat16())
    packed = Packed(torch.randn(8, 4, generator=g).bfloat16())
    with pytest.raises(ValueError, match="input"):
        packed(torch.randn(3, 5, generator=g).bfloat16())
    with pytest.raises(ValueError, match="input"):
        packed(torch.randn(3, 4, generator=g))                       # float32 input for a bf16 weight


@needs_bf16_primitive
def test_a_weight_kept_in_row_parts():
    """`Rows` keeps a weight's row ranges apart (packed or plain); `row_slice` gives exactly those ranges (a view for
    a tensor), and the whole weight's product is the parts' side by side."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g).bfloat16()
    x = torch.randn(9, 24, generator=g).bfloat16()
    rows = Rows([0, 30, 40], [Packed(w[:30]), w[30:].clone()])
    assert rows.shape == (40, 24) and rows.dtype == torch.bfloat16
    assert isinstance(row_slice(rows, 0, 30), Packed) and torch.equal(row_slice(rows, 30), w[30:])
    with pytest.raises(ValueError, match=r"rows \[0, 20\)"):
        row_slice(rows, 0, 20)
    _within_one_rounding(rows(x), x, w)
    _within_one_rounding(lin.linear(x, rows), x, w)
    assert torch.equal(rows.plain(), w)
    assert packed_label(w, rows) == packed_label(Packed(w)) == " packed"
    assert packed_label(w, w[:3]) == ""                     # a layer's row-block records: per layout
    view = row_slice(w, 30)
    assert view.data_ptr() == w[30:].data_ptr() and torch.equal(row_slice(w, 2, 5), w[2:5])
    with pytest.raises(ValueError, match="bounds"):
        Rows([0, 30], [w[:30], w[30:]])
    with pytest.raises(ValueError, match="part of 10 rows"):
        Rows([0, 20, 40], [w[:10], w[10:]])


def test_which_roles_are_packed(monkeypatch):
    """All six where malloc is tuned or the workspace is off; with malloc as is and the workspace on, not the three
    whose outputs the workspace keeps. The switch: 0 packs nothing, anything but on, off or auto words is an error; float32,
    CUDA and CPUs without oneDNN's bf16 primitive pack nothing."""
    assert prepack.packed_roles(malloc_tuned=True, workspace_on=True) == prepack.ROLES
    assert prepack.packed_roles(malloc_tuned=False, workspace_on=False) == prepack.ROLES
    assert prepack.packed_roles(malloc_tuned=False, workspace_on=True) == ("out_proj", "o_proj", "down", "vision")
    assert set(prepack.WORKSPACE_ROLES) == {"in_proj", "qkv", "gate_up"}
    assert prepack.packed_roles(malloc_tuned=False, workspace_on=True, dtype=torch.float32) == prepack.ROLES
    assert prepack.applies("cpu", torch.float16) == "torch.float16 forward"
    assert prepack.applies("cuda", torch.bfloat16) == "cuda forward"
    assert prepack.chosen_roles("cpu", torch.float16) == ()
    # float32: only where its projections run oneDNN's primitive already (measured against F.linear here)
    assert (prepack.applies("cpu", torch.float32) is None) == lin.plain_onednn("cpu", torch.float32)
    monkeypatch.setenv(prepack.SWITCH, "0")
    assert prepack.applies("cpu", torch.bfloat16) == "PIXELTRIAGE_PREPACK=off"
    assert prepack.chosen_roles("cpu", torch.bfloat16) == ()
    monkeypatch.setenv(prepack.SWITCH, "sometimes")
    with pytest.raises(ValueError, match="PIXELTRIAGE_PREPACK='sometimes'"):
        prepack.chosen_roles("cpu", torch.bfloat16)
    monkeypatch.setenv(prepack.SWITCH, "1")                  # without measuring
    if lin.onednn_available(torch.bfloat16):
        monkeypatch.setattr(prepack, "choice", lambda: pytest.fail("measured under PIXELTRIAGE_PREPACK=1"))
        monkeypatch.setattr(prepack.tuning, "malloc_tuned", True)
        assert prepack.chosen_roles("cpu", torch.bfloat16) == prepack.ROLES
    else:
        assert prepack.applies("cpu", torch.bfloat16) == "no oneDNN bf16 linear primitive for this CPU"


@needs_bf16_primitive
def test_the_measured_record():
    record = prepack.measure(torch.bfloat16, shape=(64, 96, 128), pairs=3)
    assert record["layout"] in ("packed", "plain") and record["shape"] == [64, 96, 128] and record["pairs"] == 3
    assert (record["layout"] == "packed") == (record["packed_over_plain"] < prepack.MARGIN)
    q1, q3 = record["quartiles"]
    assert 0 < q1 <= record["packed_over_plain"] <= q3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_scorer_with_packed_weights_scores_as_one_without(tiny_checkpoint, monkeypatch, dtype):
    """bf16 or float32 (on oneDNN's primitive: PIXELTRIAGE_ONEDNN=1) on the CPU, every role packed
    (PIXELTRIAGE_PREPACK=1, malloc tuned): the decoder's fields hold packed weights (in_proj its packed main part and
    plain b/a rows, the last layer's qkv its query and key/value parts), the plain ones are let go, and the scores,
    the batch's scores and the hidden states (every row: the last layer's whole qkv from its parts) are those of a
    Scorer without (PIXELTRIAGE_PREPACK=0): the same bits where this CPU's packed products give the plain ones' bits
    (checked on the checkpoint's own weights), else within the bound tests/engine/test_parity.py holds the bf16
    forward to from float32 (2e-2 on scores), or float32's 1e-5 between forwards that sum in another order
    (docs/reliability.md)."""
    from pixeltriage import Scorer
    from pixeltriage.config import FULL
    from pixeltriage.episode import sample_episode

    if dtype == torch.float32:
        # float32 packs where its projections run oneDNN's primitive, which this machine's measurement (timing)
        # decides: forced here (PIXELTRIAGE_ONEDNN=1), so that the case runs the path it names wherever torch has it
        if not lin.onednn_available(torch.float32):
            pytest.skip("this torch has no oneDNN linear primitive")
        monkeypatch.setattr(lin, "_STATE", {})
        monkeypatch.setenv(lin.ONEDNN_SWITCH, "1")
    elif not lin.onednn_available(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear primitive for this CPU")
    assert prepack.applies("cpu", dtype) is None
    question, memories = sample_episode()
    monkeypatch.setenv(prepack.SWITCH, "0")
    plain = Scorer.load(tiny_checkpoint, dtype=dtype)
    assert prepack.roles_of(plain.weights) == () and "prepacked" not in plain.kernels()
    monkeypatch.setenv(prepack.SWITCH, "1")
    monkeypatch.setattr(prepack.tuning, "malloc_tuned", True)
    assert "prepacked" not in Scorer.load(tiny_checkpoint, dtype=dtype, reorder_weights=False).kernels()
    packed = Scorer.load(tiny_checkpoint, dtype=dtype)
    text, cfg = packed.weights.text, packed.model_config.text
    assert prepack.roles_of(packed.weights) == ()                         # the load only decides
    assert packed.kernels()["prepacked"].endswith("in_proj, qkv, gate_up, out_proj, o_proj, down, vision")
    other = packed.with_cache(None)                     # on the same weights: one reorder, whichever goes first
    other.score(question, memories)
    # the vision features' cache key is the plain weights' (what a Scorer without packing computes)
    assert other.vision_fingerprint == plain.vision_fingerprint
    assert prepack.roles_of(packed.weights) == prepack.ROLES
    assert packed._prepack is other._prepack and packed._prepack.done
    vision = packed.weights.vision
    assert all(isinstance(getattr(b, n), Packed) for b in vision.blocks for n in prepack.VISION_BLOCK_FIELDS)
    assert all(isinstance(getattr(vision, n), Packed) for n in prepack.VISION_FIELDS)
    last = len(text.layers) - 1
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, text.layers)):
        assert isinstance(layer.gate_up, Packed) and isinstance(layer.down, Packed)
        if kind == FULL:
            assert isinstance(layer.attn.qkv, Rows if i == last else Packed) and isinstance(layer.attn.o_proj, Packed)
        else:
            ba = row_slice(layer.attn.in_proj, cfg.linear_conv_dim + cfg.linear_value_dim)
            assert isinstance(layer.attn.in_proj, Rows) and isinstance(layer.attn.out_proj, Packed)
            assert ba.shape == (2 * cfg.linear_num_value_heads, cfg.hidden_size)
            assert ba.untyped_storage().nbytes() == ba.numel() * ba.element_size()    # not a view of the whole
    g = torch.Generator().manual_seed(0)
    pw = plain.weights
    weights = [(w, None) for layer in pw.text.layers
               for w in (layer.gate_up, layer.down, *(getattr(layer.attn, name) for name in
                                                      ("in_proj", "out_proj", "qkv", "o_proj")
                                                      if hasattr(layer.attn, name)))]
    weights += [(getattr(b, n), getattr(b, n[:-1] + "b")) for b in pw.vision.blocks for n in prepack.VISION_BLOCK_FIELDS]
    weights += [(getattr(pw.vision, n), getattr(pw.vision, n[:-1] + "b")) for n in prepack.VISION_FIELDS]
    same_bits = all(torch.equal(Packed(w)(x, b), lin.linear(x, w, b))        # as the plain forward runs each
                    for w, b in weights for x in [torch.randn(300, w.shape[1], generator=g).to(dtype)])
    a, b = packed.score(question, memories), plain.score(question, memories)
    batch = packed.score_batch([(question, memories), (question, memories[:1])])
    want_batch = plain.score_batch([(question, memories), (question, memories[:1])])
    state = packed.pack(question, memories)
    hidden, want = packed.last_hidden(state), plain.last_hidden(state)
    if same_bits:
        assert a == b and batch == want_batch and torch.equal(hidden, want)
    else:
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5                 # float32: docs/reliability.md's bound
        for got, ref in ((a, b), *zip(batch, want_batch)):
            assert got.p_vis == pytest.approx(ref.p_vis, abs=tol)
            assert max(abs(u - v) for u, v in zip(got.gains, ref.gains)) <= tol

    # the plain weights of packed roles are not kept, and are handed to `release` as they go
    monkeypatch.setenv(prepack.SWITCH, "0")
    again = Scorer.load(tiny_checkpoint, dtype=torch.bfloat16)
    gone = weakref.ref(again.weights.text.layers[0].gate_up)
    released = []
    prepack.pack_in_place(again.weights, cfg, ["gate_up"], release=lambda w: released.append(w.shape))
    gc.collect()
    assert gone() is None and prepack.roles_of(again.weights) == ("gate_up",)
    assert released == [(2 * cfg.intermediate_size, cfg.hidden_size)] * len(text.layers)
    with pytest.raises(ValueError, match="unknown prepack roles"):
        prepack.pack_in_place(again.weights, cfg, ["lm_head"])
    with pytest.raises(ValueError, match="unknown prepack roles"):
        prepack.OnFirstForward(["lm_head"])


def test_one_thread_packs_on_the_first_forward(monkeypatch):
    """`OnFirstForward.apply` packs once, however many threads call it at once: four released together by a barrier,
    the packing thread holding the lock until all four have reached it (three contend); none returns before it is
    done."""
    import threading

    calls, reached = [], []

    class Text:
        layers = []

    once = prepack.OnFirstForward(["down"])

    class Counted:
        """The lock, counting the threads that reach it."""

        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            reached.append(threading.get_ident())
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    once._lock = Counted(once._lock)
    everyone_waits = threading.Event()

    def slow(weights, cfg, roles, release=None):
        if not everyone_waits.wait(timeout=120):
            raise AssertionError(f"waited 120 s for the test to see four threads at the lock; {len(reached)} came")
        calls.append(roles)

    monkeypatch.setattr(prepack, "pack_in_place", slow)
    start, seen, errors = threading.Barrier(4), [], []

    def first_forward():
        try:
            start.wait(timeout=60)
            once.apply(Text, None)
            seen.append(once.done)
        except Exception as e:                        # noqa: BLE001 (reported below, with what it was)
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=first_forward) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(reached) < 4 and time.monotonic() < deadline and not errors:
        time.sleep(0.01)
    everyone_waits.set()
    for i, t in enumerate(threads):
        t.join(timeout=60)
        assert not t.is_alive(), f"waited 60 s for thread {i} to return from apply"
    assert not errors, errors
    assert len(reached) == 4 and calls == [("down",)] and seen == [True] * 4
    assert prepack.OnFirstForward().done and prepack.OnFirstForward().roles == ()
