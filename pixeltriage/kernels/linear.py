"""Linear layers on the CPU's fastest GEMM: oneDNN's linear primitive or torch's (MKL's sgemm in float32), with
the activation fused into the primitive's epilogue where that measured faster (bf16), after it where not.

bf16: oneDNN's primitive applies the activation to each output tile while it is still in cache, in float32 before
the output's rounding: `F.gelu(F.linear(...))` instead writes the [N, 4 x hidden] output, reads it back and writes
it again (a second rounding). The bench-small ViT's fc1 ([4000, 512] x [512, 2048]): 27 -> 15.5 ms. A layer with a
bias takes the primitive too: `F.linear` runs addmm, which copies the bias into every output row and accumulates
onto it, where oneDNN adds it in the epilogue (bit-identical; [4000, 512] x [512, 1536]: 10.1 -> 7.6 ms). Without a
bias torch's bf16 matmul is oneDNN's already.

float32: every layer (with a bias or not) runs one library, the faster on this machine, measured once and kept
(`tuning`: "float32 GEMM", a [2048, 1024] x [1024, 4096] product timed both ways in interleaved pairs); then the
activation, in place (the tanh GELU in C, `activation.gelu_tanh_`). Which library wins is not the CPU's vendor's
to say: on AVX2 AMD EPYCs of one model, oneDNN ran the decoder's shapes at 1.1-1.3x MKL's rate one day (the
bench-small forward 0.91x with it) and MKL at 1.1-1.3x oneDNN's another (0.89x without it; 2b 0.76x). oneDNN's GELU
epilogues in float32 cost more than the pass after the product ([4000, 512] x [512, 2048] + tanh GELU: 115 against
85-88 ms), so no float32 layer uses them.

The MLPs (the decoder's gate_up, SiLU-and-multiply, down; the ViT's fc1 + GELU, fc2) run in blocks of ROW_BLOCK
rows where this machine measured that faster for the layer's shape (`in_row_blocks`, kept by `tuning` per shape and
dtype): the 2b decoder's [2296, 12288] intermediate is 56 MB in bf16, a 1024-row block's 25 MB, which a 32 MB
last-level cache keeps between the products.

oneDNN (and ideep above it) keep one primitive per product shape they have run, ~0.5 MiB each (its descriptor and
JIT-compiled kernels), in caches of 1024 entries; a forward's row count is its packed batch's token total, new in
almost every batch a server forms. Fed as they came, a server's RSS climbed for as long as it served: the caches
filling, then their evictions fragmenting the heap (docs/serve.md, "Soak"). So every product that reaches oneDNN
(the primitive, packed weights, bf16's torch product) runs on its rows with zero rows appended up to `bucket_rows`,
8 counts per octave (at most 1/8 more rows, 4.3% on average from 600 to 4096), and returns the first rows: each
output row is its own input row's, and a server makes each (bucket, product) primitive once. Between a tiny-preset
question (~660 tokens) and the CPU's 4096-token batch lie 22 buckets (44 at 16 per octave, which pad half as much
but whose rarer buckets were still being met for the first time minutes into serving). MKL's sgemm (float32 on
F.linear) keeps nothing per shape and runs unpadded.

Registers the "linear" op (`kernels.registry`; with an activation), the "projection" op (without one) and the
"prepacked_linear" op (a weight reordered for oneDNN, `kernels.prepack`).

`PIXELTRIAGE_ONEDNN`: auto (the default) as above, on the primitive for every float32 layer, off F.linear everywhere
(bf16 too: no primitive at all).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from pixeltriage import settings
from pixeltriage.kernels import registry, tuning, workspace
from pixeltriage.kernels.activation import gelu_tanh_
from pixeltriage.kernels.onednn_weights import Packed, Rows

# activation name (transformers' hidden_act) -> oneDNN post-op (attr, algorithm)
_POST_OPS = {"gelu_pytorch_tanh": ("gelu", "tanh"), "gelu": ("gelu", "none"), "silu": ("swish", "")}
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu}
# activations that overwrite their input (a C kernel's pass), for outputs no one else holds
_IN_PLACE = {"gelu_pytorch_tanh": gelu_tanh_}
_STATE: dict[str, bool] = {}
ONEDNN_SWITCH = "PIXELTRIAGE_ONEDNN"


def activation(name: str, in_place: bool = False):
    """The activation transformers calls `name`; in_place: one that may overwrite its input where there is one
    (`_IN_PLACE`), for a tensor no one else holds. ValueError for a name not known."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _IN_PLACE.get(name, _ACTIVATIONS[name]) if in_place else _ACTIVATIONS[name]


