"""Projection benchmarks (pytest-benchmark): a float32 decoder projection by torch's matmul (`F.linear`: MKL's sgemm
in the x86 wheels) against oneDNN's linear primitive (`kernels.linear`), one group per shape, 2296 rows (the bench
state's tokens). Run with `make bench`; the ratio of a group's two medians is what `kernels.tuning` measures once per
machine, on a smaller product, to choose float32's library (`pixeltriage bench tune` shows the choice). No timing is
asserted; each entry's output is checked against float64 once first.

- projection-in_proj: bench-small's Gated DeltaNet in_proj, [2296, 1024] x [1024, 8192];
- projection-down: bench-small's MLP down projection, [2296, 3072] x [3072, 1024].
"""
import pytest
import torch
import torch.nn.functional as F

from pixeltriage.kernels import linear

pytestmark = [pytest.mark.bench, pytest.mark.skipif(not linear.onednn_available(torch.float32),
                                                    reason="this torch has no oneDNN linear primitive")]
ROUNDS = 15
ROWS = 2296
SHAPES = {"in_proj": (1024, 8192), "down": (3072, 1024)}


@pytest.mark.parametrize("library", ["torch", "onednn"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_float32_projection(benchmark, shape, library):
    gen = torch.Generator().manual_seed(0)
    inputs, outputs = SHAPES[shape]
    x = torch.randn(ROWS, inputs, generator=gen)
    w = torch.randn(outputs, inputs, generator=gen) * inputs ** -0.5
    fns = {"torch": lambda: F.linear(x, w),
           "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")}
    exact = F.linear(x.double(), w.double())
    err = ((fns[library]().double() - exact).abs().max() / exact.abs().max()).item()
    assert err < 1e-5, err        # float32 sums of up to 3072 products (measured: MKL 4-5e-7, oneDNN 1.2-1.5e-6)
    benchmark.group = f"projection-{shape}"
    benchmark.pedantic(fns[library], rounds=ROUNDS, warmup_rounds=2)
