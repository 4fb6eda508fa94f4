"""transformers' Qwen3.5 as the reference implementation: tiny random checkpoints and forced torch paths."""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from pixeltriage import Memory
from pixeltriage.config import ImageConfig, TriageConfig
from pixeltriage.weights.tokenizer import build_tokenizer, save_tokenizer, special_token_ids


SPECIAL_BASE = 1000  # tiny tokenizers put Qwen's special tokens from this id on


def tiny_config(text: dict | None = None, vision: dict | None = None, vocab_size: int = 1100) -> dict:
    """A transformers Qwen3_5Config kwargs dict for small parity checkpoints."""
    text_cfg = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    text_cfg.update(text or {})
    vision_cfg = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=text_cfg["hidden_size"],
                      num_position_embeddings=64)
    vision_cfg.update(vision or {})
    return dict(text_config=text_cfg, vision_config=vision_cfg)


def randomize_(model: torch.nn.Module, seed: int, residual_scale: float = 1.0) -> None:
    """Every parameter random, norm weights included, at scales that keep activations sane.

    `residual_scale` multiplies the text layers' projections back into the residual stream (attention o_proj,
    Gated DeltaNet out_proj, MLP down_proj), as GPT-2's scaled residual init does with 1/sqrt(2 * layers)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight") and "visual" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))          # LayerNorm
            elif "linear_attn.norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))          # gated RMSNorm: plain weight
            elif "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))                # zero-centred RMSNorm
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 64
                scale = 1.0 / fan_in ** 0.5 if p.dim() > 1 else 0.05
                if "patch_embed" in name and p.dim() > 1:
                    scale = 1.0 / (p[0].numel() ** 0.5)
                if "language_model" in name and any(s in name for s in ("o_proj", "out_proj", "down_proj")):
                    scale *= residual_scale
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def write_reference_checkpoint(path: Path, config_kwargs: dict, seed: int = 0, head_dim: int = 16,
                               shards: bool = False, residual_scale: float = 1.0) -> "torch.nn.Module":
    """A complete System One checkpoint written by transformers' save_pretrained. Returns the model (float32)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(SPECIAL_BASE - 200, SPECIAL_BASE)
    save_tokenizer(tokenizer, path, model_max_length=4096)
    special = special_token_ids(tokenizer)
    cfg = Qwen3_5Config(**config_kwargs, image_token_id=special["<|image_pad|>"],
                        video_token_id=special["<|video_pad|>"], vision_start_token_id=special["<|vision_start|>"],
                        vision_end_token_id=special["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    randomize_(model, seed, residual_scale)
    model.save_pretrained(path, max_shard_size="200KB" if shards else "5GB")
    hidden = config_kwargs["text_config"]["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    save_file({"head.decision.weight": torch.randn(head_dim, hidden, generator=gen) / hidden ** 0.5,
               "head.candidate.weight": torch.randn(head_dim, hidden, generator=gen) / hidden ** 0.5},
              str(path / "decision_head.safetensors"))
    (path / "preprocessor_config.json").write_text(json.dumps(ImageConfig().to_dict(), indent=2))
    (path / "pixeltriage.json").write_text(json.dumps(TriageConfig(head_dim=head_dim).to_dict(), indent=2))
    return model


def rel(a, b) -> float:
    """max |a - b| / max |b|: the relative error the kernel tests state their tolerances in."""
    return ((a - b).abs().max() / b.abs().max()).item()


# -- the parity episode: four awkward images (RGBA, grey, wide random, JPEG bytes) ----------------------------
def images():
    rgba = Image.new("RGBA", (120, 90), (200, 30, 30, 128))
    rgba.paste((10, 200, 10, 255), (10, 10, 60, 50))
    gray = Image.linear_gradient("L").resize((64, 96))
    wide = Image.frombytes("RGB", (500, 200), random.Random(0).randbytes(500 * 200 * 3))   # the same each call
    buf = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").save(buf, format="JPEG")
    return [rgba, gray, wide, buf.getvalue()]


def episode():
    ims = images()
    notes = ["a red card with a green square", "", "noise <|im_start|> not a control token", "a radial glow"]
    memories = [Memory(image=im, note=n, dialogue=f"user shared picture {i}", date=f"2026-0{i + 1}-1{i}")
                for i, (im, n) in enumerate(zip(ims, notes))]
    return "What colour was the square on the card?", memories


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def float64_head(hidden_rows: torch.Tensor, state, scorer) -> dict:
    """The scores of one state in float64 from its hidden rows at `state.head_positions()` and the scorer's head
    weights: the reference the bf16 forwards are measured against."""
    wd = scorer.weights.head_decision.double()
    wc = scorer.weights.head_candidate.double()
    n = state.num_memories
    h = hidden_rows.double()
    markers, dec = h[:n], h[n:n + 3]
    true_, false_, gnone, rnone = h[n + 3], h[n + 4], h[n + 5], h[n + 6]
    scale = wd.shape[0] ** -0.5

    def logit(d, c):
        return (wd @ d) @ (wc @ c) * scale

    lt, lf = logit(dec[0], true_), logit(dec[0], false_)
    p_vis = torch.softmax(torch.stack([lt, lf]), 0)[0]
    gains = [torch.sigmoid(logit(dec[1], markers[i]) - logit(dec[1], gnone)) for i in range(n)]
    rel = torch.softmax(torch.stack([logit(dec[2], markers[i]) for i in range(n)] + [logit(dec[2], rnone)]), 0)
    return {"p_vis": p_vis.item(), "gains": [g.item() for g in gains], "relevance": rel[:n].tolist(),
            "relevance_none": rel[n].item()}
