"""The fused Triton decision head against the float64 reference: on CUDA when there is one, else in Triton's
interpreter on the CPU.

Triton decorates kernels (its own helpers included) when their module is imported, so TRITON_INTERPRET must be set
before the first `import triton` of the process. tests/conftest.py imports transformers, which imports fla and so
triton: when that came first, the kernel tests are skipped with the reason below.
"""
import os
import subprocess
import sys

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from kernel_claims import claims  # noqa: E402
from pixeltriage import settings  # noqa: E402
from pixeltriage.errors import BackendUnavailableError  # noqa: E402
from pixeltriage.kernels import head  # noqa: E402
from pixeltriage.kernels.head import HeadOutput, decision_head, decision_head_reference, resolve_head_backend  # noqa: E402

settings.reload()                    # TRITON_INTERPRET as set above

try:
    from pixeltriage.kernels.head import triton as head_triton
except ModuleNotFoundError as e:   # triton absent: only the tests of that case run (no module-level skip)
    if (e.name or "").split(".")[0] != "triton":
        raise
    head_triton = None

needs_triton = pytest.mark.skipif(head_triton is None, reason="triton is not installed (the gpu extra)")
runs_kernel = pytest.mark.skipif(
    head_triton is not None and DEVICE.type == "cpu" and not head_triton.interpreter_ready(),
    reason="triton was imported before TRITON_INTERPRET=1 was set: run pytest with TRITON_INTERPRET=1 in the "
    "environment, or set it at the top of tests/conftest.py",
)

# Max abs error against the float64 reference, per output. Probabilities computed in float32 from inputs that
# the reference sees exactly (bf16/fp16 widen without rounding): the error is float32 rounding only (~5e-7 seen).
ATOL = {"p_vis": 1e-5, "gains": 1e-5, "relevance": 1e-5, "relevance_none": 1e-5}
EPS = 1e-6


def make_batch(counts, hidden_size, dim, dtype=torch.float32, weight_dtype=torch.float32, seed=0):
    """Reference-order args for states with `counts` memories each; every state owns distinct, shuffled rows."""
    g = torch.Generator().manual_seed(seed)
    num_states, num_markers = len(counts), sum(counts)
    num_rows = 7 * num_states + num_markers + 3  # 3 rows nobody reads
    rows = torch.randperm(num_rows, generator=g)
    # Rows of very different scales so the norm matters; a wider buffer so hidden has a row stride != H.
    scales = torch.empty(num_rows, 1).uniform_(0.05, 20.0, generator=g)
    wide = torch.randn(num_rows, hidden_size + 5, generator=g) * scales
    hidden = wide.to(dtype)[:, 2:2 + hidden_size]
    norm_weight = (0.3 * torch.randn(hidden_size, generator=g)).to(weight_dtype)
    # Logits of a few units, so no softmax is flat or saturated.
    w_decision = (2.0 * torch.randn(dim, hidden_size, generator=g) / hidden_size ** 0.5).to(weight_dtype)
    w_candidate = (2.0 * torch.randn(dim, hidden_size, generator=g) / hidden_size ** 0.5).to(weight_dtype)
    b = num_states
    # decision_rows is a transposed view (strides (1, B)): the wrapper copies small index tensors.
    decision_rows, binary_rows = rows[:3 * b].view(3, b).t(), rows[3 * b:5 * b].view(b, 2)
    none_rows, marker_rows = rows[5 * b:7 * b].view(b, 2), rows[7 * b:7 * b + num_markers]
    marker_offsets = torch.tensor([0] + list(counts), dtype=torch.int64).cumsum(0)
    args = (hidden, norm_weight, EPS, w_decision, w_candidate, decision_rows, binary_rows, none_rows, marker_rows,
            marker_offsets)
    return tuple(a.to(DEVICE) if torch.is_tensor(a) else a for a in args)


def reference64(args) -> HeadOutput:
    wide = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    return decision_head_reference(*wide, compute_dtype=torch.float64)


def poisoned_out(num_states, num_markers) -> HeadOutput:
    sizes = (num_states, num_markers, num_markers, num_states)
    return HeadOutput(*(torch.full((n,), float("nan"), device=DEVICE) for n in sizes))


def assert_matches_reference(out: HeadOutput, args) -> None:
    expected = reference64(args)
    for name, got, want in zip(HeadOutput._fields, out, expected):
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert torch.isfinite(got).all(), f"{name}: unwritten (NaN poison) or non-finite entries"
        err = (got.double() - want).abs().max().item() if got.numel() else 0.0
        assert err <= ATOL[name], f"{name}: max abs error {err:.3g} > {ATOL[name]:.0e}"


@needs_triton
@pytest.mark.parametrize(
    "counts, hidden_size, dim, dtype, weight_dtype",
    [
        # 0, 1, 10 memories and 37 + 4 fixed candidates in one tile, 70 + 4 over two tiles; H = 72 is a full
        # BLOCK_H chunk and a masked one, D = 24 a masked BLOCK_D.
        ([0, 1, 10, 37, 70], 72, 24, torch.float32, torch.float32),
        ([37, 0, 1], 40, 16, torch.bfloat16, torch.bfloat16),
        ([10], 24, 16, torch.float16, torch.float32),
    ],
    ids=["fp32-mixed", "bf16", "fp16-one-state"],
)
@runs_kernel
def test_kernel_matches_reference(counts, hidden_size, dim, dtype, weight_dtype):
    args = make_batch(counts, hidden_size, dim, dtype, weight_dtype)
    out = poisoned_out(len(counts), sum(counts))
    result = head_triton.decision_head_triton(*args, out=out)
    assert all(r is o for r, o in zip(result, out))
    assert_matches_reference(result, args)


