"""The Gated DeltaNet's token mixing in a bf16 forward on the CPU's matrix units (C `pt_delta_chunked_bf16`).

The chunked rule of `chunk.py` with flash-linear-attention's numerics: each chunk's products (kb k^T and q k^T, the
UT transform's u = T vb and w = T diag(exp(gamma)) kb, and the recurrence's w S, q S, intra v_new and k_end^T v_new)
are bf16 matmuls accumulated in float32, on AMX tiles or AVX512-BF16 dot products where the CPU has them; the
state, u and v_new before their rounding, the decays, the UT inverse and every sum stay float32. The conv + SiLU and
the L2 norms are the float32 pass's (`pt_delta_chunked`), in the same one pass per head. A float32 forward never
comes here: the float32 pass stays the reference, and the tests hold this one to it.

Engines (`native.BF16_ENGINES`): "amx" (tiles), "avx512_bf16" (dot products), "fma" (float32 multiply-adds of the
same bf16 operands, on any machine: what the tests run where the CPU has neither, and the other two's reference).
"""
from __future__ import annotations

import time

import torch

from pixeltriage import settings
from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels import native, registry, tuning
from pixeltriage.kernels.gated_delta import chunk
from pixeltriage.kernels.gated_delta.shapes import check_projection, check_value_heads

# The chunk: 32 tokens, the tiles' block (bench-small layer, 2 threads, 20 interleaved runs each, two runs: 0.948x and
# 0.962x the time at 64, 1.09x at 96, 1.23x at 128, the same error): the state's packing and scaling per chunk cost
# less than the UT inverse and the intra-chunk products save.
BF16_CHUNK = 32


# The engine: `native.fast_bf16_engine()`, AMX's tiles, else AVX512-BF16's dot products, else none (the float32
# pass). A bf16 forward on a CPU with either takes the pass where it measured faster than the float32 pass on the
# machine (`delta_choice`); PIXELTRIAGE_DELTA_BF16=1 takes it there without measuring, 0 never. On a bench-small
# layer (2296 tokens, 2 threads) AVX512-BF16 in 8 rows by 32 columns of registers took 0.78-0.91x the float32 pass's
# time (AMD EPYC with AVX-512 BF16, no AMX; medians of 7 and of `make bench`'s delta-rule group); in 4 rows by 16 it
# had taken 2.3x (an Intel Xeon, 1 thread). Its error, as root-mean-square error against the float64 recurrence
# (tests/kernels/test_gated_delta.py measures it on ten inputs): 0.72-0.84x that of flash-linear-attention's own
# bf16 numerics (what a bf16 model runs on a GPU, which also rounds the conv's and the L2 norms' outputs, u and the
# decayed v_new) and 0.87-1.16x that of transformers' bf16 torch path on the CPU (q, k, v rounded to bf16 by its bf16
# conv and norms, the recurrence in float32). On AMX, a bench-small layer took 0.73-0.84x the float32 pass's time
# (`make bench`, group delta-rule, two runs). The float32 pass stays the reference (float32 forwards never come here).
SWITCH = "PIXELTRIAGE_DELTA_BF16"


def switch() -> str:
    """PIXELTRIAGE_DELTA_BF16 (`pixeltriage.settings`): "auto" (unset: measured), "on" or "off"."""
    return settings.current().delta_bf16


# The record `tuning` keeps, the layer it is timed on (tokens, heads of q, k and v, their width: a bench-small layer
# at half its tokens) and the margin the bf16 pass must win by
RECORD = "bf16 delta pass"
MEASURE_SHAPE = (1024, 16, 128)
MARGIN = 0.97
# whether a bf16 forward takes the pass where auto decides, once per process (under RECORD)
_CHOICE: dict[str, bool] = {}


