"""Attention over several independent segments of one token axis (images of the ViT, questions of a batch), and
the last layer's attention at a few query rows.

Registers the "attention" op (causal within each segment: the decoder's), the "vision_attention" op (every token of a
segment sees the whole segment: the ViT's), both fn(q, k, v, lengths), and "rows_attention" (`rows_attention`), in
`kernels.registry`: torch's SDPA on every device (flash / memory-efficient on CUDA); on the CPU, for each of the two,
a C kernel where it measured faster than SDPA on this machine (timed once per machine and dtype, and kept:
`kernels.tuning`): in float32 `attention_f32`, in bf16 on a CPU with AMX or AVX512-BF16 the kernels on those units
(`causal_attention_bf16`, `segment_attention_bf16`). What a C kernel declines, SDPA runs.
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


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      causal: bool) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (Hq a multiple of Hkv), token-major -> [T, Hq, D]; no token attends
    outside its segment (`lengths` sum to T); by the "attention" op's kernel (causal) or the "vision_attention"
    op's (not causal)."""
    _check_lengths(lengths, q.shape[0])
    return (ATTENTION if causal else VISION_ATTENTION)(q, k, v, lengths)


def sdpa_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool) -> torch.Tensor:
    """`segment_attention` on torch's SDPA (the ops' torch kernel).

    Each run of consecutive segments of one length goes to SDPA as one 4-D batch, [count, H, length, D] as a
    strided view of the token-major inputs: the ViT's images of one size are one call per block instead of one per
    image (bench-small, ten 400-patch images: 15.6 -> 12.9 ms per block), and SDPA's fused CPU kernel writes its
    output token-major, so the [T, H * D] the output projection reads is a view. A 4-D batch also keeps SDPA on
    that fused (flash) kernel: 3-D inputs fall back to the math path that materialises the [H, T, T] scores (10x
    slower at T = 2.3k in bf16)."""
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


def _refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], *, dtype: torch.dtype,
             multiple: int, widest: int, longest: int, grouped: bool = True) -> str | None:
    """Why a C attention kernel declines these inputs, or None where it takes them: not `dtype` on the CPU, a last
    stride other than 1, key/value heads unlike the query's (grouped: not dividing them), head dims not a multiple
    of `multiple` up to `widest`, a segment over `longest`, no library. ValueError for lengths that do not cover
    q's tokens."""
    _check_lengths(lengths, q.shape[0])
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1] == 0:
        return "q, k, v not [T, H, D] with k and v alike"
    if not (q.shape[1] % k.shape[1] == 0 if grouped else q.shape[1] == k.shape[1]):
        return "query heads not a multiple of the key/value heads" if grouped else "key/value heads unlike the query's"
    if q.device.type != "cpu" or any(t.dtype != dtype or t.stride(-1) != 1 for t in (q, k, v)):
        return f"not {str(dtype).removeprefix('torch.')} on the CPU with unit last strides"
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % multiple or q.shape[-1] > widest:
        return f"head dims not a multiple of {multiple} up to {widest}"
    if max(lengths, default=0) > longest:
        return f"a segment over {longest} tokens"
    return None if native.library() is not None else "no C library"


def _bf16_refusal(q, k, v, lengths, engine: str | None, longest: int, grouped: bool) -> str | None:
    """`_refusal` for the bf16 kernels (head dims a multiple of 32 up to 256), and where the library has no such
    engine (None: `native.fast_bf16_engine()`)."""
    reason = _refusal(q, k, v, lengths, dtype=torch.bfloat16, multiple=32, widest=256, longest=longest,
                      grouped=grouped)
    if reason is None and (native.fast_bf16_engine() if engine is None else engine) not in native.bf16_engines():
        return "no such bf16 engine on this machine"
    return reason


def _segments(lengths: list[int]):
    """Each segment's first token and length as host int64 arrays (no tensor op for a graph-shaped forward to see:
    tests/engine)."""
    starts = (ctypes.c_int64 * len(lengths))(*itertools.accumulate(lengths[:-1], initial=0) if lengths else ())
    return starts, (ctypes.c_int64 * len(lengths))(*lengths)


