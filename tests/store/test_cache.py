import hashlib
import io
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from pixeltriage.errors import InvalidMemoryError, PixelTriageError
from pixeltriage.media.image import encode_png, make_thumbnail, to_rgb
from pixeltriage.store.cache import Cache, CacheMissError, CorruptEntryError, image_key
from pixeltriage.store.schema import VERSION

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT = 600  # the interpreter start (torch import) can be slow on a loaded machine


def noise_png(seed: int, size=(96, 64)) -> bytes:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


# --- images --------------------------------------------------------------------------------------

def test_put_and_read_back(cache, tmp_path):
    data = noise_png(1, size=(700, 400))
    key = cache.put(data, note="a red mug")
    assert key == hashlib.sha256(data).hexdigest() == image_key(data)
    assert key in cache and len(cache) == 1
    assert cache.note(key) == "a red mug"
    thumb = cache.thumbnail(key)
    assert thumb.mode == "RGB" and thumb.size == (336, 192)
    expected = make_thumbnail(to_rgb(Image.open(io.BytesIO(data))), 336)
    assert thumb.tobytes() == expected.tobytes()


def test_keys_of_paths_and_pil_images(cache, tmp_path):
    data = noise_png(2)
    path = tmp_path / "photo.png"
    path.write_bytes(data)
    assert cache.put(path) == hashlib.sha256(data).hexdigest()
    assert cache.put(str(path)) == hashlib.sha256(data).hexdigest()
    img = Image.open(io.BytesIO(noise_png(3))).convert("RGB")
    key = cache.put(img)
    assert key == hashlib.sha256(encode_png(img)).hexdigest() == image_key(img)
    assert len(cache) == 2
    assert cache.thumbnail(key).tobytes() == img.tobytes()  # already below 336 px


def test_put_is_idempotent_and_notes_follow_the_rule(cache):
    data = noise_png(4)
    key = cache.put(data, note="first")
    assert cache.put(data) == key
    assert cache.note(key) == "first"  # an empty note never erases
    cache.put(data, note="second")
    assert cache.note(key) == "second"  # the latest non-empty note wins
    assert len(cache) == 1
    assert cache.stats()["images"] == 1


def test_missing_key(cache):
    with pytest.raises(CacheMissError) as info:
        cache.thumbnail("abc123")
    assert isinstance(info.value, KeyError) and isinstance(info.value, PixelTriageError)
    assert "abc123" in str(info.value) and info.value.key == "abc123"
    with pytest.raises(KeyError, match="abc123"):
        cache.note("abc123")
    assert "abc123" not in cache and 5 not in cache


def test_bad_images_raise_invalid_memory(cache, tmp_path):
    with pytest.raises(InvalidMemoryError):
        cache.put(b"not an image")
    with pytest.raises(InvalidMemoryError):
        cache.put(tmp_path / "missing.png")
    with pytest.raises(InvalidMemoryError):
        cache.put(12345)
    assert len(cache) == 0


def test_corrupt_thumbnail_is_a_cache_miss_and_put_repairs_it(cache, raw):
    data = noise_png(5)
    key = cache.put(data, note="keep me")
    raw("UPDATE images SET thumbnail = ? WHERE key = ?", (b"\x89PNG garbage", key))
    with pytest.raises(CorruptEntryError, match="put the image again"):
        cache.thumbnail(key)
    assert cache.note(key) == "keep me"
    cache.put(data)
    assert cache.thumbnail(key).size == (96, 64)
    assert cache.note(key) == "keep me"
    # a row with a matching checksum that still does not decode
    bad = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
    raw("UPDATE images SET thumbnail = ?, checksum = ? WHERE key = ?", (bad, hashlib.sha256(bad).hexdigest(), key))
    with pytest.raises(CorruptEntryError, match="does not decode"):
        cache.thumbnail(key)
    raw("UPDATE images SET thumbnail = 'text' WHERE key = ?", (key,))
    with pytest.raises(CorruptEntryError, match="checksum"):
        cache.thumbnail(key)
    cache.put(data)
    assert cache.thumbnail(key).size == (96, 64)


