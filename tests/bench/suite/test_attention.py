"""Attention benchmarks (pytest-benchmark): SDPA against this machine's C kernel, on bench-small's shapes, one group
per dtype and layer kind. Run with `make bench`; the ratio of a group's two medians is the kernel's speed-up on this
CPU, what `kernels.attention.measure_attention` measures once per machine to choose (on smaller shapes). No timing is
asserted; each entry's output is checked against float64 once first.

- float32, the C kernel `attention_f32` (measured on an AVX2 AMD EPYC only);
- bf16 on a CPU with AMX or AVX512-BF16 (skipped elsewhere), the kernels `causal_attention_bf16` /
  `segment_attention_bf16` on those units, whose e V is two bf16 products (measured on AVX512-BF16 only);
- attention-<dtype>-decoder: one gated attention layer's causal attention, 2296 tokens, 8 query heads of 256 over 2
  key/value heads;
- attention-<dtype>-vit: one ViT block's attention, 10 images of 400 patches, 8 heads of 64, strided views of the
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


# the float64 check per dtype: float32 (tests/kernels: both within 1.6e-6 of float64); bf16, the output's rounding
# (both within 2^-8 of the largest output)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}


@pytest.mark.parametrize("kernel", ["sdpa", "c"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attention(benchmark, dtype, case, kernel):
    if dtype == torch.bfloat16 and native.fast_bf16_engine() is None:
        pytest.skip("bf16's C attention runs on AMX tiles or AVX512-BF16, which this CPU lacks")
    lengths, hq, hkv, dim, causal = CASES[case]
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(lengths), hq + 2 * hkv, dim, generator=gen).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    n, count = lengths[0], len(lengths)          # one length: SDPA takes the segments as one 4-D batch

    def sdpa():
        qs, ks, vs = (t.reshape(count, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=hq != hkv)
        return out.transpose(1, 2).reshape(-1, hq, dim)

    def c():
        return attention.c_kernel(dtype)(q, k, v, lengths, causal)

    fn = {"sdpa": sdpa, "c": c}[kernel]
    exact = _reference(q, k, v, lengths, causal)
    err = ((fn().double() - exact).abs().max() / exact.abs().max()).item()
    assert err < TOLERANCE[dtype], err
    benchmark.group = f"attention-{'f32' if dtype == torch.float32 else 'bf16'}-{case}"
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=2)
