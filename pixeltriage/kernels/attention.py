"""Attention over several independent segments of one token axis (images of the ViT, questions of a batch).

Registers the "attention" op (`kernels.registry`): torch's SDPA on every device (flash / memory-efficient on CUDA);
on the CPU, a C kernel for each mask (causal, segments) where it measured faster than SDPA on this machine (timed
once per machine and dtype, and kept: `kernels.tuning`): in float32 `attention_f32`, in bf16 on a CPU with AMX or
AVX512-BF16 the kernels on those units (`segment_attention_bf16`, `causal_attention_bf16`). Each C kernel declines
what it does not take, and SDPA runs it.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import time
from typing import Callable

import torch
import torch.nn.functional as F

from pixeltriage.kernels import native, registry, tuning


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (Hq a multiple of Hkv), token-major -> [T, Hq, D]; no token attends
    outside its segment (`lengths` sum to T).

    Each run of consecutive segments of one length goes to SDPA as one 4-D batch, [count, H, length, D] as a
    strided view of the token-major inputs: the ViT's images of one size are one call per block instead of one per
    image (bench-small, ten 400-patch images: 15.6 -> 12.9 ms per block), and SDPA's fused CPU kernel writes its
    output token-major, so the [T, H * D] the output projection reads is a view. A 4-D batch also keeps SDPA on
    that fused (flash) kernel: 3-D inputs fall back to the math path that materialises the [H, T, T] scores (10x
    slower at T = 2.3k in bf16).
    """
    _check_lengths(lengths, q.shape[0])
    chosen = registry.choose("attention", q.device, q.dtype)
    if chosen in (BF16, FLOAT32) and c_wins(q.dtype, causal):
        out = c_kernel(q.dtype)(q, k, v, lengths, causal)
        if out is not None:
            return out
    return _sdpa_segments(q, k, v, lengths, causal)


def _sdpa_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                   causal: bool) -> torch.Tensor:
    """`segment_attention` on torch's SDPA, one call per run of equal lengths (lengths already checked)."""
    gqa = q.shape[1] != k.shape[1]
    outs, start, i = [], 0, 0
    while i < len(lengths):
        length, count = lengths[i], 1
        while i + count < len(lengths) and lengths[i + count] == length:
            count += 1
        i += count
        span = length * count
        if length:
            qs, ks, vs = (t[start:start + span].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)   # [count, H, length, D]
            outs.append(o.transpose(1, 2).reshape(span, *o.shape[1:2], o.shape[-1]))
        start += span
    if not outs:
        return q.new_empty(*q.shape[:2], v.shape[-1])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _check_lengths(lengths: list[int], tokens: int) -> None:
    """ValueError unless `lengths` (none negative) add up to the `tokens` the segments share."""
    if sum(lengths) != tokens or any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths {lengths} do not cover the {tokens} tokens")


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], *, dtype: torch.dtype,
                  multiple: int, widest: int, longest: int, grouped: bool = True):
    """What a C attention kernel needs for these inputs: the output to fill (q's shape and dtype) and each segment's
    first token and length as host int64 arrays (no tensor op for a graph-shaped forward to see: tests/engine);
    None where it declines them: not `dtype` on the CPU, a last stride other than 1, key/value heads unlike the
    query's (grouped: not dividing them), head dims not a multiple of `multiple` up to `widest`, a segment over
    `longest`, no library. ValueError for lengths that do not cover q's tokens."""
    _check_lengths(lengths, q.shape[0])
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1] == 0:
        return None
    heads_ok = q.shape[1] % k.shape[1] == 0 if grouped else q.shape[1] == k.shape[1]
    if (not heads_ok or q.shape[-1] != k.shape[-1] or q.device.type != "cpu"
            or any(t.dtype != dtype or t.stride(-1) != 1 for t in (q, k, v))
            or q.shape[-1] % multiple or q.shape[-1] > widest or max(lengths, default=0) > longest
            or native.library() is None):
        return None
    starts = (ctypes.c_int64 * len(lengths))(*itertools.accumulate(lengths[:-1], initial=0) if lengths else ())
    lens = (ctypes.c_int64 * len(lengths))(*lengths)
    return q.new_empty(q.shape), starts, lens