@pytest.mark.parametrize("width, height", [("abc", 10), (b"\x00", 10), (0, 10), (-5, 7), (2.5, 10)])
def test_a_damaged_size_reads_as_unknown(cache, raw, backend, caplog, width, height):
    if backend != "sqlite" and not isinstance(width, int):
        pytest.skip("PostgreSQL keeps an INTEGER column's type: only a SQLite file can hold this")
    key = cache.put(noise_png(4))
    raw("UPDATE images SET width = ?, height = ? WHERE key = ?", (width, height, key))
    with caplog.at_level(logging.WARNING):
        assert cache.size(key) is None
    assert "stored size" in caplog.text and "damaged" in caplog.text


# --- schema --------------------------------------------------------------------------------------

def test_schema_and_version_of_a_postgresql_database(cache, raw, backend):
    if backend != "postgresql":
        pytest.skip("a PostgreSQL database's own schema")
    assert raw("SELECT id, version FROM schema_version") == [(0, VERSION)]
    tables = {r[0] for r in raw("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert tables == {"images", "features", "regions", "region_deletions", "schema_version"}
    assert {r[0] for r in raw("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")} == {"regions_deleted"}
    assert cache.stats()["schema_version"] == VERSION and cache.stats()["backend"] == "postgresql"
    assert cache.integrity_check() == "ok"


def test_schema_wal_and_version(tmp_path):
    with Cache(tmp_path / "cache.db") as cache:
        with sqlite3.connect(cache.path, isolation_level=None) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert conn.execute("SELECT id, version FROM schema_version").fetchall() == [(0, VERSION)]
            assert conn.execute("PRAGMA user_version").fetchone()[0] == VERSION == 5  # what earlier releases read
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            triggers = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert tables == {"images", "features", "regions", "region_deletions", "schema_version", "sqlite_sequence"}
        assert triggers == {"images_deleted", "images_deleted_regions", "regions_deleted"}
        assert cache.stats()["schema_version"] == VERSION and cache.stats()["backend"] == "sqlite"
        assert cache.integrity_check() == "ok"


def test_a_file_written_by_the_sqlite_only_release_opens_unchanged(tmp_path):
    """tests/store/data/cache-v5.sqlite3 was written by the release before the PostgreSQL backend (schema 5): three
    images put with notes, features of the first, region vectors of the second and third, the third image deleted.
    It opens as it is (no migration, not a byte of its tables changed) and takes new rows."""
    import shutil

    import numpy as np

    from pixeltriage.store.regions import RegionStore

    path = tmp_path / "old.sqlite3"
    shutil.copy(REPO / "tests" / "store" / "data" / "cache-v5.sqlite3", path)
    keys = [image_key(noise_png(seed, (40, 24))) for seed in range(3)]

    def dump():
        with sqlite3.connect(path) as conn:
            return list(conn.iterdump())

    before = dump()
    with Cache(path) as c:
        store = RegionStore(c)
        assert len(c) == 2 and keys[2] not in c
        assert [c.note(k) for k in keys[:2]] == ["note 0", "note 1"]
        assert c.thumbnail(keys[0]).size == (40, 24) and c.size(keys[1]) == (40, 24)
        assert torch.equal(c.get_features(keys[0], "vit"), torch.arange(12, dtype=torch.float32).reshape(3, 4))
        assert np.array_equal(store.get(keys[1], "enc"), np.arange(10, dtype=np.float32).reshape(2, 5))
        assert store.state("enc") == (1, 1)
        assert c.integrity_check() == "ok"
    assert dump() == before
    with Cache(path) as c:
        key = c.put(noise_png(7), note="new")
        assert RegionStore(c).put(key, "enc", np.ones((2, 5), np.float32)) == 3       # AUTOINCREMENT goes on
        assert len(c) == 3


def test_reopen_keeps_rows_and_refuses_newer_schema(target, raw, backend):
    with Cache(target) as c:
        key = c.put(noise_png(6), note="n")
    with Cache.open(target) as c:
        assert c.note(key) == "n"
    raw(f"UPDATE schema_version SET version = {VERSION + 1}")
    with pytest.raises(PixelTriageError, match=f"schema version {VERSION + 1} is newer than this version of "
                                               f"pixeltriage reads \\({VERSION}\\)"):
        Cache(target)
    if backend == "sqlite":
        raw(f"UPDATE schema_version SET version = {VERSION}")
        raw(f"PRAGMA user_version = {VERSION + 1}")                          # a later release's, either way
        with pytest.raises(PixelTriageError, match="newer"):
            Cache(target)
    raw("DELETE FROM schema_version")
    with pytest.raises(PixelTriageError, match="schema_version holds no valid version"):
        Cache(target)


def test_a_file_that_is_not_a_cache(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"just some text, not SQLite" * 100)
    with pytest.raises(PixelTriageError, match="not a usable cache"):
        Cache(path)


def test_closed_cache_refuses(target):
    c = Cache(target)
    c.close()
    c.close()
    with pytest.raises(ValueError, match="closed"):
        len(c)


# --- features ------------------------------------------------------------------------------------

def test_features_round_trip(cache):
    key = cache.put(noise_png(7))
    assert cache.get_features(key, "vit-a") is None
    feats = torch.randn(12, 8, dtype=torch.bfloat16)
    cache.put_features(key, "vit-a", feats)
    cache.put_features(key, "vit-b", torch.arange(6.0).reshape(2, 3))
    assert torch.equal(cache.get_features(key, "vit-a"), feats)
    assert cache.get_features(key, "vit-a").dtype == torch.bfloat16
    assert torch.equal(cache.get_features(key, "vit-b"), torch.arange(6.0).reshape(2, 3))
    cache.put_features(key, "vit-a", torch.zeros(3))  # replaces
    assert torch.equal(cache.get_features(key, "vit-a"), torch.zeros(3))
    assert cache.stats()["feature_rows"] == 2
    # a non-contiguous view is stored by value
    base = torch.randn(4, 6)
    cache.put_features(key, "view", base.t())
    assert torch.equal(cache.get_features(key, "view"), base.t())


def test_features_need_the_image(cache):
    with pytest.raises(CacheMissError, match="put it before its features"):
        cache.put_features("0" * 64, "vit", torch.zeros(2))
    with pytest.raises(ValueError):
        cache.get_features("0" * 64, "")
    assert cache.get_features("0" * 64, "vit") is None


@pytest.mark.parametrize("damage", ["flipped", "text", "undecodable", "wrong_name"])
def test_corrupt_feature_rows_are_missing_then_recomputed(cache, raw, damage):
    from safetensors.torch import save

    key = cache.put(noise_png(8))
    cache.put_features(key, "vit", torch.ones(4))
    if damage == "flipped":
        data = bytearray(raw.one("SELECT data FROM features"))
        data[-1] ^= 0xFF
        update = ("UPDATE features SET data = ?", (bytes(data),))
    elif damage == "text":  # not even a BLOB any more
        update = ("UPDATE features SET data = 'garbage'", ())
    elif damage == "undecodable":
        junk = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
        update = ("UPDATE features SET data = ?, checksum = ?", (junk, hashlib.sha256(junk).hexdigest()))
    else:
        other = save({"other": torch.ones(4)})
        update = ("UPDATE features SET data = ?, checksum = ?", (other, hashlib.sha256(other).hexdigest()))
    raw(*update)
    assert cache.get_features(key, "vit") is None
    assert raw.one("SELECT COUNT(*) FROM features") == 0  # deleted
    cache.put_features(key, "vit", torch.full((4,), 2.0))  # the scorer recomputes and stores
    assert torch.equal(cache.get_features(key, "vit"), torch.full((4,), 2.0))


def test_deleting_an_image_cascades_to_features(cache):
    key = cache.put(noise_png(9))
    cache.put_features(key, "vit", torch.ones(2))
    with cache.transaction() as conn:
        conn.execute("DELETE FROM images WHERE key = ?", (key,))
    with cache.connection() as conn:
        assert conn.execute("SELECT COUNT(*) FROM features").fetchone()[0] == 0


# --- concurrency ---------------------------------------------------------------------------------

def test_threads_share_one_cache(cache):
    images = [noise_png(100 + i) for i in range(24)]
    errors = []

    def work(offset):
        try:
            for i in range(len(images)):
                data = images[(i + offset) % len(images)]
                key = cache.put(data, note=f"note {(i + offset) % len(images)}")
                cache.thumbnail(key)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k * 6,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) == len(images)
    for i, data in enumerate(images):
        assert cache.note(image_key(data)) == f"note {i}"


WRITER = r"""
import io, random, sys, time
from pathlib import Path
from PIL import Image
from pixeltriage.store.cache import Cache

def noise_png(seed, size):
    rng = random.Random(seed)
    img = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()

target, mode, worker, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
cache = Cache(target, busy_timeout_ms=120_000)
print("ready", flush=True)
while not go.exists():
    time.sleep(0.01)
if mode == "pair":
    shared = list(range(20))
    own = list(range(1000 * (worker + 1), 1000 * (worker + 1) + 20))
    seeds = [s for pair in zip(shared, own) for s in pair]
    for seed in seeds:
        key = cache.put(noise_png(seed, (64, 48)), note=f"seed {seed}")
        print(key, flush=True)
else:  # endless writer, killed by the test
    seed = 0
    while True:
        key = cache.put(noise_png(seed, (900, 700)), note=f"seed {seed}")
        print(key, flush=True)
        seed += 1
"""


def _start_writer(tmp_path, target, mode, worker, go):
    script = tmp_path / "writer.py"
    if not script.exists():           # written once: a writer starting while another truncates it would run nothing
        script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(script), str(target), mode, str(worker), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_ready(proc):
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"writer did not start: {line!r} {proc.stderr.read()}")


