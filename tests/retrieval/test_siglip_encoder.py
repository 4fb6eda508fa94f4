"""The SigLIP 2 encoder against transformers: preprocessing bit for bit against the checkpoint's PIL image processor,
token ids against its processor, embeddings against transformers' model on the same inputs; the demo checkpoints;
fingerprints; load errors."""
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from pixeltriage.errors import CheckpointError
from pixeltriage.retrieval.demo import PRESETS, demo_encoder, write_demo_encoder
from pixeltriage.retrieval.encoder import Encoder, SiglipEncoder, naflex_size, preprocess_images
from pixeltriage.retrieval.regions import region_crops

transformers = pytest.importorskip("transformers")

# unit-norm embeddings in float32 through the same model, batched differently: rounding only
EMBEDDING_ATOL = 1e-5
SIZES = [(37, 53), (300, 5), (1, 1), (64, 64), (17, 333), (500, 700)]         # (width, height)
QUESTIONS = ["What colour was the MUG on the desk?", "", "Ünïcode 🎉 and\ttabs", "word " * 80]


def images(seed=0, sizes=SIZES) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def reference(directory):
    """transformers' processor (PIL image processor, tokenizer) and model for the checkpoint."""
    processor = transformers.AutoProcessor.from_pretrained(directory)
    model = transformers.AutoModel.from_pretrained(directory).eval()
    return processor, model


@pytest.fixture(scope="module")
def naflex_encoder(naflex_encoder_dir):
    return SiglipEncoder.load(naflex_encoder_dir, batch_size=2)


@pytest.mark.parametrize("variant", ["fixed", "naflex"])
def test_preprocessing_matches_the_pil_image_processor_exactly(variant, request):
    directory = request.getfixturevalue("tiny_encoder_dir" if variant == "fixed" else "naflex_encoder_dir")
    encoder = SiglipEncoder.load(directory)
    processor, _ = reference(directory)
    assert type(processor.image_processor).__name__.endswith("ImageProcessorPil")
    batch = images() + region_crops(images(1, [(101, 77)])[0])               # odd sizes and real crops
    ours, theirs = preprocess_images(batch, encoder.image_rules), processor(images=batch, return_tensors="pt")
    assert set(ours) == set(theirs.keys())
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


def test_naflex_sizes_follow_transformers():
    from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

    for height, width in [(1, 1), (5, 300), (333, 17), (4000, 3000), (224, 224), (16, 4096), (999, 1001)]:
        for patch, limit in [(16, 256), (16, 1024), (14, 729)]:
            assert naflex_size(height, width, patch, limit) == get_image_size_for_max_num_patches(
                height, width, patch, limit)


