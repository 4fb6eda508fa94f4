"""`pixeltriage bench roofline`: the ideal GPU time of System One, stage by stage, at a device's published peaks.

    pixeltriage bench roofline --device-spec a100|h100|h200 [--preset 2b] [--memories N] [--questions B] [--json]

Each stage of one forward (the profiler's stages: vision, gated_delta, attention, mlp, head; plus embed and the
host-to-device copies) gets
- its FLOPs: `pixeltriage.bench.models.flops.system_one_flops`, unchanged (the tests hold the two equal);
- its bytes of HBM traffic (`stage_traffic`): every weight it reads, once per call, in the checkpoint's dtype;
  every activation each of its kernels reads and writes, once per kernel (the residual stream in float32, the rest
  in the model dtype); the keys and values of the attention layers, read once by a flash kernel; the gated delta
  rule as flash-linear-attention 0.6's chunked forward moves it (per-chunk states written and read back, the
  chunk-local matrices); the vision tower's weights and activations; the head's rows and weights;
- compute time = FLOPs / dense bf16 peak, memory time = bytes / HBM bandwidth, and the roofline: their max.

From these: the predicted p50 of one question (a batch of one, with a stated per-kernel launch cost, eager and with
the decoder replayed from a CUDA graph, with the vision tower run and with its features cached), and the questions/s
a batch of B packed questions reaches (the decoder's weights read once per forward, compute growing with B).
The prediction is the ideal: the achievable fraction of peak is NOT folded in; `python -m
pixeltriage.bench.gpu_check` measures and prints measured against predicted.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from pixeltriage.bench.models.flops import (CHUNK_SIZE, SYSTEM_ONE_HEAD_DIM, Flops, StateShape, paper_state,
                                     shape_from_config, system_one_config, system_one_flops)
from pixeltriage.config import FULL, ModelConfig, TextConfig, VisionConfig
from pixeltriage.engine.state import EXTRA_HEAD_ROWS


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's published peaks: dense bf16 tensor-core TFLOP/s (no 2:4 sparsity), HBM TB/s, and the host link
    (PCIe, one direction) GB/s; `source`: the datasheet (docs/performance.md, "GPU roofline")."""

    name: str
    bf16_tflops: float
    hbm_tb_s: float
    host_gb_s: float
    source: str


A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                  "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
H100_DATASHEET = "https://www.nvidia.com/en-us/data-center/h100/"
H200_DATASHEET = "https://www.nvidia.com/en-us/data-center/h200/"

# The datasheets print bf16 "with sparsity" (A100 624, H100/H200 1,979); dense is half. Host link: PCIe Gen4 x16
# (A100, 64 GB/s both directions) and Gen5 x16 (H100/H200 SXM, 128 GB/s both directions), one direction here.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("A100-SXM4-80GB", 312.0, 2.039, 32.0, A100_DATASHEET),
    "h100": DeviceSpec("H100-SXM5-80GB", 989.0, 3.35, 64.0, H100_DATASHEET),
    "h200": DeviceSpec("H200-SXM-141GB", 989.0, 4.8, 64.0, H200_DATASHEET),
}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICE_SPECS:
        raise ValueError(f"unknown device spec {name!r}; known: {sorted(DEVICE_SPECS)}")
    return DEVICE_SPECS[name]


def spec_key_for_gpu(gpu_name: str) -> str | None:
    """The DEVICE_SPECS key of a CUDA device name (torch.cuda.get_device_name), None for a GPU whose peaks differ
    from every listed one (PCIe and NVL boards, the 40 GB A100: other clocks or memory)."""
    name = gpu_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100"
    if "A100" in name and "80GB" in name:
        return "a100"
    return None


# ---- the stated assumptions ----------------------------------------------------------------------------------------

