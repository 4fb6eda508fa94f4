"""oneDNN's products on bucketed row counts (`kernels.linear.bucket_rows`, `on_bucketed_rows`): the rows that reach
the primitive, the values against the unpadded product, and the memory oneDNN keeps per row count.

oneDNN (and ideep above it) keep one primitive per product shape they have run, ~0.5 MiB each, in caches of 1024
entries; the forward's row count is the packed batch's token total, new in almost every batch a server forms. The
products therefore run on row counts rounded up to 8 steps per octave, whose primitives are made once.

Exactness: a padded product gives the unpadded one's bits (`torch.equal`), float32 and bf16, plain and packed
weights, with and without a bias and an epilogue, at one and two threads. Each output element is one dot product of
its own row with a weight column: where the kernel orders that sum by K, N and the ISA and not by the row count,
the bits are the same, and the padding rows (zeros) reach no other row (NaN there leaves the real rows' bits).
oneDNN documents no such guarantee, so it is measured: on an AVX512-BF16 EPYC over 432 products of the model's
layer shapes ([256-1024] -> [1024-1536], 17-2296 rows) at one thread and again at two, all the same bits; these
tests hold it on each machine that runs them. Against F.linear (another library's sums): float32 within 1e-6 of
the largest output, bf16 within one rounding of the output (2^-8)."""
import json
import subprocess
import sys

import pytest
import torch

from pixeltriage.kernels import linear as lin
from pixeltriage.kernels.onednn_weights import Packed
from reference import rel


def test_bucket_rows_bounds_the_row_counts_and_the_padding():
    buckets = {lin.bucket_rows(m) for m in range(1, 4097)}
    assert all(lin.bucket_rows(m) == m for m in range(1, 17))
    for m in range(1, 20000):
        b = lin.bucket_rows(m)
        assert m <= b <= m + m / 8 and lin.bucket_rows(b) == b
    # every count below 16, then 8 per octave up to 4096 (the CPU's batch budget), and 4096 itself
    assert len(buckets) == 15 + 8 * 8 + 1


@pytest.fixture
def pointwise_rows(monkeypatch):
    """The row counts that reach oneDNN's linear primitive (the real one runs)."""
    real, seen = torch.ops.mkldnn, []

    class Ops:
        @staticmethod
        def _linear_pointwise(x, *args):
            seen.append(x.reshape(-1, x.shape[-1]).shape[0])
            return real._linear_pointwise(x, *args)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(torch.ops, "mkldnn", Ops(), raising=False)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_products_run_on_bucketed_rows(dtype, packed, bias, pointwise_rows, monkeypatch):
    """linear and linear_act on oneDNN's primitive (float32: chosen for every layer, as on a machine that measured
    it faster): the primitive sees bucketed row counts only, the output has the input's rows (leading dimensions
    kept) and matches the unpadded product."""
    monkeypatch.setattr(lin, "_STATE", {})
    monkeypatch.setenv("PIXELTRIAGE_ONEDNN", "1")
    if not lin.onednn_available(dtype):
        pytest.skip(f"no oneDNN {dtype} linear primitive for this CPU")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 40, generator=g) * 0.2).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    weight = Packed(w) if packed else w
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8
    for rows in (37, 101, 301, 1025):
        x = torch.randn(1, rows, 40, generator=g).to(dtype)
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        got = lin.linear(x, weight, b)
        assert got.shape == (1, rows, 48) and got.dtype == dtype
        assert rel(got.float(), want) <= tolerance
        activated = lin.linear_act(x[0], weight, b, "silu")
        assert activated.shape == (rows, 48)
        assert rel(activated.float(), torch.nn.functional.silu(want[0])) <= 2 * tolerance
    # bf16 without a bias and a plain weight: torch's product (oneDNN's matmul), not the primitive
    primitive_calls = 8 if dtype == torch.float32 or packed or bias else 4
    assert len(pointwise_rows) == primitive_calls
    assert set(pointwise_rows) == {40, 104, 320, 1152} == {lin.bucket_rows(m) for m in (37, 101, 301, 1025)}


ROWS = (17, 37, 301, 777, 1025)        # none a bucket: each product runs on 1-127 more rows
ACTS = (None, "silu", "gelu_pytorch_tanh")