# Segment lengths the C kernel takes: a query block's 64 rows of float32 scores (1 MB at 4096) stay in reach of a
# core's L2; one 4096-token segment of 8 heads of 64 measured 0.82x SDPA's time, one of 8192 1.11x
MAX_SEGMENT = 4096


def segment_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                           engine: str | None = None) -> torch.Tensor:
    """`segment_attention`'s non-causal contract in bf16 on the CPU's matrix units (C `pt_segment_attention_bf16`):
    per segment, head and block of 64 queries, S = Q K^T as bf16 products with float32 sums, a float32 softmax, e V
    as two bf16 products (e's top bf16 bits, then the rest rounded: within 2^-16 of float32 e) and float32 sums
    divided out, so that the output's rounding to bf16 is its error (transformers' SDPA calls round e to bf16 for
    their one e V product: 1.12-1.13x that error, docs/performance.md). The vision tower's images are short
    (hundreds of patches) and their heads narrow (64): SDPA's flash kernel reached ~35% of the GEMM rate there.

    engine: one of `native.BF16_ENGINES` (None: `native.fast_bf16_engine()`, AMX's tiles or AVX512-BF16's dot
    products; "fma" runs on any machine, for the tests). `registry.Declined` for what it does not take (not bf16 on
    the CPU, key/value heads unlike the query's, head dims not a multiple of 32 up to 256, a segment over
    MAX_SEGMENT, no library or no such engine); ValueError for lengths that do not cover q's tokens."""
    return registry.run(BF16_SEGMENTS, q, k, v, lengths, engine=engine)


def _segment_bf16_accepts(q, k, v, lengths, engine=None):
    return _bf16_refusal(q, k, v, lengths, engine, MAX_SEGMENT, grouped=False)


def _bf16_call(q, lengths, engine):
    """What both bf16 kernels are called with: their engine's name, the output to fill, and each segment's first
    token and length (`_segments`)."""
    return (native.fast_bf16_engine() if engine is None else engine, q.new_empty(q.shape), *_segments(lengths))


def _segment_bf16(q, k, v, lengths, engine=None):
    name, out, starts, lens = _bf16_call(q, lengths, engine)
    per_thread = native.query("pt_segment_attention_scratch", max(lengths, default=0), q.shape[2])
    scratch = torch.empty(torch.get_num_threads(), per_thread)
    registry.c_call("pt_segment_attention_bf16", _attention_args(q, k, v, starts, lens, False),
                    native.BF16_ENGINES[name], out.data_ptr(), scratch.data_ptr(), per_thread)
    return out


# Segment lengths the causal kernel takes: a query block's 64 rows of float32 scores up to its last key (8 MB at
# the longest) stay in reach of a core's caches
MAX_CAUSAL = 32768


def causal_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                          engine: str | None = None) -> torch.Tensor:
    """`segment_attention`'s causal contract in bf16 on the CPU's matrix units (C `pt_causal_attention_bf16`): per
    segment, query head and block of 64 queries, S = Q K^T up to the block's last key as bf16 products with float32
    sums, a float32 softmax over the keys each query sees, e V as two bf16 products, float32 sums divided out;
    `segment_attention_bf16`'s numerics. Grouped-query heads share their key/value head's K^T and V, packed once
    per segment. The decoder's full-attention layers: 8 heads of 256 over 2 key/value heads at every preset.

    engine: as `segment_attention_bf16`. `registry.Declined` for what it does not take (not bf16 on the CPU, query
    heads not a multiple of the key/value heads, head dims not a multiple of 32 up to 256, a segment over
    MAX_CAUSAL, no library or no such engine); ValueError for lengths that do not cover q's tokens."""
    return registry.run(BF16_CAUSAL, q, k, v, lengths, engine=engine)


def _causal_bf16_accepts(q, k, v, lengths, engine=None):
    return _bf16_refusal(q, k, v, lengths, engine, MAX_CAUSAL, grouped=True)


