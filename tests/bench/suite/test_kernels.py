"""Kernel benchmarks (pytest-benchmark): each C kernel on the CPU's bf16 units (AMX tiles, else AVX512-BF16 dot
products: `native.fast_bf16_engine`) against what it replaces, on bench-small's shapes, in one group per pair.
Skipped in `make test`; run with `make bench`. Compare the medians of a group's two entries in one run: that ratio
is the kernel's speed-up. No timing is asserted; each entry's output is checked against the other's once, so a
group never times a kernel that went wrong.

- attention-decoder: one gated attention layer's causal attention, 2296 tokens, 8 query heads of 256 over 2
  key/value heads: SDPA's flash kernel against `causal_attention_bf16`;
- attention-vit: one ViT block's attention, 10 images of 441 patches, 8 heads of 64: SDPA (the images as one
  4-D batch) against `segment_attention_bf16`;
- delta-rule: one Gated DeltaNet layer's conv + SiLU and chunked rule, 2296 tokens, 16 heads of 128: the float32
  pass against the bf16 pass.
"""
import pytest
import torch
import torch.nn.functional as F

from pixeltriage.kernels import native

pytestmark = [pytest.mark.bench, pytest.mark.skipif(native.fast_bf16_engine() is None,
                                                    reason="the kernels need AMX tiles or AVX512-BF16")]
ROUNDS = 15


def _check_and_time(benchmark, group: str, kernel: str, fns: dict, tol: float) -> None:
    """The pair's outputs agree (max error over the largest output under `tol`), then fns[kernel] is timed."""
    want, got = (fn().float() for fn in fns.values())
    assert ((got - want).abs().max() / want.abs().max()).item() < tol
    benchmark.group = group
    benchmark.pedantic(fns[kernel], rounds=ROUNDS, warmup_rounds=2)


@pytest.fixture(scope="module")
def decoder_qkv():
    gen = torch.Generator().manual_seed(0)
    tokens = 2296
    return tuple(torch.randn(tokens, heads, 256, generator=gen).bfloat16() for heads in (8, 2, 2))


@pytest.mark.parametrize("kernel", ["sdpa", "c"])
def test_decoder_causal_attention(benchmark, decoder_qkv, kernel):
    from pixeltriage.kernels.attention import causal_attention_bf16

    q, k, v = decoder_qkv

    def sdpa():
        return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                              enable_gqa=True)[0].transpose(0, 1)

    def c():
        return causal_attention_bf16(q, k, v, [q.shape[0]])

    _check_and_time(benchmark, "attention-decoder", kernel, {"sdpa": sdpa, "c": c}, 2 ** -7)


@pytest.mark.parametrize("kernel", ["sdpa", "c"])
def test_vit_attention(benchmark, kernel):
    from pixeltriage.kernels.attention import segment_attention_bf16

    gen = torch.Generator().manual_seed(1)
    images, patches, heads, dim = 10, 441, 8, 64
    q, k, v = torch.randn(images * patches, 3, heads, dim, generator=gen).bfloat16().unbind(1)

    def sdpa():
        qs, ks, vs = (t.view(images, patches, heads, dim).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, heads, dim)

    def c():
        return segment_attention_bf16(q, k, v, [patches] * images)

    _check_and_time(benchmark, "attention-vit", kernel, {"sdpa": sdpa, "c": c}, 2 ** -7)


@pytest.mark.parametrize("kernel", ["float32 pass", "bf16 pass"])
def test_delta_rule(benchmark, kernel):
    from pixeltriage.kernels.gated_delta import bf16, conv_chunk_gated_delta_rule

    args = bf16.layer_inputs(2296, 16, 128, seed=2)
    fns = {"float32 pass": lambda: conv_chunk_gated_delta_rule(*args),
           "bf16 pass": lambda: bf16.conv_chunk_rule_bf16(*args)}
    _check_and_time(benchmark, "delta-rule", kernel, fns, 2 ** -6)