def _open_at_once(target, barrier, results):
    barrier.wait(timeout=SUBPROCESS_TIMEOUT)
    try:
        Cache(target, busy_timeout_ms=60_000).close()
        results.put("ok")
    except Exception as e:  # reported to the test, which names it
        results.put(f"{type(e).__name__}: {e}")


def test_processes_opening_one_new_store_at_once_all_get_the_cache(tmp_path, backend, request):
    # SQLite: two connections switching a new file to WAL at once: SQLite answers one "database is locked" without
    # waiting (without the retry, ~6% of openers failed here; 12 rounds of 4 make a miss unlikely to pass).
    # PostgreSQL: four processes creating the tables of one new database at once; one does, under a lock.
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    server = request.getfixturevalue("postgres_server") if backend == "postgresql" else None
    failures = []
    for round_ in range(12 if server is None else 3):
        target = str(tmp_path / f"new{round_}.db") if server is None else server.create_database()
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(target, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        answers = [results.get(timeout=SUBPROCESS_TIMEOUT) for _ in procs]
        for p in procs:
            p.join(timeout=SUBPROCESS_TIMEOUT)
        failures += [a for a in answers if a != "ok"]
        with Cache(target) as c:
            assert c.integrity_check() == "ok" and len(c) == 0
    assert failures == []


def test_four_processes_write_at_once_and_one_killed_mid_write_loses_nothing(tmp_path, target, raw):
    """Three writers put 20 shared and 20 images of their own each, interleaved, while a fourth puts large images
    without end and is SIGKILLed in the middle of one: every put that returned is there with its note and
    thumbnail, the killed put is there whole or not at all, no row fails its checksum, and the store takes writes."""
    go = tmp_path / "go"
    pairs = [_start_writer(tmp_path, target, "pair", w, go) for w in range(3)]
    endless = _start_writer(tmp_path, target, "endless", 3, go)
    for p in (*pairs, endless):
        _wait_ready(p)
    go.touch()
    returned = []
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while len(returned) < 4 and time.monotonic() < deadline:
        line = endless.stdout.readline()
        if not line:
            break
        returned.append(line.strip())
    time.sleep(random.Random(0).uniform(0.0, 0.05))  # land somewhere inside the next put
    endless.send_signal(signal.SIGKILL)
    rest, err = endless.communicate(timeout=60)
    returned += rest.split()  # puts that returned before the kill
    assert endless.returncode == -signal.SIGKILL
    assert len(returned) >= 4, err
    outputs = [p.communicate(timeout=SUBPROCESS_TIMEOUT) for p in pairs]
    for p, (out, err) in zip(pairs, outputs):
        assert p.returncode == 0, err
        assert "locked" not in err
    keys = [set(out.split()) for out, _ in outputs]
    assert len(keys[0] & keys[1] & keys[2]) == 20 and len(keys[0] | keys[1] | keys[2]) == 80
    with Cache(target) as c:
        assert c.integrity_check() == "ok"
        assert len(c) in (80 + len(returned), 80 + len(returned) + 1)      # the killed put: whole or not at all
        for seed in [*range(20), *range(1000, 1020), *range(2000, 2020), *range(3000, 3020)]:
            key = image_key(noise_png(seed, (64, 48)))
            assert c.note(key) == f"seed {seed}"
            assert c.thumbnail(key).size == (64, 48)
        for seed, key in enumerate(returned):
            assert c.note(key) == f"seed {seed}"
            assert c.thumbnail(key).size == (336, 261)
        for (key,) in raw("SELECT key FROM images"):                       # every row whole: its checksum holds
            c.thumbnail(key)
        c.put(noise_png(10_000), note="after")  # still writable
        assert c.note(image_key(noise_png(10_000))) == "after"


# --- command line --------------------------------------------------------------------------------

def _cli(argv):
    from pixeltriage.cli import main

    return main(["cache", *argv])


def test_cli_put_and_stats(tmp_path, target, capsys):
    a, b = tmp_path / "a.png", tmp_path / "sub" / "b.png"
    b.parent.mkdir()
    a.write_bytes(noise_png(20))
    b.write_bytes(noise_png(21))
    notes = tmp_path / "notes.json"
    notes.write_text(json.dumps({"a.png": "note a", str(b): "note b", "zzz.png": "unused"}))
    db = target
    assert _cli(["put", str(db), str(a), str(b), "--notes", str(notes)]) == 0
    out, err = capsys.readouterr()
    lines = [line.split("\t") for line in out.strip().splitlines()]
    assert [path for _, path in lines] == [str(a), str(b)]
    assert "1 notes match no image" in err
    with Cache(db) as c:
        assert c.note(lines[0][0]) == "note a" and c.note(lines[1][0]) == "note b"
    assert _cli(["stats", str(db)]) == 0
    printed = capsys.readouterr().out
    stats = json.loads(printed)
    assert stats["images"] == 2 and stats["notes"] == 2 and stats["feature_rows"] == 0 and stats["bytes"] > 0
    if "://" in db:                                                  # the URL's password is never printed
        assert stats["path"] == db.replace(db.split(":")[2].split("@")[0], "***") and db not in printed
    else:
        assert stats["path"] == str(db)


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:                  # usage errors, before anything is opened
        _cli(["stats", str(tmp_path / "none.db")])
    assert exit_.value.code == 2 and "none.db: no such file" in capsys.readouterr().err
    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2]")
    img = tmp_path / "a.png"
    img.write_bytes(noise_png(22))
    assert _cli(["put", str(tmp_path / "x.db"), str(img), "--notes", str(bad)]) == 2
    assert "JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli([])


