"""Cache files written before the region tables left the cache's schema (cache schema 3, where the cache made
them) keep working: their thumbnails, notes, sizes, features and region vectors read back, they take new rows, and
they end on the schema a new file has.

The file is built here with schema 3's SQL verbatim, as that code created it, and rows inserted as it inserted
them (thumbnail PNG and SHA-256, safetensors features and SHA-256, raw float32 vectors with a checksum over key,
fingerprint, shape and bytes), so the test does not depend on the code it checks."""
import hashlib
import io
import sqlite3

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save

from pixeltriage.retrieval.index import RegionIndex, index_fingerprint
from pixeltriage.retrieval.regions import RegionGrid
from pixeltriage.store.cache import Cache
from pixeltriage.store.regions import RegionStore
from pixeltriage.store.schema import VERSION
from region_toys import ColourEncoder

SCHEMA_3 = (
    """CREATE TABLE images (
    key        TEXT PRIMARY KEY,
    thumbnail  BLOB NOT NULL,
    checksum   TEXT NOT NULL,
    note       TEXT NOT NULL DEFAULT '',
    created    REAL NOT NULL,
    width      INTEGER,
    height     INTEGER
)""",
    """CREATE TABLE features (
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    data        BLOB NOT NULL,
    checksum    TEXT NOT NULL,
    created     REAL NOT NULL,
    PRIMARY KEY (key, fingerprint)
)""",
    """CREATE TABLE regions (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    count       INTEGER NOT NULL,
    dim         INTEGER NOT NULL,
    vectors     BLOB NOT NULL,
    checksum    TEXT NOT NULL,
    created     REAL NOT NULL,
    UNIQUE (key, fingerprint)
)""",
    "CREATE INDEX regions_by_fingerprint ON regions (fingerprint, seq)",
    """CREATE TABLE region_log (
    id          INTEGER PRIMARY KEY CHECK (id = 0),
    deletions   INTEGER NOT NULL
)""",
    "INSERT OR IGNORE INTO region_log (id, deletions) VALUES (0, 0)",
    """CREATE TRIGGER regions_deleted AFTER DELETE ON regions BEGIN
    UPDATE region_log SET deletions = deletions + 1 WHERE id = 0;
END""",
    """CREATE TRIGGER images_deleted AFTER DELETE ON images BEGIN
    DELETE FROM regions WHERE key = OLD.key;
    DELETE FROM features WHERE key = OLD.key;
END""",
    "PRAGMA user_version = 3",
)

# RegionIndex(cache, ColourEncoder()) of schema 3's days keyed its rows by this: pinned, since a change to
# index_fingerprint would leave every stored vector unread
COLOUR_INDEX = hashlib.sha256(b"pixeltriage-regions-v1\0toy-colour-v1\0grid2x2+whole/overlap=0.25").hexdigest()
RED, GREY = (220, 20, 20), (128, 128, 128)


def _png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _region_checksum(key: str, fingerprint: str, count: int, dim: int, data: bytes) -> str:
    return _sha256(f"{key}\0{fingerprint}\0{count}x{dim}\0".encode() + data)


