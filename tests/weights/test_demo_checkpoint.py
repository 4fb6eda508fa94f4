import dataclasses
import json
import threading

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from pixeltriage.config import ImageConfig, ModelConfig, TriageConfig
from pixeltriage.errors import CheckpointError
from pixeltriage.weights import demo
from pixeltriage.weights.tokenizer import SPECIAL_TOKENS


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return demo.write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", "tiny", seed=0)


def test_tiny_files_and_configs(tiny):
    assert sorted(p.name for p in tiny.iterdir()) == [
        "config.json", "decision_head.safetensors", "model.safetensors", "pixeltriage.json",
        "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"]
    cfg = ModelConfig.from_file(tiny / "config.json")
    assert cfg.text.hidden_size == 64 and cfg.text.vocab_size == 1024
    assert cfg.text.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.text.linear_num_key_heads == 2 and cfg.text.linear_num_value_heads == 4
    assert cfg.text.mrope_section == (2, 1, 1) and cfg.text.rotary_dim == 8
    assert cfg.vision.out_hidden_size == 64 and cfg.vision.num_position_embeddings == 64
    assert TriageConfig.from_file(tiny / "pixeltriage.json").head_dim == 16
    image = ImageConfig.from_file(tiny / "preprocessor_config.json")
    assert image.max_pixels >= 336 * 336 and image.factor == 32
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert raw["dtype"] == "float32"


def test_transformers_loads_every_key(tiny):
    from transformers import Qwen3_5ForConditionalGeneration

    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    stored = _tensors(tiny / "model.safetensors")
    assert "lm_head.weight" in stored
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, stored[key], rtol=0, atol=0, msg=key)


def test_tied_and_sharded_layout_loads(tmp_path, monkeypatch):
    # The 2b layout (tied embeddings, no lm_head.weight, several shards) on tiny shapes.
    monkeypatch.setitem(demo.PRESETS, "tiny-tied", dataclasses.replace(demo.PRESETS["tiny"], tie_word_embeddings=True))
    monkeypatch.setattr(demo, "MAX_SHARD_BYTES", 512 * 1024)
    path = demo.write_demo_checkpoint(tmp_path / "tied", "tiny-tied", dtype="bfloat16")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and not (path / "model.safetensors").exists()
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["total_size"] == sum(s.numel for s in demo.backbone_specs(demo.hf_config("tiny-tied"))) * 2

    from transformers import Qwen3_5ForConditionalGeneration

    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


def test_decision_head_shapes(tiny):
    head = _tensors(tiny / "decision_head.safetensors")
    assert {k: tuple(v.shape) for k, v in head.items()} == {"head.decision.weight": (16, 64),
                                                            "head.candidate.weight": (16, 64)}
    assert all(v.dtype == torch.float32 for v in head.values())


def test_weight_statistics(tiny):
    w = _tensors(tiny / "model.safetensors")
    lm = "model.language_model."
    zero_centred = [w[lm + "norm.weight"], w[lm + "layers.0.input_layernorm.weight"], w[lm + "layers.3.self_attn.q_norm.weight"]]
    assert all(t.abs().mean() < 0.2 and t.std() > 0.03 for t in zero_centred)
    unit_centred = [w[lm + "layers.0.linear_attn.norm.weight"], w["model.visual.blocks.0.norm1.weight"],
                    w["model.visual.merger.norm.weight"]]
    assert all((t.mean() - 1).abs() < 0.1 and t.std() > 0.03 for t in unit_centred)
    a_log = w[lm + "layers.0.linear_attn.A_log"]
    assert ((a_log >= 0) & (a_log <= torch.log(torch.tensor(16.0)))).all()
    assert (w[lm + "layers.0.linear_attn.dt_bias"] - 1).abs().max() < 0.5
    assert abs(w[lm + "embed_tokens.weight"].std() - 0.02) < 0.002


def test_seed_determinism_and_dtype_override(tiny, tmp_path):
    same = demo.write_demo_checkpoint(tmp_path / "same", "tiny", seed=0)
    for name in ("model.safetensors", "decision_head.safetensors", "tokenizer.json", "config.json"):
        assert (same / name).read_bytes() == (tiny / name).read_bytes(), name

    other = _tensors(demo.write_demo_checkpoint(tmp_path / "other", "tiny", seed=1) / "model.safetensors")
    base = _tensors(tiny / "model.safetensors")
    assert all(not torch.equal(base[k], other[k]) for k in base)

    half = demo.write_demo_checkpoint(tmp_path / "bf16", "tiny", seed=0, dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    for key, value in _tensors(half / "model.safetensors").items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, base[key].to(torch.bfloat16)), key


