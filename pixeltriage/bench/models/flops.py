"""Analytic prefill FLOPs of System One and of the answering models, from their configs.

Conventions:
- A multiply-add is 2 FLOPs. Only products are counted: linear layers, attention's QK^T and PV,
  the gated delta rule's chunk products and convolutions (`Flops.matmul`, the quantity
  torch.utils.flop_counter.FlopCounterMode reports) and the delta rule's triangular solves
  (`Flops.solve`, which FlopCounterMode does not see). Norms, activations, gates, softmax and
  rotary embeddings are left out (under 1% of any forward here).
- Causal attention counts half of the dense T x T products (`causal="half"`, 2*T^2*H*d for
  QK^T + PV): the work of a causal flash kernel, up to its diagonal blocks. `causal="dense"`
  counts the full rectangle that masked eager attention computes (4*T^2*H*d). Vision attention
  is bidirectional and always dense, per image (Qwen3.5) or per window (Qwen2.5-VL).
- The gated delta rule is counted as transformers' `torch_chunk_gated_delta_rule` runs it, with
  chunks of C = 64 over the sequence padded to a multiple of C, per value head (queries and keys
  are repeated to the value heads): KK^T and QK^T (C x C per chunk), the UT transform as two
  unit-triangular solves (C(C-1) FLOPs per right-hand column), then per chunk the state reads
  (W S, Q S), the intra-chunk product A V and the state write K^T V. fla's kernels form the
  inverse of the C x C system and multiply by it (about 2C^2 per column instead of C(C-1)); the
  difference is under 1% of a layer.
- Prefill of an answering call computes the LM head on the last row only; System One has no LM
  head, its decision head projects the 3 decision rows and 4 + n candidate rows to D.
- An image is resized as the model's processor does (`smart_resize`), one frame (t = 1).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pixeltriage.config import FULL, LINEAR, ModelConfig
from pixeltriage.delivery.profiles import CHECKPOINTS, answering_model
from pixeltriage.delivery.rules import GridRule
from pixeltriage.engine.patches import smart_resize  # the Qwen processors' resize, one implementation
from pixeltriage.engine.state import EXTRA_HEAD_ROWS
from pixeltriage.media.policy import THUMBNAIL_SIDE

# The delta rule's chunk in the analytic count: transformers' 64, the same work definition for every implementation.
# The engine's C path runs 32-token chunks, whose intra-chunk products are half as large: at bench-small ~5 of the
# forward's 824 GFLOP fewer than counted (0.6%), so its achieved rate reads that much high.
CHUNK_SIZE = 64
CAUSAL_CONVENTIONS = ("half", "dense")

Grid = tuple[int, int, int]  # (t, h, w) in patches


@dataclass(frozen=True)
class Flops:
    matmul: int = 0  # dense products (what FlopCounterMode counts)
    solve: int = 0   # triangular solves of the gated delta rule's UT transform

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(self.matmul + other.matmul, self.solve + other.solve)

    def __mul__(self, times: int) -> "Flops":
        return Flops(self.matmul * times, self.solve * times)

    __rmul__ = __mul__

    @property
    def total(self) -> int:
        return self.matmul + self.solve


def total(parts: Mapping[str, Flops]) -> Flops:
    return sum(parts.values(), Flops())


@dataclass(frozen=True)
class VisionShape:
    """A Qwen vision tower and its processor's resize limits."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    gated_mlp: bool                   # SwiGLU gate/up/down (Qwen2.5-VL) or fc1/fc2 (Qwen3.5)
    min_pixels: int
    max_pixels: int
    temporal_patch_size: int = 2
    in_channels: int = 3
    window_size: int = 0              # window attention side in pixels; 0: every block sees the whole image
    full_attention_blocks: tuple[int, ...] = ()

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.window_size and self.window_size % self.factor:
            raise ValueError(f"vision window_size {self.window_size} not a multiple of patch*merge {self.factor}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.spatial_merge_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


@dataclass(frozen=True)
class LanguageShape:
    """A Qwen decoder: full attention layers, optionally Gated DeltaNet layers, dense or MoE FFNs."""

    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_output_gate: bool       # Qwen3.5: q_proj also emits a sigmoid gate of the output's width
    intermediate_size: int = 0        # dense SwiGLU FFN
    num_experts: int = 0              # MoE FFN: routed experts ...
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # ... plus one gated shared expert
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self):
        for kind in self.layer_types:
            if kind not in (LINEAR, FULL):
                raise ValueError(f"unknown layer type {kind!r}")
        if (self.intermediate_size > 0) == (self.num_experts > 0):
            raise ValueError("a decoder needs exactly one of intermediate_size (dense) or num_experts (MoE)")
        if LINEAR in self.layer_types and min(self.linear_num_key_heads, self.linear_num_value_heads,
                                              self.linear_key_head_dim, self.linear_value_head_dim,
                                              self.linear_conv_kernel_dim) <= 0:
            raise ValueError("linear_attention layers need linear_* head counts, head dims and conv kernel")

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim


@dataclass(frozen=True)
class ModelShape:
    name: str
    language: LanguageShape
    vision: VisionShape
    answering: str | None = None      # an answering checkpoint's model in pixeltriage.delivery.profiles


@dataclass(frozen=True)
class StateShape:
    """One forward's input: `text_tokens` counts every token that is not an image placeholder
    (vision start/end markers included); each image adds (t*h*w)/merge^2 placeholders."""

    text_tokens: int
    image_grids: tuple[Grid, ...] = field(default_factory=tuple)

    def image_tokens(self, merge_unit: int) -> int:
        return sum(t * h * w for t, h, w in self.image_grids) // merge_unit

    def num_tokens(self, merge_unit: int) -> int:
        return self.text_tokens + self.image_tokens(merge_unit)


def image_grid(width: int, height: int, vision: VisionShape) -> Grid:
    """(t, h, w) patch grid of one image after the processor's resize."""
    h, w = smart_resize(height, width, vision.factor, vision.min_pixels, vision.max_pixels)
    return 1, h // vision.patch_size, w // vision.patch_size


def visual_tokens(width: int, height: int, vision: VisionShape) -> int:
    t, h, w = image_grid(width, height, vision)
    return t * h * w // vision.merge_unit


# ---- vision tower ------------------------------------------------------------------------------


