"""Bad input -> the documented, typed error naming what is wrong."""
import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from pixeltriage import CheckpointError, InvalidMemoryError, Memory, Scorer


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    return Scorer.load(tiny_checkpoint)


def test_corrupt_image_bytes_names_the_memory(scorer):
    memories = [Memory(image=Image.new("RGB", (40, 40))), Memory(image=b"\x89PNG\r\n\x1a\nnot really")]
    with pytest.raises(InvalidMemoryError) as e:
        scorer.score("q", memories)
    assert e.value.index == 1


def test_missing_path(scorer, tmp_path):
    with pytest.raises(InvalidMemoryError, match="does-not-exist"):
        scorer.score("q", [Memory(image=str(tmp_path / "does-not-exist.png"))])


def test_non_string_note(scorer):
    with pytest.raises(InvalidMemoryError, match="note must be a string") as e:
        scorer.score("q", [Memory(image=Image.new("RGB", (40, 40)), note=42)])
    assert e.value.index == 0


def test_not_a_memory(scorer):
    with pytest.raises(InvalidMemoryError, match="pixeltriage.Memory"):
        scorer.score("q", ["photo.png"])


def _rewrite(path, edit):
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor(tiny_copy):
    name = "model.language_model.layers.0.linear_attn.A_log"
    _rewrite(tiny_copy / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="layers.0.linear_attn.A_log"):
        Scorer.load(tiny_copy)


def test_wrong_shape_names_file_tensor_expected_found(tiny_copy):
    name = "model.language_model.layers.1.mlp.down_proj.weight"

    def edit(t):
        t[name] = t[name][:, :-1].contiguous()

    _rewrite(tiny_copy / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as e:
        Scorer.load(tiny_copy)
    msg = str(e.value)
    assert "model.safetensors" in msg and name in msg and "expected shape" in msg and "found" in msg


def test_unknown_tensor(tiny_copy):
    _rewrite(tiny_copy / "model.safetensors", lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        Scorer.load(tiny_copy)


def test_missing_head(tiny_copy):
    (tiny_copy / "decision_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="head.decision.weight"):
        Scorer.load(tiny_copy)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_weight(tiny_copy, bad):
    name = "model.language_model.norm.weight"

    def edit(t):
        t[name] = t[name].clone()
        t[name][3] = bad

    _rewrite(tiny_copy / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match="NaN"):
        Scorer.load(tiny_copy)


def test_missing_file(tiny_copy):
    (tiny_copy / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        Scorer.load(tiny_copy)


def test_bad_template_placeholder(tiny_copy):
    cfg = json.loads((tiny_copy / "pixeltriage.json").read_text())
    cfg["template"]["marker"] = "[memory {idx}]"
    (tiny_copy / "pixeltriage.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="marker"):
        Scorer.load(tiny_copy)


@pytest.mark.parametrize("edit, needle", [
    (lambda cfg: cfg["state"].update(max_state_token=100), "state.max_state_token"),   # a misspelt budget
    (lambda cfg: cfg.update(templates={}), "'templates'"),
    (lambda cfg: cfg["head"].update(dimension=8), "head.dimension"),
    (lambda cfg: cfg.update(state=[]), "'state' must be an object"),
])
def test_unknown_pixeltriage_json_keys_are_errors(tiny_copy, edit, needle):
    cfg = json.loads((tiny_copy / "pixeltriage.json").read_text())
    edit(cfg)
    (tiny_copy / "pixeltriage.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=needle):
        Scorer.load(tiny_copy)


def test_truncated_safetensors(tiny_copy):
    path = tiny_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Scorer.load(tiny_copy)