def switch() -> str:
    """PIXELTRIAGE_ONEDNN (`pixeltriage.settings`): "auto", "on" or "off"."""
    return settings.current().onednn


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear primitive may run `dtype` here (torch has it, PIXELTRIAGE_ONEDNN is not off, and for
    bf16 the CPU has bf16 units oneDNN builds for)."""
    if switch() == "off":
        return False
    if "ok" not in _STATE:
        try:
            _STATE["ok"] = bool(torch.backends.mkldnn.is_available()) and \
                hasattr(torch.ops.mkldnn, "_linear_pointwise")
            # oneDNN builds bf16 primitives only on CPUs with bf16 support (AVX-512 BF16 / AMX, some aarch64)
            _STATE["bf16"] = _STATE["ok"] and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _STATE["ok"] = _STATE["bf16"] = False
    return _STATE["ok"] and (dtype != torch.bfloat16 or _STATE.get("bf16", False))


def _onednn_refusal(x: torch.Tensor, weight, bias: torch.Tensor | None) -> str | None:
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return "weight or bias in another dtype than x"
    return None


def _call_onednn(x: torch.Tensor, weight, bias: torch.Tensor | None, attr: str, algorithm: str) -> torch.Tensor:
    """oneDNN's linear primitive with post-op `attr` (on a weight in its plain layout or reordered, `Packed`). A
    oneDNN build without the primitive for this CPU/dtype raises once: the call is declined and the primitive is
    unavailable from then on (the torch kernels differ by at most one rounding of the output)."""
    try:
        if isinstance(weight, Packed):                # reordered for the primitive once (`kernels.prepack`)
            return weight(x, bias, attr, algorithm)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    except RuntimeError as e:
        _STATE["ok"] = False
        raise registry.Declined(f"oneDNN's primitive raised {type(e).__name__}; not used from now on") from e


def _primitive_accepts(x, weight, bias=None, into=None) -> str | None:
    return _onednn_refusal(x, weight, bias)


def _primitive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               into: str | None = None) -> torch.Tensor:
    """The "projection" op on oneDNN's primitive (float32; its product has no output argument: `into` unused), on
    bucketed rows."""
    return on_bucketed_rows(lambda rows: _call_onednn(rows, weight, bias, "none", ""), x)


def _bias_primitive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    into: str | None = None) -> torch.Tensor:
    """The "projection" op in bf16: a layer with a bias on oneDNN's primitive (the bias in its epilogue), one
    without on torch's product (oneDNN's already in bf16); both on bucketed rows."""
    if bias is None:
        return on_bucketed_rows(lambda rows: projection_torch(rows, weight, into=into), x)
    return on_bucketed_rows(lambda rows: _call_onednn(rows, weight, bias, "none", ""), x)


def projection_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     into: str | None = None) -> torch.Tensor:
    """The "projection" op on torch's product (`F.linear`); into: a workspace role (`kernels.workspace`) whose
    buffer, where a workspace is active and the product has no bias and a 2-D x on the CPU, receives it by
    `torch.mm`'s out= form (the same library call, the same values) and is returned."""
    if into is not None and bias is None and x.dim() == 2:
        out = workspace.take(into, (x.shape[0], weight.shape[0]), x.dtype, x.device)
        if out is not None:
            return torch.mm(x, weight.t(), out=out)
    return F.linear(x, weight, bias)


# The product the float32 choice is timed on: a decoder projection's order of size (2048 rows, 16 MB of weight)
MEASURE_SHAPE = (2048, 1024, 4096)
# oneDNN is taken only where it measured at least this much faster (F.linear's sums are transformers' own)
MARGIN = 0.97