@pytest.fixture
def product_rows(monkeypatch):
    """(rows asked, rows the product ran on) for every product `on_bucketed_rows` ran."""
    real, seen = lin.on_bucketed_rows, []

    def spy(fn, x):
        asked = x.reshape(-1, x.shape[-1]).shape[0]

        def product(rows):
            seen.append((asked, rows.reshape(-1, rows.shape[-1]).shape[0]))
            return fn(rows)
        return real(product, x)

    monkeypatch.setattr(lin, "on_bucketed_rows", spy)
    return seen


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _product(x, weight, bias, act):
    return lin.linear(x, weight, bias) if act is None else lin.linear_act(x, weight, bias, act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_bucketed_products_are_the_unbucketed_bits(dtype, packed, threads, product_rows, monkeypatch):
    """Every product that reaches oneDNN (float32 on the primitive, as where measured faster; bf16's primitive and
    torch's product), with and without a bias and an epilogue: run on the bucket's rows (the spy sees the padded
    count), then with the buckets off (`bucket_rows` the identity: the spy sees the rows as asked), the same bits."""
    monkeypatch.setattr(lin, "_STATE", {})
    monkeypatch.setenv("PIXELTRIAGE_ONEDNN", "1")
    if not lin.onednn_available(dtype):
        pytest.skip(f"no oneDNN {dtype} linear primitive for this CPU")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 512, generator=g) * 512 ** -0.5).to(dtype)
    weight = Packed(w) if packed else w
    for bias in (None, torch.randn(96, generator=g).to(dtype)):
        for act in ACTS:
            for rows in ROWS:
                x = torch.randn(rows, 512, generator=g).to(dtype)
                product_rows.clear()
                bucketed = _product(x, weight, bias, act)
                assert product_rows == [(rows, lin.bucket_rows(rows))] and lin.bucket_rows(rows) > rows
                with monkeypatch.context() as off:
                    off.setattr(lin, "bucket_rows", lambda n: n)
                    product_rows.clear()
                    unbucketed = _product(x, weight, bias, act)
                    assert product_rows == [(rows, rows)]
                assert bucketed.shape == unbucketed.shape == (rows, 96)
                assert torch.equal(bucketed, unbucketed), (dtype, packed, bias is not None, act, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_padding_rows_never_reach_the_real_rows(dtype, packed, threads, monkeypatch):
    """A bucket's row count (run as it is) whose last rows are zeros, then NaN: the real rows the same bits, no NaN
    among them: no output row reads another input row."""
    monkeypatch.setattr(lin, "_STATE", {})
    monkeypatch.setenv("PIXELTRIAGE_ONEDNN", "1")
    if not lin.onednn_available(dtype):
        pytest.skip(f"no oneDNN {dtype} linear primitive for this CPU")
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(96, 512, generator=g) * 512 ** -0.5).to(dtype)
    weight = Packed(w) if packed else w
    bias = torch.randn(96, generator=g).to(dtype)
    for rows in (301, 1025):
        x = torch.randn(rows, 512, generator=g).to(dtype)
        pad = lin.bucket_rows(rows) - rows
        zeros = torch.cat([x, torch.zeros(pad, 512, dtype=dtype)])
        nans = torch.cat([x, torch.full((pad, 512), float("nan"), dtype=dtype)])
        for b in (None, bias):
            for act in ACTS:
                clean = _product(zeros, weight, b, act)[:rows]
                assert not clean.isnan().any()
                assert torch.equal(_product(nans, weight, b, act)[:rows], clean), (dtype, packed, act, rows)


def test_torch_product_keeps_its_rows(monkeypatch):
    """float32 on F.linear, as on a machine that measured it faster (MKL's sgemm keeps nothing per shape): no
    padding, the output is F.linear's own."""
    monkeypatch.setattr(lin, "_STATE", {})
    monkeypatch.setattr(lin, "float32_choice", lambda: {"library": "F.linear"})
    monkeypatch.delenv("PIXELTRIAGE_ONEDNN", raising=False)
    padded = []
    monkeypatch.setattr(lin, "on_bucketed_rows", lambda fn, x: padded.append(x) or fn(x))
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(301, 40, generator=g), torch.randn(48, 40, generator=g)
    assert lin.registry.choose("projection", "cpu", torch.float32) is not lin.ONEDNN_PROJECTION
    assert torch.equal(lin.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(lin.linear_act(x, w, None, "silu"), torch.nn.functional.silu(torch.nn.functional.linear(x, w)))
    assert padded == []


MEMORY_SCRIPT = r"""
import ctypes, json, torch
from pixeltriage.kernels import linear as lin

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info

def live_mib():
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2 ** 20

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
w, x = torch.randn(128, 64, generator=g), torch.randn(1100, 64, generator=g)
out = {}
for name, product in (("bucketed", lambda rows: lin.linear(x[:rows], w, None)),
                      ("each row count", lambda rows: torch.ops.mkldnn._linear_pointwise(x[:rows], w, None, "none",
                                                                                          [], ""))):
    product(1100)
    before = live_mib()
    for rows in range(700, 1100):
        product(rows)
    out[name] = live_mib() - before
print(json.dumps(out))
"""


def test_memory_levels_off_over_many_row_counts():
    """400 products of distinct row counts in a fresh process (its oneDNN caches empty), live malloc bytes after
    against before: on each row count oneDNN keeps a primitive per count (~0.5 MiB, >= 100 MiB in all, measured
    ~230); on bucketed rows, one per bucket (7 between 700 and 1100 rows: a few MiB)."""
    if not lin.onednn_available(torch.float32) or not sys.platform.startswith("linux"):
        pytest.skip("needs oneDNN's float32 linear primitive and glibc's mallinfo2")
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PIXELTRIAGE_ONEDNN": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    grown = json.loads(run.stdout.strip().splitlines()[-1])
    assert grown["each row count"] >= 100, grown          # what oneDNN keeps per shape: the premise of the buckets
    assert grown["bucketed"] <= 20, grown
