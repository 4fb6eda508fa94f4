"""Region vectors in the write-time cache: the regions table (schema 3), checksums, write sequence numbers that a
reader can follow, corrupt rows read as missing, and the migration of older files."""
import hashlib
import io
import logging
import random
import sqlite3

import numpy as np
import pytest
import torch
from PIL import Image

from pixeltriage.engine.cache import SCHEMA_VERSION, Cache, CacheMissError


def noise_png(seed: int, size=(48, 32)) -> bytes:
    rng = random.Random(seed)
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def raw(path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


@pytest.fixture
def cache(tmp_path):
    with Cache(tmp_path / "cache.db") as c:
        yield c


def vectors(seed: int, rows=5, dim=8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def test_round_trip_and_replacement_get_new_sequence_numbers(cache):
    a, b = cache.put(noise_png(1)), cache.put(noise_png(2))
    assert cache.get_regions(a, "enc") is None and cache.region_state("enc") == (0, 0)
    first = cache.put_regions(a, "enc", vectors(1))
    second = cache.put_regions(b, "enc", torch.from_numpy(vectors(2)))           # a tensor works too
    cache.put_regions(a, "other", vectors(3, rows=2, dim=3))
    assert np.array_equal(cache.get_regions(a, "enc"), vectors(1))
    assert cache.get_regions(a, "enc").dtype == np.float32
    assert np.array_equal(cache.get_regions(a, "other"), vectors(3, rows=2, dim=3))
    assert [(r.seq, r.key) for r in cache.region_rows("enc")] == [(first, a), (second, b)]
    third = cache.put_regions(a, "enc", vectors(4))                                # replaces a's row
    assert third > second > first
    assert [(r.key, r.seq) for r in cache.region_rows("enc", after=second)] == [(a, third)]
    assert np.array_equal(cache.get_regions(a, "enc"), vectors(4))
    assert cache.region_state("enc") == (third, 0)                               # a replacement deletes nothing
    assert cache.region_fingerprints() == {"enc": 2, "other": 1}
    stats = cache.stats()
    assert stats["region_rows"] == 3 and stats["region_bytes"] == (2 * 5 * 8 + 2 * 3) * 4


def test_sequence_numbers_are_never_reused_and_deletions_are_counted(cache):
    keys = [cache.put(noise_png(i)) for i in range(3)]
    seqs = [cache.put_regions(k, "enc", vectors(i)) for i, k in enumerate(keys)]
    cache.put_regions(keys[2], "other", vectors(5))
    cache._conn().execute("DELETE FROM images WHERE key = ?", (keys[2],))           # cascades to its two rows
    assert cache.region_state("enc") == (seqs[1], 2) and cache.region_fingerprints() == {"enc": 2}
    assert cache.put_regions(keys[0], "enc", vectors(9)) > seqs[2]                 # AUTOINCREMENT
    cache._conn().execute("DELETE FROM regions WHERE key = ?", (keys[1],))
    assert cache.region_state("enc")[1] == 3 and cache.region_state("other") == (0, 3)


def test_paging_reads_every_row_in_order(cache):
    keys = [cache.put(noise_png(10 + i)) for i in range(7)]
    seqs = cache.put_regions_many("enc", [(k, vectors(i)) for i, k in enumerate(keys)])
    rows = list(cache.region_rows("enc", page=3))
    assert [r.seq for r in rows] == seqs and [r.key for r in rows] == keys
    assert all(np.array_equal(r.vectors, vectors(i)) for i, r in enumerate(rows))
    assert [r.key for r in cache.region_rows("enc", after=seqs[3], page=2)] == keys[4:]


def test_what_is_refused(cache):
    with pytest.raises(CacheMissError, match="put it before its region vectors"):
        cache.put_regions("0" * 64, "enc", vectors(0))
    key = cache.put(noise_png(3))
    for bad in (np.zeros(8, np.float32), np.zeros((0, 8), np.float32), np.full((5, 8), np.nan, np.float32)):
        with pytest.raises(ValueError, match="region vectors"):
            cache.put_regions(key, "enc", bad)
    with pytest.raises(ValueError, match="fingerprint"):
        cache.put_regions(key, "", vectors(0))
    assert cache.region_state("enc") == (0, 0)
    # one bad pair stores nothing of its batch
    with pytest.raises(CacheMissError):
        cache.put_regions_many("enc", [(key, vectors(0)), ("f" * 64, vectors(1))])
    assert cache.get_regions(key, "enc") is None


@pytest.mark.parametrize("damage", ["flipped byte", "text", "short", "other key", "count"])
def test_a_corrupt_row_is_deleted_with_a_warning_and_read_as_missing(cache, damage, caplog):
    a, b = cache.put(noise_png(4)), cache.put(noise_png(5))
    cache.put_regions(a, "enc", vectors(1))
    cache.put_regions(b, "enc", vectors(2))
    with raw(cache.path) as conn:
        if damage == "flipped byte":
            data = bytearray(conn.execute("SELECT vectors FROM regions WHERE key = ?", (a,)).fetchone()[0])
            data[7] ^= 0x01
            conn.execute("UPDATE regions SET vectors = ? WHERE key = ?", (bytes(data), a))
        elif damage == "text":
            conn.execute("UPDATE regions SET vectors = 'garbage' WHERE key = ?", (a,))
        elif damage == "short":
            conn.execute("UPDATE regions SET vectors = substr(vectors, 1, 12) WHERE key = ?", (a,))
        elif damage == "other key":                  # b's sound row copied under a's key: its checksum names b
            row = conn.execute("SELECT vectors, checksum FROM regions WHERE key = ?", (b,)).fetchone()
            conn.execute("UPDATE regions SET vectors = ?, checksum = ? WHERE key = ?", (*row, a))
        else:
            conn.execute("UPDATE regions SET count = 4, dim = 10 WHERE key = ?", (a,))
    with caplog.at_level(logging.WARNING, logger="pixeltriage.engine.cache"):
        assert [r.key for r in cache.region_rows("enc")] == [b]
    assert f"region vectors of {a} (enc) are corrupt" in caplog.text
    assert cache.region_fingerprints() == {"enc": 1} and cache.region_state("enc")[1] == 1     # deleted
    assert cache.keys_without_regions("enc") == [a]
    cache.put_regions(a, "enc", vectors(1))                          # recomputed from the image
    assert np.array_equal(cache.get_regions(a, "enc"), vectors(1))


def test_get_regions_of_a_corrupt_row(cache, caplog):
    key = cache.put(noise_png(6))
    cache.put_regions(key, "enc", vectors(1))
    with raw(cache.path) as conn:
        conn.execute("UPDATE regions SET checksum = ?", (hashlib.sha256(b"x").hexdigest(),))
    with caplog.at_level(logging.WARNING):
        assert cache.get_regions(key, "enc") is None
    assert "corrupt" in caplog.text and cache.region_state("enc") == (0, 1)


def test_keys_without_regions(cache):
    keys = [cache.put(noise_png(20 + i)) for i in range(3)]
    cache.put_regions(keys[1], "enc", vectors(0))
    assert cache.keys_without_regions("enc") == [keys[0], keys[2]]
    assert cache.keys_without_regions("other") == keys


def _downgrade(path, version: int) -> None:
    """Make a current file look like one written by schema `version` (1 or 2)."""
    with raw(path) as conn:
        conn.execute("DROP TRIGGER images_deleted")                          # neither version had it
        conn.execute("DROP TABLE regions")
        if version == 1:
            conn.execute("ALTER TABLE images DROP COLUMN width")
            conn.execute("ALTER TABLE images DROP COLUMN height")
        conn.execute(f"PRAGMA user_version = {version}")


@pytest.mark.parametrize("version", [1, 2])
def test_older_files_gain_the_regions_table(tmp_path, version):
    path = tmp_path / "old.db"
    with Cache(path) as c:
        key = c.put(noise_png(7), note="kept")
        c.put_features(key, "vit", torch.ones(3))
    _downgrade(path, version)
    with Cache(path) as c:
        assert c.note(key) == "kept" and torch.equal(c.get_features(key, "vit"), torch.ones(3))
        assert c.size(key) == ((48, 32) if version == 2 else None)
        c.put_regions(key, "enc", vectors(0))
        assert np.array_equal(c.get_regions(key, "enc"), vectors(0))
        c._conn().execute("DELETE FROM images")
        assert c.region_state("enc") == (0, 1)                                  # the trigger came with it
        assert c.integrity_check() == "ok"
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "regions_by_fingerprint" in indexes


def test_deleting_an_image_without_foreign_keys_deletes_its_vectors(cache):
    """The sqlite3 shell and Python's sqlite3 leave foreign keys off; the image's rows still go with it."""
    a, b = cache.put(noise_png(1)), cache.put(noise_png(2))
    cache.put_regions(a, "enc", vectors(1))
    cache.put_regions(b, "enc", vectors(2))
    conn = raw(cache.path)
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 0
    conn.execute("DELETE FROM images WHERE key = ?", (a,))
    conn.close()
    assert [row.key for row in cache.region_rows("enc")] == [b]
    assert cache.region_state("enc")[1] == 1                                # readers holding it learn of it


def test_rows_orphaned_before_the_trigger_are_removed_on_open(tmp_path):
    path = tmp_path / "old.db"
    with Cache(path) as c:
        key = c.put(noise_png(3))
        c.put_regions(key, "enc", vectors(3))
    conn = raw(path)
    conn.execute("DROP TRIGGER images_deleted")                             # as a file written before it existed
    conn.execute("DELETE FROM images")
    assert conn.execute("SELECT COUNT(*) FROM regions").fetchone()[0] == 1
    conn.close()
    with Cache(path) as c:
        assert list(c.region_rows("enc")) == []


@pytest.mark.parametrize("width, height", [("abc", 10), (b"\x00", 10), (0, 10), (-5, 7), (2.5, 10)])
def test_a_damaged_size_reads_as_unknown(cache, caplog, width, height):
    key = cache.put(noise_png(4))
    conn = raw(cache.path)
    conn.execute("UPDATE images SET width = ?, height = ? WHERE key = ?", (width, height, key))
    conn.close()
    with caplog.at_level(logging.WARNING):
        assert cache.size(key) is None
    assert "stored size" in caplog.text and "damaged" in caplog.text