def test_refuses_non_empty_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        demo.write_demo_checkpoint(tmp_path / "x", "tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no staging directory left behind


def test_tokenizer_special_tokens(tiny):
    raw = json.loads((tiny / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(1024 - len(SPECIAL_TOKENS), 1024))
    assert ids["<|image_pad|>"] == raw["image_token_id"]
    assert ids["<|vision_start|>"] == raw["vision_start_token_id"]
    assert ids["<|vision_end|>"] == raw["vision_end_token_id"]
    assert ids["<|video_pad|>"] == raw["video_token_id"]

    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    control = tok.encode(text, add_special_tokens=False).ids
    assert control[0] == ids["<|im_start|>"] and control[-3:] == [ids[t] for t in
                                                                   ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    tok.encode_special_tokens = True
    plain = tok.encode("<|vision_start|>", add_special_tokens=False).ids
    assert len(plain) > 1 and not set(plain) & set(ids.values())
    assert tok.decode(plain) == "<|vision_start|>"


def test_tokenizer_round_trip(tiny):
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = "Date: 2024-03-17 — Alice said 👋🏽 «hi»; مرحبا بالعالم, שלום! 12345"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert max(ids) < 1024 - len(SPECIAL_TOKENS) and tok.decode(ids) == text
    words = tok.encode("Question: the photo from the beach", add_special_tokens=False).tokens
    assert words == ["Question", ":", "Ġthe", "Ġphoto", "Ġfrom", "Ġthe", "Ġbeach"]


def test_transformers_tokenizer(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 1012
    assert tok("<|im_start|>hi", add_special_tokens=False)["input_ids"][0] == 1011


@pytest.mark.parametrize("preset", ["bench-small", "2b"])
def test_large_preset_configs(preset, tmp_path):
    config = demo.hf_config(preset)
    config.save_pretrained(tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    p = demo.PRESETS[preset]
    assert cfg.text.vocab_size == 248320
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (248056, 248053, 248054)
    assert cfg.text.layer_types == tuple("full_attention" if i % 4 == 3 else "linear_attention"
                                         for i in range(cfg.text.num_layers))
    assert cfg.text.linear_num_key_heads == cfg.text.linear_num_value_heads == 16
    assert cfg.text.mrope_section == (11, 11, 10)

    specs = {s.name: s.shape for s in demo.backbone_specs(config)}
    hidden = cfg.text.hidden_size
    assert specs["model.language_model.embed_tokens.weight"] == (248320, hidden)
    assert specs["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == (3 * 16 * 128, hidden)
    assert specs["model.language_model.layers.3.self_attn.q_proj.weight"] == (2 * 8 * 256, hidden)
    assert specs["model.visual.merger.linear_fc2.weight"] == (hidden, 4 * cfg.vision.hidden_size)
    head = demo.head_specs(config, p.head_dim)
    assert [s.shape for s in head] == [(256, hidden)] * 2
    assert ("lm_head.weight" in specs) is (preset == "bench-small")


def test_2b_parameter_count_and_shards():
    config = demo.hf_config("2b")
    assert config.text_config.num_hidden_layers == 24 and config.tie_word_embeddings
    assert config.text_config.rope_parameters["rope_theta"] == 10_000_000
    specs = demo.backbone_specs(config)
    backbone = sum(s.numel for s in specs)
    assert 1.8e9 < backbone < 2.4e9
    assert sum(s.numel for s in demo.head_specs(config, 256)) == 2 * 256 * 2048
    shards = demo._shard(specs, torch.bfloat16, demo.MAX_SHARD_BYTES)
    assert len(shards) > 1 and sum(len(s) for s in shards) == len(specs)
    assert all(sum(s.numel for s in shard) * 2 <= demo.MAX_SHARD_BYTES for shard in shards)


def test_cached_checkpoint_concurrent_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".demo-tiny-seed3.tmp-killed").mkdir()  # left by a killed run
    results, errors = [], []

    def call():
        try:
            results.append(demo.demo_checkpoint("tiny", seed=3))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    expected = tmp_path / "cache" / "demo-tiny-seed3"
    assert results == [expected, expected]
    assert ModelConfig.from_file(expected / "config.json").text.hidden_size == 64
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".demo-tiny-seed3.lock", "demo-tiny-seed3"]
    assert demo.demo_checkpoint("tiny", seed=3) == expected


def test_cli_run(tmp_path, capsys):
    from pixeltriage.cli import main

    assert main(["init-demo", str(tmp_path / "out"), "--preset", "tiny", "--seed", "2", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    counts = demo.count_parameters(tmp_path / "out")
    assert counts == {"backbone": 408232, "head": 2 * 16 * 64}
    assert "410,280 parameters" in out and str(tmp_path / "out") in out
