"""The Scorer with a write-time cache: memories by key, cached thumbnails and notes, vision features reused.

Tolerance: scores with and without cached features agree to 1e-6 (float32); in practice they are identical,
since the cached features are the very tensors the ViT produced.
"""
import io
import json
import random
import sqlite3

import pytest
import torch
from PIL import Image

from pixeltriage import Cache, InvalidMemoryError, Memory, Scorer, visual_tokens
from pixeltriage.cli import main
from pixeltriage.store.schema import VERSION

ATOL = 1e-6


def images():
    wide = Image.frombytes("RGB", (500, 200), random.Random(0).randbytes(500 * 200 * 3))  # same pixels each call
    rgba = Image.new("RGBA", (120, 90), (200, 30, 30, 128))
    gray = Image.linear_gradient("L").resize((64, 96))
    buf = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").save(buf, format="JPEG")
    return [wide, rgba, gray, buf.getvalue()]


NOTES = ["a noisy strip", "a red card", "", "a radial glow"]
QUESTION = "Which picture shows the red card?"


def by_value():
    return [Memory(image=im, note=n, dialogue=f"shared picture {i}", date=f"2026-0{i + 1}-01")
            for i, (im, n) in enumerate(zip(images(), NOTES))]


def assert_scores_equal(a, b, atol=ATOL):
    assert a.p_vis == pytest.approx(b.p_vis, abs=atol)
    assert a.gains == pytest.approx(b.gains, abs=atol)
    assert a.relevance == pytest.approx(b.relevance, abs=atol)
    assert a.relevance_none == pytest.approx(b.relevance_none, abs=atol)


@pytest.fixture
def cache(tmp_path):
    with Cache(tmp_path / "cache.db") as c:
        yield c


def test_cached_features_give_the_same_scores_and_skip_the_vit(tiny_checkpoint, cache):
    plain = Scorer.load(tiny_checkpoint).score(QUESTION, by_value())
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    first = scorer.score(QUESTION, by_value())
    assert scorer.vision_counts == {"cached": 0, "computed": 4}
    second = scorer.score(QUESTION, by_value())
    assert scorer.vision_counts == {"cached": 4, "computed": 4}
    assert_scores_equal(first, plain)
    assert_scores_equal(second, plain)
    assert cache.stats()["feature_rows"] == 4


def test_with_cache_shares_the_loaded_weights(tiny_checkpoint, cache):
    plain = Scorer.load(tiny_checkpoint)
    cached = plain.with_cache(cache)
    assert cached.weights is plain.weights and cached.cache is cache and plain.cache is None
    assert cached.workspace is plain.workspace          # one forward's buffers, not one set per Scorer
    assert cached.vision_fingerprint == plain.vision_fingerprint
    cached.score(QUESTION, by_value())
    assert_scores_equal(cached.score(QUESTION, by_value()), plain.score(QUESTION, by_value()))
    assert cached.vision_counts == {"cached": 4, "computed": 4}


def test_a_new_memory_runs_the_vit_only_for_itself(tiny_checkpoint, cache):
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    memories = by_value()
    scorer.score(QUESTION, memories[:2])
    expected = Scorer.load(tiny_checkpoint).score(QUESTION, memories[1:])
    got = scorer.score(QUESTION, memories[1:])                       # memory 1 cached, 2 and 3 new
    assert scorer.vision_counts == {"cached": 1, "computed": 4}
    assert_scores_equal(got, expected)


def test_memories_by_key_use_the_cached_thumbnail_and_note(tiny_checkpoint, cache):
    keys = [cache.put(im, note) for im, note in zip(images(), NOTES)]
    by_key = [Memory(key=k, dialogue=f"shared picture {i}", date=f"2026-0{i + 1}-01") for i, k in enumerate(keys)]
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    state = scorer.pack(QUESTION, by_key)
    assert state.image_keys == keys
    expected = Scorer.load(tiny_checkpoint).score(QUESTION, by_value())   # same images, notes given by value
    assert_scores_equal(scorer.score(QUESTION, by_key), expected)
    # an explicit note overrides the cached one
    overridden = [Memory(key=keys[0], note="something else")] + by_key[1:]
    assert scorer.pack(QUESTION, overridden).input_ids.tolist() != state.input_ids.tolist()


def test_key_errors_name_the_memory(tiny_checkpoint, cache):
    key = cache.put(images()[0])
    with pytest.raises(InvalidMemoryError, match="memory 2: .*no cache"):
        Scorer.load(tiny_checkpoint).score(QUESTION, [Memory(image=images()[1]), Memory(key=key)])
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    with pytest.raises(InvalidMemoryError, match="memory 2: key 'f+' is not in the cache"):
        scorer.score(QUESTION, [Memory(key=key), Memory(key="f" * 64)])


def test_corrupt_features_are_recomputed(tiny_checkpoint, cache, caplog):
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    first = scorer.score(QUESTION, by_value())
    with sqlite3.connect(cache.path) as conn:
        conn.execute("UPDATE features SET data = X'00112233'")
    again = scorer.score(QUESTION, by_value())
    assert scorer.vision_counts["computed"] == 8
    assert "corrupt" in caplog.text
    assert_scores_equal(again, first)
    third = scorer.score(QUESTION, by_value())                         # repaired rows are reused
    assert scorer.vision_counts == {"cached": 4, "computed": 8}
    assert_scores_equal(third, first)