def layer_inputs(tokens: int, heads: int, dim: int, seed: int = 0) -> tuple:
    """A Gated DeltaNet layer's inputs to time the passes on (`measure_delta`, `make bench`'s delta-rule group): a bf16
    projection [tokens, 3 heads dim] (q, k, v), conv weights, g and beta, then the heads and both head dims; the
    arguments of `chunk.conv_chunk_gated_delta_rule` and `conv_chunk_rule_bf16`."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, 3 * heads * dim, generator=gen) * 0.5).bfloat16()
    weight = torch.randn(x.shape[1], 4, generator=gen) * 0.3
    g, beta = -torch.rand(tokens, heads, generator=gen), torch.rand(tokens, heads, generator=gen)
    return x, weight, g, beta, heads, dim, dim


def measure_delta(pairs: int = 7) -> dict:
    """The bf16 pass on this CPU's engine (`native.fast_bf16_engine`) against the float32 pass, on one
    MEASURE_SHAPE layer (conv + SiLU, norms and the chunked rule), in interleaved pairs: the record `tuning` keeps
    ({"pass": "bf16" or "float32", "bf16_over_float32": the median of the pairs' time ratios, "engine", "shape",
    "pairs", "measured"}). Without an engine (none without the library): "float32", nothing timed."""
    name = native.fast_bf16_engine()
    record = {"engine": name, "shape": list(MEASURE_SHAPE), "pairs": pairs,
              "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    if name is None:
        return {"pass": "float32", **record}
    args = layer_inputs(*MEASURE_SHAPE)
    ratios = tuning.interleaved_ratio(lambda: chunk.conv_chunk_gated_delta_rule(*args),
                                      lambda: conv_chunk_rule_bf16(*args), pairs=pairs)
    ratio = ratios[len(ratios) // 2]
    return {"pass": "bf16" if ratio < MARGIN else "float32", "bf16_over_float32": round(ratio, 4), **record}


def delta_choice() -> dict:
    """This machine's measured delta pass for bf16 forwards (`measure_delta`'s record, kept by `tuning`); one
    measured on another engine than this process's is measured anew."""
    return tuning.measured(RECORD, measure_delta, native.on_this_engine)


def available() -> bool:
    """Whether the registry gives a bf16 forward this pass: the CPU has a fast engine (`native.fast_bf16_engine`) and
    PIXELTRIAGE_DELTA_BF16 is on, or auto and the pass measured faster than the float32 pass here (decided once per
    process). Under the ISA emulation (its speed means nothing) it is taken without a measurement, so that the
    emulated forward checks it."""
    mode = switch()
    if mode == "off" or native.fast_bf16_engine() is None:
        return False
    if mode == "on" or native.isa_emulated():
        return True
    if RECORD not in _CHOICE:
        _CHOICE[RECORD] = delta_choice()["pass"] == "bf16"
    return _CHOICE[RECORD]