EAGER_LAUNCH_US = 5.0    # per kernel of an eager forward: torch's dispatch and the launch, not hidden behind the GPU
GRAPH_LAUNCH_US = 1.0    # per kernel inside a replayed CUDA graph (the gap between kernels)
# Kernels per call of the CUDA branch: the ATen ops that launch a kernel (views and allocations left out) and the
# Triton launches, counted per profiler stage with the branch run on CPU tensors under the tests' emulation
# (tests/triton_interpreter.py: PIXELTRIAGE_EMULATE_CUDA=1, TRITON_INTERPRET=1) on the tiny preset, float32, the
# interpreter's own argument copies left out; bf16 adds the casts around beta and the decay (~6 per Gated DeltaNet
# layer). Per layer and per block they do not depend on the sizes. gpu_check counts the real number on a GPU.
KERNELS = {
    "embed": 6,                  # gather, cast, the visual rows' scatter, the residual copy, rotary tables
    "linear_attention": 36,      # input norm, projections, beta/decay, conv, fla's 8 (l2norm x2, cumsum, KK^T,
                                 # solve, w/u, states, output), gated norm, output projection
    "full_attention": 40,        # input norm, projections, q/k norm + partial rotary, SDPA, gate, output
    "ffn": 12,                   # post norm (add + RMSNorm in torch ops), gate_up, SiLU * up, down
    "vision_block": 25,          # 2 LayerNorms with their adds, qkv, rotary, SDPA, proj, fc1 + GELU, fc2
    "vision_fixed": 35,          # patch embedding, interpolated position embeddings, rotary tables, merger
    "head": 15,                  # row indices to the device, gathers, the fused head, the results' copy back
}
# what a forward of several questions splits into on CUDA (Scorer.max_batch_tokens there)
CUDA_MAX_BATCH_TOKENS = 32768
TEXT_TOKENS_PER_MEMORY = 128     # a memory's note, dialogue and date (the paper's state: 10 memories, 1280 tokens)
FLOAT32 = 4
INT64 = 8

ASSUMPTIONS = (
    "ideal: every stage runs at the device's dense bf16 tensor-core peak or its HBM bandwidth, whichever binds "
    "(the achievable fraction of peak is NOT folded in; gpu_check measures it)",
    "every FLOP of pixeltriage.bench.models.flops counts at the tensor-core peak (the delta rule's triangular solves "
    "too)",
    "HBM traffic: each weight read once per call in the checkpoint dtype; each kernel reads its inputs and writes its "
    "outputs once (residual stream float32, other activations in the model dtype: q, k, v into the gated delta rule "
    "in bf16, grouped heads as they are); attention K and V read once per layer (flash); the gated delta rule as "
    "fla 0.6's chunked forward (per-chunk states written and read back); caches (L2) not credited",
    "stages add up: no overlap between kernels",
    f"launch cost: {EAGER_LAUNCH_US:g} us per kernel eager (not hidden behind GPU work), {GRAPH_LAUNCH_US:g} us per "
    "kernel in a replayed CUDA graph; kernels per layer counted on the CUDA branch emulated on the CPU (KERNELS; "
    "gpu_check counts them on the GPU)",
    "CUDA graphs: the decoder replays the whole padded bucket (T rounded up to the bucket, every row of the last "
    "layer); vision, embedding and head stay eager; graphs replay single-question forwards only",
    "cached vision features: no vision stage, the features copied host to device instead of the pixels",
    "packed questions: one varlen forward per Scorer.max_batch_tokens on CUDA; the vision tower runs once per "
    "question (its weights read per question), the decoder's and head's weights once per forward",
    "host-to-device copies at the PCIe link's one-way peak, not overlapped",
)


# ---- bytes ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Traffic:
    """Bytes one stage moves through HBM: parameters read, activations (and KV, recurrent states) read and written."""

    weights: int = 0
    activations: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.weights + other.weights, self.activations + other.activations)

    def __mul__(self, times: int) -> "Traffic":
        return Traffic(self.weights * times, self.activations * times)

    __rmul__ = __mul__

    @property
    def total(self) -> int:
        return self.weights + self.activations


