"""float32 attention benchmarks (pytest-benchmark): SDPA's flash kernel against the C kernel
(`kernels.attention.attention_f32`), on bench-small's shapes, one group per layer kind. Run with `make bench`; the
ratio of a group's two medians is the kernel's speed-up on this CPU (measured on an AVX2 AMD EPYC only: on an
AVX-512 or AMX CPU, this is the measurement that says whether float32 should keep it). No timing is asserted; each
entry's output is checked against float64 once first.

- attention-f32-decoder: one gated attention layer's causal attention, 2296 tokens, 8 query heads of 256 over 2
  key/value heads;
- attention-f32-vit: one ViT block's attention, 10 images of 400 patches, 8 heads of 64, strided views of the
  block's qkv projection.
"""
import pytest
import torch
import torch.nn.functional as F

from pixeltriage.kernels import attention, native

pytestmark = [pytest.mark.bench, pytest.mark.skipif(not native.available(), reason="no C kernels on this machine")]
ROUNDS = 15


def _reference(q, k, v, lengths, causal):
    """float64 attention within each segment (the test's check, once per entry)."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], dim=0) for t in (ks, vs))
        scores = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


CASES = {   # tokens' segments, query heads, key/value heads, head dim, causal
    "decoder": ([2296], 8, 2, 256, True),
    "vit": ([400] * 10, 8, 8, 64, False),
}


@pytest.mark.parametrize("kernel", ["sdpa", "c"])
@pytest.mark.parametrize("case", list(CASES))
def test_float32_attention(benchmark, case, kernel):
    lengths, hq, hkv, dim, causal = CASES[case]
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(lengths), hq + 2 * hkv, dim, generator=gen)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    n, count = lengths[0], len(lengths)          # one length: SDPA takes the segments as one 4-D batch

    def sdpa():
        qs, ks, vs = (t.reshape(count, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=hq != hkv)
        return out.transpose(1, 2).reshape(-1, hq, dim)

    def c():
        return attention.attention_f32(q, k, v, lengths, causal)

    fn = {"sdpa": sdpa, "c": c}[kernel]
    exact = _reference(q, k, v, lengths, causal)
    err = ((fn().double() - exact).abs().max() / exact.abs().max()).item()
    assert err < 1e-5, err        # float32 (tests/kernels: both within 1.6e-6 of float64)
    benchmark.group = f"attention-f32-{case}"
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=2)