def _vectors(red_share: float) -> np.ndarray:
    """Five region vectors of the colour toy: the whole image and four tiles, red only in the last tile."""
    tile = np.array([red_share, 0, 0, 1 - red_share], np.float32)
    grey = np.array([0, 0, 0, 1], np.float32)
    rows = np.stack([grey, grey, grey, grey, tile])
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def write_schema_3_file(path) -> dict:
    """A cache file as schema 3's code left it: three images (one from schema 1, without a size), features of two,
    region vectors of all three under the colour index and of one under another fingerprint, two deleted rows."""
    images = [Image.new("RGB", (40 + 10 * i, 30), (30 * i, 90, 200)) for i in range(3)]
    thumbnails = [_png(img) for img in images]           # below 336 px: the thumbnail is the image itself
    originals = [_png(Image.new("RGB", (400 + 100 * i, 300), (30 * i, 90, 200))) for i in range(3)]
    keys = [_sha256(data) for data in originals]
    sizes = [(400, 300), (500, 300), None]
    features = {keys[0]: torch.arange(12.0).reshape(3, 4), keys[1]: torch.ones(2, 2, dtype=torch.bfloat16)}
    regions = {keys[0]: _vectors(0.9), keys[1]: _vectors(0.5), keys[2]: _vectors(0.1)}
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN IMMEDIATE")
    for statement in SCHEMA_3:
        conn.execute(statement)
    for i, key in enumerate(keys):
        width, height = sizes[i] or (None, None)
        conn.execute("INSERT INTO images (key, thumbnail, checksum, note, created, width, height) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, thumbnails[i], _sha256(thumbnails[i]), f"note {i}",
                                                      1000.0 + i, width, height))
    for key, tensor in features.items():
        data = save({"features": tensor})
        conn.execute("INSERT OR REPLACE INTO features (key, fingerprint, data, checksum, created) "
                     "VALUES (?, ?, ?, ?, ?)", (key, "vit", data, _sha256(data), 2000.0))
    rows = [(key, COLOUR_INDEX, matrix) for key, matrix in regions.items()]
    rows.append((keys[0], "other encoder", np.full((5, 3), 0.5, np.float32)))
    rows.append((keys[1], "other encoder", np.full((5, 3), 0.5, np.float32)))
    seqs = {}
    for key, fingerprint, matrix in rows:
        data = matrix.astype("<f4").tobytes()
        count, dim = matrix.shape
        seqs[key, fingerprint] = conn.execute(
            "INSERT OR REPLACE INTO regions (key, fingerprint, count, dim, vectors, checksum, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
            (key, fingerprint, count, dim, data, _region_checksum(key, fingerprint, count, dim, data),
             3000.0)).fetchone()[0]
    conn.execute("DELETE FROM regions WHERE key = ? AND fingerprint = 'other encoder'", (keys[1],))
    conn.execute("DELETE FROM regions WHERE key = ? AND fingerprint = 'other encoder'", (keys[0],))
    conn.execute("COMMIT")
    assert conn.execute("SELECT deletions FROM region_log").fetchone()[0] == 2
    conn.close()
    return {"keys": keys, "thumbnails": images, "sizes": sizes, "features": features, "regions": regions,
            "seqs": seqs}


def schema(path) -> set:
    with sqlite3.connect(path) as conn:
        return set(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))


