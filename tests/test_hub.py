"""Checkpoints by Hugging Face hub id (pixeltriage.hub): a hub cache in huggingface_hub's standard layout is read
with no network, a local path wins, an id that is not cached is a CheckpointError without any connection attempt,
and only safetensors checkpoints are fetched or loaded."""
from pathlib import Path

import pytest
from integrations.integration_inputs import COLORS, QUESTION, guard_network, hub_cache, png

from pixeltriage import CheckpointError, Memory, Scorer
from pixeltriage.hub import ALLOW_PATTERNS, check_checkpoint, parse_hub_id, resolve_checkpoint

pytest.importorskip("huggingface_hub")

COMMIT = "c0ffee" * 6 + "c0ff"


@pytest.fixture
def no_network(monkeypatch):
    return guard_network(monkeypatch)


@pytest.fixture
def cache(tiny_checkpoint, tmp_path, monkeypatch):
    """The tiny checkpoint as `pixeltriage/tiny` (main and tag v1) in a hub cache that HF_HUB_CACHE points at."""
    root = tmp_path / "hub"
    snapshot = hub_cache(root, "pixeltriage/tiny", tiny_checkpoint, COMMIT, refs=("main", "v1"))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return snapshot


def test_a_cached_id_resolves_offline_and_scores_as_the_directory(tiny_checkpoint, cache, no_network):
    assert resolve_checkpoint("pixeltriage/tiny") == cache
    assert resolve_checkpoint("pixeltriage/tiny@v1") == cache
    assert resolve_checkpoint("pixeltriage/tiny", "v1") == cache
    assert resolve_checkpoint(f"pixeltriage/tiny@{COMMIT}") == cache
    memories = [Memory(image=png(c), note=f"note {i}") for i, c in enumerate(COLORS[:3])]
    expected = Scorer.load(tiny_checkpoint).score(QUESTION, memories)
    assert Scorer.load(resolve_checkpoint("pixeltriage/tiny")).score(QUESTION, memories) == expected
    assert Scorer.load("pixeltriage/tiny", revision="v1").score(QUESTION, memories) == expected
    assert no_network == []


def test_scorer_load_refuses_an_id_not_cached_without_a_connection(cache, no_network):
    with pytest.raises(CheckpointError, match="allow_download=True"):
        Scorer.load("pixeltriage/absent")
    assert no_network == []


def test_an_id_not_cached_is_refused_without_a_connection(cache, monkeypatch, no_network):
    with pytest.raises(CheckpointError, match="allow_download=True") as error:
        resolve_checkpoint("pixeltriage/absent")
    assert "pixeltriage/absent" in str(error.value) and str(cache.parents[2]) in str(error.value)
    with pytest.raises(CheckpointError, match="revision nope"):
        resolve_checkpoint("pixeltriage/tiny@nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")            # allow_download, but the environment says offline
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE=1 is set"):
        resolve_checkpoint("pixeltriage/absent", allow_download=True)
    assert resolve_checkpoint("pixeltriage/tiny", allow_download=True) == cache
    assert no_network == []


def test_a_local_path_wins_over_the_same_id(tiny_checkpoint, cache, tmp_path, monkeypatch, no_network):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pixeltriage").mkdir()
    (tmp_path / "pixeltriage" / "tiny").symlink_to(tiny_checkpoint)
    assert resolve_checkpoint("pixeltriage/tiny").resolve() == tiny_checkpoint.resolve()
    with pytest.raises(CheckpointError, match="a local path has no revision"):
        resolve_checkpoint("pixeltriage/tiny", "v1")
    assert resolve_checkpoint(str(tiny_checkpoint)) == tiny_checkpoint
    assert no_network == []


def test_only_safetensors(tmp_path, monkeypatch, no_network):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    hub_cache(tmp_path / "hub", "org/pickled", pickled)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="no safetensors weights"):   # the .bin is not even in the snapshot
        resolve_checkpoint("org/pickled")

    from huggingface_hub.utils import filter_repo_objects

    listing = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
               "pixeltriage.json", "spiece.model", "merges.txt", "pytorch_model.bin", "model.pt", "weights.pth",
               "optimizer.pkl", "modeling_custom.py", "flax_model.msgpack", "tf_model.h5", "onnx/model.onnx"]
    fetched = set(filter_repo_objects(listing, allow_patterns=ALLOW_PATTERNS))
    assert fetched == set(listing[:10])
    assert no_network == []


def test_a_pickle_only_repository_is_refused_before_any_download(tmp_path, monkeypatch):
    """The listing is read (the caller allowed the network), and nothing is downloaded after it."""
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, **kw: calls.append(("list", repo_id, kw.get("revision")))
                        or ["config.json", "pytorch_model.bin"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: calls.append(("download", a, kw)))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(CheckpointError, match="pytorch_model.bin, which are not loaded"):
        resolve_checkpoint("org/pickled@v2", allow_download=True, cache_dir=tmp_path)
    assert calls == [("list", "org/pickled", "v2")]


def test_a_download_asks_for_the_checkpoint_files_only(tiny_checkpoint, tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = hub_cache(tmp_path / "hub", "org/tiny", tiny_checkpoint)
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, **kw: [p.name for p in tiny_checkpoint.iterdir()])
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kw: calls.append((repo_id, kw)) or str(snapshot))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert resolve_checkpoint("org/tiny", allow_download=True, cache_dir=tmp_path / "hub") == snapshot
    [(repo_id, options)] = calls
    assert repo_id == "org/tiny" and options["allow_patterns"] == ALLOW_PATTERNS
    assert not options.get("local_files_only") and options["cache_dir"] == tmp_path / "hub"


def test_an_empty_checkpoint_is_refused():
    for refuse in (check_checkpoint, resolve_checkpoint):
        with pytest.raises(CheckpointError, match="empty checkpoint"):
            refuse("")


@pytest.mark.parametrize("text", ["missing-dir", "./org/name", "/abs/org/name", "a/b/c", "org--x/name",
                                  "org/na..me", "org/name@", "org/name@a@b", "-org/name"])
def test_what_is_neither_a_path_nor_an_id(text, tmp_path, monkeypatch, no_network):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no such file or directory, and not a Hugging Face hub id"):
        check_checkpoint(text)
    assert resolve_checkpoint(text) == Path(text)         # a path, for the loader to refuse in its own words
    with pytest.raises(CheckpointError, match="a local path has no revision"):
        resolve_checkpoint(text, "v1")
    assert no_network == []


def test_a_missing_local_checkpoint_keeps_the_loaders_message(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        Scorer.load(resolve_checkpoint(tmp_path / "none"))


def test_parse_hub_id():
    assert parse_hub_id("org/name") == parse_hub_id("org/name", None)
    assert str(parse_hub_id("Org-1/na_me.v2@refs/pr/3")) == "Org-1/na_me.v2@refs/pr/3"
    assert parse_hub_id("org/name", "v1").revision == "v1"
    assert parse_hub_id("org/name@v1", "v1").revision == "v1"
    with pytest.raises(CheckpointError, match="disagree"):
        parse_hub_id("org/name@v1", "v2")
    assert parse_hub_id("org/name/extra") is None


def test_the_default_cache_is_named_when_an_id_is_missing(tmp_path, monkeypatch, no_network):
    """With no cache directory configured, huggingface_hub's default one (under HF_HOME) is looked in and named."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CheckpointError, match="allow_download=True") as error:
        resolve_checkpoint("pixeltriage/absent")
    assert "huggingface" in str(error.value)
    assert no_network == []
