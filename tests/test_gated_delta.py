"""The chunked gated delta rule against the plain recurrence, and against transformers' torch version."""
import pytest
import torch
import torch.nn.functional as F

from pixeltriage.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


def inputs(seq_len, heads=3, k_dim=12, v_dim=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(seq_len, heads, k_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(seq_len, heads, k_dim, generator=gen), dim=-1)
    v = torch.randn(seq_len, heads, v_dim, generator=gen)
    g = -F.softplus(torch.randn(seq_len, heads, generator=gen)) * 2.0    # log decay <= 0, some strong
    beta = torch.rand(seq_len, heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 500])
def test_chunk_matches_recurrent(seq_len):
    args = inputs(seq_len)
    ref = recurrent_gated_delta_rule(*args)
    out = chunk_gated_delta_rule(*args)
    assert out.shape == ref.shape == (seq_len, 3, 20)
    assert (out - ref).abs().max().item() / ref.abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_does_not_change_result(chunk_size):
    args = inputs(130, seed=1)
    ref = recurrent_gated_delta_rule(*args)
    out = chunk_gated_delta_rule(*args, chunk_size=chunk_size)
    assert (out - ref).abs().max().item() / ref.abs().max().item() <= 1e-5


def test_matches_transformers_torch_chunk():
    from pixeltriage.bench.hf import force_transformers_torch_path

    force_transformers_torch_path()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    q, k, v, g, beta = inputs(97, seed=2)
    ref, _ = m.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                            use_qk_l2norm_in_kernel=False)
    out = chunk_gated_delta_rule(q, k, v, g, beta)
    assert (out - ref[0]).abs().max().item() / ref.abs().max().item() <= 1e-5