@needs_triton
@runs_kernel
def test_kernel_without_memories():
    args = make_batch([0, 0], 24, 16)
    out = head_triton.decision_head_triton(*args)
    assert out.gains.shape == out.relevance.shape == (0,)
    assert_matches_reference(out, args)
    assert torch.equal(out.relevance_none.cpu(), torch.ones(2))


@needs_triton
def test_empty_batch_does_not_launch(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a kernel for an empty batch")

    monkeypatch.setattr(head_triton, "decision_head_kernel", NoLaunch())
    args = make_batch([], 24, 16)
    out = head_triton.decision_head_triton(*args)
    assert [tuple(t.shape) for t in out] == [(0,)] * 4
    assert all(t.dtype == torch.float32 for t in out)


@needs_triton
@pytest.mark.parametrize(
    "index, bad, message",
    [
        (5, lambda t: t.int(), "decision_rows expected dtype"),
        (9, lambda t: t[:-1], "marker_offsets expected shape"),
        (4, lambda t: t[:-1], "w_candidate expected shape"),
        (3, lambda t: t.t().contiguous().t(), "w_decision must be contiguous"),
        (0, lambda t: t.t().contiguous().t(), "hidden must have unit stride"),
        (1, lambda t: t.double(), "norm_weight expected dtype"),
    ],
    ids=["int32-rows", "offsets-length", "mismatched-D", "strided-weight", "strided-hidden", "fp64-norm"],
)
def test_wrapper_rejects_bad_inputs(index, bad, message):
    args = list(make_batch([2, 1], 24, 16))
    args[index] = bad(args[index])
    with pytest.raises(ValueError, match=message):
        head_triton.decision_head_triton(*args)


@needs_triton
def test_wrapper_rejects_bad_out():
    args = make_batch([2, 1], 24, 16)
    out = poisoned_out(2, 3)._replace(gains=torch.empty(2))
    with pytest.raises(ValueError, match="out.gains expected shape"):
        head_triton.decision_head_triton(*args, out=out)


@needs_triton
def test_resolve_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_head_backend("auto", cpu) == "torch"
    assert resolve_head_backend("auto", cuda) == "triton"
    assert resolve_head_backend("torch", cpu) == resolve_head_backend("torch", cuda) == "torch"
    assert resolve_head_backend("triton", cuda) == "triton"
    assert resolve_head_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="unknown"):
        resolve_head_backend("fla", cpu)


@needs_triton
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_head_backend("triton", torch.device("cpu"))
    with pytest.raises(BackendUnavailableError):
        decision_head("triton", *(a.cpu() if torch.is_tensor(a) else a for a in make_batch([1], 24, 16)))
    assert resolve_head_backend("auto", torch.device("cpu")) == "torch"


def test_triton_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec and import both fail as when it is absent
    with pytest.raises(BackendUnavailableError, match="not installed"):
        resolve_head_backend("triton", torch.device("cuda"))
    assert resolve_head_backend("auto", torch.device("cuda")) == "torch"


@needs_triton
@runs_kernel
@claims(head.TRITON)
def test_decision_head_dispatch():
    args = make_batch([2, 0], 24, 16)
    expected = decision_head_reference(*args)
    for got, want in zip(decision_head("torch", *args), expected):
        assert torch.equal(got, want)
    if DEVICE.type == "cpu":
        for got, want in zip(decision_head("auto", *args), expected):
            assert torch.equal(got, want)
    assert_matches_reference(decision_head("triton", *args), args)


def test_cpu_path_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from pixeltriage.kernels.head import decision_head\n"
        "rows = torch.arange(7).view(1, 7)\n"
        "out = decision_head('auto', torch.randn(7, 8), torch.zeros(8), 1e-6, torch.randn(4, 8), torch.randn(4, 8),\n"
        "                    rows[:, :3], rows[:, 3:5], rows[:, 5:], torch.zeros(0, dtype=torch.long),\n"
        "                    torch.zeros(2, dtype=torch.long))\n"
        "assert out.relevance_none.item() == 1.0\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


@needs_triton
@runs_kernel
@claims(head.TRITON)
def test_registry_runs_the_fused_head(monkeypatch):
    """The registry's CUDA head kernel, and decision_head("auto", ...) on top of it, run the fused kernel: on CUDA,
    or on CPU tensors under the test switch (PIXELTRIAGE_EMULATE_CUDA=1 with the interpreter)."""
    from pixeltriage.kernels import registry
    from pixeltriage.kernels.head import HEAD, TRITON

    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("PIXELTRIAGE_EMULATE_CUDA", "1")
    kernel = registry.choose("head", DEVICE, torch.float32)
    assert kernel is TRITON and not kernel.slow
    args = make_batch([3, 0, 12], 40, 16)
    calls = []
    real = head_triton.decision_head_triton
    monkeypatch.setattr(head_triton, "decision_head_triton", lambda *a: calls.append(1) or real(*a))
    with registry.recording() as record:
        assert_matches_reference(HEAD(*args), args)
        assert resolve_head_backend("auto", DEVICE) == "triton"
        assert_matches_reference(decision_head("auto", *args), args)
    assert len(calls) == 2 and record.snapshot().calls == {("head", "triton fused head"): 2}