@pytest.mark.parametrize("variant", ["fixed", "naflex"])
def test_embeddings_match_transformers(variant, request):
    directory = request.getfixturevalue("tiny_encoder_dir" if variant == "fixed" else "naflex_encoder_dir")
    encoder = request.getfixturevalue("tiny_encoder" if variant == "fixed" else "naflex_encoder")
    processor, model = reference(directory)
    batch = images(2)
    with torch.no_grad():
        pooled = model.get_image_features(**processor(images=batch, return_tensors="pt")).pooler_output
    want = torch.nn.functional.normalize(pooled, dim=-1)
    got = encoder.encode_images(batch)                                        # batch_size 4 or 2: several forwards
    assert got.shape == (len(batch), encoder.dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=EMBEDDING_ATOL, rtol=0)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(batch)), atol=1e-6, rtol=0)
    assert (want @ want.T - torch.eye(len(batch))).abs().max() > 0.01         # the images do differ

    # texts: the fixed-resolution checkpoints load a plain Gemma tokenizer, so a user lower-cases (SigLIP 2 was
    # trained on lower-cased text); the NaFlex ones load transformers' Siglip2Tokenizer, which lower-cases itself
    texts = [q.lower() for q in QUESTIONS] if variant == "fixed" else QUESTIONS
    tokens = processor(text=texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    assert list(tokens.keys()) == ["input_ids"]                              # no attention mask, as released
    ours = encoder.tokenize(QUESTIONS)
    assert list(ours) == ["input_ids"] and torch.equal(ours["input_ids"], tokens["input_ids"])
    assert ours["input_ids"].shape == (len(QUESTIONS), 64)
    with torch.no_grad():
        want = torch.nn.functional.normalize(model.get_text_features(**tokens).pooler_output, dim=-1)
    torch.testing.assert_close(encoder.encode_texts(QUESTIONS), want, atol=EMBEDDING_ATOL, rtol=0)


def test_tokenization_pads_truncates_and_ends_with_eos(tiny_encoder):
    ids = tiny_encoder.tokenize(["A red mug", "word " * 80])["input_ids"]
    eos, pad = tiny_encoder.tokenizer.eos_token_id, tiny_encoder.tokenizer.pad_token_id
    assert (eos, pad) == (1, 0)
    short = ids[0].tolist()
    assert short[short.index(eos) + 1:] == [pad] * (63 - short.index(eos)) and 2 not in short   # no BOS
    assert pad not in ids[1].tolist()                                         # truncated to 64, no room for padding
    assert torch.equal(tiny_encoder.tokenize(["A RED Mug"])["input_ids"], ids[:1])             # lower-cased
    with pytest.raises(TypeError, match="text 2 must be a str"):
        tiny_encoder.tokenize(["ok", 3])


def test_empty_batches(tiny_encoder):
    assert tiny_encoder.encode_images([]).shape == (0, 32)
    assert tiny_encoder.encode_texts([]).shape == (0, 32)


def test_non_rgb_images_are_refused(tiny_encoder):
    with pytest.raises(ValueError, match="image 1: .*RGB"):
        tiny_encoder.encode_images([Image.new("L", (8, 8))])


def test_the_encoder_is_an_encoder(tiny_encoder):
    assert isinstance(tiny_encoder, Encoder)
    assert tiny_encoder.dim == 32 and tiny_encoder.device.type == "cpu" and tiny_encoder.dtype == torch.float32
    assert "SigLIP 2 (siglip, 32x32, D=32)" in repr(tiny_encoder)


def test_fingerprints(tiny_encoder, tiny_encoder_dir, tmp_path):
    again = SiglipEncoder.load(tiny_encoder_dir, batch_size=1)
    assert again.fingerprint == tiny_encoder.fingerprint and len(again.fingerprint) == 64
    other_seed = write_demo_encoder(tmp_path / "seed1", "tiny", seed=1)
    assert SiglipEncoder.load(other_seed).fingerprint != tiny_encoder.fingerprint
    resized = shutil.copytree(tiny_encoder_dir, tmp_path / "resized")
    config = json.loads((resized / "preprocessor_config.json").read_text())
    config["resample"] = 3                                                    # same weights, other preprocessing
    (resized / "preprocessor_config.json").write_text(json.dumps(config))
    assert SiglipEncoder.load(resized).fingerprint != tiny_encoder.fingerprint
    # the dtype and device it runs in are not part of it (rounding, not another model)
    assert SiglipEncoder.load(tiny_encoder_dir, dtype=torch.bfloat16).fingerprint == tiny_encoder.fingerprint


def test_demo_checkpoints_are_deterministic_and_cached(tiny_encoder_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path / "cache"))
    path = demo_encoder("tiny", seed=0)
    assert path.parent == tmp_path / "cache" and demo_encoder("tiny", seed=0) == path
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (path / name).read_bytes() == (tiny_encoder_dir / name).read_bytes(), name
    assert sorted(PRESETS) == ["base", "tiny", "tiny-naflex"]
    with pytest.raises(ValueError, match="unknown encoder demo preset"):
        demo_encoder("huge")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        write_demo_encoder(path, "tiny")


def test_load_errors_name_the_file(tiny_encoder_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        SiglipEncoder.load(tmp_path / "none")
    broken = shutil.copytree(tiny_encoder_dir, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "clip"}))
    with pytest.raises(CheckpointError, match="model_type 'clip' is not a SigLIP 2"):
        SiglipEncoder.load(broken)
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")      # a pickle is never read
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        SiglipEncoder.load(broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_encoder_dir / "model.safetensors")
    del tensors["vision_model.head.probe"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing keys .*vision_model.head.probe"):
        SiglipEncoder.load(broken)
    shutil.copy(tiny_encoder_dir / "model.safetensors", broken / "model.safetensors")
    (broken / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 0, "width": 32}}))
    with pytest.raises(CheckpointError, match="preprocessor_config.json: height must be a positive integer"):
        SiglipEncoder.load(broken)
    (broken / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match="preprocessor_config.json: file not found"):
        SiglipEncoder.load(broken)


def test_a_hub_id_loads_from_the_local_hub_cache(tiny_encoder, tiny_encoder_dir, tmp_path, monkeypatch):
    """`SiglipEncoder.load("org/name")` (and `--index-encoder org/name`) reads the hub cache, never the network."""
    from integrations.integration_inputs import guard_network, hub_cache

    hub_cache(tmp_path / "hub", "acme/siglip-tiny", tiny_encoder_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    connections = guard_network(monkeypatch)
    assert SiglipEncoder.load("acme/siglip-tiny").fingerprint == tiny_encoder.fingerprint
    with pytest.raises(CheckpointError, match="allow_download=True"):
        SiglipEncoder.load("acme/absent")
    assert connections == []
