"""Checkpoint names -> the engine's fused parameter layout.

The engine keeps, per Gated DeltaNet layer, one input projection (qkv | z | b | a); per attention
layer one qkv projection (query+gate | key | value); per MLP one gate|up projection; the patch
embedding as a matrix. Checkpoint names are this module's business only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from pixeltriage.config import FULL, ModelConfig
from pixeltriage.errors import CheckpointError
from pixeltriage.weights.reader import TensorSource
from pixeltriage.weights.pages import drop_file_pages

HEAD_DECISION = "head.decision.weight"
HEAD_CANDIDATE = "head.candidate.weight"
# engine fields kept in float32 whatever the engine dtype (the decay parameters feed exp/softplus; the head is fp32)
FLOAT32_FIELDS = frozenset({"A_log", "dt_bias", "head_decision", "head_candidate"})


LAYOUTS = {
    # name: (text prefix, vision prefix)
    "transformers": ("model.language_model.", "model.visual."),
    "valen": ("backbone.language_model.", "backbone.visual."),
}


def detect_layout(names: list[str], where: Path) -> str:
    """Which key layout the checkpoint uses: transformers' (`model.language_model.*`, `model.visual.*`) or
    Valen's export (`backbone.language_model.*`, `backbone.visual.*`). Both or neither -> CheckpointError."""
    found = [layout for layout, (text, _) in LAYOUTS.items() if any(n.startswith(text) for n in names)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(f"{where}: no backbone tensors found (expected keys under 'model.language_model.' "
                              "(transformers) or 'backbone.language_model.' (Valen export))")
    raise CheckpointError(f"{where}: ambiguous layout: holds both 'model.language_model.*' and "
                          "'backbone.language_model.*' tensors")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or its name in DTYPES, as the torch dtype; ValueError naming the choices otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def field_dtype(field: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine keeps field `field` in, for an engine of `dtype`."""
    return torch.float32 if field in FLOAT32_FIELDS else dtype


@dataclass
class LinearAttentionWeights:
    in_proj: torch.Tensor   # [conv_dim + value_dim + 2 * Hv, hidden]: qkv | z | b | a
    conv: torch.Tensor      # [conv_dim, kernel]
    A_log: torch.Tensor     # [Hv]
    dt_bias: torch.Tensor   # [Hv]
    norm: torch.Tensor      # [value_head_dim]
    out_proj: torch.Tensor  # [hidden, value_dim]


@dataclass
class FullAttentionWeights:
    qkv: torch.Tensor       # [heads * 2 * head_dim + 2 * kv_heads * head_dim, hidden]; per head: query | gate
    q_norm: torch.Tensor    # [head_dim]
    k_norm: torch.Tensor    # [head_dim]
    o_proj: torch.Tensor    # [hidden, heads * head_dim]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: LinearAttentionWeights | FullAttentionWeights
    gate_up: torch.Tensor   # [2 * ffn, hidden]: gate | up
    down: torch.Tensor      # [hidden, ffn]


@dataclass
class TextWeights:
    embed: torch.Tensor     # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor      # [hidden]


@dataclass
class VisionBlockWeights:
    norm1_w: torch.Tensor
    norm1_b: torch.Tensor
    qkv_w: torch.Tensor     # [3 * hidden, hidden]
    qkv_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


@dataclass
class VisionWeights:
    patch_w: torch.Tensor   # [hidden, channels * temporal * patch * patch]
    patch_b: torch.Tensor
    pos_embed: torch.Tensor  # [num_position_embeddings, hidden]
    blocks: list[VisionBlockWeights]
    merger_norm_w: torch.Tensor
    merger_norm_b: torch.Tensor
    merger_fc1_w: torch.Tensor  # [hidden * merge^2, hidden * merge^2]
    merger_fc1_b: torch.Tensor
    merger_fc2_w: torch.Tensor  # [out_hidden, hidden * merge^2]
    merger_fc2_b: torch.Tensor


@dataclass
class EngineWeights:
    text: TextWeights
    vision: VisionWeights
    head_decision: torch.Tensor   # [D, hidden]
    head_candidate: torch.Tensor  # [D, hidden]


class _Taker:
    """Takes tensors by checkpoint name, checks shapes, casts to the engine dtype."""

    def __init__(self, source: TensorSource, dtype: torch.dtype, device: torch.device):
        self.source, self.dtype, self.device = source, dtype, device

    def __call__(self, name: str, shape: tuple[int, ...], field: str = "") -> torch.Tensor:
        """The tensor at the engine dtype, or at the dtype the layout keeps engine field `field` in."""
        tensor, out = self._take(name, shape, field)
        if out.data_ptr() != tensor.data_ptr():
            drop_file_pages([tensor])            # a copy now: the file's pages of it are not read again
        return out

    def cat(self, names: list[str], shapes: list[tuple[int, ...]], dim: int = 0) -> torch.Tensor:
        taken = [self._take(n, s) for n, s in zip(names, shapes)]
        out = torch.cat([part for _, part in taken], dim=dim)
        drop_file_pages([tensor for tensor, _ in taken])     # as read, all fused into `out`: those views of the file
        return out

    def _take(self, name: str, shape: tuple[int, ...], field: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """(the tensor as read, that tensor at the engine dtype or field `field`'s: itself where no cast is due)."""
        tensor = self.source.take(name, shape)
        if not tensor.is_floating_point():
            raise CheckpointError(f"{self.source.file_of(name)}: tensor '{name}' has dtype {tensor.dtype}, "
                                  "expected a floating point dtype")
        return tensor, tensor.to(device=self.device, dtype=field_dtype(field, self.dtype))


def build_engine_weights(source: TensorSource, cfg: ModelConfig, head_dim: int, dtype: torch.dtype,
                         device: torch.device, text_prefix: str = "model.language_model.",
                         vision_prefix: str = "model.visual.") -> EngineWeights:
    """Consume every backbone and head tensor of `source` into the engine layout (then `source.finish()`)."""
    take = _Taker(source, dtype, device)
    text = _text_weights(take, cfg, text_prefix)
    vision = _vision_weights(take, cfg, vision_prefix)
    hidden = cfg.text.hidden_size
    head_d = take(HEAD_DECISION, (head_dim, hidden), field="head_decision")
    head_c = take(HEAD_CANDIDATE, (head_dim, hidden), field="head_candidate")
    source.finish()
    return EngineWeights(text, vision, head_d, head_c)


def _text_weights(take: _Taker, cfg: ModelConfig, prefix: str) -> TextWeights:
    t = cfg.text
    h, ffn = t.hidden_size, t.intermediate_size
    layers = []
    for i, kind in enumerate(t.layer_types):
        p = f"{prefix}layers.{i}."
        if kind == FULL:
            nh, nkv, hd = t.num_attention_heads, t.num_key_value_heads, t.head_dim
            a = p + "self_attn."
            attn = FullAttentionWeights(
                qkv=take.cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                             [(nh * 2 * hd, h), (nkv * hd, h), (nkv * hd, h)]),
                q_norm=take(a + "q_norm.weight", (hd,)),
                k_norm=take(a + "k_norm.weight", (hd,)),
                o_proj=take(a + "o_proj.weight", (h, nh * hd)),
            )
        else:
            a = p + "linear_attn."
            hv = t.linear_num_value_heads
            attn = LinearAttentionWeights(
                in_proj=take.cat(
                    [a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight", a + "in_proj_a.weight"],
                    [(t.linear_conv_dim, h), (t.linear_value_dim, h), (hv, h), (hv, h)]),
                conv=take(a + "conv1d.weight", (t.linear_conv_dim, 1, t.linear_conv_kernel_dim)).squeeze(1),
                A_log=take(a + "A_log", (hv,), field="A_log"),
                dt_bias=take(a + "dt_bias", (hv,), field="dt_bias"),
                norm=take(a + "norm.weight", (t.linear_value_head_dim,)),
                out_proj=take(a + "out_proj.weight", (h, t.linear_value_dim)),
            )
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (h,)),
            post_norm=take(p + "post_attention_layernorm.weight", (h,)),
            attn=attn,
            gate_up=take.cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(ffn, h), (ffn, h)]),
            down=take(p + "mlp.down_proj.weight", (h, ffn)),
        ))
    return TextWeights(
        embed=take(prefix + "embed_tokens.weight", (t.vocab_size, h)),
        layers=layers,
        norm=take(prefix + "norm.weight", (h,)),
    )