def _window_lengths(grid: Grid, vision: VisionShape) -> list[int]:
    """Patches per attention window of one image, as Qwen2.5-VL partitions its merged grid."""
    t, h, w = grid
    merge = vision.spatial_merge_size
    side = vision.window_size // vision.factor  # window side in merged tokens

    def segments(n: int) -> list[int]:
        return [min(side, n - start) for start in range(0, n, side)]

    return [a * b * vision.merge_unit for _ in range(t) for a in segments(h // merge) for b in segments(w // merge)]


def vision_flops(vision: VisionShape, grids: Sequence[Grid]) -> Flops:
    """Patch embedding, blocks and merger over every image. grids: (t, h, w) in patches."""
    return total(vision_parts(vision, grids))


VISION_PARTS = ("matmuls", "attention")


def vision_parts(vision: VisionShape, grids: Sequence[Grid]) -> dict[str, Flops]:
    """`vision_flops` in its VISION_PARTS: the linear layers (patch embedding, qkv, proj, MLP, merger) and the
    attention's QK^T and PV, as the profiler times them apart."""
    hidden = vision.hidden_size
    patches = sum(t * h * w for t, h, w in grids)
    if not patches:
        return {name: Flops() for name in VISION_PARTS}
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    embed = 2 * patches * patch_dim * hidden
    mlp_mats = 3 if vision.gated_mlp else 2
    per_patch = 2 * (4 * hidden * hidden + mlp_mats * hidden * vision.intermediate_size)  # qkv, proj, MLP
    blocks = vision.depth * patches * per_patch
    frame_sq = sum(t * (h * w) ** 2 for t, h, w in grids)  # full attention: each frame attends to itself
    if vision.window_size:
        window_sq = sum(n * n for g in grids for n in _window_lengths(g, vision))
        full = len(vision.full_attention_blocks)
        attention = 4 * hidden * (full * frame_sq + (vision.depth - full) * window_sq)
    else:
        attention = 4 * hidden * vision.depth * frame_sq
    merged_dim = vision.merge_unit * hidden
    merger = 2 * (patches // vision.merge_unit) * (merged_dim * merged_dim + merged_dim * vision.out_hidden_size)
    return {"matmuls": Flops(matmul=embed + blocks + merger), "attention": Flops(matmul=attention)}


# ---- decoder -----------------------------------------------------------------------------------


def full_attention_flops(lang: LanguageShape, num_tokens: int, causal: str = "half",
                         query_rows: int | None = None) -> Flops:
    """One full attention layer: projections plus QK^T and PV over `num_tokens` rows.

    query_rows: the layer's output is wanted at these many rows only (the engine's last layer, see
    `decoder_forward(rows=...)`): keys and values over every row, queries, gates, scores against every key (a
    masked dense rectangle, whatever `causal` says) and the output projection at the rows."""
    if causal not in CAUSAL_CONVENTIONS:
        raise ValueError(f"causal must be one of {CAUSAL_CONVENTIONS}, found {causal!r}")
    t, h = num_tokens, lang.hidden_size
    q_width = lang.num_attention_heads * lang.head_dim
    kv_width = lang.num_key_value_heads * lang.head_dim
    q_out = 2 * q_width if lang.attention_output_gate else q_width
    r = t if query_rows is None else query_rows                   # rows with queries, gates and outputs
    projections = 2 * t * h * 2 * kv_width + 2 * r * h * q_out + 2 * r * q_width * h
    scores = 4 * r * t * q_width  # QK^T and PV over the full r x T rectangle, all query heads
    if query_rows is None and causal == "half":
        scores //= 2
    return Flops(matmul=projections + scores)


def linear_attention_flops(lang: LanguageShape, num_tokens: int, chunk_size: int = CHUNK_SIZE,
                           output_rows: int | None = None) -> Flops:
    """One Gated DeltaNet layer: projections, causal conv1d and the chunked gated delta rule.
    output_rows: the output projection at these many rows only (the engine's last layer)."""
    return total(linear_attention_parts(lang, num_tokens, chunk_size, output_rows))


LINEAR_PARTS = ("projections", "conv", "recurrence")


def linear_attention_parts(lang: LanguageShape, num_tokens: int, chunk_size: int = CHUNK_SIZE,
                           output_rows: int | None = None) -> dict[str, Flops]:
    """`linear_attention_flops` in its LINEAR_PARTS: the projections (in_proj's four and out_proj), the causal
    conv1d, and the chunked gated delta rule (its products and solves), as the profiler times them apart."""
    t, h = num_tokens, lang.hidden_size
    heads = lang.linear_num_value_heads
    dk, dv, c = lang.linear_key_head_dim, lang.linear_value_head_dim, chunk_size
    value_width = heads * dv
    in_width = lang.linear_conv_dim + value_width + 2 * heads  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    projections = 2 * t * h * in_width + 2 * (t if output_rows is None else output_rows) * value_width * h
    conv = 2 * t * lang.linear_conv_dim * lang.linear_conv_kernel_dim
    chunks = -(-t // c)
    intra = 2 * c * c * dk * 2 + 2 * c * c * dv          # KK^T, QK^T, A @ V
    state = 3 * 2 * c * dk * dv                          # W @ S, Q @ S, K^T @ V
    solve = c * (c - 1) * (dk + dv)                      # UT transform of V and of the decayed K
    return {"projections": Flops(matmul=projections), "conv": Flops(matmul=conv),
            "recurrence": Flops(matmul=heads * chunks * (intra + state), solve=heads * chunks * solve)}


def ffn_flops(lang: LanguageShape, num_tokens: int) -> Flops:
    """Dense SwiGLU, or MoE with its router, the active routed experts and the gated shared expert."""
    t, h = num_tokens, lang.hidden_size
    if lang.num_experts == 0:
        return Flops(matmul=2 * t * 3 * h * lang.intermediate_size)
    router = 2 * t * h * lang.num_experts
    routed = 2 * t * lang.experts_per_token * 3 * h * lang.expert_intermediate_size
    shared = 2 * t * 3 * h * lang.shared_expert_intermediate_size + 2 * t * h  # expert + its sigmoid gate
    return Flops(matmul=router + routed + shared)


def language_flops(lang: LanguageShape, num_tokens: int, causal: str = "half",
                   output_rows: int | None = None, split: bool = False) -> dict[str, Flops]:
    """Every decoder layer over `num_tokens` rows (no embedding, no final norm, no head).

    output_rows: the decoder's output is wanted at these many rows only, so the last layer computes everything
    after its token mixer's recurrence or keys and values at those rows (`decoder_forward(rows=...)`).
    split: the Gated DeltaNet layers as "linear_projections", "linear_conv" and "linear_recurrence"
    (`linear_attention_parts`) in place of one "linear_attention"; the same total."""
    linear_names = [f"linear_{p}" for p in LINEAR_PARTS] if split else ["linear_attention"]
    parts = {"full_attention": Flops()}
    if LINEAR in lang.layer_types:
        parts.update((name, Flops()) for name in linear_names)
    parts["ffn"] = Flops()
    last = len(lang.layer_types) - 1
    for i, kind in enumerate(lang.layer_types):
        rows = output_rows if i == last else None                 # the last layer at the rows, when asked
        if kind == FULL:
            parts["full_attention"] += full_attention_flops(lang, num_tokens, causal, query_rows=rows)
        elif split:
            for name, f in linear_attention_parts(lang, num_tokens, output_rows=rows).items():
                parts[f"linear_{name}"] += f
        else:
            parts["linear_attention"] += linear_attention_flops(lang, num_tokens, output_rows=rows)
        parts["ffn"] += ffn_flops(lang, num_tokens if rows is None else rows)
    return parts


def lm_head_flops(lang: LanguageShape, rows: int = 1) -> Flops:
    return Flops(matmul=2 * rows * lang.hidden_size * lang.vocab_size)


def decision_head_flops(hidden_size: int, head_dim: int, num_memories: int) -> Flops:
    """Valen's bilinear head: 3 decision rows and 2 + 2 + n candidate rows projected to D, then
    2 binary, 2 none and 2n marker logits (D-dot products)."""
    projections = 2 * hidden_size * head_dim * (3 + 4 + num_memories)
    logits = 2 * head_dim * (4 + 2 * num_memories)
    return Flops(matmul=projections + logits)


# ---- whole forwards ----------------------------------------------------------------------------


def shape_from_config(cfg: ModelConfig, name: str = "system-one", min_pixels: int = 65536,
                      max_pixels: int = 16777216) -> ModelShape:
    """A Qwen3.5 checkpoint's shape. The pixel limits default to Qwen3.5's preprocessor_config.json."""
    t, v = cfg.text, cfg.vision
    language = LanguageShape(
        hidden_size=t.hidden_size, vocab_size=t.vocab_size, layer_types=t.layer_types,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, attention_output_gate=True, intermediate_size=t.intermediate_size,
        linear_num_key_heads=t.linear_num_key_heads, linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim, linear_value_head_dim=t.linear_value_head_dim,
        linear_conv_kernel_dim=t.linear_conv_kernel_dim)
    vision = VisionShape(
        depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_heads,
        patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size, out_hidden_size=v.out_hidden_size,
        gated_mlp=False, min_pixels=min_pixels, max_pixels=max_pixels,
        temporal_patch_size=v.temporal_patch_size, in_channels=v.in_channels)
    return ModelShape(name=name, language=language, vision=vision)


def state_shape(state, merge_unit: int) -> StateShape:
    """The shape of an engine `State` (pixeltriage.engine.state): its text tokens and image grids."""
    grids = tuple(tuple(g) for g in state.image_grid_thw.tolist())
    image_tokens = StateShape(text_tokens=0, image_grids=grids).image_tokens(merge_unit)
    return StateShape(text_tokens=state.num_tokens - image_tokens, image_grids=grids)


def scorer_flops(scorer, state, cached_vision: bool = False, split: bool = False) -> dict[str, Flops]:
    """`system_one_flops` of a loaded `Scorer`'s model for one of its `State`s."""
    return system_one_flops(scorer.model_config, state_shape(state, scorer.model_config.vision.merge_unit),
                            scorer.triage_config.head_dim, cached_vision=cached_vision, split=split)


def system_one_flops(model: ModelConfig | ModelShape, state: StateShape, head_dim: int = 256,
                     cached_vision: bool = False, causal: str = "half",
                     num_memories: int | None = None, head_rows_only: bool = True,
                     split: bool = False) -> dict[str, Flops]:
    """One System One forward: vision tower (skipped when its outputs are cached), decoder, decision head.

    num_memories: marker rows scored by the head; defaults to one per image.
    head_rows_only: the decoder's last layer at the head's n + EXTRA_HEAD_ROWS rows only, as the engine runs it;
    False counts the whole last layer, as a forward that returns every row (transformers') does.
    split: the parts as the profiler times them apart (`bench cpu`): the vision tower as "vision_matmuls" and
    "vision_attention" (`vision_parts`), the Gated DeltaNet layers in three (`language_flops`); the same total.
    """
    shape = shape_from_config(model) if isinstance(model, ModelConfig) else model
    merge_unit = shape.vision.merge_unit
    memories = len(state.image_grids) if num_memories is None else num_memories
    if split:
        vision = vision_parts(shape.vision, () if cached_vision else state.image_grids)
        parts = {f"vision_{name}": f for name, f in vision.items()}
    else:
        parts = {"vision": Flops() if cached_vision else vision_flops(shape.vision, state.image_grids)}
    parts.update(language_flops(shape.language, state.num_tokens(merge_unit), causal,
                                output_rows=memories + EXTRA_HEAD_ROWS if head_rows_only else None, split=split))
    parts["head"] = decision_head_flops(shape.language.hidden_size, head_dim, memories)
    return parts


def prefill_flops(model: ModelShape, text_tokens: int, image_sizes: Iterable[tuple[int, int]] = (),
                  causal: str = "half", lm_head_rows: int = 1) -> dict[str, Flops]:
    """Prefill of one answering call: the vision tower on the images given as (width, height) px and the
    decoder over the text plus their visual tokens, each image wrapped in vision start/end markers."""
    grids = tuple(image_grid(w, h, model.vision) for w, h in image_sizes)
    state = StateShape(text_tokens=text_tokens + 2 * len(grids), image_grids=grids)
    parts = {"vision": vision_flops(model.vision, grids)}
    parts.update(language_flops(model.language, state.num_tokens(model.vision.merge_unit), causal))
    parts["lm_head"] = lm_head_flops(model.language, lm_head_rows)
    return parts


# ---- the profiler's stages ---------------------------------------------------------------------

# The profiler's stages of one forward, in order, and what each holds. The vision tower is two: its attention
# (per image, "vision_attention") timed apart from its linear layers, norms and rotary ("vision"). The Gated
# DeltaNet layer's kernel call is timed apart from the norms, projections and gates around it ("gated_delta"); the
# C kernels do the conv + SiLU and the recurrence in one pass per head and report the conv's share of it
# ("delta_conv", the profiler's part), the rest being "delta_rule". Where no conv part is reported (the torch path,
# PIXELTRIAGE_NATIVE=0, whose conv and recurrence calls sit inside the registry's one kernel function) "delta_rule"
# holds both, and its row says so (`UNSPLIT_STAGES`).
PROFILER_STAGES = {
    "vision": "vision matmuls (+ norms)",
    "vision_attention": "vision attention",
    "gated_delta": "gated_delta projections",
    "delta_conv": "delta conv + SiLU",
    "delta_rule": "delta_rule (recurrence)",
    "attention": "attention",
    "mlp": "mlp",
    "head": "head",
}
UNSPLIT_STAGES = {"delta_rule": "delta_rule (conv + recurrence)"}
# Each part of the FLOP model (scorer_flops(..., split=True)) in exactly one stage
STAGE_OF_PART = {"vision_matmuls": "vision", "vision_attention": "vision_attention",
                 "linear_projections": "gated_delta", "linear_conv": "delta_conv", "linear_recurrence": "delta_rule",
                 "full_attention": "attention", "ffn": "mlp", "head": "head"}


def profiler_stage_flops(parts: Mapping[str, Flops], conv_apart: bool = True) -> dict[str, int]:
    """FLOPs per stage of `PROFILER_STAGES` from the FLOP model's parts (`Flops`); a part no stage holds is a
    KeyError. conv_apart False (the run's kernels reported no "delta_conv"): the conv's FLOPs in "delta_rule", no
    "delta_conv" stage."""
    out = dict.fromkeys(PROFILER_STAGES, 0)
    for name, f in parts.items():
        stage = STAGE_OF_PART[name]
        out["delta_rule" if stage == "delta_conv" and not conv_apart else stage] += f.total
    if not conv_apart:
        del out["delta_conv"]
    return out


# ---- presets -----------------------------------------------------------------------------------

# System One's backbone, Qwen/Qwen3.5-2B config.json (the fields ModelConfig reads): 24 layers, every
# 4th full attention (18 Gated DeltaNet + 6 gated attention); linear attention 16 key / 16 value heads of
# dim 128, conv kernel 4; attention 8 query / 2 KV heads of dim 256; FFN 6144; vision tower 24 blocks of
# 1024 (16 heads, FFN 4096), 16-px patches merged 2x2 into 2048.
SYSTEM_ONE_CONFIGS: dict[str, dict] = {
    "2b": {
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": {
            "vocab_size": 248320, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
            "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 16, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10]},
        },
        "vision_config": {
            "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "in_channels": 3,
            "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 2048,
            "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
        },
    },
}
SYSTEM_ONE_HEAD_DIM = 256


def system_one_config(name: str = "2b") -> ModelConfig:
    if name not in SYSTEM_ONE_CONFIGS:
        raise ValueError(f"unknown System One preset {name!r}; known: {sorted(SYSTEM_ONE_CONFIGS)}")
    return ModelConfig.from_dict(SYSTEM_ONE_CONFIGS[name], source=f"System One preset {name!r}")


def paper_state(num_memories: int = 10, thumbnail: tuple[int, int] = (THUMBNAIL_SIDE, THUMBNAIL_SIDE),
                text_tokens: int = 1280, vision: VisionShape | None = None) -> StateShape:
    """The paper's state: n memories with a 336-px thumbnail each. A 336x336 thumbnail resizes to
    320x320 (20x20 patches, 100 tokens); with 1280 other tokens, 10 memories make 2280 tokens
    (the paper: 2.2k to 2.4k)."""
    vision = vision or shape_from_config(system_one_config()).vision
    grid = image_grid(thumbnail[0], thumbnail[1], vision)
    return StateShape(text_tokens=text_tokens, image_grids=(grid,) * num_memories)


_LINEAR_3_FULL_1 = (LINEAR, LINEAR, LINEAR, FULL)


def _checkpoint_shape(checkpoint: str, language: LanguageShape, **tower) -> ModelShape:
    """An answering checkpoint's shape; its vision tower's patching and resize limits are its answering model's rule
    in the registry (pixeltriage.delivery.profiles), so the FLOP model and the delivery count the same tokens."""
    model = CHECKPOINTS[checkpoint]
    rule = answering_model(model).rule
    if not isinstance(rule, GridRule):
        raise ValueError(f"{checkpoint}: the FLOP model counts Qwen vision towers only, found {type(rule).__name__}")
    vision = VisionShape(patch_size=rule.patch_size, spatial_merge_size=rule.merge_size, min_pixels=rule.min_pixels,
                         max_pixels=rule.max_pixels, **tower)
    return ModelShape(name=checkpoint, language=language, vision=vision, answering=model)


_QWEN35_VISION = dict(  # Qwen3.5-27B and -397B-A17B: 27 blocks of 1152 (SigLIP-2 so400m shape)
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, gated_mlp=False)

# Answering checkpoints (the registry's CHECKPOINTS), public config.json values; their patching and pixel limits are
# the registry's (the checkpoints' preprocessor_config.json).
_CHECKPOINT_SHAPES: dict[str, ModelShape] = {shape.name: shape for shape in (
    # Qwen/Qwen2.5-VL-7B-Instruct. LM: 28 layers of 3584, 28 query / 4 KV heads of 128 (q/k/v biases), FFN
    # 18944, vocab 152064. ViT: 32 blocks of 1280, 16 heads, SwiGLU FFN 3420, 14-px patches merged 2x2 into
    # 3584 (one token per 28x28 px); 112-px window attention except blocks 7, 15, 23, 31.
    _checkpoint_shape(
        "qwen2.5-vl-7b",
        LanguageShape(
            hidden_size=3584, vocab_size=152064, layer_types=(FULL,) * 28, num_attention_heads=28,
            num_key_value_heads=4, head_dim=128, attention_output_gate=False, intermediate_size=18944),
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, gated_mlp=True,
        window_size=112, full_attention_blocks=(7, 15, 23, 31)),
    # Qwen/Qwen3.5-27B: 64 layers of 5120 = 16 x (3 Gated DeltaNet + 1 gated attention); attention 24 query /
    # 4 KV heads of 256; linear attention 16 key / 48 value heads of 128, conv 4; FFN 17408; vocab 248320.
    _checkpoint_shape(
        "qwen3.5-27b",
        LanguageShape(
            hidden_size=5120, vocab_size=248320, layer_types=_LINEAR_3_FULL_1 * 16, num_attention_heads=24,
            num_key_value_heads=4, head_dim=256, attention_output_gate=True, intermediate_size=17408,
            linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4),
        out_hidden_size=5120, **_QWEN35_VISION),
    # Qwen/Qwen3.5-397B-A17B: 60 layers of 4096 = 15 x (3 Gated DeltaNet + 1 gated attention); attention 32
    # query / 2 KV heads of 256; linear attention 16 key / 64 value heads of 128, conv 4; MoE of 512 experts,
    # 10 routed + 1 shared per token, all of width 1024; vocab 248320. Active decoder weights ~15B, with the
    # embedding and LM head ~17B, as the name says. The vision tower is taken to be the 27B's (the
    # larger Qwen3.5 models share it); its width into the decoder is 4096.
    _checkpoint_shape(
        "qwen3.5-397b",
        LanguageShape(
            hidden_size=4096, vocab_size=248320, layer_types=_LINEAR_3_FULL_1 * 15, num_attention_heads=32,
            num_key_value_heads=2, head_dim=256, attention_output_gate=True, num_experts=512,
            experts_per_token=10, expert_intermediate_size=1024, shared_expert_intermediate_size=1024,
            linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4),
        out_hidden_size=4096, **_QWEN35_VISION),
)}
if set(_CHECKPOINT_SHAPES) != set(CHECKPOINTS):
    raise AssertionError(f"FLOP shapes {sorted(_CHECKPOINT_SHAPES)} differ from the registry's checkpoints "
                         f"{sorted(CHECKPOINTS)} (pixeltriage.delivery.profiles)")
# the FLOP shape of each answering checkpoint, in the registry's order
ANSWERING_SHAPES: dict[str, ModelShape] = {name: _CHECKPOINT_SHAPES[name] for name in CHECKPOINTS}


def answering_shape(checkpoint: str) -> ModelShape:
    """The FLOP shape of an answering checkpoint (a name in pixeltriage.delivery.profiles.CHECKPOINTS)."""
    if checkpoint not in ANSWERING_SHAPES:
        raise ValueError(f"unknown answering checkpoint {checkpoint!r}; known: {', '.join(ANSWERING_SHAPES)}")
    return ANSWERING_SHAPES[checkpoint]
