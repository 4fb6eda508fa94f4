"""The CPU forward's workspace (`kernels.workspace`): one buffer per role, reused across layers and forwards, for
one forward at a time; the products and the SwiGLU pass written into it give the values they give without it."""
import threading

import pytest
import torch

from kernel_claims import claims
from pixeltriage.kernels import activation, prepack, registry, workspace
from pixeltriage.kernels.workspace import Workspace


def test_one_buffer_per_role_grown_to_the_largest_request():
    ws = Workspace()
    assert workspace.take("a", (4, 4), torch.float32, "cpu") is None          # no workspace active
    with ws.active() as on:
        assert on
        a = workspace.take("a", (8, 16), torch.bfloat16, "cpu")
        assert a.shape == (8, 16) and a.dtype == torch.bfloat16 and a.is_contiguous()
        assert workspace.take("a", (8, 16), torch.bfloat16, "cpu").data_ptr() == a.data_ptr()
        smaller = workspace.take("a", (3, 5), torch.float32, "cpu")            # another shape and dtype, same bytes
        assert smaller.data_ptr() == a.data_ptr() and smaller.shape == (3, 5)
        b = workspace.take("b", (8, 16), torch.bfloat16, "cpu")
        assert b.data_ptr() != a.data_ptr() and ws.nbytes == 2 * 8 * 16 * 2
        grown = workspace.take("a", (64, 16), torch.float32, "cpu")           # larger: a new buffer for the role
        assert grown.numel() == 64 * 16 and ws.nbytes == 64 * 16 * 4 + 8 * 16 * 2
        assert workspace.take("a", (2, 2), torch.float32, "cuda") is None      # other devices allocate as before
        assert workspace.take("empty", (0, 7), torch.float32, "cpu").shape == (0, 7)
        with pytest.raises(ValueError, match="negative"):
            workspace.take("a", (-1, 4), torch.float32, "cpu")
    assert workspace.take("a", (4, 4), torch.float32, "cpu") is None          # the block is over
    assert ws.release() == 64 * 16 * 4 + 8 * 16 * 2 and ws.nbytes == 0


def test_what_would_pass_max_bytes_is_not_kept():
    """A buffer that would take the workspace past max_bytes is not taken (None: the caller allocates it); the
    role's buffer stays, and growing a role counts its old buffer out."""
    ws = Workspace(max_bytes=1000)
    with ws.active():
        a = workspace.take("a", (10, 10), torch.float32, "cpu")                 # 400 B
        assert workspace.take("b", (10, 20), torch.float32, "cpu") is None     # 400 + 800 > 1000
        assert workspace.take("a", (10, 30), torch.float32, "cpu") is None     # 1200 > 1000
        assert workspace.take("a", (10, 10), torch.float32, "cpu").data_ptr() == a.data_ptr()
        assert workspace.take("a", (10, 25), torch.float32, "cpu").numel() == 250 and ws.nbytes == 1000
    assert Workspace().max_bytes == workspace.MAX_BYTES == 256 * 2 ** 20


