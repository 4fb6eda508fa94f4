"""The region index over the write-time cache: MaxSim against an independent computation, a small object in a corner
found by its region and missed by whole-image scoring, fingerprint keying, corrupt and missing rows, incremental
refresh, concurrent writer processes, and the SigLIP 2 demo end to end."""
import io
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pixeltriage.errors import InvalidMemoryError
from pixeltriage.retrieval.index import Hit, RegionIndex, index_fingerprint
from pixeltriage.retrieval.regions import Box, RegionGrid, region_crops
from pixeltriage.retrieval.search import faiss_available
from pixeltriage.store.cache import Cache, image_key
from region_toys import ColourEncoder, colour_shares

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GREY = (128, 128, 128)


def png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def corner_cue() -> bytes:
    """200 x 200 grey with a 26 x 26 red square in the bottom-right corner: 1.7% of the frame (DMV-Bench's median
    cue), 4.3% of the 125 x 125 bottom-right tile."""
    pixels = np.full((200, 200, 3), GREY, dtype=np.uint8)
    pixels[174:, 174:] = (220, 20, 20)
    return png(Image.fromarray(pixels))


def thin_stripes() -> bytes:
    """Six red rows spread over the frame: 3% red everywhere, at most 3.2% in any tile."""
    pixels = np.full((200, 200, 3), GREY, dtype=np.uint8)
    pixels[[0, 33, 66, 100, 133, 166]] = (220, 20, 20)
    return png(Image.fromarray(pixels))


def plain(colour, size=(120, 90)) -> bytes:
    return png(Image.new("RGB", size, colour))


def expected_maxsim(image: bytes, query: np.ndarray, grid=RegionGrid()) -> tuple[float, int]:
    """The score and winning region computed here, independently of the index: the cosine of the query and each
    crop's colour shares, maximised over the five crops."""
    scores = []
    for crop in region_crops(image, grid):
        shares = colour_shares(crop)
        scores.append(float(shares @ query / np.linalg.norm(shares)))
    return max(scores), int(np.argmax(scores))


@pytest.fixture
def cache(tmp_path):
    with Cache(tmp_path / "cache.db") as c:
        yield c


def test_a_small_object_in_a_corner_is_found_by_its_region_and_missed_by_the_whole_image(cache):
    index = RegionIndex(cache, ColourEncoder())
    cue, stripes = corner_cue(), thin_stripes()
    keys = index.add_many([plain(GREY), cue, plain((20, 20, 220)), stripes, plain((20, 200, 20))],
                          ["grey", "cue", "blue", "stripes", "green"])
    regions = index.search("the red sticker", top=3)
    assert [h.key for h in regions[:2]] == [keys[1], keys[3]]
    assert regions[0].region == "bottom-right" and regions[0].box == Box(75, 75, 200, 200)
    assert regions[0].score == pytest.approx(676 / 15625 / np.hypot(676 / 15625, 1 - 676 / 15625), abs=1e-6)
    whole = index.search("the red sticker", top=3, whole_image=True)
    assert [h.key for h in whole[:2]] == [keys[3], keys[1]]                   # the stripes' 3% beats the cue's 1.7%
    assert {h.region for h in whole} == {"whole"} and whole[0].box == Box(0, 0, 200, 200)
    assert whole[1].score == pytest.approx(676 / 40000 / np.hypot(676 / 40000, 1 - 676 / 40000), abs=1e-6)


def test_maxsim_ranking_against_an_independent_computation(cache):
    rng = np.random.default_rng(0)
    images = []
    for i in range(12):                                    # grey frames with a few coloured blocks of random size
        pixels = np.full((90 + 7 * i, 130 - 5 * i, 3), GREY, dtype=np.uint8)
        for colour in [(220, 20, 20), (20, 220, 20), (20, 20, 220)]:
            h, w = rng.integers(3, 40, 2)
            top, left = rng.integers(0, pixels.shape[0] - h), rng.integers(0, pixels.shape[1] - w)
            pixels[top:top + h, left:left + w] = colour
        images.append(png(Image.fromarray(pixels)))
    index = RegionIndex(cache, ColourEncoder(), images_per_batch=5)
    keys = index.add_many(images)
    for word, query in [("red", [1, 0, 0, 0]), ("green", [0, 1, 0, 0]), ("blue", [0, 0, 1, 0])]:
        expected = sorted(((*expected_maxsim(img, np.array(query)), key) for img, key in zip(images, keys)),
                          key=lambda t: -t[0])
        hits = index.search(f"the {word} one", top=12)
        assert [h.key for h in hits] == [key for _, _, key in expected]
        for hit, (score, region, _) in zip(hits, expected):
            assert hit.score == pytest.approx(score, abs=1e-6) and hit.region == RegionGrid().names[region]
    assert len(index.search("red", top=5)) == 5 and len(index.search("red", top=100)) == 12