def _bf16_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], engine: str | None,
                longest: int, grouped: bool):
    """`_kernel_takes` for the bf16 kernels (head dims a multiple of 32 up to 256), with the engine's name (None:
    `native.fast_bf16_engine()`); None also where the library has no such engine."""
    taken = _kernel_takes(q, k, v, lengths, dtype=torch.bfloat16, multiple=32, widest=256, longest=longest,
                          grouped=grouped)
    name = native.fast_bf16_engine() if engine is None else engine
    if taken is None or name not in native.bf16_engines():
        return None
    return (name, *taken)


# Segment lengths the C kernel takes: a query block's 64 rows of float32 scores (1 MB at 4096) stay in reach of a
# core's L2; one 4096-token segment of 8 heads of 64 measured 0.82x SDPA's time, one of 8192 1.11x
MAX_SEGMENT = 4096


def segment_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                           engine: str | None = None) -> torch.Tensor | None:
    """`segment_attention`'s non-causal contract in bf16 on the CPU's matrix units (C `pt_segment_attention_bf16`):
    per segment, head and block of 64 queries, S = Q K^T as bf16 products with float32 sums, a float32 softmax, e V
    as two bf16 products (e's top bf16 bits, then the rest rounded: within 2^-16 of float32 e) and float32 sums
    divided out, so that the output's rounding to bf16 is its error (transformers' SDPA calls round e to bf16 for
    their one e V product: 1.12-1.13x that error, docs/performance.md). The vision tower's images are short
    (hundreds of patches) and their heads narrow (64): SDPA's flash kernel reached ~35% of the GEMM rate there.

    engine: one of `native.BF16_ENGINES` (None: `native.fast_bf16_engine()`, AMX's tiles or AVX512-BF16's dot
    products; "fma" runs on any machine, for the tests). Returns None for what it does not take (not bf16 on the
    CPU, key/value heads unlike the query's, head dims not a multiple of 32 up to 256, a segment over MAX_SEGMENT, no
    library or no such engine): the caller takes SDPA. ValueError for lengths that do not cover q's tokens."""
    taken = _bf16_takes(q, k, v, lengths, engine, MAX_SEGMENT, grouped=False)
    if taken is None:
        return None
    name, out, starts, lens = taken
    per_thread = native.query("pt_segment_attention_scratch", max(lengths, default=0), q.shape[2])
    scratch = torch.empty(torch.get_num_threads(), per_thread)
    rc = native.call("pt_segment_attention_bf16", _attention_args(q, k, v, starts, lens, False),
                     native.BF16_ENGINES[name], out.data_ptr(), scratch.data_ptr(), per_thread)
    return out if rc == 0 else None


# Segment lengths the causal kernel takes: a query block's 64 rows of float32 scores up to its last key (8 MB at
# the longest) stay in reach of a core's caches
MAX_CAUSAL = 32768


def causal_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                          engine: str | None = None) -> torch.Tensor | None:
    """`segment_attention`'s causal contract in bf16 on the CPU's matrix units (C `pt_causal_attention_bf16`): per
    segment, query head and block of 64 queries, S = Q K^T up to the block's last key as bf16 products with float32
    sums, a float32 softmax over the keys each query sees, e V as two bf16 products, float32 sums divided out;
    `segment_attention_bf16`'s numerics. Grouped-query heads share their key/value head's K^T and V, packed once
    per segment. The decoder's full-attention layers: 8 heads of 256 over 2 key/value heads at every preset.

    engine: as `segment_attention_bf16`. Returns None for what it does not take (not bf16 on the CPU, query heads
    not a multiple of the key/value heads, head dims not a multiple of 32 up to 256, a segment over MAX_CAUSAL, no
    library or no such engine): the caller takes SDPA. ValueError for lengths that do not cover q's tokens."""
    taken = _bf16_takes(q, k, v, lengths, engine, MAX_CAUSAL, grouped=True)
    if taken is None:
        return None
    name, out, starts, lens = taken
    per_thread, per_head = native.query("pt_causal_attention_scratch", max(lengths, default=0), q.shape[2])
    scratch = torch.empty(torch.get_num_threads(), per_thread)
    kv = torch.empty(k.shape[1], per_head, dtype=torch.bfloat16)
    rc = native.call("pt_causal_attention_bf16", _attention_args(q, k, v, starts, lens, True),
                     native.BF16_ENGINES[name], out.data_ptr(), kv.data_ptr(), per_head, scratch.data_ptr(),
                     per_thread)
    return out if rc == 0 else None