def _causal_bf16(q, k, v, lengths, engine=None):
    name, out, starts, lens = _bf16_call(q, lengths, engine)
    per_thread, per_head = native.query("pt_causal_attention_scratch", max(lengths, default=0), q.shape[2])
    scratch = torch.empty(torch.get_num_threads(), per_thread)
    kv = torch.empty(k.shape[1], per_head, dtype=torch.bfloat16)
    registry.c_call("pt_causal_attention_bf16", _attention_args(q, k, v, starts, lens, True),
                    native.BF16_ENGINES[name], out.data_ptr(), kv.data_ptr(), per_head, scratch.data_ptr(),
                    per_thread)
    return out


# Segment lengths the float32 kernel takes: a query block's 64 rows of scores (8 MB at the longest) per thread
MAX_ATTENTION_F32 = 32768


def attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                  causal: bool) -> torch.Tensor:
    """`segment_attention`'s contract in float32 on the CPU (C `pt_attention_f32`), causal or not, grouped-query
    heads included: per segment, query head and block of 64 queries, S = Q K^T, a softmax over the keys each query
    sees and e V divided by e's sum, the products in float32 register blocks of the machine's vector width. Each
    key/value head's K^T and V are packed once per segment and shared by its query heads; a causal block computes
    its products only up to its last key. Against SDPA's flash kernel on bench-small's shapes (AVX2 AMD EPYC, 2
    threads, `make bench` group attention-f32-*): the decoder's causal attention (2296 tokens, 8 heads of 256 over
    2) 0.68-0.81x its time, the ViT's (10 images of 400 patches, 8 heads of 64) 0.87-1.0x. Within 1.6e-6 of float64
    on the tests' shapes, as SDPA; the output does not depend on the thread count.

    `registry.Declined` for what it does not take (not float32 on the CPU, a last stride other than 1, query heads
    not a multiple of the key/value heads, head dims not a multiple of 16 up to 512, a segment over
    MAX_ATTENTION_F32, no library); ValueError for lengths that do not cover q's tokens."""
    return registry.run(F32_CAUSAL if causal else F32_SEGMENTS, q, k, v, lengths)


def _f32_accepts(q, k, v, lengths):
    return _refusal(q, k, v, lengths, dtype=torch.float32, multiple=16, widest=512, longest=MAX_ATTENTION_F32)