def test_entry_of_reads_when_stored_and_puts_when_not(target):
    img = Image.new("RGB", (500, 300), (10, 120, 200))
    with Cache(target) as cache:
        key, (thumb, note) = cache.entry_of(img)                  # absent: stored, then read back
        assert key == image_key(img) and key in cache and note == ""
        assert thumb.size == (336, 202) and thumb.mode == "RGB"
        cache.put(img, note="a blue card")
        assert cache.entry_of(img) == (key, (cache.thumbnail(key), "a blue card"))
        assert len(cache) == 1


def test_entry_of_repairs_a_row_that_passes_its_checksum_but_does_not_decode(target, raw):
    data = noise_png(6)
    with Cache(target) as cache:
        key = cache.put(data, note="keep me")
        want = cache.thumbnail(key)
        bad = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
        raw("UPDATE images SET thumbnail = ?, checksum = ? WHERE key = ?", (bad, hashlib.sha256(bad).hexdigest(), key))
        got_key, (thumb, note) = cache.entry_of(data)
        assert got_key == key and note == "keep me"
        assert thumb.tobytes() == want.tobytes()                  # the in-memory thumbnail is the stored one
        assert cache.thumbnail(key).tobytes() == want.tobytes()


def test_entry_of_errors_name_the_memory_and_match_the_image_module(tmp_path):
    from pixeltriage.media.image import open_image

    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with Cache(tmp_path / "c.db") as cache:
        for bad in ("https://example.com/a.png", str(empty), str(tmp_path / "missing.png"), tmp_path):
            with pytest.raises(InvalidMemoryError) as theirs:
                open_image(bad, 3)
            with pytest.raises(InvalidMemoryError) as ours:
                cache.entry_of(bad, 3)
            assert ours.value.index == 3 and ours.value.reason == theirs.value.reason
        assert len(cache) == 0