def test_a_schema_3_file_reads_back_and_takes_new_rows(tmp_path):
    path = tmp_path / "v3.db"
    old = write_schema_3_file(path)
    keys = old["keys"]
    with Cache(path) as cache:
        assert len(cache) == 3 and cache.integrity_check() == "ok"
        for i, key in enumerate(keys):
            thumbnail, note = cache.entry(key)
            assert thumbnail.tobytes() == old["thumbnails"][i].tobytes() and note == f"note {i}"
            assert cache.size(key) == old["sizes"][i]
        for key, tensor in old["features"].items():
            stored = cache.get_features(key, "vit")
            assert stored.dtype == tensor.dtype and torch.equal(stored, tensor)
        assert cache.get_features(keys[2], "vit") is None

        store = RegionStore(cache)
        for key, matrix in old["regions"].items():
            assert np.array_equal(store.get(key, COLOUR_INDEX), matrix)
        assert [(r.seq, r.key) for r in store.rows(COLOUR_INDEX)] == \
            [(old["seqs"][key, COLOUR_INDEX], key) for key in keys]
        assert store.fingerprints() == {COLOUR_INDEX: 3}
        assert store.state(COLOUR_INDEX) == (old["seqs"][keys[2], COLOUR_INDEX], 0)   # counted per fingerprint now

        index = RegionIndex(cache, ColourEncoder())
        assert index.fingerprint == COLOUR_INDEX == index_fingerprint("toy-colour-v1", RegionGrid())
        hits = index.search("red", top=3)
        assert [h.key for h in hits] == keys and {h.region for h in hits} == {"bottom-right"}
        assert hits[0].box is not None and hits[2].box is None         # schema 1's row has no size
        assert index.unindexed() == []

        # it takes new rows: an image, its features, its vectors (a seq after every one ever given)
        red = np.full((60, 80, 3), GREY, np.uint8)
        red[40:, 60:] = RED
        buffer = io.BytesIO()
        Image.fromarray(red).save(buffer, format="PNG")
        new = index.add(buffer.getvalue(), note="new")
        cache.put_features(new, "vit", torch.zeros(2))
        assert torch.equal(cache.get_features(new, "vit"), torch.zeros(2)) and cache.note(new) == "new"
        assert store.state(COLOUR_INDEX)[0] > max(old["seqs"].values())
        assert len(index.search("red", top=10)) == 4

    # an image deleted by a connection without foreign keys takes its features and vectors with it
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("DELETE FROM images WHERE key = ?", (keys[0],))
        assert conn.execute("SELECT COUNT(*) FROM features WHERE key = ?", (keys[0],)).fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM regions WHERE key = ?", (keys[0],)).fetchone()[0] == 0
        assert conn.execute("PRAGMA user_version").fetchone()[0] == VERSION == 5
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == VERSION
    with Cache(path) as cache:
        assert keys[0] not in cache and RegionStore(cache).state(COLOUR_INDEX)[1] == 1
        assert cache.integrity_check() == "ok"

    # and it ends on the schema of a file made new
    fresh = tmp_path / "new.db"
    with Cache(fresh) as cache:
        RegionStore(cache)
    assert schema(path) == schema(fresh)


def test_a_schema_3_file_opened_by_the_cache_alone_is_migrated_whole(tmp_path):
    """The cache migrates the whole file, region tables included, before any region store opens it; an image deleted
    afterwards by a connection without foreign keys takes its features and vectors with it."""
    path = tmp_path / "v3.db"
    old = write_schema_3_file(path)
    keys = old["keys"]
    with Cache(path) as cache:
        cache.put_features(keys[2], "vit", torch.ones(1))
        assert cache.note(keys[1]) == "note 1"
    with sqlite3.connect(path, isolation_level=None) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "region_log" not in tables and "region_deletions" in tables
        conn.execute("DELETE FROM images WHERE key = ?", (keys[1],))               # foreign keys off
        assert conn.execute("SELECT COUNT(*) FROM features WHERE key = ?", (keys[1],)).fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM regions WHERE key = ?", (keys[1],)).fetchone()[0] == 0
    with Cache(path) as cache:
        store = RegionStore(cache)
        assert [r.key for r in store.rows(COLOUR_INDEX)] == [keys[0], keys[2]]
        assert store.state(COLOUR_INDEX)[1] == 1


@pytest.mark.parametrize("table", ["regions", "features"])
def test_a_damaged_row_of_a_schema_3_file_is_deleted_and_reported_as_today(tmp_path, table, caplog):
    path = tmp_path / "v3.db"
    keys = write_schema_3_file(path)["keys"]
    column = "vectors" if table == "regions" else "data"
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute(f"UPDATE {table} SET {column} = 'garbage' WHERE key = ?", (keys[0],))
    with Cache(path) as cache:
        if table == "regions":
            assert RegionStore(cache).get(keys[0], COLOUR_INDEX) is None
        else:
            assert cache.get_features(keys[0], "vit") is None
        with cache.connection() as conn:
            assert conn.execute(f"SELECT COUNT(*) FROM {table} WHERE key = ?", (keys[0],)).fetchone()[0] == 0
    assert "corrupt" in caplog.text and keys[0] in caplog.text
