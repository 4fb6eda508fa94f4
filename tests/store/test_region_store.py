"""Region vectors in the write-time cache's file (`RegionStore`): checksums, write sequence numbers that a reader can
follow, deletions counted per fingerprint, corrupt rows and rows of another shape read as missing, the tables made
with the file, and files written before the region tables existed."""
import hashlib
import io
import logging
import random
import sqlite3

import numpy as np
import pytest
import torch
from PIL import Image

from pixeltriage.errors import PixelTriageError
from pixeltriage.store.cache import Cache, CacheMissError
from pixeltriage.store.regions import RegionStore
from pixeltriage.store.schema import VERSION


def noise_png(seed: int, size=(48, 32)) -> bytes:
    rng = random.Random(seed)
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def connect(path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def names(path, kind: str) -> set[str]:
    with connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = ?", (kind,))}


@pytest.fixture
def store(cache):
    return RegionStore(cache)


def vectors(seed: int, rows=5, dim=8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def test_round_trip_and_replacement_get_new_sequence_numbers(cache, store):
    a, b = cache.put(noise_png(1)), cache.put(noise_png(2))
    assert store.get(a, "enc") is None and store.state("enc") == (0, 0)
    first = store.put(a, "enc", vectors(1))
    second = store.put(b, "enc", torch.from_numpy(vectors(2)))                   # a tensor works too
    store.put(a, "other", vectors(3, rows=2, dim=3))
    assert np.array_equal(store.get(a, "enc"), vectors(1)) and store.get(a, "enc").dtype == np.float32
    assert np.array_equal(store.get(a, "other"), vectors(3, rows=2, dim=3))
    assert [(r.seq, r.key) for r in store.rows("enc")] == [(first, a), (second, b)]
    third = store.put(a, "enc", vectors(4))                                        # replaces a's row
    assert third > second > first
    assert [(r.key, r.seq) for r in store.rows("enc", after=second)] == [(a, third)]
    assert np.array_equal(store.get(a, "enc"), vectors(4))
    assert store.state("enc") == (third, 0)                                      # a replacement deletes nothing
    assert store.fingerprints() == {"enc": 2, "other": 1} and store.keys("enc") == {a, b}
    assert store.stats() == {"region_rows": 3,
                             "region_bytes": (2 * 5 * 8 + 2 * 3) * 4}
    assert "region_rows" not in cache.stats()                                    # the cache counts its own rows


def test_sequence_numbers_are_never_reused_and_deletions_are_counted_per_fingerprint(cache, store):
    keys = [cache.put(noise_png(i)) for i in range(3)]
    seqs = [store.put(k, "enc", vectors(i)) for i, k in enumerate(keys)]
    store.put(keys[2], "other", vectors(5))
    with cache.transaction() as conn:
        conn.execute("DELETE FROM images WHERE key = ?", (keys[2],))               # cascades to its two rows
    assert store.state("enc") == (seqs[1], 1) and store.state("other") == (0, 1)
    assert store.fingerprints() == {"enc": 2}
    assert store.put(keys[0], "enc", vectors(9)) > seqs[2]                         # AUTOINCREMENT
    with cache.transaction() as conn:
        conn.execute("DELETE FROM regions WHERE key = ?", (keys[1],))
    assert store.state("enc")[1] == 2 and store.state("other") == (0, 1)           # the other one's count stays
    assert store.state("never written") == (0, 0)


def test_paging_reads_every_row_in_order(cache, store):
    keys = [cache.put(noise_png(10 + i)) for i in range(7)]
    seqs = store.put_many("enc", [(k, vectors(i)) for i, k in enumerate(keys)])
    rows = list(store.rows("enc", page=3))
    assert [r.seq for r in rows] == seqs and [r.key for r in rows] == keys
    assert all(np.array_equal(r.vectors, vectors(i)) for i, r in enumerate(rows))
    assert [r.key for r in store.rows("enc", after=seqs[3], page=2)] == keys[4:]


def test_what_is_refused(cache, store):
    with pytest.raises(CacheMissError, match="put it before its region vectors"):
        store.put("0" * 64, "enc", vectors(0))
    key = cache.put(noise_png(3))
    for bad in (np.zeros(8, np.float32), np.zeros((0, 8), np.float32), np.full((5, 8), np.nan, np.float32)):
        with pytest.raises(ValueError, match="region vectors"):
            store.put(key, "enc", bad)
    with pytest.raises(ValueError, match="fingerprint"):
        store.put(key, "", vectors(0))
    with pytest.raises(ValueError, match="fingerprint"):
        list(store.rows(""))
    assert store.state("enc") == (0, 0)
    # one bad pair stores nothing of its batch: one transaction
    with pytest.raises(CacheMissError):
        store.put_many("enc", [(key, vectors(0)), ("f" * 64, vectors(1))])
    assert store.get(key, "enc") is None


@pytest.mark.parametrize("damage", ["flipped byte", "text", "short", "other key", "count"])
def test_a_corrupt_row_is_deleted_with_a_warning_and_read_as_missing(cache, store, raw, damage, caplog):
    a, b = cache.put(noise_png(4)), cache.put(noise_png(5))
    store.put(a, "enc", vectors(1))
    store.put(b, "enc", vectors(2))
    if damage == "flipped byte":
        data = bytearray(raw.one("SELECT vectors FROM regions WHERE key = ?", (a,)))
        data[7] ^= 0x01
        raw("UPDATE regions SET vectors = ? WHERE key = ?", (bytes(data), a))
    elif damage == "text":
        raw("UPDATE regions SET vectors = 'garbage' WHERE key = ?", (a,))
    elif damage == "short":
        raw("UPDATE regions SET vectors = substr(vectors, 1, 12) WHERE key = ?", (a,))
    elif damage == "other key":                      # b's sound row copied under a's key: its checksum names b
        row = raw("SELECT vectors, checksum FROM regions WHERE key = ?", (b,))[0]
        raw("UPDATE regions SET vectors = ?, checksum = ? WHERE key = ?", (*row, a))
    else:
        raw("UPDATE regions SET count = 4, dim = 10 WHERE key = ?", (a,))
    with caplog.at_level(logging.WARNING, logger="pixeltriage.store.regions"):
        assert [r.key for r in store.rows("enc")] == [b]
    assert f"region vectors of {a} (enc) are corrupt" in caplog.text
    assert store.fingerprints() == {"enc": 1} and store.state("enc")[1] == 1      # deleted
    assert store.keys_without("enc") == [a]
    store.put(a, "enc", vectors(1))                                  # recomputed from the image
    assert np.array_equal(store.get(a, "enc"), vectors(1))


def test_get_of_a_corrupt_row(cache, store, raw, caplog):
    key = cache.put(noise_png(6))
    store.put(key, "enc", vectors(1))
    raw("UPDATE regions SET checksum = ?", (hashlib.sha256(b"x").hexdigest(),))
    with caplog.at_level(logging.WARNING):
        assert store.get(key, "enc") is None
    assert "corrupt" in caplog.text and store.state("enc") == (0, 1)


def test_a_row_of_another_shape_than_asked_is_deleted_with_a_warning(cache, store, caplog):
    a, b = cache.put(noise_png(7)), cache.put(noise_png(8))
    store.put(a, "enc", vectors(1, rows=3, dim=4))
    store.put(b, "enc", vectors(2))
    assert store.get(a, "enc").shape == (3, 4)                      # no shape asked: any sound row
    with caplog.at_level(logging.WARNING, logger="pixeltriage.store.regions"):
        assert [r.key for r in store.rows("enc", shape=(5, 8))] == [b]
    assert f"region vectors of {a} (enc) have shape (3, 4), expected (5, 8); deleting the row" in caplog.text
    assert store.keys_without("enc") == [a] and store.state("enc")[1] == 1
    store.put(a, "enc", vectors(1, rows=3, dim=4))
    assert store.get(a, "enc", shape=(5, 8)) is None and store.keys("enc") == {b}


def test_keys_without(cache, store):
    keys = [cache.put(noise_png(20 + i)) for i in range(3)]
    store.put(keys[1], "enc", vectors(0))
    assert store.keys_without("enc") == [keys[0], keys[2]]
    assert store.keys_without("other") == keys


def test_the_region_tables_come_with_the_file_and_a_store_writes_no_schema(tmp_path):
    path = tmp_path / "c.db"
    with Cache(path) as c:
        key = c.put(noise_png(9))
    made = {kind: names(path, kind) for kind in ("table", "trigger", "index")}
    assert {"regions", "region_deletions"} <= made["table"] and "regions_by_fingerprint" in made["index"]
    assert {"images_deleted", "images_deleted_regions", "regions_deleted"} == made["trigger"]
    with Cache(path) as c:
        store = RegionStore(c)
        store.put(key, "enc", vectors(0))
        assert np.array_equal(RegionStore(c).get(key, "enc"), vectors(0))
    assert {kind: names(path, kind) for kind in ("table", "trigger", "index")} == made


def test_newer_region_tables_of_a_version_4_file_are_refused(tmp_path):
    path = tmp_path / "c.db"
    Cache(path).close()
    with connect(path) as conn:                                     # as schema 4 kept the region tables' version
        conn.execute("DROP TABLE schema_version")
        conn.execute("CREATE TABLE region_schema (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL)")
        conn.execute("INSERT INTO region_schema (id, version) VALUES (0, 3)")
        conn.execute("PRAGMA user_version = 4")
    with pytest.raises(PixelTriageError, match="region tables of version 3 are newer"):
        Cache(path)


def _downgrade(path, version: int) -> None:
    """Make a current cache file look like one written by cache schema `version` (1 or 2): no region tables, no
    image trigger, no version table."""
    with connect(path) as conn:
        for trigger in ("images_deleted", "images_deleted_regions", "regions_deleted"):   # neither version had them
            conn.execute(f"DROP TRIGGER {trigger}")
        for table in ("regions", "region_deletions", "schema_version"):
            conn.execute(f"DROP TABLE {table}")
        if version == 1:
            conn.execute("ALTER TABLE images DROP COLUMN width")
            conn.execute("ALTER TABLE images DROP COLUMN height")
        conn.execute(f"PRAGMA user_version = {version}")


@pytest.mark.parametrize("version", [1, 2])
def test_older_files_gain_the_region_tables(tmp_path, version):
    path = tmp_path / "old.db"
    with Cache(path) as c:
        key = c.put(noise_png(7), note="kept")
        c.put_features(key, "vit", torch.ones(3))
    _downgrade(path, version)
    assert "regions" not in names(path, "table")
    with Cache(path) as c:
        store = RegionStore(c)
        assert c.note(key) == "kept" and torch.equal(c.get_features(key, "vit"), torch.ones(3))
        assert c.size(key) == ((48, 32) if version == 2 else None)
        store.put(key, "enc", vectors(0))
        assert np.array_equal(store.get(key, "enc"), vectors(0))
        with c.transaction() as conn:
            conn.execute("DELETE FROM images")
        assert store.state("enc") == (0, 1)                                 # the trigger came with it
        assert c.integrity_check() == "ok"
    with connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == VERSION
    assert "regions_by_fingerprint" in names(path, "index")


def test_deleting_an_image_from_another_program_deletes_its_vectors(cache, store, raw, backend):
    """The sqlite3 shell and Python's sqlite3 leave foreign keys off; the image's rows still go with it (on
    PostgreSQL, foreign keys are always on)."""
    a, b = cache.put(noise_png(1)), cache.put(noise_png(2))
    store.put(a, "enc", vectors(1))
    store.put(b, "enc", vectors(2))
    cache.put_features(a, "vit", torch.ones(2))
    if backend == "sqlite":
        assert raw.one("PRAGMA foreign_keys") == 0
    raw("DELETE FROM images WHERE key = ?", (a,))
    assert raw.one("SELECT COUNT(*) FROM features") == 0                             # the cache's trigger
    assert [row.key for row in store.rows("enc")] == [b]
    assert store.state("enc")[1] == 1                                       # readers holding it learn of it


def test_rows_orphaned_before_the_trigger_are_removed_on_open(tmp_path):
    path = tmp_path / "old.db"
    with Cache(path) as c:
        key = c.put(noise_png(3))
        RegionStore(c).put(key, "enc", vectors(3))
    conn = connect(path)
    conn.execute("DROP TRIGGER images_deleted_regions")                     # as a file written before it existed
    conn.execute("DELETE FROM images")
    assert conn.execute("SELECT COUNT(*) FROM regions").fetchone()[0] == 1
    conn.close()
    with Cache(path) as c:
        store = RegionStore(c)
        assert list(store.rows("enc")) == [] and store.state("enc") == (0, 1)
    assert "images_deleted_regions" in names(path, "trigger")