def weight_parameters(model: ModelConfig, head_dim: int) -> dict[str, int]:
    """Parameters each stage reads, from the config alone: what a checkpoint stores per stage ("embed" is the whole
    table, of which a forward gathers its tokens' rows; an LM head, which System One never reads, is left out)."""
    t, v = model.text, model.vision
    h = t.hidden_size
    linear = (t.linear_conv_dim + t.linear_value_dim + 2 * t.linear_num_value_heads) * h \
        + t.linear_conv_dim * t.linear_conv_kernel_dim + 2 * t.linear_num_value_heads \
        + t.linear_value_head_dim + h * t.linear_value_dim + h                      # ... + input norm
    q_width, kv_width = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    full = (2 * q_width + 2 * kv_width) * h + 2 * t.head_dim + h * q_width + h \
        + (q_width + 2 * kv_width if t.attention_bias else 0)
    ffn = 3 * t.intermediate_size * h + h                                            # ... + post-attention norm
    n_full = sum(kind == FULL for kind in t.layer_types)
    vh, merged = v.hidden_size, v.hidden_size * v.merge_unit
    block = 4 * vh + 3 * vh * vh + 3 * vh + vh * vh + vh + 2 * v.intermediate_size * vh + v.intermediate_size + vh
    vision = vh * v.patch_dim + vh + v.num_position_embeddings * vh + v.depth * block \
        + 2 * vh + merged * merged + merged + v.out_hidden_size * merged + v.out_hidden_size
    return {"embed": t.vocab_size * h, "vision": vision, "linear_attention": (t.num_layers - n_full) * linear,
            "full_attention": n_full * full, "ffn": t.num_layers * ffn, "head": h + 2 * head_dim * h}


def _add_norm(rows: int, width: int, act: int, with_delta: bool) -> int:
    """(residual += delta) then norm: the float32 residual read (and written back with a delta), the delta read, the
    normed rows written in the model dtype."""
    return rows * width * (FLOAT32 + act + (FLOAT32 + act if with_delta else 0))


def gated_delta_traffic(t: TextConfig, tokens: int, rows: int, chunks: int, act: int) -> int:
    """One Gated DeltaNet layer's activations past its input norm: projections, beta and decay, conv, fla's chunked
    rule, the gated norm and the output projection at `rows`."""
    h, hk, hv = t.hidden_size, t.linear_num_key_heads, t.linear_num_value_heads
    dk, dv, conv, value = t.linear_key_head_dim, t.linear_value_head_dim, t.linear_conv_dim, t.linear_value_dim
    q_bytes, v_bytes, gate_bytes = tokens * hk * dk * act, tokens * hv * dv * act, tokens * hv * FLOAT32
    chunk_rows = tokens * hv * CHUNK_SIZE                                     # per token, a row of its chunk's matrix
    states = chunks * hv * dk * dv * act                                      # one [dk, dv] state per chunk and head
    return (tokens * h * act + tokens * (conv + value) * act                  # in_proj: qkv | z
            + tokens * h * act + 2 * 2 * gate_bytes                           # b, a in float32; beta, decay
            + 2 * tokens * conv * act                                         # causal conv + SiLU
            + 2 * 2 * q_bytes                                                 # fla: l2norm of q and k
            + 2 * gate_bytes                                                  # decay cumsum
            + q_bytes + 2 * gate_bytes + chunk_rows * FLOAT32                 # beta K K^T -> A (float32)
            + chunk_rows * FLOAT32 + chunk_rows * act                         # triangular solve -> A^-1
            + q_bytes + v_bytes + chunk_rows * act + 2 * gate_bytes + tokens * hv * (dk + dv) * act   # w, u
            + q_bytes + tokens * hv * (dk + dv) * act + gate_bytes + states + v_bytes  # states, v_new
            + 2 * q_bytes + v_bytes + states + gate_bytes + v_bytes           # output
            + rows * h * FLOAT32 * 2 * (rows != tokens)                       # the residual's rows (last layer)
            + rows * hv * dv * act + rows * value * act * 2                   # gated norm at the rows
            + rows * value * act + rows * h * act)                            # out_proj


def attention_traffic(t: TextConfig, tokens: int, rows: int, act: int) -> int:
    """One gated attention layer's activations past its input norm, queries and outputs at `rows`."""
    h = t.hidden_size
    q_width, kv_width = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    kv = tokens * kv_width * act
    return (tokens * h * act + (rows * h * act if rows != tokens else 0)       # x (and its rows) into qkv
            + rows * 2 * q_width * act + 2 * kv                               # q | gate, k, v out
            + 2 * rows * q_width * act + 2 * kv                               # q and k: norm + rotary
            + rows * q_width * act + 2 * kv + rows * q_width * act            # flash attention: q, K, V in, o out
            + 3 * rows * q_width * act                                        # o *= sigmoid(gate)
            + rows * q_width * act + rows * h * act                           # o_proj
            + rows * h * FLOAT32 * 2 * (rows != tokens))                      # the residual's rows (last layer)