def test_the_fingerprint_keys_the_vectors(cache):
    a, b = ColourEncoder("a"), ColourEncoder("b")
    index_a, index_b = RegionIndex(cache, a), RegionIndex(cache, b)
    assert index_a.fingerprint == index_fingerprint("toy-a", RegionGrid()) != index_b.fingerprint
    assert RegionIndex(cache, a, RegionGrid(0.1)).fingerprint != index_a.fingerprint      # the grid too
    keys = index_a.add_many([corner_cue(), thin_stripes(), plain(GREY)])
    assert len(index_b.search("red", top=10)) == 0 and index_b.unindexed() == keys
    index_b.add(plain(GREY))                                                  # already in the cache: vectors only
    assert a.images_encoded == 15 and b.images_encoded == 5
    assert [h.key for h in index_b.search("red", top=10)] == [keys[2]]
    assert len(index_a.search("red", top=10)) == 3 and index_a.unindexed() == []
    assert RegionIndex(cache, a, RegionGrid(0.1)).unindexed() == keys
    assert index_a.store.fingerprints() == {index_a.fingerprint: 3, index_b.fingerprint: 1}


def test_adding_is_idempotent_and_recompute_re_encodes(cache):
    encoder = ColourEncoder()
    index = RegionIndex(cache, encoder)
    key = index.add(corner_cue(), note="first")
    assert index.add(corner_cue()) == key and encoder.images_encoded == 5    # a sound row is kept
    assert cache.note(key) == "first"
    index.add(corner_cue(), note="second", recompute=True)
    assert encoder.images_encoded == 10 and cache.note(key) == "second"
    assert index.add_many([thin_stripes(), thin_stripes()]) == [image_key(thin_stripes())] * 2
    assert encoder.images_encoded == 15                                       # a repeated image is encoded once
    assert key == image_key(corner_cue())


def _corrupt(cache, key):
    with sqlite3.connect(cache.path, isolation_level=None) as conn:
        data = bytearray(conn.execute("SELECT vectors FROM regions WHERE key = ?", (key,)).fetchone()[0])
        data[0] ^= 0x40
        conn.execute("UPDATE regions SET vectors = ? WHERE key = ?", (bytes(data), key))


def test_a_corrupt_row_is_reported_at_search_and_recomputed_when_the_image_is_at_hand(cache, caplog):
    encoder = ColourEncoder()
    index = RegionIndex(cache, encoder)
    cue, stripes = corner_cue(), thin_stripes()
    keys = index.add_many([cue, stripes])
    _corrupt(cache, keys[0])
    with caplog.at_level(logging.WARNING):
        fresh = RegionIndex(cache, encoder)                  # loads everything: the corrupt row is met here
        assert [h.key for h in fresh.search("red", top=5)] == [keys[1]]
    assert f"region vectors of {keys[0]}" in caplog.text and "corrupt" in caplog.text
    assert fresh.unindexed() == [keys[0]]
    fresh.add(cue)                                           # the image is at hand: recomputed
    assert encoder.images_encoded == 15
    assert [h.key for h in fresh.search("red", top=5)] == keys and fresh.unindexed() == []
    # corrupt while held in memory, found again by add: a warning, then recomputed
    _corrupt(cache, keys[1])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fresh.add(stripes)
    assert f"region vectors of {keys[1]}" in caplog.text and encoder.images_encoded == 20
    assert [h.key for h in fresh.search("red", top=5)] == keys


