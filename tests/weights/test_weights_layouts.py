"""Checkpoint layouts and PEFT LoRA adapters.

Tolerances: a merged LoRA layer against the hand-written LoRA forward x W^T + s x A^T B^T: max-abs relative
error <= 1e-6 (float32); the whole forward with a merged adapter against peft's unmerged forward in
transformers: max-abs relative error <= 1e-4 (the parity bar); identical layouts: identical scores.
"""
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pixeltriage import Scorer
from pixeltriage.errors import CheckpointError
from pixeltriage.bench.transformers_baseline import force_transformers_torch_path, transformers_hidden
from reference import episode, rel_err, tiny_config, write_reference_checkpoint

force_transformers_torch_path()

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "ckpt"
    write_reference_checkpoint(path, CONFIG, seed=3, residual_scale=8 ** -0.5)
    return path


def write_adapter(directory, tensors: dict, r=4, alpha=8, **config):
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["down_proj"], "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None}
    cfg.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    return directory


def lora_pair(out_features, in_features, r, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, in_features, generator=g) * 0.3, torch.randn(out_features, r, generator=g) * 0.3


DOWN = "model.language_model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_layer_equals_the_hand_written_lora_forward(base, tmp_path, rslora):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=0)
    adapter = write_adapter(tmp_path / "adapter", {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b},
                            use_rslora=rslora)
    w = load_file(str(base / "model.safetensors"))[f"{DOWN}.weight"]
    merged = Scorer.load(base, adapter=adapter).weights.text.layers[0].down
    s = 8 / (4 ** 0.5 if rslora else 4)
    x = torch.randn(37, ffn, generator=torch.Generator().manual_seed(1))
    expected = x @ w.T + s * (x @ a.T) @ b.T
    assert ((x @ merged.T - expected).abs().max() / expected.abs().max()).item() <= 1e-6
    # every other layer untouched
    plain = Scorer.load(base)
    assert torch.equal(plain.weights.text.layers[1].down, Scorer.load(base, adapter=adapter).weights.text.layers[1].down)


def test_adapter_from_peft_matches_peft_forward(base, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(base, torch_dtype=torch.float32).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", "gate_proj", "up_proj", "down_proj", "attn.qkv", "attn.proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=["merger"],
                             init_lora_weights=False)
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():                                   # a trained-looking merger, not a copy of the base
        for p in wrapped.base_model.model.model.visual.merger.parameters():
            p.add_(0.05 * torch.randn_like(p))
    wrapped.save_pretrained(tmp_path / "adapter")
    scorer = Scorer.load(base, adapter=tmp_path / "adapter")
    state = scorer.pack(*episode())
    rows = state.head_positions()
    ours = scorer.hidden_states(state, rows)
    with torch.no_grad():
        ref = transformers_hidden(wrapped.base_model.model, state)[rows]
    assert rel_err(ours, ref) <= 1e-4
    assert rel_err(Scorer.load(base).hidden_states(state, rows), ref) > 1e-3    # the adapter really changed it


def test_adapter_inside_the_checkpoint_directory_is_used(base, tmp_path):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=2)
    ckpt = shutil.copytree(base, tmp_path / "ckpt")
    write_adapter(ckpt, {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b})
    ep = episode()
    explicit = Scorer.load(base, adapter=ckpt).score(*ep)
    assert Scorer.load(ckpt).score(*ep) == explicit
    assert Scorer.load(base).score(*ep) != explicit


def to_valen(src, dst):
    """Rewrite a transformers-layout checkpoint as Valen's export: backbone.* keys, the head in the same shard."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    renamed = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()}
    renamed.update(load_file(str(dst / "decision_head.safetensors")))
    (dst / "decision_head.safetensors").unlink()
    save_file(renamed, str(dst / "model.safetensors"))
    return dst


def test_valen_layout_gives_identical_scores(base, tmp_path):
    valen = to_valen(base, tmp_path / "valen")
    ep = episode()
    assert Scorer.load(valen).score(*ep) == Scorer.load(base).score(*ep)


def test_adapter_written_for_one_layout_applies_to_the_other(base, tmp_path):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=5)
    adapter = write_adapter(tmp_path / "adapter", {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b})
    valen = to_valen(base, tmp_path / "valen")
    ep = episode()
    assert Scorer.load(valen, adapter=adapter).score(*ep) == Scorer.load(base, adapter=adapter).score(*ep)


def test_both_layouts_at_once_is_ambiguous(base, tmp_path):
    ckpt = shutil.copytree(base, tmp_path / "ckpt")
    extra = {"backbone.language_model.norm.weight": torch.zeros(CONFIG["text_config"]["hidden_size"])}
    save_file(extra, str(ckpt / "extra.safetensors"))
    index = {"weight_map": {**{k: "model.safetensors" for k in load_file(str(ckpt / "model.safetensors"))},
                            **{k: "extra.safetensors" for k in extra}}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ambiguous layout"):
        Scorer.load(ckpt)


@pytest.mark.parametrize("damage,message", [
    (lambda t: {"model.language_model.layers.0.mlp.nothing_here.lora_A.weight": t["A"],
                "model.language_model.layers.0.mlp.nothing_here.lora_B.weight": t["B"]}, "matches no tensor"),
    (lambda t: {f"{DOWN}.lora_A.weight": t["A"][:2], f"{DOWN}.lora_B.weight": t["B"]}, "rank-r product"),
    (lambda t: {f"{DOWN}.lora_A.weight": t["A"][:, :5], f"{DOWN}.lora_B.weight": t["B"]}, "expects a base of shape"),
    (lambda t: {f"{DOWN}.lora_A.weight": t["A"]}, "no lora_B"),
    (lambda t: {}, "holds no LoRA"),
])
def test_bad_adapters_are_errors(base, tmp_path, damage, message):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=0)
    adapter = write_adapter(tmp_path / "adapter", damage({"A": a, "B": b}))
    with pytest.raises(CheckpointError, match=message):
        Scorer.load(base, adapter=adapter)


def test_rank_in_config_must_match_the_tensors(base, tmp_path):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=0)
    adapter = write_adapter(tmp_path / "adapter", {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b}, r=8)
    with pytest.raises(CheckpointError, match="has rank 4, adapter_config.json says r = 8"):
        Scorer.load(base, adapter=adapter)


def test_fan_in_fan_out_is_reset_for_linear_layers_like_peft(base, tmp_path, caplog):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=0)
    pair = {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b}
    plain = Scorer.load(base, adapter=write_adapter(tmp_path / "plain", pair))
    with caplog.at_level(logging.WARNING):
        flagged = Scorer.load(base, adapter=write_adapter(tmp_path / "flagged", pair, fan_in_fan_out=True))
    assert "fan_in_fan_out=true ignored" in caplog.text
    assert torch.equal(plain.weights.text.layers[0].down, flagged.weights.text.layers[0].down)


def test_unsupported_adapter_kinds(base, tmp_path):
    hidden, ffn = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["intermediate_size"]
    a, b = lora_pair(hidden, ffn, 4, seed=0)
    pair = {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b}
    with pytest.raises(CheckpointError, match="DoRA"):
        Scorer.load(base, adapter=write_adapter(tmp_path / "dora", pair, use_dora=True))
    with pytest.raises(CheckpointError, match="peft_type 'IA3'"):
        Scorer.load(base, adapter=write_adapter(tmp_path / "ia3", pair, peft_type="IA3"))
    with pytest.raises(CheckpointError, match="adapter config not found"):
        Scorer.load(base, adapter=tmp_path / "nowhere")