def mlp_traffic(t: TextConfig, rows: int, act: int) -> int:
    """Post norm and SwiGLU MLP at `rows`."""
    h, ffn = t.hidden_size, t.intermediate_size
    return (_add_norm(rows, h, act, True) + rows * h * act + rows * 2 * ffn * act
            + rows * 2 * ffn * act + rows * ffn * act + rows * ffn * act + rows * h * act)


def vision_traffic(v: VisionConfig, patches: int, act: int) -> int:
    """The vision tower's activations over `patches` patches (one call)."""
    if not patches:
        return 0
    vh, ffn, merged_rows = v.hidden_size, v.intermediate_size, patches // v.merge_unit
    merged = vh * v.merge_unit
    embed = patches * v.patch_dim * (FLOAT32 + 2 * act) + patches * vh * (act + 2 * FLOAT32)  # cast, GEMM, + pos
    block = (2 * _add_norm(patches, vh, act, True)
             + patches * vh * act + patches * 3 * vh * act                  # qkv
             + 2 * patches * 2 * vh * act                                   # rotary on q and k
             + patches * 3 * vh * act + patches * vh * act                  # attention
             + 2 * patches * vh * act                                       # proj
             + patches * vh * act + patches * ffn * act                     # fc1 + GELU
             + patches * ffn * act + patches * vh * act)                    # fc2
    merger = (_add_norm(patches, vh, act, True) + 2 * merged_rows * merged * act
              + merged_rows * merged * act + merged_rows * v.out_hidden_size * act)
    # the first block's first norm has no delta to add
    return embed + v.depth * block - patches * vh * (FLOAT32 + act) + merger


@dataclass(frozen=True)
class Forward:
    """One forward's inputs: `questions` states of `tokens` tokens each (`image_tokens` of them visual rows, from
    `patches` patches), `rows` head rows each; `padded_tokens`: the decoder's length per question when a CUDA graph
    replays a bucket (every row of its last layer then computed)."""

    questions: int
    tokens: int
    image_tokens: int
    patches: int
    rows: int
    cached_vision: bool = False
    padded_tokens: int | None = None