def _vision_weights(take: _Taker, cfg: ModelConfig, prefix: str) -> VisionWeights:
    v = cfg.vision
    h, ffn, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    blocks = []
    for i in range(v.depth):
        p = f"{prefix}blocks.{i}."
        blocks.append(VisionBlockWeights(
            norm1_w=take(p + "norm1.weight", (h,)), norm1_b=take(p + "norm1.bias", (h,)),
            qkv_w=take(p + "attn.qkv.weight", (3 * h, h)), qkv_b=take(p + "attn.qkv.bias", (3 * h,)),
            proj_w=take(p + "attn.proj.weight", (h, h)), proj_b=take(p + "attn.proj.bias", (h,)),
            norm2_w=take(p + "norm2.weight", (h,)), norm2_b=take(p + "norm2.bias", (h,)),
            fc1_w=take(p + "mlp.linear_fc1.weight", (ffn, h)), fc1_b=take(p + "mlp.linear_fc1.bias", (ffn,)),
            fc2_w=take(p + "mlp.linear_fc2.weight", (h, ffn)), fc2_b=take(p + "mlp.linear_fc2.bias", (h,)),
        ))
    patch_shape = (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return VisionWeights(
        patch_w=take(prefix + "patch_embed.proj.weight", patch_shape).reshape(h, -1),
        patch_b=take(prefix + "patch_embed.proj.bias", (h,)),
        pos_embed=take(prefix + "pos_embed.weight", (v.num_position_embeddings, h)),
        blocks=blocks,
        merger_norm_w=take(prefix + "merger.norm.weight", (h,)),
        merger_norm_b=take(prefix + "merger.norm.bias", (h,)),
        merger_fc1_w=take(prefix + "merger.linear_fc1.weight", (merged, merged)),
        merger_fc1_b=take(prefix + "merger.linear_fc1.bias", (merged,)),
        merger_fc2_w=take(prefix + "merger.linear_fc2.weight", (v.out_hidden_size, merged)),
        merger_fc2_b=take(prefix + "merger.linear_fc2.bias", (v.out_hidden_size,)),
    )


# -- EngineWeights <-> flat tensors (the packed file's layout) --------------------------------------------

_CLASSES = {cls.__name__: cls for cls in (EngineWeights, TextWeights, LayerWeights, LinearAttentionWeights,
                                           FullAttentionWeights, VisionWeights, VisionBlockWeights)}


def flatten(obj, prefix: str = "") -> tuple[dict[str, torch.Tensor], object]:
    """(name -> tensor in a fixed order, a JSON-able structure that `unflatten` turns back into `obj`)."""
    if isinstance(obj, torch.Tensor):
        return {prefix.rstrip("."): obj}, None
    if callable(getattr(obj, "plain", None)):      # a weight kept in another layout (kernels.prepack): its plain copy
        return {prefix.rstrip("."): obj.plain()}, None
    if isinstance(obj, list):
        tensors, items = {}, []
        for i, item in enumerate(obj):
            t, s = flatten(item, f"{prefix}{i}.")
            tensors.update(t)
            items.append(s)
        return tensors, {"list": items}
    if dataclasses.is_dataclass(obj):
        name = type(obj).__name__
        if name not in _CLASSES:
            raise TypeError(f"cannot pack a {name}")
        tensors, fields = {}, {}
        for f in dataclasses.fields(obj):
            t, s = flatten(getattr(obj, f.name), f"{prefix}{f.name}.")
            tensors.update(t)
            fields[f.name] = s
        return tensors, {"class": name, "fields": fields}
    raise TypeError(f"cannot pack a {type(obj).__name__}")


def unflatten(structure, tensors: dict[str, torch.Tensor], prefix: str = "", source: str = ""):
    if structure is None:
        name = prefix.rstrip(".")
        if name not in tensors:
            raise CheckpointError(f"{source}: packed file lacks tensor '{name}'")
        return tensors[name]
    if not isinstance(structure, dict):
        raise CheckpointError(f"{source}: malformed 'structure' metadata at '{prefix}'")
    if "list" in structure:
        return [unflatten(s, tensors, f"{prefix}{i}.", source) for i, s in enumerate(structure["list"])]
    cls = _CLASSES.get(structure.get("class"))
    if cls is None:
        raise CheckpointError(f"{source}: unknown class {structure.get('class')!r} in 'structure' metadata")
    fields = structure.get("fields", {})
    expected = [f.name for f in dataclasses.fields(cls)]
    if sorted(fields) != sorted(expected):
        raise CheckpointError(f"{source}: {cls.__name__} fields {sorted(fields)} differ from {sorted(expected)}")
    return cls(**{k: unflatten(fields[k], tensors, f"{prefix}{k}.", source) for k in expected})


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's raw bytes (on the CPU, contiguous), for hashing and writing."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
