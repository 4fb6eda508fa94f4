"""Fast CPU paths against the references beside them.

Tolerances (float32): conv1d + SiLU <= 1e-6 relative; the delta rule with strong decays (where the subnormal
cut-off acts) <= 1e-5 relative to the recurrent reference, as for mild decays in tests/test_gated_delta.py.
"""
import pytest
import torch
import torch.nn.functional as F

from pixeltriage.kernels.conv import causal_conv1d_silu, causal_conv1d_silu_reference
from pixeltriage.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("seq_len,width", [(1, 4), (3, 4), (4, 4), (97, 4), (50, 2), (20, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_matches_reference(seq_len, width, dtype):
    g = torch.Generator().manual_seed(seq_len * 10 + width)
    x = torch.randn(seq_len, 24, generator=g).to(dtype)
    w = torch.randn(24, width, generator=g).to(dtype)
    out = causal_conv1d_silu(x, w)
    assert out.dtype == torch.float32 and out.shape == (seq_len, 24)
    assert rel(out, causal_conv1d_silu_reference(x, w)) <= 1e-6


@pytest.mark.parametrize("seq_len", [65, 300])
def test_strong_decays_stay_exact(seq_len):
    g = torch.Generator().manual_seed(seq_len)
    h, dk, dv = 3, 16, 8
    q = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(seq_len, h, dk, generator=g), dim=-1)
    v = torch.randn(seq_len, h, dv, generator=g)
    decay = -torch.rand(seq_len, h, generator=g) * 40              # down to e^-40 per token: subnormals without the cut
    beta = torch.rand(seq_len, h, generator=g)
    assert rel(chunk_gated_delta_rule(q, k, v, decay, beta), recurrent_gated_delta_rule(q, k, v, decay, beta)) <= 1e-5