# Segment lengths the float32 kernel takes: a query block's 64 rows of scores (8 MB at the longest) per thread
MAX_ATTENTION_F32 = 32768


def attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                  causal: bool) -> torch.Tensor | None:
    """`segment_attention`'s contract in float32 on the CPU (C `pt_attention_f32`), causal or not, grouped-query
    heads included: per segment, query head and block of 64 queries, S = Q K^T, a softmax over the keys each query
    sees and e V divided by e's sum, the products in float32 register blocks of the machine's vector width. Each
    key/value head's K^T and V are packed once per segment and shared by its query heads; a causal block computes
    its products only up to its last key. Against SDPA's flash kernel on bench-small's shapes (AVX2 AMD EPYC, 2
    threads, `make bench` group attention-f32-*): the decoder's causal attention (2296 tokens, 8 heads of 256 over
    2) 0.68-0.81x its time, the ViT's (10 images of 400 patches, 8 heads of 64) 0.87-1.0x. Within 1.6e-6 of float64
    on the tests' shapes, as SDPA; the output does not depend on the thread count.

    Returns None for what it does not take (not float32 on the CPU, a last stride other than 1, query heads not a
    multiple of the key/value heads, head dims not a multiple of 16 up to 512, a segment over MAX_ATTENTION_F32, no
    library): the caller takes SDPA. ValueError for lengths that do not cover q's tokens."""
    taken = _kernel_takes(q, k, v, lengths, dtype=torch.float32, multiple=16, widest=512, longest=MAX_ATTENTION_F32)
    if taken is None:
        return None
    out, starts, lens = taken
    if not q.shape[0]:
        return out
    dim = q.shape[2]
    padded = sum(-(-n // 16) * 16 for n in lengths)
    kv = torch.empty(2 * k.shape[1] * dim * padded)
    per_thread = native.query("pt_attention_f32_scratch", max(lengths), dim)
    scratch = torch.empty(torch.get_num_threads(), per_thread)
    rc = native.call("pt_attention_f32", _attention_args(q, k, v, starts, lens, causal), out.data_ptr(),
                     kv.data_ptr(), kv.numel(), scratch.data_ptr(), per_thread)
    return out if rc == 0 else None


def _attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts, lens, causal: bool):
    """The C attention kernels' argument block (abi.h's pt_attention_args) for q [T, H, D], k and v [T, Hkv, D]."""
    return native.struct("pt_attention_args", q=q.data_ptr(), q_t=q.stride(0), q_h=q.stride(1), k=k.data_ptr(),
                         k_t=k.stride(0), k_h=k.stride(1), v=v.data_ptr(), v_t=v.stride(0), v_h=v.stride(1),
                         H=q.shape[1], Hkv=k.shape[1], D=q.shape[2], seg_start=ctypes.addressof(starts),
                         seg_len=ctypes.addressof(lens), nseg=len(lens), causal=int(causal), scale=q.shape[2] ** -0.5)


# The shapes each dtype's choice is timed on: the decoder's causal attention (8 query heads of 256 over 2, one
# question of 1024 tokens) and the ViT's (4 images of 400 patches, 8 heads of 64)
MEASURE_CAUSAL = (1024, 8, 2, 256)
MEASURE_SEGMENTS = (4, 400, 8, 64)
# a C kernel is taken only where it measured at least this much faster than SDPA
MARGIN = 0.97
# the name each dtype's record is kept under (`tuning`)
RECORDS = {torch.float32: "float32 attention", torch.bfloat16: "bf16 attention"}
# (dtype, ISA emulated) -> {mask: whether the C kernel runs it}, decided once per process
_CHOICE: dict[tuple[torch.dtype, bool], dict[str, bool]] = {}


def c_kernel(dtype: torch.dtype) -> Callable[..., torch.Tensor | None]:
    """The C attention of `dtype` with `segment_attention`'s arguments (q, k, v, lengths, causal): float32's
    `attention_f32`; bf16's two kernels on this CPU's bf16 units (`native.fast_bf16_engine`). None from it:
    declined."""
    if dtype == torch.float32:
        return attention_f32
    if dtype == torch.bfloat16:
        return lambda q, k, v, lengths, causal: (causal_attention_bf16 if causal else segment_attention_bf16)(
            q, k, v, lengths)
    raise ValueError(f"no C attention kernel for {dtype}; they take {sorted(map(str, RECORDS))}")


def measure_attention(dtype: torch.dtype, pairs: int = 7) -> dict:
    """The C kernel of `dtype` (`c_kernel`) against SDPA here, on each mask's shape (MEASURE_CAUSAL,
    MEASURE_SEGMENTS), in interleaved pairs: the record `tuning` keeps ({"causal": "C" or "SDPA",
    "causal_c_over_sdpa": the median of the pairs' time ratios, and the same for "segments"; "pairs", "measured";
    bf16's "engine", `native.fast_bf16_engine()`). A mask the kernel declines here (no library; for bf16, neither AMX
    nor AVX512-BF16) is SDPA's without a measurement."""
    kernel = c_kernel(dtype)
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = MEASURE_CAUSAL
    causal = (*(torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)), [t])
    n, length, h, d = MEASURE_SEGMENTS
    segments = (*torch.randn(3, n * length, h, d, generator=gen).to(dtype).unbind(0), [length] * n)
    record = {"pairs": pairs, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    if dtype == torch.bfloat16:
        record["engine"] = native.fast_bf16_engine()
    for name, (q, k, v, lengths), mask in (("causal", causal, True), ("segments", segments, False)):
        if kernel(q, k, v, lengths, mask) is None:
            record[name] = "SDPA"
            continue
        ratios = tuning.interleaved_ratio(lambda: _sdpa_segments(q, k, v, lengths, mask),
                                          lambda: kernel(q, k, v, lengths, mask), pairs=pairs)
        ratio = ratios[len(ratios) // 2]
        record[name] = "C" if ratio < MARGIN else "SDPA"
        record[f"{name}_c_over_sdpa"] = round(ratio, 4)
    return record


def attention_choice(dtype: torch.dtype) -> dict:
    """This machine's measured attention kernel per mask in `dtype` (`measure_attention`'s record, kept by
    `tuning` under RECORDS[dtype]); a bf16 record measured on another engine than this process's is measured anew."""
    fits = native.on_this_engine if dtype == torch.bfloat16 else None
    return tuning.measured(RECORDS[dtype], functools.partial(measure_attention, dtype), fits)


def c_wins(dtype: torch.dtype, causal: bool) -> bool:
    """Whether attention in `dtype` with this mask runs the C kernel here (decided once per process). bf16 under the
    ISA emulation (PIXELTRIAGE_NATIVE_ISA=emulated: the AMX kernels' exactness on any CPU, at no meaningful
    speed) runs the kernels without a measurement."""
    key = (dtype, dtype == torch.bfloat16 and native.isa_emulated())
    if key not in _CHOICE:
        record = {"causal": "C", "segments": "C"} if key[1] else attention_choice(dtype)
        _CHOICE[key] = {mask: record.get(mask) == "C" for mask in ("causal", "segments")}
    return _CHOICE[key]["causal" if causal else "segments"]


def _float32_available() -> bool:
    return native.available() and (c_wins(torch.float32, True) or c_wins(torch.float32, False))


def _bf16_available() -> bool:
    return (native.fast_bf16_engine() is not None
            and (c_wins(torch.bfloat16, True) or c_wins(torch.bfloat16, False)))


registry.register("attention", "torch SDPA", segment_attention, devices=("cpu", "cuda"))
# float32 on the CPU: the C kernel for each mask where it measured faster than SDPA on this machine (SDPA for the
# other, and for what the kernel declines)
FLOAT32 = registry.register("attention", "native C pt_attention_f32 (where measured faster than SDPA)",
                            segment_attention, devices=("cpu",), dtypes=(torch.float32,),
                            available=_float32_available, priority=10)
# bf16 on a CPU with AMX tiles or AVX512-BF16 dot products: the vision tower's images and the decoder's causal
# segments on those units, each mask where it measured faster than SDPA on this machine (SDPA for the other, and for
# what the kernels decline)
BF16 = registry.register("attention", "native C pt_segment_attention_bf16 / pt_causal_attention_bf16 (where measured "
                        "faster than SDPA)", segment_attention, devices=("cpu",), dtypes=(torch.bfloat16,),
                        available=_bf16_available, priority=10)