def _f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool) -> torch.Tensor:
    out = q.new_empty(q.shape)
    if not q.shape[0]:
        return out
    starts, lens = _segments(lengths)
    dim = q.shape[2]
    padded = sum(-(-n // 16) * 16 for n in lengths)
    kv = torch.empty(2 * k.shape[1] * dim * padded)
    per_thread = native.query("pt_attention_f32_scratch", max(lengths), dim)
    scratch = torch.empty(torch.get_num_threads(), per_thread)
    registry.c_call("pt_attention_f32", _attention_args(q, k, v, starts, lens, causal), out.data_ptr(),
                    kv.data_ptr(), kv.numel(), scratch.data_ptr(), per_thread)
    return out


def _attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts, lens, causal: bool):
    """The C attention kernels' argument block (abi.h's pt_attention_args) for q [T, H, D], k and v [T, Hkv, D]."""
    return native.struct("pt_attention_args", q=q.data_ptr(), q_t=q.stride(0), q_h=q.stride(1), k=k.data_ptr(),
                         k_t=k.stride(0), k_h=k.stride(1), v=v.data_ptr(), v_t=v.stride(0), v_h=v.stride(1),
                         H=q.shape[1], Hkv=k.shape[1], D=q.shape[2], seg_start=ctypes.addressof(starts),
                         seg_len=ctypes.addressof(lens), nseg=len(lens), causal=int(causal), scale=q.shape[2] ** -0.5)


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


def c_kernel(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The C attention of `dtype` with `segment_attention`'s arguments (q, k, v, lengths, causal): float32's
    `attention_f32`; bf16's two kernels on this CPU's bf16 units (`native.fast_bf16_engine`). Each raises
    `registry.Declined` for what it does not take."""
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
    kernels = {torch.float32: (F32_CAUSAL, F32_SEGMENTS), torch.bfloat16: (BF16_CAUSAL, BF16_SEGMENTS)}
    if dtype not in kernels:
        raise ValueError(f"no C attention kernel for {dtype}; they take {sorted(map(str, RECORDS))}")
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = MEASURE_CAUSAL
    causal = (*(torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)), [t])
    n, length, h, d = MEASURE_SEGMENTS
    segments = (*torch.randn(3, n * length, h, d, generator=gen).to(dtype).unbind(0), [length] * n)
    record = {"pairs": pairs, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    if dtype == torch.bfloat16:
        record["engine"] = native.fast_bf16_engine()
    for name, args, mask, kernel in (("causal", causal, True, kernels[dtype][0]),
                                     ("segments", segments, False, kernels[dtype][1])):
        if kernel.accepts(*args) is not None:
            record[name] = "SDPA"
            continue
        ratios = tuning.interleaved_ratio(lambda: sdpa_segments(*args, mask), lambda: registry.run(kernel, *args),
                                          pairs=pairs)
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


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the queries at token positions `rows` only, by the "rows_attention" op's kernel.
    q: [Hq, R, D]; k, v: [Hkv, T, D] -> [Hq, R, D]. The query at row r sees keys 0..r of its own packed sequence
    (segments: [T], each token's sequence), as in the full causal attention, whose rows `rows` this equals."""
    return ROWS_ATTENTION(q, k, v, rows, segments)


def rows_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
    """The "rows_attention" op on SDPA with a [R, T] mask built on the device."""
    keys = torch.arange(k.shape[1], device=k.device)
    mask = keys[None, :] <= rows[:, None]                                       # [R, T] causal
    if segments is not None:
        mask &= segments[None, :] == segments.index_select(0, rows)[:, None]
    gqa = q.shape[0] != k.shape[0]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=gqa)[0]


def _available(dtype: torch.dtype, causal: bool) -> Callable[[], bool]:
    """Whether the C kernel of `dtype` runs this mask here: built (bf16: on AMX or AVX512-BF16), and measured
    faster than SDPA on this machine (`c_wins`)."""
    if dtype == torch.float32:
        return lambda: native.available() and c_wins(torch.float32, causal)
    return lambda: native.fast_bf16_engine() is not None and c_wins(torch.bfloat16, causal)


def _device_dtype(q: torch.Tensor, *args, **kwargs) -> tuple[torch.device, torch.dtype]:
    return q.device, q.dtype


# Each op's kernels: fn(q [T, Hq, D], k, v [T, Hkv, D], lengths) -> [T, Hq, D]
ATTENTION = registry.op("attention", _device_dtype)
F32_CAUSAL = ATTENTION.register("native C pt_attention_f32", functools.partial(_f32, causal=True),
                                accepts=_f32_accepts, dtypes=(torch.float32,), priority=10,
                                available=_available(torch.float32, True), entry="pt_attention_f32")
BF16_CAUSAL = ATTENTION.register("native C pt_causal_attention_bf16", _causal_bf16, accepts=_causal_bf16_accepts,
                                 dtypes=(torch.bfloat16,), available=_available(torch.bfloat16, True), priority=10,
                                 entry="pt_causal_attention_bf16")
SDPA_CAUSAL = ATTENTION.register("torch SDPA", functools.partial(sdpa_segments, causal=True), devices=("cpu", "cuda"))
VISION_ATTENTION = registry.op("vision_attention", _device_dtype)
F32_SEGMENTS = VISION_ATTENTION.register("native C pt_attention_f32", functools.partial(_f32, causal=False),
                                         accepts=_f32_accepts, dtypes=(torch.float32,), priority=10,
                                         available=_available(torch.float32, False), entry="pt_attention_f32")
BF16_SEGMENTS = VISION_ATTENTION.register("native C pt_segment_attention_bf16", _segment_bf16,
                                          accepts=_segment_bf16_accepts, dtypes=(torch.bfloat16,),
                                          available=_available(torch.bfloat16, False), priority=10,
                                          entry="pt_segment_attention_bf16")
SDPA_SEGMENTS = VISION_ATTENTION.register("torch SDPA", functools.partial(sdpa_segments, causal=False),
                                          devices=("cpu", "cuda"))
ROWS_ATTENTION = registry.op("rows_attention", _device_dtype)
ROWS_SDPA = ROWS_ATTENTION.register("torch SDPA with a row mask", rows_attention_sdpa, devices=("cpu", "cuda"))
