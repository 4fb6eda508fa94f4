"""The packed checkpoint (`pixeltriage pack`): one valid safetensors file, mapped in place, identical scores."""
import json

import pytest
import torch
from safetensors import safe_open

from pixeltriage import Scorer
from pixeltriage.cli import main
from pixeltriage.episode import sample_episode
from pixeltriage.errors import CheckpointError
from pixeltriage.weights.packed import pack_checkpoint
from test_weights_layouts import DOWN, lora_pair, write_adapter


@pytest.fixture(scope="module")
def episode():
    return sample_episode()


@pytest.fixture(scope="module")
def packed(tiny_checkpoint, tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("packed")
    for dtype in (torch.float32, torch.bfloat16):
        out[dtype] = root / f"tiny-{dtype}.safetensors"
        pack_checkpoint(tiny_checkpoint, out[dtype], dtype=dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_directory_give_identical_scores(tiny_checkpoint, packed, episode, dtype):
    assert Scorer.load(packed[dtype], dtype=dtype).score(*episode) == \
        Scorer.load(tiny_checkpoint, dtype=dtype).score(*episode)


def test_a_float32_pack_loads_at_bfloat16_like_the_directory(tiny_checkpoint, packed, episode):
    assert Scorer.load(packed[torch.float32], dtype=torch.bfloat16).score(*episode) == \
        Scorer.load(tiny_checkpoint, dtype=torch.bfloat16).score(*episode)


def test_the_file_is_plain_safetensors_with_embedded_configs(tiny_checkpoint, packed):
    with safe_open(str(packed[torch.bfloat16]), "pt") as f:
        meta = f.metadata()
        names = list(f.keys())
        assert f.get_tensor("text.embed").dtype == torch.bfloat16
        assert f.get_tensor("head_decision").dtype == torch.float32
    assert meta["format"] == "pixeltriage-packed" and meta["dtype"] == "BF16"
    assert json.loads(meta["config"]) == json.loads((tiny_checkpoint / "config.json").read_text())
    assert json.loads(meta["pixeltriage"]) == json.loads((tiny_checkpoint / "pixeltriage.json").read_text())
    assert meta["tokenizer"] == (tiny_checkpoint / "tokenizer.json").read_text()
    assert len(meta["fingerprint"]) == 64
    assert "text.layers.0.attn.in_proj" in names and "vision.blocks.0.qkv_w" in names


def test_loading_at_the_packed_dtype_copies_nothing(packed, monkeypatch):
    monkeypatch.setenv("PIXELTRIAGE_PREPACK", "0")              # no weight reordered for oneDNN (below)
    scorer = Scorer.load(packed[torch.bfloat16], dtype=torch.bfloat16)
    w = scorer.weights
    tensors = [w.text.embed, w.text.norm, w.text.layers[0].attn.in_proj, w.text.layers[-1].down,
               w.vision.patch_w, w.vision.blocks[0].qkv_w, w.head_decision]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1                                    # all views of the one mapped file
    assert w.vision.patch_w.is_contiguous() and w.text.layers[0].attn.in_proj.is_contiguous()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 primitive here")
def test_weights_reordered_at_load_give_their_mapped_pages_back(tiny_checkpoint, packed, episode, monkeypatch):
    """bf16 with the decoder's weights reordered for oneDNN (`kernels.prepack`, all six roles): the other tensors
    stay views of the file, the reordered ones' pages are dropped (`weights.pages`), and the scores are the
    directory's with the same reordering."""
    import pixeltriage.engine.scorer as scorer_module
    from pixeltriage.kernels import prepack

    monkeypatch.setenv("PIXELTRIAGE_PREPACK", "1")
    monkeypatch.setattr(prepack.tuning, "malloc_tuned", True)
    expected = Scorer.load(tiny_checkpoint, dtype=torch.bfloat16).score(*episode)
    scorer = Scorer.load(packed[torch.bfloat16], dtype=torch.bfloat16)
    w = scorer.weights
    dropped = []
    drop = scorer_module.drop_file_pages
    monkeypatch.setattr(scorer_module, "drop_file_pages", lambda ts: dropped.append(drop(ts)) or dropped[-1])
    assert scorer.score(*episode) == expected
    assert prepack.roles_of(w) == prepack.ROLES                         # by that first forward
    # four weights a decoder layer, four a vision block, the patch embedding and the merger's two
    assert len(dropped) == 4 * len(w.text.layers) + 4 * len(w.vision.blocks) + 3 and sum(dropped) > 0
    assert len({t.untyped_storage().data_ptr() for t in (w.text.embed, w.vision.pos_embed, w.head_decision,
                                                         w.text.layers[0].attn.conv)}) == 1


def test_fingerprints_are_stable_and_follow_the_content(tiny_checkpoint, packed, tmp_path):
    again = pack_checkpoint(tiny_checkpoint, tmp_path / "again.safetensors", dtype=torch.bfloat16)
    assert again["fingerprint"] == Scorer.load(packed[torch.bfloat16], dtype=torch.bfloat16).checkpoint_fingerprint
    from pixeltriage.config import ModelConfig

    text = ModelConfig.from_file(tiny_checkpoint / "config.json").text
    a, b = lora_pair(text.hidden_size, text.intermediate_size, 4, seed=0)
    adapter = write_adapter(tmp_path / "adapter", {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b})
    merged = pack_checkpoint(tiny_checkpoint, tmp_path / "merged.safetensors", adapter=adapter, dtype=torch.bfloat16)
    assert merged["fingerprint"] != again["fingerprint"]
    assert merged["vision_fingerprint"] == again["vision_fingerprint"]      # the adapter touched no vision weight


def test_adapter_merged_at_pack_time(tiny_checkpoint, tmp_path, episode):
    from pixeltriage.config import ModelConfig

    text = ModelConfig.from_file(tiny_checkpoint / "config.json").text
    a, b = lora_pair(text.hidden_size, text.intermediate_size, 4, seed=1)
    adapter = write_adapter(tmp_path / "adapter", {f"{DOWN}.lora_A.weight": a, f"{DOWN}.lora_B.weight": b})
    pack_checkpoint(tiny_checkpoint, tmp_path / "p.safetensors", adapter=adapter, dtype=torch.float32)
    assert Scorer.load(tmp_path / "p.safetensors").score(*episode) == \
        Scorer.load(tiny_checkpoint, adapter=adapter).score(*episode)
    with pytest.raises(CheckpointError, match="adapter merged already"):
        Scorer.load(tmp_path / "p.safetensors", adapter=adapter)


def test_packed_vision_fingerprint_matches_a_computed_one(packed):
    scorer = Scorer.load(packed[torch.float32])
    stored = scorer.vision_fingerprint
    scorer._fingerprint = None
    assert scorer.vision_fingerprint == stored


def test_truncated_or_foreign_files_are_clear_errors(tiny_checkpoint, packed, tmp_path):
    data = packed[torch.float32].read_bytes()
    for name, blob, message in [
        ("truncated.safetensors", data[: len(data) // 2], "truncated or corrupt"),
        ("short.safetensors", data[:5], "not a safetensors file .*too short"),
        ("garbage.safetensors", b"\xff" * 64, "not a safetensors file, or a truncated one"),
    ]:
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(CheckpointError, match=name):
            Scorer.load(tmp_path / name)
        with pytest.raises(CheckpointError, match=message):
            Scorer.load(tmp_path / name)
    with pytest.raises(CheckpointError, match="not a packed System One checkpoint"):
        Scorer.load(tiny_checkpoint / "model.safetensors")


def _patch_tensor(path, name, edit):
    """Overwrite tensor `name` of the safetensors file at `path` in place through `edit(flat float32 view)`."""
    from pixeltriage.weights.reader import read_safetensors_header

    header, start = read_safetensors_header(path)
    info = header[name]
    data = bytearray(path.read_bytes())
    begin, end = (start + o for o in info["data_offsets"])
    assert info["dtype"] == "F32"
    t = torch.frombuffer(data, dtype=torch.float32, offset=begin, count=(end - begin) // 4)
    edit(t)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_damaged_small_tensor_is_caught_at_every_load(packed, tmp_path, bad):
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(packed[torch.float32].read_bytes())
    _patch_tensor(damaged, "text.norm", lambda t: t.__setitem__(3, bad))
    with pytest.raises(CheckpointError, match=r"damaged\.safetensors: tensor .*text.*norm contains NaN or Inf"):
        Scorer.load(damaged)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_damaged_matrix_is_caught_by_verify_and_never_scored(packed, tmp_path, episode, bad, monkeypatch):
    from pixeltriage.engine import scorer as scorer_mod
    from pixeltriage.errors import NonFiniteScoreError

    monkeypatch.setattr(scorer_mod, "SMALL_TENSOR", 1000)          # the tiny model's matrices count as large
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(packed[torch.float32].read_bytes())
    _patch_tensor(damaged, "text.layers.0.gate_up", lambda t: t.__setitem__(7, bad))
    question, memories = episode
    scorer = Scorer.load(damaged)                       # the matrices are not read by default: it maps, fast
    with pytest.raises(NonFiniteScoreError):
        scorer.score(question, memories[:2])
    with pytest.raises(CheckpointError, match=r"damaged\.safetensors: tensor .*gate_up contains NaN or Inf"):
        Scorer.load(damaged, verify=True)


def test_verify_catches_a_finite_change_by_its_fingerprint(packed, tmp_path):
    Scorer.load(packed[torch.float32], verify=True)                # the file as written passes
    changed = tmp_path / "changed.safetensors"
    changed.write_bytes(packed[torch.float32].read_bytes())
    _patch_tensor(changed, "text.norm", lambda t: t.__setitem__(0, t[0] + 0.25))
    with pytest.raises(CheckpointError, match="changed.safetensors: contents do not match the fingerprint"):
        Scorer.load(changed, verify=True)


def test_pack_refuses_bad_targets(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        pack_checkpoint(tiny_checkpoint, tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        pack_checkpoint(tmp_path / "nothing", tmp_path / "x.safetensors")
    assert not list(tmp_path.glob(".*tmp*"))                       # nothing half-written left behind


def test_a_device_that_cannot_run_is_an_error_naming_the_checkpoint(tiny_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(CheckpointError, match=f"{tiny_checkpoint}.*CUDA is not available"):
        Scorer.load(tiny_checkpoint, device="cuda")


def test_pack_keeps_the_checkpoint_dtype_by_default_and_warns_when_narrowing(tiny_checkpoint, tmp_path, caplog):
    from pixeltriage.weights.packed import checkpoint_dtype

    assert checkpoint_dtype(tiny_checkpoint) == torch.float32            # the tiny demo checkpoint is float32
    with caplog.at_level("WARNING", logger="pixeltriage.weights.packed"):
        kept = pack_checkpoint(tiny_checkpoint, tmp_path / "kept.safetensors")
    assert kept["dtype"] == "F32" and not caplog.records
    with caplog.at_level("WARNING", logger="pixeltriage.weights.packed"):
        pack_checkpoint(tiny_checkpoint, tmp_path / "narrow.safetensors", dtype=torch.bfloat16)
    assert "rounds every float32 weight to bfloat16" in caplog.text


def test_pack_cli_warns_on_stderr_when_narrowing(tiny_checkpoint, tmp_path):
    from cli_inputs import run_cli

    out = run_cli("pack", str(tiny_checkpoint), str(tmp_path / "p.safetensors"), "--dtype", "bfloat16", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "WARNING" in out.stderr and "rounds every float32 weight to bfloat16" in out.stderr


def test_pack_cli(tiny_checkpoint, tmp_path, capsys, episode):
    dst = tmp_path / "cli.safetensors"
    assert main(["pack", str(tiny_checkpoint), str(dst), "--dtype", "float32", "--quiet"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(dst) and info["dtype"] == "F32"
    assert Scorer.load(dst).score(*episode) == Scorer.load(tiny_checkpoint).score(*episode)


def test_score_cli_verify_names_the_damaged_file(packed, tmp_path, capsys):
    from cli_inputs import write_episode

    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(packed[torch.float32].read_bytes())
    _patch_tensor(damaged, "text.norm", lambda t: t.__setitem__(0, float("nan")))
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(damaged), "--episode", str(episode), "--verify"]) == 2
    assert "damaged.safetensors: tensor" in capsys.readouterr().err


def test_verify_cli(tiny_checkpoint, packed, tmp_path, capsys):
    assert main(["verify", str(packed[torch.bfloat16])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] and info["kind"] == "packed" and info["dtype"] == "BF16"
    assert main(["verify", str(tiny_checkpoint)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "directory"
    changed = tmp_path / "changed.safetensors"
    changed.write_bytes(packed[torch.float32].read_bytes())
    _patch_tensor(changed, "text.norm", lambda t: t.__setitem__(1, t[1] * 2))
    assert main(["verify", str(changed)]) == 2
    assert "changed.safetensors: contents do not match" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:                 # a usage error: nothing is loaded
        main(["verify", str(tmp_path / "missing")])
    assert exit_.value.code == 2 and "no such file or directory" in capsys.readouterr().err


def test_verify_catches_a_vision_fingerprint_that_is_not_the_weights(packed, tmp_path):
    data = packed[torch.float32].read_bytes()
    stored = Scorer.load(packed[torch.float32]).vision_fingerprint.encode()
    assert data.count(stored) == 1
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(data.replace(stored, stored[::-1]))         # same length: the header stays valid
    Scorer.load(forged)                                             # structure intact: loads
    with pytest.raises(CheckpointError, match="forged.safetensors: its vision_fingerprint does not match"):
        Scorer.load(forged, verify=True)