def measure_float32_gemm(shape: tuple[int, int, int] = MEASURE_SHAPE, pairs: int = 7) -> dict:
    """oneDNN's primitive against F.linear on one float32 product here, interleaved: the record `tuning` keeps
    ({"library": "oneDNN" or "F.linear", "onednn_over_f_linear": the median of the pairs' time ratios, "quartiles",
    "shape", "pairs", "measured"}); where the primitive raises, {"library": "F.linear", "error": its message, ...}."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * k ** -0.5
    record = {"shape": list(shape), "pairs": pairs, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        ratios = tuning.interleaved_ratio(lambda: F.linear(x, w),
                                          lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                          pairs=pairs)
    except RuntimeError as e:                      # a torch whose primitive refuses this CPU: F.linear, and why
        return {"library": "F.linear", "error": str(e).splitlines()[0][:300] if str(e) else type(e).__name__,
                **record}
    ratio = ratios[len(ratios) // 2]
    return {"library": "oneDNN" if ratio < MARGIN else "F.linear", "onednn_over_f_linear": round(ratio, 4),
            "quartiles": [round(ratios[len(ratios) // 4], 4), round(ratios[3 * len(ratios) // 4], 4)], **record}


# Row blocks of an MLP (`in_row_blocks`): the one block size measured against the whole; its records' names' prefix
ROW_BLOCK = 1024
ROW_BLOCKS = "row blocks: "


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, layer: str) -> torch.Tensor:
    """fn(x) for a row-wise fn (an MLP: each output row is a function of its input row alone), in blocks of
    ROW_BLOCK rows where this machine measured that faster for this layer (`row_block_choice`), else whole: a block's
    intermediate ([1024, 2 x 6144] bf16 for the 2b decoder's gate_up, 25 MB) can stay in the last-level cache between
    the products where the whole ([2296, 12288], 56 MB) goes to memory and back. CPU tensors of at least twice
    ROW_BLOCK rows only (a smaller batch is one block). layer: names the layer's shape and dtype, the record's key."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] < 2 * ROW_BLOCK:
        return fn(x)
    return _blocks(fn, x, ROW_BLOCK) if row_block_choice(fn, x, layer)["rows"] else fn(x)


def row_block_records(followed: bool = False) -> dict[str, dict]:
    """This machine's kept row-block records by layer (`bench tune`); followed: only those this process's MLPs
    followed (what a forward here ran: `bench cpu`)."""
    return {name[len(ROW_BLOCKS):]: record for name, record in tuning.kept(ROW_BLOCKS, followed).items()}


def _blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([fn(x[r:r + rows]) for r in range(0, x.shape[0], rows)])


def row_block_choice(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, layer: str,
                     pairs: int = 5) -> dict:
    """Whether `layer` runs in row blocks here (`measure_row_blocks` on this call's own x, the first time on this
    machine, which includes its malloc condition: `tuning.machine_key`; kept by `tuning` under ROW_BLOCKS + layer)."""
    return tuning.measured(ROW_BLOCKS + layer, lambda: measure_row_blocks(fn, x, pairs))


def measure_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, pairs: int = 5) -> dict:
    """fn over x in ROW_BLOCK-row blocks against fn over x whole, interleaved: {"rows": ROW_BLOCK where the blocks
    took under MARGIN of the whole's time, else 0; "blocks_over_whole": the median of the pairs' ratios, "tokens",
    "pairs", "measured"}. On an AVX512-BF16 EPYC (2 threads, 32 MB L3) the 2b decoder's MLP took 0.90x in blocks of
    1024 rows, the 2b ViT's 0.93x, bench-small's decoder MLP 0.97x and its ViT's 1.05x (slower: its products are
    small)."""
    ratios = tuning.interleaved_ratio(lambda: fn(x), lambda: _blocks(fn, x, ROW_BLOCK), pairs=pairs, warmup=1)
    ratio = ratios[len(ratios) // 2]
    return {"rows": ROW_BLOCK if ratio < MARGIN else 0, "blocks_over_whole": round(ratio, 4),
            "tokens": x.shape[0], "pairs": pairs, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


def _projection_available() -> bool:
    """float32 on oneDNN's primitive: PIXELTRIAGE_ONEDNN on, or auto and measured faster here (`float32_choice`)."""
    if not onednn_available(torch.float32):
        return False
    if switch() == "on":
        return True
    if "plain" not in _STATE:
        _STATE["plain"] = float32_choice()["library"] == "oneDNN"
    return _STATE["plain"]


def float32_choice() -> dict:
    """This machine's measured float32 GEMM library (`measure_float32_gemm`'s record, kept by `tuning`)."""
    return tuning.measured("float32 GEMM", measure_float32_gemm)


def plain_onednn(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `linear` runs oneDNN's primitive for `dtype` tensors on `device` whatever the layer (float32 where
    measured faster, or PIXELTRIAGE_ONEDNN on); deciding it here measures once per machine where not yet known."""
    return registry.choose("projection", device, dtype) is ONEDNN_PROJECTION


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to the next of 8 steps per octave (every count below 16 is its own): at most 1/8 more."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def on_bucketed_rows(fn: Callable[[torch.Tensor], torch.Tensor | None], x: torch.Tensor) -> torch.Tensor | None:
    """fn(x) for a product whose every output row depends on its input row alone (x: [..., in]), run on x's rows
    with zero rows appended up to `bucket_rows`; the output's first rows (a view), or None where fn gives None."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded_rows = bucket_rows(rows)
    if padded_rows == rows:
        return fn(x)
    padded = flat.new_empty((padded_rows, flat.shape[1]))
    padded[:rows].copy_(flat)
    padded[rows:].zero_()
    out = fn(padded)
    return None if out is None else out[:rows].view(*x.shape[:-1], out.shape[-1])


def linear_act(x: torch.Tensor, weight, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """act(x @ weight^T + bias); x: [..., in], weight: [out, in] (or reordered for oneDNN, `kernels.prepack`) ->
    [..., out] in x's dtype, by the "linear" op's kernel."""
    return LINEAR(x, weight, bias, act)


def _fused_accepts(x, weight, bias, act) -> str | None:
    if act not in _POST_OPS:
        return f"no oneDNN post-op for {act}"
    return _onednn_refusal(x, weight, bias)


def _fused(x: torch.Tensor, weight, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """The "linear" op on oneDNN's primitive with the activation in its epilogue, on bucketed rows."""
    return on_bucketed_rows(lambda rows: _call_onednn(rows, weight, bias, *_POST_OPS[act]), x)


def _then_activation(x: torch.Tensor, weight, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """The "linear" op as the "projection" op's product, then the activation in place (the product is ours)."""
    return activation(act, in_place=True)(linear(x, weight, bias))


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, into: str | None = None) -> torch.Tensor:
    """x @ weight^T + bias, as `F.linear`, by the "projection" op's kernel (see the module); a weight reordered for
    oneDNN (`kernels.prepack`: `Packed`, `Rows`) by the "prepacked_linear" op's.

    into: a workspace role (`kernels.workspace`): where a workspace is active and the kernel is torch's product (no
    bias, x 2-D on the CPU), the product is written into the role's buffer and that buffer is returned (oneDNN's
    primitive has no output argument)."""
    if isinstance(weight, (Packed, Rows)):
        return PREPACKED(x, weight, bias)
    return PROJECTION(x, weight, bias, into)


def linear_act_reference(x: torch.Tensor, weight, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    if isinstance(weight, (Packed, Rows)):         # reordered for oneDNN: the plain weight
        weight = weight.plain()
    return activation(act)(F.linear(x, weight, bias))


def _prepacked(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return on_bucketed_rows(lambda rows: weight(rows, bias), x)


def _device_dtype(x: torch.Tensor, *args) -> tuple[torch.device, torch.dtype]:
    return x.device, x.dtype


LINEAR = registry.op("linear", _device_dtype)
# bf16 (oneDNN builds its bf16 primitives only on some CPUs): the activation in the primitive's epilogue, a bias too
ONEDNN = LINEAR.register("oneDNN linear with fused post-ops", _fused, accepts=_fused_accepts, dtypes=(torch.bfloat16,),
                         available=lambda: onednn_available(torch.bfloat16), priority=10)
# float32, and bf16 activations without an epilogue: the product on this machine's faster library ("projection"),
# then the activation
THEN_ACTIVATION = LINEAR.register("linear, then the activation", _then_activation, devices=("cpu",),
                                  dtypes=(torch.float32, torch.bfloat16), priority=5)
TORCH_LINEAR = LINEAR.register("torch linear", linear_act_reference, devices=("cpu", "cuda"))
PROJECTION = registry.op("projection", _device_dtype)
ONEDNN_PROJECTION = PROJECTION.register("oneDNN linear", _primitive, accepts=_primitive_accepts,
                                       dtypes=(torch.float32,), available=_projection_available, priority=10)
ONEDNN_BIAS = PROJECTION.register("oneDNN linear for layers with a bias, torch linear without", _bias_primitive,
                                  accepts=_primitive_accepts, dtypes=(torch.bfloat16,),
                                  available=lambda: onednn_available(torch.bfloat16), priority=10)
TORCH_PROJECTION = PROJECTION.register("torch linear", projection_torch, devices=("cpu", "cuda"))
# a weight reordered for oneDNN's primitive by the first forward (`kernels.prepack`, which packs only where it runs)
PREPACKED = registry.op("prepacked_linear", _device_dtype)
PACKED = PREPACKED.register("oneDNN prepacked weight", _prepacked)