def test_rows_written_or_removed_elsewhere_are_followed(cache, tmp_path):
    index = RegionIndex(cache, ColourEncoder())
    first = index.add(corner_cue())
    assert [h.key for h in index.search("red", top=5)] == [first]
    with Cache(cache.path) as other:                         # another connection, as another process would
        writer = RegionIndex(other, ColourEncoder())
        second = writer.add(thin_stripes())
        assert index.refresh() == 1 and len(index) == 2       # only the new row is read
        writer.add_vectors(first, torch.tensor([[0.0, 0, 0, 1]] * 5))         # first replaced: no red any more
        assert index.refresh() == 1
        assert [h.key for h in index.search("red", top=1)] == [second]
        with other.transaction() as conn:
            conn.execute("DELETE FROM images WHERE key = ?", (second,))  # cascades to its vectors
    assert [h.key for h in index.search("red", top=5)] == [first] and len(index) == 1


def test_after_a_deletion_the_held_vectors_are_not_read_again(cache):
    """A deletion drops what went and reads no vector again; another fingerprint's deletions cost nothing."""
    index, other = RegionIndex(cache, ColourEncoder()), RegionIndex(cache, ColourEncoder("other"))
    keys = index.add_many([corner_cue(), thin_stripes(), plain(GREY)])
    other.add(plain(GREY))
    assert index.refresh() == 3 and other.refresh() == 1
    with cache.transaction() as conn:
        conn.execute("DELETE FROM regions WHERE fingerprint = ?", (other.fingerprint,))
    assert index.refresh() == 0 and len(index) == 3
    assert other.refresh() == 0 and len(other) == 0
    with cache.transaction() as conn:
        conn.execute("DELETE FROM images WHERE key = ?", (keys[1],))          # cascades to its vectors
    assert index.refresh() == 0 and len(index) == 2 and keys[1] not in index
    assert [h.key for h in index.search("red", top=5)] == [keys[0], keys[2]]
    with cache.transaction() as conn:
        conn.execute("DELETE FROM regions WHERE key = ?", (keys[0],))          # deleted, then
    index.add(corner_cue())                                                              # written again
    assert index.refresh() == 1 and len(index) == 2 and keys[0] in index
    assert [h.key for h in index.search("red", top=5)] == [keys[0], keys[2]]


def test_a_row_of_the_wrong_shape_is_not_searched_and_recomputed_by_add(cache, caplog):
    encoder = ColourEncoder()
    index = RegionIndex(cache, encoder)
    keys = index.add_many([corner_cue(), thin_stripes(), plain(GREY)])
    assert len(index.search("red", top=5)) == 3
    index.store.put(keys[0], index.fingerprint, np.ones((3, 4), np.float32))         # a sound row, but 3 regions
    with caplog.at_level(logging.WARNING):
        assert [h.key for h in index.search("red", top=5)] == [keys[1], keys[2]]
    assert "have shape (3, 4), expected (5, 4); deleting the row" in caplog.text
    assert len(index) == 2 and keys[0] not in index                                    # the held row went too
    assert index.unindexed() == [keys[0]]                                              # named, as a corrupt row is
    index.add(corner_cue())
    assert encoder.images_encoded == 20 and [h.key for h in index.search("red", top=1)] == [keys[0]]


def test_add_many_names_the_bad_image(cache, tmp_path):
    index = RegionIndex(cache, ColourEncoder(), images_per_batch=2)
    images = [plain(GREY), corner_cue(), b"not an image", thin_stripes()]
    with pytest.raises(InvalidMemoryError, match="memory 3: .*not a recognised image") as info:
        index.add_many(images)
    assert info.value.index == 2
    assert len(cache) == 2                                   # the first batch is stored, the bad one's is not
    with pytest.raises(InvalidMemoryError, match="memory 2: .*missing.png"):
        index.add_many([plain(GREY), tmp_path / "missing.png"])
    with pytest.raises(ValueError, match="2 images but 1 notes"):
        index.add_many([plain(GREY), corner_cue()], ["one"])
    path = tmp_path / "cue.png"
    path.write_bytes(corner_cue())
    assert index.add(path) == image_key(corner_cue())         # a path keys as its bytes


def test_search_arguments(cache):
    index = RegionIndex(cache, ColourEncoder())
    assert index.search("red") == [] and index.search_many(["a", "b"]) == [[], []]
    with pytest.raises(ValueError, match="top must be a positive integer"):
        index.search("red", top=0)
    with pytest.raises(TypeError, match="list of questions"):
        index.search_many("red")
    with pytest.raises(ValueError, match="queries: expected"):
        index.search_vectors(torch.ones(1, 3))
    with pytest.raises(ValueError, match="backend"):
        RegionIndex(cache, ColourEncoder(), backend="annoy")
    key = index.add(corner_cue())
    with pytest.raises(ValueError, match=r"vectors: expected \[5, 4\]"):
        index.add_vectors(key, torch.ones(4, 4))
    hit = index.search("red")[0]
    assert hit.to_dict() == {"key": key, "score": hit.score, "region": "bottom-right", "box": [75, 75, 200, 200]}


@pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed")
def test_the_faiss_backend_ranks_as_the_exact_one(cache):
    rng = np.random.default_rng(3)
    exact, quantized = RegionIndex(cache, ColourEncoder()), RegionIndex(cache, ColourEncoder(), backend="faiss")
    exact.add_many([png(Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))) for _ in range(30)])
    for word in ("red", "green", "blue", "grey"):
        assert quantized.search(word, top=7) == exact.search(word, top=7)
    exact.add(corner_cue())                                   # appended to the faiss index on the next search
    assert quantized.search("red", top=3) == exact.search("red", top=3)


WRITER = r"""
import sys
sys.path[:0] = [sys.argv[3]]
from region_toys import ColourEncoder
from test_region_index import palette
from pixeltriage.retrieval.index import RegionIndex
from pixeltriage.store.cache import Cache

db, worker = sys.argv[1], int(sys.argv[2])
images = palette()
mine = images[:8] + images[8 + 4 * worker: 12 + 4 * worker]          # 8 shared, 4 of its own
with Cache(db, busy_timeout_ms=120_000) as cache:
    index = RegionIndex(cache, ColourEncoder(), images_per_batch=3)
    for image in mine:                                               # one at a time: many short transactions
        print(index.add(image), flush=True)
"""


def palette() -> list[bytes]:
    """20 distinct images: red blocks of growing size in grey frames."""
    out = []
    for i in range(20):
        pixels = np.full((64, 96, 3), GREY, dtype=np.uint8)
        pixels[:4 + 2 * i, :6 + i] = (220, 20, 20)
        out.append(png(Image.fromarray(pixels)))
    return out


def test_concurrent_writer_processes(tmp_path):
    db = tmp_path / "shared.db"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    with Cache(db) as cache:
        reader = RegionIndex(cache, ColourEncoder())
        assert reader.search("red") == []                    # loaded before the writers start
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
        procs = [subprocess.Popen([sys.executable, str(script), str(db), str(w), str(HERE)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(3)]
        outputs = [p.communicate(timeout=600) for p in procs]
        for p, (_, err) in zip(procs, outputs):
            assert p.returncode == 0, err
        images = palette()
        keys = [image_key(img) for img in images]
        assert set().union(*(set(out.split()) for out, _ in outputs)) == set(keys)
        assert cache.integrity_check() == "ok" and len(cache) == 20
        assert reader.store.fingerprints() == {reader.fingerprint: 20}
        hits = reader.search("red", top=20)                  # incremental: rows from three other processes
        assert len(reader) == 20 and sorted(h.key for h in hits) == sorted(keys)
        for hit in hits:
            score, region = expected_maxsim(images[keys.index(hit.key)], np.array([1.0, 0, 0, 0]))
            assert hit.score == pytest.approx(score, abs=1e-6) and hit.region == RegionGrid().names[region]


def test_the_siglip_demo_end_to_end(cache, tiny_encoder):
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (50 + 9 * i, 70, 3), dtype=np.uint8)) for i in range(6)]
    index = RegionIndex(cache, tiny_encoder, images_per_batch=4)       # 4 images = 20 crops, 5 forwards of 4
    keys = index.add_many(images)
    hits = index.search("a photo of a red mug", top=6)
    query = tiny_encoder.encode_texts(["a photo of a red mug"])[0]
    want = []
    for key, img in zip(keys, images):
        scores = tiny_encoder.encode_images(region_crops(img)) @ query
        want.append((float(scores.max()), int(scores.argmax()), key))
    want.sort(key=lambda t: -t[0])
    assert [h.key for h in hits] == [k for *_, k in want]
    for hit, (score, region, _) in zip(hits, want):
        assert hit.score == pytest.approx(score, abs=1e-5) and hit.region == RegionGrid().names[region]
    assert all(isinstance(h, Hit) for h in hits) and len(cache) == 6