def test_one_forward_at_a_time_and_the_switch(monkeypatch):
    """While one thread's forward holds the workspace, another's runs without one (takes None) and never waits;
    once released, the other thread gets it. A forward nested in one of the same thread's runs without it too
    (never on the outer one's buffers). PIXELTRIAGE_WORKSPACE=0: never active."""
    ws = Workspace()
    seen = []

    def other():
        with ws.active() as on:
            seen.append((on, workspace.take("a", (2, 2), torch.float32, "cpu")))

    with ws.active():
        workspace.take("a", (2, 2), torch.float32, "cpu")
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=60)
    assert not thread.is_alive() and seen == [(False, None)]
    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=60)
    assert seen[1][0] and seen[1][1].shape == (2, 2)
    with ws.active():                                       # a forward nested in one of this thread's
        outer = workspace.take("a", (2, 2), torch.float32, "cpu")
        with ws.active() as on, Workspace().active() as other:          # the innermost active one serves
            inner = workspace.take("b", (2, 2), torch.float32, "cpu")
            assert not on and other and inner.data_ptr() != outer.data_ptr() and "b" not in ws._buffers
        with ws.active() as on:
            assert not on and workspace.take("a", (2, 2), torch.float32, "cpu") is None
        assert workspace.take("a", (2, 2), torch.float32, "cpu").data_ptr() == outer.data_ptr()
    monkeypatch.setenv("PIXELTRIAGE_WORKSPACE", "0")
    with ws.active() as on:
        assert not on and workspace.take("a", (2, 2), torch.float32, "cpu") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_into_a_role_are_the_products(dtype):
    """`linear(..., into=role)` writes torch's product into the role's buffer (the same values as without it) where
    a workspace is active and the kernel is torch's (no bias; not oneDNN's float32 primitive, which returns a new
    tensor of the same values); none active, or a bias: a new tensor. bf16's product (oneDNN's) runs on the rows
    padded to `bucket_rows` (72 here): the role holds those."""
    from pixeltriage.kernels import linear as lin

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 48, generator=g).to(dtype), torch.randn(96, 48, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    want, want_b = lin.linear(x, w), lin.linear(x, w, b)
    assert torch.equal(lin.linear(x, w, into="qkv"), want)                   # no workspace active
    ws = Workspace()
    rows = 72 if dtype == torch.bfloat16 else 70
    with ws.active():
        buf = workspace.take("qkv", (rows, 96), dtype, "cpu").fill_(float("nan"))
        got = lin.linear(x, w, into="qkv")
        assert torch.equal(got, want)
        torch_product = lin.registry.choose("projection", x.device, dtype) is not lin.ONEDNN_PROJECTION
        assert (got.data_ptr() == buf.data_ptr()) == torch_product
        with_bias = lin.linear(x, w, b, into="qkv")
        assert torch.equal(with_bias, want_b) and with_bias.data_ptr() != buf.data_ptr()
    assert ws.nbytes == rows * 96 * x.element_size()


@pytest.mark.parametrize("path", ["auto", pytest.param("c", marks=claims(activation.NATIVE)), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_into_a_role_is_the_swiglu(path, dtype):
    """`silu_mul(..., into=role)` (the op: the AVX-512 pass where it picks it), and each of its kernels on the role's
    buffer (the C pass, torch): the values it gives without a workspace, in the role's buffer."""
    def swiglu():
        if path == "auto":
            return activation.silu_mul(gate_up, into="swiglu")
        out = workspace.take("swiglu", (37, 80), dtype, "cpu")
        return registry.run({"c": activation.NATIVE, "torch": activation.TORCH}[path], gate_up, out)

    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(37, 2 * 80 + 6, generator=g) * 4).to(dtype)[:, 3:3 + 2 * 80]     # strided rows
    want = swiglu()
    with Workspace().active():
        buf = workspace.take("swiglu", (37, 80), dtype, "cpu").fill_(float("nan"))
        got = swiglu()
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)


def test_the_c_passes_check_what_they_write_into():
    """The SwiGLU passes' out (a workspace buffer) is checked before any kernel writes: a wrong shape, dtype or
    layout is a ValueError, not a write past it."""
    from pixeltriage.kernels import simd

    gate_up = torch.randn(37, 160).bfloat16()
    for bad in (torch.empty(37, 81, dtype=torch.bfloat16), torch.empty(80, 37, dtype=torch.bfloat16).t(),
                torch.empty(37, 80)):
        for kernel in (activation.VECTOR, activation.NATIVE):
            if kernel is activation.VECTOR and not simd.available():
                continue
            with pytest.raises(ValueError, match="out"):
                registry.run(kernel, gate_up, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forwards_with_the_workspace_score_as_without(tiny_checkpoint, monkeypatch, dtype):
    """A Scorer's forwards write into its workspace (its buffers the same from one forward to the next) and score
    exactly as forwards without one (PIXELTRIAGE_WORKSPACE=0); release empties it, the next forward fills it."""
    from pixeltriage import Scorer
    from pixeltriage.episode import sample_episode

    question, memories = sample_episode()
    monkeypatch.setenv("PIXELTRIAGE_WORKSPACE", "0")
    scorer = Scorer.load(tiny_checkpoint, dtype=dtype)
    without = scorer.score_batch([(question, memories), (question, memories[:1])])
    single = scorer.score(question, memories)                                  # one state: `last_hidden_packed`
    assert scorer.workspace.nbytes == 0
    monkeypatch.setenv("PIXELTRIAGE_WORKSPACE", "1")
    first = scorer.score_batch([(question, memories), (question, memories[:1])])
    held = {role: buf.data_ptr() for role, buf in scorer.workspace._buffers.items()}
    from pixeltriage.kernels import linear as lin

    products = lin.registry.choose("projection", torch.device("cpu"), dtype) is not lin.ONEDNN_PROJECTION
    # a weight reordered for oneDNN at load (kernels.prepack) runs the primitive, which writes no buffer
    packed = set(prepack.roles_of(scorer.weights))
    assert set(held) == {"swiglu"} | ({"in_proj", "qkv", "gate_up"} - packed if products else set())
    assert scorer.score_batch([(question, memories), (question, memories[:1])]) == first == without
    assert {role: buf.data_ptr() for role, buf in scorer.workspace._buffers.items()} == held
    assert scorer.score(question, memories) == single
    freed = scorer.workspace.release()
    assert freed > 0 and scorer.workspace.nbytes == 0
    assert scorer.score(question, memories) == single and scorer.workspace.nbytes > 0