def stage_traffic(model: ModelConfig, head_dim: int, fwd: Forward, weight_bytes: int = 2,
                  act_bytes: int | None = None) -> dict[str, Traffic]:
    """Bytes each stage moves in one forward (HBM), and the host-to-device copies ("host_to_device", over PCIe)."""
    t, v = model.text, model.vision
    act = weight_bytes if act_bytes is None else act_bytes
    params = weight_parameters(model, head_dim)
    b, h = fwd.questions, t.hidden_size
    tokens = b * (fwd.padded_tokens or fwd.tokens)
    rows = tokens if fwd.padded_tokens else b * fwd.rows
    chunks = b * -(-(fwd.padded_tokens or fwd.tokens) // CHUNK_SIZE)
    visual = b * fwd.image_tokens
    out: dict[str, Traffic] = {}
    out["host_to_device"] = Traffic(activations=b * (4 * fwd.tokens * INT64 + (
        fwd.image_tokens * h * act if fwd.cached_vision else fwd.patches * v.patch_dim * FLOAT32)))
    out["embed"] = Traffic(weights=b * fwd.tokens * h * weight_bytes,             # the tokens' rows of the table
                           activations=b * fwd.tokens * h * FLOAT32 + visual * h * (act + FLOAT32)
                           + tokens * h * 2 * FLOAT32                           # the residual stream's copy
                           + (tokens * h * 3 * FLOAT32 if fwd.padded_tokens else 0))   # graph buffers in and out
    out["vision"] = Traffic() if fwd.cached_vision or not fwd.patches else \
        Traffic(params["vision"] * weight_bytes, vision_traffic(v, fwd.patches, act)) * b
    lin, full, ffn = 0, 0, 0
    last = t.num_layers - 1
    for i, kind in enumerate(t.layer_types):
        r = rows if i == last else tokens
        norm = _add_norm(tokens, h, act, with_delta=i > 0)
        if kind == FULL:
            full += norm + attention_traffic(t, tokens, r, act)
        else:
            lin += norm + gated_delta_traffic(t, tokens, r, chunks, act)
        ffn += mlp_traffic(t, r, act)
    ffn += rows * h * (2 * FLOAT32 + act)                                      # the last MLP's output added
    out["linear_attention"] = Traffic(params["linear_attention"] * weight_bytes, lin)
    out["full_attention"] = Traffic(params["full_attention"] * weight_bytes, full)
    out["ffn"] = Traffic(params["ffn"] * weight_bytes, ffn)
    head_rows = b * fwd.rows
    out["head"] = Traffic(params["head"] * weight_bytes, head_rows * h * 2 * FLOAT32 + head_rows * head_dim * FLOAT32)
    return out


# ---- times ---------------------------------------------------------------------------------------------------------

# the profiler's stage names (pixeltriage.engine.profiling) of the FLOP model's parts
PROFILER_STAGE = {"vision": "vision", "linear_attention": "gated_delta", "full_attention": "attention",
                  "ffn": "mlp", "head": "head", "embed": "embed", "host_to_device": "host_to_device"}
STAGE_ORDER = ("host_to_device", "embed", "vision", "linear_attention", "full_attention", "ffn", "head")


def stage_flops(model: ModelConfig, state: StateShape, head_dim: int, cached_vision: bool = False,
                padded_tokens: int | None = None) -> dict[str, Flops]:
    """flops.system_one_flops of one question, with embed and host_to_device at 0; a graph replay's decoder over
    `padded_tokens` tokens with its whole last layer."""
    parts = system_one_flops(model, state, head_dim, cached_vision=cached_vision)
    if padded_tokens is not None:
        padded = StateShape(text_tokens=padded_tokens - state.image_tokens(model.vision.merge_unit),
                            image_grids=state.image_grids)
        decoder = system_one_flops(model, padded, head_dim, cached_vision=True, head_rows_only=False)
        parts.update({k: decoder[k] for k in ("linear_attention", "full_attention", "ffn") if k in decoder})
    return {"host_to_device": Flops(), "embed": Flops(), **parts}


def forward_stages(model: ModelConfig, state: StateShape, spec: DeviceSpec, head_dim: int = SYSTEM_ONE_HEAD_DIM,
                   questions: int = 1, cached_vision: bool = False, padded_tokens: int | None = None,
                   weight_bytes: int = 2) -> dict[str, dict]:
    """Per stage of one forward of `questions` copies of `state`: FLOPs, bytes, compute / memory / roofline ms."""
    merge = model.vision.merge_unit
    patches = sum(t * h * w for t, h, w in state.image_grids)
    fwd = Forward(questions, state.num_tokens(merge), state.image_tokens(merge), patches,
                  len(state.image_grids) + EXTRA_HEAD_ROWS, cached_vision, padded_tokens)
    flops = stage_flops(model, state, head_dim, cached_vision, padded_tokens)
    traffic = stage_traffic(model, head_dim, fwd, weight_bytes)
    out = {}
    for name in STAGE_ORDER:
        if name not in flops:
            continue
        f, tr = flops[name].total * questions, traffic[name]
        compute_ms = f / (spec.bf16_tflops * 1e12) * 1e3
        rate = spec.host_gb_s * 1e9 if name == "host_to_device" else spec.hbm_tb_s * 1e12
        memory_ms = tr.total / rate * 1e3
        out[name] = {"stage": PROFILER_STAGE[name], "gflop": f / 1e9, "weight_mb": tr.weights / 1e6,
                     "activation_mb": tr.activations / 1e6, "compute_ms": compute_ms, "memory_ms": memory_ms,
                     "roofline_ms": max(compute_ms, memory_ms),
                     "bound": ("pcie" if name == "host_to_device" else
                               "compute" if compute_ms >= memory_ms else "memory")}
    return out


def kernel_count(model: ModelConfig, questions: int = 1, cached_vision: bool = False) -> dict[str, int]:
    """Estimated kernels of one forward: decoder (what a graph replays) and the rest (eager in both modes)."""
    t = model.text
    n_full = sum(kind == FULL for kind in t.layer_types)
    decoder = (n_full * KERNELS["full_attention"] + (t.num_layers - n_full) * KERNELS["linear_attention"]
               + t.num_layers * KERNELS["ffn"])
    vision = 0 if cached_vision else KERNELS["vision_fixed"] + model.vision.depth * KERNELS["vision_block"]
    return {"decoder": decoder, "other": questions * (KERNELS["embed"] + vision) + KERNELS["head"]}


def bucket_for(tokens: int, buckets: tuple[int, ...] | None = None) -> int | None:
    """The CUDA-graph bucket a state of `tokens` tokens replays (engine.graphs.DEFAULT_BUCKETS)."""
    from pixeltriage.engine.graphs import DEFAULT_BUCKETS

    return next((b for b in (buckets or DEFAULT_BUCKETS) if b >= tokens), None)


def predict(model: ModelConfig, state: StateShape, spec: DeviceSpec, head_dim: int = SYSTEM_ONE_HEAD_DIM,
            questions: int = 1, cached_vision: bool = False, cuda_graphs: bool = False,
            max_batch_tokens: int = CUDA_MAX_BATCH_TOKENS, bucket: int | None = None,
            weight_bytes: int = 2) -> dict:
    """Predicted time of `questions` copies of `state` scored together (Scorer.score_states): its forwards (split
    at max_batch_tokens), each the sum of its stages' rooflines plus its launches. cuda_graphs: a single question
    whose state fits a bucket replays the decoder (`bucket`: its length; default the engine's buckets)."""
    merge = model.vision.merge_unit
    tokens = state.num_tokens(merge)
    per_forward = max(1, max_batch_tokens // max(tokens, 1))
    sizes = [min(per_forward, questions - i) for i in range(0, questions, per_forward)]
    padded = None
    if cuda_graphs and questions == 1:
        padded = bucket or bucket_for(tokens)
    total_ms, roofline_ms, launch_ms, forwards = 0.0, 0.0, 0.0, []
    for b in sizes:
        stages = forward_stages(model, state, spec, head_dim, b, cached_vision, padded, weight_bytes)
        kernels = kernel_count(model, b, cached_vision)
        launches = (kernels["decoder"] * (GRAPH_LAUNCH_US if padded else EAGER_LAUNCH_US)
                    + kernels["other"] * EAGER_LAUNCH_US) / 1e3
        roof = sum(s["roofline_ms"] for s in stages.values())
        forwards.append({"questions": b, "roofline_ms": roof, "launch_ms": launches, "ms": roof + launches,
                         "kernels": kernels, "stages": stages})
        total_ms += roof + launches
        roofline_ms += roof
        launch_ms += launches
    return {"questions": questions, "cached_vision": cached_vision, "cuda_graphs": padded is not None,
            "bucket": padded, "ms": total_ms, "ms_per_question": total_ms / questions,
            "questions_per_s": questions / total_ms * 1e3, "roofline_ms": roofline_ms, "launch_ms": launch_ms,
            "forwards": forwards}


def default_state(model: ModelConfig, memories: int, text_tokens: int | None = None) -> StateShape:
    """The paper's state: `memories` 336-px thumbnails (100 visual tokens each at the 2b shape) and
    TEXT_TOKENS_PER_MEMORY text tokens per memory (at least one memory's worth, for the question and template)."""
    text = TEXT_TOKENS_PER_MEMORY * max(1, memories) if text_tokens is None else text_tokens
    return paper_state(memories, text_tokens=text, vision=shape_from_config(model).vision)


def roofline_report(spec_name: str, preset: str = "2b", memories: int = 10, questions: int = 16,
                    text_tokens: int | None = None) -> dict:
    """Everything `bench roofline` prints, as one JSON-able dict."""
    spec = device_spec(spec_name)
    model = system_one_config(preset)
    state = default_state(model, memories, text_tokens)
    merge = model.vision.merge_unit
    params = weight_parameters(model, SYSTEM_ONE_HEAD_DIM)
    one = predict(model, state, spec)
    p50 = {mode: {vision: predict(model, state, spec, cached_vision=cached, cuda_graphs=graphs)[key]
                  for vision, cached in (("vision", False), ("cached_vision", True))}
           for mode, graphs, key in (("eager", False, "ms"), ("cuda_graphs", True, "ms"),
                                     ("no_launch_cost", False, "roofline_ms"))}
    packed = {vision: {k: v for k, v in predict(model, state, spec, questions=questions, cached_vision=cached).items()
                       if k != "forwards"}
              for vision, cached in (("vision", False), ("cached_vision", True))}
    return {
        "device": {"spec": spec_name, "name": spec.name, "bf16_dense_tflops": spec.bf16_tflops,
                   "hbm_tb_s": spec.hbm_tb_s, "host_gb_s": spec.host_gb_s, "source": spec.source},
        "preset": preset, "dtype": "bfloat16", "memories": memories,
        "state": {"tokens": state.num_tokens(merge), "image_tokens": state.image_tokens(merge),
                  "text_tokens": state.text_tokens, "head_rows": memories + EXTRA_HEAD_ROWS},
        "parameters": {"read_per_forward": sum(v for k, v in params.items() if k != "embed"),
                       "embedding_table": params["embed"]},
        "stages": one["forwards"][0]["stages"],
        "kernels": one["forwards"][0]["kernels"],
        "p50_ms": p50,
        "packed": {"questions": questions, **packed},
        "assumptions": {"eager_launch_us": EAGER_LAUNCH_US, "graph_launch_us": GRAPH_LAUNCH_US,
                        "max_batch_tokens": CUDA_MAX_BATCH_TOKENS, "notes": list(ASSUMPTIONS)},
    }


def format_report(r: dict) -> str:
    d, s = r["device"], r["state"]
    lines = [f"roofline: {r['preset']} ({r['dtype']}) on {d['name']}: {d['bf16_dense_tflops']:g} TFLOP/s dense bf16, "
             f"{d['hbm_tb_s']:g} TB/s HBM, {d['host_gb_s']:g} GB/s host link (peaks: {d['source']})",
             f"state: {r['memories']} memories, {s['tokens']} tokens ({s['image_tokens']} visual), "
             f"{s['head_rows']} head rows; {r['parameters']['read_per_forward'] / 1e9:.3f} B parameters read per "
             "forward",
             "",
             "one question, vision run, eager:",
             f"{'stage':<18}{'GFLOP':>9}{'weights MB':>12}{'activ. MB':>11}{'compute ms':>12}{'memory ms':>11}"
             f"{'roofline ms':>13}  bound"]
    for name, st in r["stages"].items():
        lines.append(f"{name:<18}{st['gflop']:>9.1f}{st['weight_mb']:>12.1f}{st['activation_mb']:>11.1f}"
                     f"{st['compute_ms']:>12.3f}{st['memory_ms']:>11.3f}{st['roofline_ms']:>13.3f}  {st['bound']}")
    total = sum(st["roofline_ms"] for st in r["stages"].values())
    k = r["kernels"]
    lines += [f"{'sum':<18}{sum(st['gflop'] for st in r['stages'].values()):>9.1f}{'':>46}{total:>13.3f}",
              f"kernels (estimated): decoder {k['decoder']}, other {k['other']}",
              "",
              "predicted p50 per question (batch 1):",
              f"{'':<16}{'vision run':>12}{'cached vision':>15}"]
    for mode, row in r["p50_ms"].items():
        lines.append(f"{mode:<16}{row['vision']:>10.2f}ms{row['cached_vision']:>13.2f}ms")
    p = r["packed"]
    lines += ["", f"{p['questions']} questions packed (Scorer.score_states):"]
    for vision in ("vision", "cached_vision"):
        x = p[vision]
        lines.append(f"  {vision:<14} {x['ms']:.2f} ms ({x['ms_per_question']:.2f} ms/question, of which launches "
                     f"{x['launch_ms']:.2f} ms): {x['questions_per_s']:.1f} questions/s")
    a = r["assumptions"]
    lines += ["", "assumptions:"] + [f"- {note}" for note in a["notes"]]
    return "\n".join(lines)


def run_roofline(args: argparse.Namespace) -> int:
    report = roofline_report(args.device_spec, args.preset, args.memories, args.questions, args.text_tokens)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def ratio(measured_ms: float | None, predicted_ms: float | None) -> float | None:
    """measured / predicted (how many times the ideal the measurement took); None when either is missing."""
    if not measured_ms or not predicted_ms or math.isnan(measured_ms):
        return None
    return measured_ms / predicted_ms
