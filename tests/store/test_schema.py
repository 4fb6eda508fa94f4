"""Files of schema 4, where the cache and the region store each made and versioned their own tables, open with every
row as it was written, take new rows and end on the schema a new file has (one version, in schema_version).

The files are built here with schema 4's SQL verbatim, as its cache (PRAGMA user_version = 4) and its region store
(region_schema, version 2) created them, and rows inserted as they inserted them, so the test does not depend on
the code it checks. Three states such a file can be in: region tables of the store's version 2, none (no store ever
opened it), and version 1 (a schema 3 file the cache migrated before any store opened it)."""
import hashlib
import io
import multiprocessing
import sqlite3

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save

from pixeltriage.store.cache import Cache
from pixeltriage.store.regions import RegionStore
from pixeltriage.store.schema import VERSION

CACHE_4 = (
    """CREATE TABLE IF NOT EXISTS images (
    key        TEXT PRIMARY KEY,
    thumbnail  BLOB NOT NULL,
    checksum   TEXT NOT NULL,
    note       TEXT NOT NULL DEFAULT '',
    created    REAL NOT NULL,
    width      INTEGER,
    height     INTEGER
)""",
    """CREATE TABLE IF NOT EXISTS features (
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    data        BLOB NOT NULL,
    checksum    TEXT NOT NULL,
    created     REAL NOT NULL,
    PRIMARY KEY (key, fingerprint)
)""",
    "PRAGMA user_version = 4",
    """CREATE TRIGGER images_deleted AFTER DELETE ON images BEGIN
    DELETE FROM features WHERE key = OLD.key;
END""",
)
REGIONS_TABLE = (
    """CREATE TABLE IF NOT EXISTS regions (
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
    "CREATE INDEX IF NOT EXISTS regions_by_fingerprint ON regions (fingerprint, seq)",
)
REGION_STORE_2 = (
    "DROP TRIGGER IF EXISTS regions_deleted",
    "DROP TABLE IF EXISTS region_log",
    """CREATE TABLE region_deletions (
    fingerprint TEXT PRIMARY KEY,
    deletions   INTEGER NOT NULL
)""",
    """CREATE TRIGGER regions_deleted AFTER DELETE ON regions BEGIN
    INSERT OR IGNORE INTO region_deletions (fingerprint, deletions) VALUES (OLD.fingerprint, 0);
    UPDATE region_deletions SET deletions = deletions + 1 WHERE fingerprint = OLD.fingerprint;
END""",
    "CREATE TABLE region_schema (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL)",
    "INSERT INTO region_schema (id, version) VALUES (0, 2)",
    """CREATE TRIGGER images_deleted_regions AFTER DELETE ON images BEGIN
    DELETE FROM regions WHERE key = OLD.key;
END""",
)
# what schema 3 left of its region tables once schema 4's cache had opened the file (its image trigger remade
# without them)
REGION_LOG_1 = (
    """CREATE TABLE region_log (
    id          INTEGER PRIMARY KEY CHECK (id = 0),
    deletions   INTEGER NOT NULL
)""",
    "INSERT OR IGNORE INTO region_log (id, deletions) VALUES (0, 0)",
    """CREATE TRIGGER regions_deleted AFTER DELETE ON regions BEGIN
    UPDATE region_log SET deletions = deletions + 1 WHERE id = 0;
END""",
)
STATES = {"store 2": REGIONS_TABLE + REGION_STORE_2, "no region tables": (),
          "region tables 1": REGIONS_TABLE + REGION_LOG_1}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def _vectors(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((5, 4)).astype(np.float32)


def write_schema_4_file(path, state: str) -> dict:
    """Three images (one without a size, as schema 1 left it), features of one, and, with region tables, vectors of
    every image under "enc" and of one under "other", then one "enc" row deleted."""
    thumbnails = [Image.new("RGB", (60 + 10 * i, 40), (40 * i, 90, 200)) for i in range(3)]
    keys = [_sha256(f"original {i}".encode()) for i in range(3)]
    sizes = [(600, 400), (700, 400), None]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN IMMEDIATE")
    for statement in CACHE_4 + STATES[state]:
        conn.execute(statement)
    for i, key in enumerate(keys):
        png = _png(thumbnails[i])
        width, height = sizes[i] or (None, None)
        conn.execute("INSERT INTO images (key, thumbnail, checksum, note, created, width, height) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, png, _sha256(png), f"note {i}", 1000.0 + i, width, height))
    features = save({"features": torch.arange(6.0).reshape(2, 3)})
    conn.execute("INSERT INTO features (key, fingerprint, data, checksum, created) VALUES (?, ?, ?, ?, ?)",
                 (keys[0], "vit", features, _sha256(features), 2000.0))
    seqs, vectors = {}, {}
    if state != "no region tables":
        for fingerprint, key, seed in [("enc", keys[0], 0), ("enc", keys[1], 1), ("other", keys[0], 2),
                                       ("enc", keys[2], 3)]:
            vectors[key, fingerprint] = _vectors(seed)
            data = vectors[key, fingerprint].astype("<f4").tobytes()
            checksum = _sha256(f"{key}\0{fingerprint}\0{5}x{4}\0".encode() + data)
            seqs[key, fingerprint] = conn.execute(
                "INSERT OR REPLACE INTO regions (key, fingerprint, count, dim, vectors, checksum, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq", (key, fingerprint, 5, 4, data, checksum, 3000.0)
            ).fetchone()[0]
        conn.execute("DELETE FROM regions WHERE key = ? AND fingerprint = 'enc'", (keys[1],))
        del seqs[keys[1], "enc"], vectors[keys[1], "enc"]
    conn.execute("COMMIT")
    conn.close()
    return {"keys": keys, "thumbnails": thumbnails, "sizes": sizes, "seqs": seqs, "vectors": vectors}


def schema(path) -> set:
    with sqlite3.connect(path) as conn:
        return set(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))


def versions(path) -> tuple:
    with sqlite3.connect(path) as conn:
        return (conn.execute("PRAGMA user_version").fetchone()[0],
                conn.execute("SELECT version FROM schema_version").fetchall())


@pytest.mark.parametrize("state", list(STATES))
def test_a_schema_4_file_reads_back_takes_new_rows_and_ends_on_a_new_files_schema(tmp_path, state):
    path = tmp_path / "v4.db"
    old = write_schema_4_file(path, state)
    keys = old["keys"]
    with Cache(path) as cache:
        assert len(cache) == 3 and cache.integrity_check() == "ok"
        for i, key in enumerate(keys):
            thumbnail, note = cache.entry(key)
            assert thumbnail.tobytes() == old["thumbnails"][i].tobytes() and note == f"note {i}"
            assert cache.size(key) == old["sizes"][i]
        assert torch.equal(cache.get_features(keys[0], "vit"), torch.arange(6.0).reshape(2, 3))

        store = RegionStore(cache)
        for (key, fingerprint), matrix in old["vectors"].items():
            assert np.array_equal(store.get(key, fingerprint), matrix)
        assert store.get(keys[1], "enc") is None
        assert [(r.seq, r.key) for r in store.rows("enc")] == sorted(
            (seq, key) for (key, fingerprint), seq in old["seqs"].items() if fingerprint == "enc")
        # the deletion is still counted where the store counted it per fingerprint; region_log's one count for
        # every fingerprint cannot be split, and starts again
        assert store.state("enc")[1] == (1 if state == "store 2" else 0)

        new = cache.put(_png(Image.new("RGB", (30, 20), (1, 2, 3))), note="new")
        seq = store.put(new, "enc", _vectors(9))
        assert seq > max(old["seqs"].values(), default=0) and cache.note(new) == "new"
        assert store.state("enc")[0] == seq

    # an image deleted by a connection without foreign keys takes its features and vectors with it
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("DELETE FROM images WHERE key = ?", (keys[0],))
        assert conn.execute("SELECT COUNT(*) FROM features").fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM regions WHERE key = ?", (keys[0],)).fetchone()[0] == 0
    assert versions(path) == (VERSION, [(VERSION,)])
    fresh = tmp_path / "new.db"
    Cache(fresh).close()
    assert schema(path) == schema(fresh)


def _open(path, barrier, results) -> None:
    try:
        barrier.wait(timeout=60)
        with Cache(path) as cache:
            results.put((len(cache), len(list(RegionStore(cache).rows("enc")))))
    except Exception as e:  # reported to the test, which names it
        results.put(f"{type(e).__name__}: {e}")


def test_processes_opening_one_schema_4_file_at_once_migrate_it_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        path, barrier, results = tmp_path / f"v4-{round_}.db", ctx.Barrier(4), ctx.Queue()
        write_schema_4_file(path, "store 2")
        procs = [ctx.Process(target=_open, args=(path, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        answers = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=120)
        assert answers == [(3, 2)] * 4
        assert versions(path) == (VERSION, [(VERSION,)])