def test_features_are_keyed_by_model_fingerprint(tiny_checkpoint, cache):
    f32 = Scorer.load(tiny_checkpoint, cache=cache)
    bf16 = Scorer.load(tiny_checkpoint, dtype=torch.bfloat16, cache=cache)
    assert f32.vision_fingerprint != bf16.vision_fingerprint
    assert f32.vision_fingerprint == Scorer.load(tiny_checkpoint).vision_fingerprint
    f32.score(QUESTION, by_value())
    bf16.score(QUESTION, by_value())
    assert bf16.vision_counts == {"cached": 0, "computed": 4}         # never another model's features


def test_fingerprint_changes_with_the_vision_weights(tiny_copy):
    before = Scorer.load(tiny_copy).vision_fingerprint
    scorer = Scorer.load(tiny_copy)
    scorer.weights.vision.blocks[0].fc1_b.add_(1e-3)
    scorer._fingerprint = None
    assert scorer.vision_fingerprint != before


def test_score_cli_with_cache(tiny_checkpoint, tmp_path, capsys):
    db = tmp_path / "cache.db"
    paths = []
    for i, im in enumerate(images()[:2]):
        path = tmp_path / f"m{i}.png"
        (im if isinstance(im, Image.Image) else Image.open(io.BytesIO(im))).convert("RGB").save(path)
        paths.append(path)
    assert main(["cache", "put", str(db), *map(str, paths)]) == 0
    keys = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    episode = tmp_path / "episode.json"
    episode.write_text(json.dumps({"question": QUESTION, "memories": [{"key": k, "date": "2026-01-01"} for k in keys]}))
    args = ["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode), "--cache", str(db), "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert len(first["memories"]) == 2
    sizes = [Image.open(p).size for p in paths]
    assert first["visual_tokens"]["open_all"] == sum(visual_tokens(s) for s in sizes)
    assert second["p_vis"] == pytest.approx(first["p_vis"], abs=ATOL)
    with Cache(db) as c:
        assert c.stats()["feature_rows"] == 2


def test_cache_keeps_the_displayed_size(cache):
    img = Image.new("RGB", (300, 120), (1, 2, 3))
    exif = Image.Exif()
    exif[0x0112] = 6                                                  # rotate 90: displayed 120 x 300
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    key = cache.put(buf.getvalue())
    assert cache.size(key) == (120, 300)
    assert cache.thumbnail(key).size == (120, 300)
    assert cache.size(cache.put(Image.new("L", (64, 96)))) == (64, 96)


def test_version_1_cache_gains_size_columns(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript("""
            CREATE TABLE images (key TEXT PRIMARY KEY, thumbnail BLOB NOT NULL, checksum TEXT NOT NULL,
                                 note TEXT NOT NULL DEFAULT '', created REAL NOT NULL);
            CREATE TABLE features (key TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
                                   fingerprint TEXT NOT NULL, data BLOB NOT NULL, checksum TEXT NOT NULL,
                                   created REAL NOT NULL, PRIMARY KEY (key, fingerprint));
            PRAGMA user_version = 1;""")
        buf = io.BytesIO()
        Image.new("RGB", (40, 30)).save(buf, format="PNG")
        import hashlib
        conn.execute("INSERT INTO images VALUES (?, ?, ?, 'old note', 0)",
                     ("a" * 64, buf.getvalue(), hashlib.sha256(buf.getvalue()).hexdigest()))
    with Cache(path) as c:
        assert c.note("a" * 64) == "old note" and c.size("a" * 64) is None
        key = c.put(Image.new("RGB", (50, 20)))
        assert c.size(key) == (50, 20)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == VERSION     # migrated all the way


def test_delivery_api_is_exported_from_the_package():
    import pixeltriage

    for name in ("Cache", "top_k", "RateGate", "token_budget", "retrieval_order", "random_policy", "downsize_all",
                 "visual_tokens", "delivery_cost", "cost_ratio", "pixel_host_messages", "text_host_messages",
                 "stamp_tag"):
        assert name in pixeltriage.__all__ and callable(getattr(pixeltriage, name))


def test_a_checkpoint_with_another_thumbnail_size_refuses_the_cache(tiny_copy, cache):
    from pixeltriage import CheckpointError

    cfg = json.loads((tiny_copy / "pixeltriage.json").read_text())
    cfg["state"]["thumbnail_size"] = 224
    (tiny_copy / "pixeltriage.json").write_text(json.dumps(cfg))
    Scorer.load(tiny_copy)                                            # fine without a cache
    with pytest.raises(CheckpointError, match="thumbnail_size is 224.*336-px"):
        Scorer.load(tiny_copy, cache=cache)


def test_unreadable_images_name_the_memory_with_a_cache_too(tiny_checkpoint, cache, tmp_path):
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    for bad in (b"not an image", str(tmp_path / "missing.png")):
        with pytest.raises(InvalidMemoryError) as info:
            scorer.score(QUESTION, [by_value()[0], Memory(image=bad)])
        assert info.value.index == 1