def refusal(x: torch.Tensor, conv_weight: torch.Tensor, k_dim: int, v_dim: int, chunk_size: int = BF16_CHUNK,
            engine_name: str | None = None) -> str | None:
    """Why the bf16 pass declines a projection x, or None where it takes it: bf16 on the CPU, last dim contiguous;
    heads up to 512 wide (the kernel pads them to multiples of 32, the matrix units' blocks, with zero columns); conv
    widths up to 16; the chunk a multiple of 32 up to 256; the library built, with the engine (None:
    `native.fast_bf16_engine()`)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(-1) != 1:
        return "projection not bf16 on the CPU with a unit last stride"
    if not (0 < k_dim <= 512 and 0 < v_dim <= 512):
        return "heads over 512 wide"
    if not 0 < conv_weight.shape[-1] <= 16:
        return "conv width over 16"
    if chunk_size % 32 or not 0 < chunk_size <= 256:
        return "a chunk not a multiple of 32 up to 256"
    if not native.available():
        return "no C library"
    if (native.fast_bf16_engine() if engine_name is None else engine_name) not in native.bf16_engines():
        return "no such bf16 engine on this machine"
    return None


def _round32(n: int) -> int:
    return -(-n // 32) * 32


def scratch_floats(c: int, k_dim: int, v_dim: int) -> int:
    """Per-thread scratch of `pt_delta_chunked_bf16`, in floats, as the library computes it (its DELTA_BF16_SCRATCH
    at the padded head dims, which it checks). The library must be built (`refusal`)."""
    return native.query("pt_delta_chunked_bf16_scratch", c, k_dim, v_dim)


# The pass's operand layouts (`pt_bf16_pack`'s `which`, abi.h's pt_pack_layout): what each packer makes of a float32
# matrix
PACKERS = native.abi.load().enums["pt_pack_layout"].by_key()


def pack(layout: str, src: torch.Tensor, scale: torch.Tensor | None = None, fast: bool = True) -> torch.Tensor:
    """One of the bf16 pass's operand packers on src (float32, 2-D, on the CPU), as the pass runs it: the vector
    packer (fast) or its scalar reference. Returns the packed bf16 matrix:
      "rows"     src [R, N] -> [R, N], row r times scale[r] (scale None: 1)
      "pairs"    src [R, N] -> [R/2, 2N], out[p, 2n + e] = src[2p + e, n] (the matrix units' B layout)
      "pairs_t"  src [N, R] -> [R/2, 2N], out[p, 2n + e] = src[n, 2p + e] (that of src^T)
      "rows_t"   src [N, R] -> [R, N], (src[n, :] * scale[n])^T
    BackendUnavailableError where the library, or with fast its vector packers (AVX512-BF16), is not built."""
    if layout not in PACKERS:
        raise ValueError(f"layout {layout!r} is not one of {sorted(PACKERS)}")
    if src.dim() != 2 or src.dtype != torch.float32 or src.device.type != "cpu":
        raise ValueError(f"a 2-D float32 CPU matrix expected, got {tuple(src.shape)} {src.dtype} on {src.device}")
    src = src.contiguous()
    rows, cols = src.shape if layout in ("rows", "pairs") else src.shape[::-1]
    if layout in ("pairs", "pairs_t") and rows % 2:
        raise ValueError(f"the paired layouts take an even reduction length, got {rows}")
    needs = src.shape[0] if layout in ("rows", "rows_t") else 0
    if layout == "rows_t" and scale is None:
        raise ValueError("'rows_t' takes a scale per source row")
    if scale is not None:
        scale = scale.float().contiguous()
        if scale.shape != (needs,):
            raise ValueError(f"scale of shape ({needs},) expected for {layout!r}, got {tuple(scale.shape)}")
    if native.library() is None:
        raise BackendUnavailableError(f"the native library is not built ({native.status()})")
    out = torch.empty(rows * cols, dtype=torch.bfloat16)
    rc = native.call("pt_bf16_pack", PACKERS[layout], int(fast), src.data_ptr(), rows, cols,
                     None if scale is None else scale.data_ptr(), out.data_ptr())
    if rc == native.DECLINE["isa"]:
        raise BackendUnavailableError("this build has no vector packers (the CPU lacks AVX512-BF16)")
    if rc != 0:
        raise ValueError(f"pt_bf16_pack refused {layout!r} of {tuple(src.shape)}: "
                         f"{native.decline_reason('pt_bf16_pack', rc)}")
    shape = {"rows": (rows, cols), "rows_t": (rows, cols), "pairs": (rows // 2, 2 * cols),
             "pairs_t": (rows // 2, 2 * cols)}[layout]
    return out.view(shape)


def conv_chunk_rule_bf16(x: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         num_k_heads: int, k_dim: int, v_dim: int, cu_seqlens: list[int] | None = None,
                         chunk_size: int = BF16_CHUNK, engine_name: str | None = None) -> torch.Tensor:
    """`chunk.conv_chunk_gated_delta_rule`'s contract on the bf16 pass (the "gated_delta" op's kernel BF16, through
    `registry.run`): x [T, conv_dim] bf16, conv_weight [conv_dim, W], g, beta [T, Hv] float32 -> [T, Hv, v_dim]
    float32.

    engine_name: one of `native.BF16_ENGINES` (None: `native.fast_bf16_engine()`); "fma" runs on any machine with
    the library. `registry.Declined` for inputs it does not take (`refusal`, an engine this machine lacks
    included)."""
    num_v_heads = check_projection(x, conv_weight, g, beta, num_k_heads, k_dim, v_dim)
    return registry.run(BF16, x, conv_weight, g, beta, num_k_heads, k_dim, num_v_heads, v_dim, cu_seqlens,
                        chunk_size=chunk_size, engine_name=engine_name)


def _accepts(qkv, conv_weight, g, beta, num_k_heads, k_dim, num_v_heads, v_dim, cu_seqlens, cu_seqlens_device=None,
             *, chunk_size: int | None = None, engine_name: str | None = None) -> str | None:
    return refusal(qkv, conv_weight, k_dim, v_dim, BF16_CHUNK if chunk_size is None else chunk_size, engine_name)


def gated_delta_bf16(qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int, cu_seqlens: list[int] | None,
                     cu_seqlens_device: torch.Tensor | None = None, *, chunk_size: int | None = None,
                     engine_name: str | None = None) -> torch.Tensor:
    """The "gated_delta" op of a bf16 forward on the matrix units (C `pt_delta_chunked_bf16`): the registry's
    signature (see `chunk.GATED_DELTA`)."""
    check_value_heads(beta, num_v_heads)
    check_projection(qkv, conv_weight, g, beta, num_k_heads, k_dim, v_dim, num_v_heads)
    name = native.fast_bf16_engine() if engine_name is None else engine_name
    seq_len = qkv.shape[0]
    plan = chunk._plan(seq_len, cu_seqlens, BF16_CHUNK if chunk_size is None else chunk_size, True)
    if plan.num_chunks == 0:
        return qkv.new_zeros(seq_len, num_v_heads, v_dim, dtype=torch.float32)
    gamma = plan.gamma(g)
    beta = beta.float().contiguous()
    taps = conv_weight.float().t().contiguous()                       # [W, conv_dim]
    c = plan.c
    out = gamma.new_empty(plan.num_chunks * c, num_v_heads, v_dim)
    state = gamma.new_empty(num_v_heads, _round32(k_dim), _round32(v_dim))
    per_thread = scratch_floats(c, k_dim, v_dim)
    scratch = gamma.new_zeros(torch.get_num_threads(), per_thread)    # the head dims' padding stays zero
    args = native.struct("pt_delta_args", q=None, q_t=0, q_h=0, k=None, k_t=0, k_h=0, v=None, v_t=0, v_h=0,
                         beta=beta.data_ptr(), gamma=gamma.data_ptr(), chunk_start=plan.chunk_start.data_ptr(),
                         chunk_len=plan.chunk_len.data_ptr(), restart=plan.restart.data_ptr(), N=plan.num_chunks,
                         H=num_v_heads, C=c, K=k_dim, V=v_dim, l2norm=1, eps=chunk.L2NORM_EPS, scale=k_dim ** -0.5,
                         cutoff=chunk.LOG_DECAY_CUTOFF, tiny=chunk._TINY, x=qkv.data_ptr(), x_t=qkv.stride(0),
                         x_bf16=1, taps=taps.data_ptr(), W=taps.shape[0], conv_dim=qkv.shape[1],
                         group=num_v_heads // num_k_heads, seg_start=plan.seg_start.data_ptr())
    with native.part_of_pass(chunk.CONV_PART) as prof:                # a profiler's split of the conv
        registry.c_call("pt_delta_chunked_bf16", args, native.BF16_ENGINES[name], out.data_ptr(), state.data_ptr(),
                        scratch.data_ptr(), per_thread, prof)
    return plan.unpad(out.view(plan.num_chunks * c, num_v_heads, v_dim))


# A bf16 forward on a CPU with AMX or AVX512-BF16, where `available` says (PIXELTRIAGE_DELTA_BF16, the measured
# choice): the chunk's products as bf16 matmuls on those units, float32 state; float32 forwards and CPUs without
# them keep the float32 pass
BF16 = chunk.GATED_DELTA.register("native C pt_delta_chunked_bf16", gated_delta_bf16, accepts=_accepts,
                                  dtypes=(torch.bfloat16,), available=lambda: available(), priority=15,
                                  entry="pt_delta_chunked_bf16")
