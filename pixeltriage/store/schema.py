"""The schema of the store, in a SQLite file or a PostgreSQL database: the tables of the cache and of the region
store, one version for them all, kept in one table, and the migrations that bring a store of an earlier version to
it (run when a Cache opens one, in one transaction: a process killed during a migration leaves the store as it was).

    images(key, thumbnail, checksum, note, created, width, height)                   the cache (store.cache)
    features(key -> images.key, fingerprint, data, checksum, created)
    regions(seq, key -> images.key, fingerprint, count, dim, vectors, checksum,      the region vectors
            created), indexed by (fingerprint, seq)                                   (store.regions)
    region_deletions(fingerprint, deletions)
    schema_version(version)                                                           one row: VERSION

Triggers delete an image's features (images_deleted) and region vectors (images_deleted_regions) with it whether
or not the deleting connection enabled foreign keys (the sqlite3 shell and Python's sqlite3 leave them off, so ON
DELETE CASCADE alone would leave orphans behind), and count the deleted region rows of each fingerprint
(regions_deleted: a DELETE, or the cascade of an image's; a REPLACE fires no delete trigger, recursive_triggers
being off, and its row comes back with a new seq, which readers fetch anyway).

Versions: 1 images and features; 2 the images' displayed size (width, height; NULL for older rows); 3 the region
vectors in the cache's schema, one deletion count for every fingerprint (region_log) and one image trigger for
features and vectors; 4 the region tables apart, created by the region store when it first opened a file, under a
version of their own in region_schema (1: as version 3 left them; 2: deletions counted per fingerprint); 5 one
schema again: every table made with the file, one version in schema_version. PRAGMA user_version carries the same
number, because releases before version 5 read only it: they refuse a file once it is migrated.

PostgreSQL (`migrate_postgres`): the same tables and version, spelt for it: bytea for BLOB, an identity column for
the region rows' seq, the deletion count kept by a PL/pgSQL trigger; foreign keys are always on there, so ON DELETE
CASCADE deletes an image's features and region vectors (and the cascade fires the count's trigger). Its first
version is 5; a database of a newer version is refused, as a file is. A migration takes an advisory lock first, so
that processes opening one database at once migrate it once.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from pixeltriage.errors import PixelTriageError

VERSION = 5
TABLES = ("images", "features", "regions", "region_deletions", "schema_version")

_IMAGES = """CREATE TABLE IF NOT EXISTS images (
    key        TEXT PRIMARY KEY,
    thumbnail  BLOB NOT NULL,
    checksum   TEXT NOT NULL,
    note       TEXT NOT NULL DEFAULT '',
    created    REAL NOT NULL,
    width      INTEGER,
    height     INTEGER
)"""
_FEATURES = """CREATE TABLE IF NOT EXISTS features (
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    data        BLOB NOT NULL,
    checksum    TEXT NOT NULL,
    created     REAL NOT NULL,
    PRIMARY KEY (key, fingerprint)
)"""
_REGIONS = (
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
_REGION_DELETIONS = (
    """CREATE TABLE region_deletions (
    fingerprint TEXT PRIMARY KEY,
    deletions   INTEGER NOT NULL
)""",
    """CREATE TRIGGER regions_deleted AFTER DELETE ON regions BEGIN
    INSERT OR IGNORE INTO region_deletions (fingerprint, deletions) VALUES (OLD.fingerprint, 0);
    UPDATE region_deletions SET deletions = deletions + 1 WHERE fingerprint = OLD.fingerprint;
END""",
)
# region tables of version 1 (made by a file of version 3) counted every fingerprint's deletions in region_log
_REGION_LOG = ("DROP TRIGGER IF EXISTS regions_deleted", "DROP TABLE IF EXISTS region_log")
_VERSION_TABLE = "CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL)"
# trigger -> (its SQL, the orphans it would have deleted: rows a delete without foreign keys left behind before it)
_IMAGE_TRIGGERS = {
    "images_deleted": ("""CREATE TRIGGER images_deleted AFTER DELETE ON images BEGIN
    DELETE FROM features WHERE key = OLD.key;
END""", "DELETE FROM features WHERE key NOT IN (SELECT key FROM images)"),
    "images_deleted_regions": ("""CREATE TRIGGER images_deleted_regions AFTER DELETE ON images BEGIN
    DELETE FROM regions WHERE key = OLD.key;
END""", "DELETE FROM regions WHERE key NOT IN (SELECT key FROM images)"),
}
_REGION_SCHEMA_VERSION = 2          # the newest version the region tables' own table (version 4 files) held


def migrate(conn: sqlite3.Connection, path: str | Path) -> None:
    """Bring the file on `conn` to VERSION, inside the caller's write transaction (`BEGIN IMMEDIATE`: two processes
    opening one older file at once migrate it once). Raises PixelTriageError for a file of a newer version."""
    version = file_version(conn, path)
    if version == 0:
        for statement in (_IMAGES, _FEATURES, *_REGIONS, *_REGION_DELETIONS):
            conn.execute(statement)
    if version == 1:
        conn.execute("ALTER TABLE images ADD COLUMN width INTEGER")
        conn.execute("ALTER TABLE images ADD COLUMN height INTEGER")
    if version == 3:
        conn.execute("DROP TRIGGER IF EXISTS images_deleted")     # it deleted region vectors too: remade below
    if 0 < version < 5:
        _region_tables_to_5(conn, path)
    if version < VERSION:
        conn.execute(_VERSION_TABLE)
        conn.execute("INSERT INTO schema_version (id, version) VALUES (0, ?)", (VERSION,))
        conn.execute(f"PRAGMA user_version = {VERSION}")
    for name, (trigger, orphans) in _IMAGE_TRIGGERS.items():
        if not _has(conn, "trigger", name):
            conn.execute(trigger)
            conn.execute(orphans)


def file_version(conn: sqlite3.Connection, path: str | Path) -> int:
    """The file's version: schema_version's row, else PRAGMA user_version (0: a new file); PixelTriageError for a
    version this code does not know."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if _has(conn, "table", "schema_version"):
        row = conn.execute("SELECT version FROM schema_version WHERE id = 0").fetchone()
        if row is None or type(row[0]) is not int or row[0] < VERSION:
            raise PixelTriageError(f"cache {path}: schema_version holds no valid version ({row})")
        version = max(version, row[0])
    if version > VERSION:
        raise PixelTriageError(f"cache {path}: schema version {version} is newer than this version of pixeltriage "
                               f"reads ({VERSION})")
    return version


def _region_tables_to_5(conn: sqlite3.Connection, path: str | Path) -> None:
    """The region tables of a file of version 1 to 4, as they are (none; version 3's; the region store's own, of
    version 1 or 2), made those of version 5."""
    if not _has(conn, "table", "regions"):
        for statement in (*_REGIONS, *_REGION_DELETIONS):
            conn.execute(statement)
        return
    if _has(conn, "table", "region_schema"):
        row = conn.execute("SELECT version FROM region_schema WHERE id = 0").fetchone()
        if row is None or type(row[0]) is not int or row[0] < 2:
            raise PixelTriageError(f"cache {path}: region_schema holds no valid version ({row})")
        if row[0] > _REGION_SCHEMA_VERSION:
            raise PixelTriageError(f"cache {path}: region tables of version {row[0]} are newer than this version of "
                                   f"pixeltriage reads ({_REGION_SCHEMA_VERSION})")
        conn.execute("DROP TABLE region_schema")
    else:                                                          # version 3's tables
        for statement in (*_REGION_LOG, *_REGION_DELETIONS):
            conn.execute(statement)
    conn.execute(_REGIONS[1])                                      # the index, were it ever missing


def _has(conn: sqlite3.Connection, kind: str, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = ? AND name = ?", (kind, name)).fetchone() is not None


_POSTGRES = (
    """CREATE TABLE images (
    key        TEXT PRIMARY KEY,
    thumbnail  BYTEA NOT NULL,
    checksum   TEXT NOT NULL,
    note       TEXT NOT NULL DEFAULT '',
    created    DOUBLE PRECISION NOT NULL,
    width      INTEGER,
    height     INTEGER
)""",
    """CREATE TABLE features (
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    data        BYTEA NOT NULL,
    checksum    TEXT NOT NULL,
    created     DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (key, fingerprint)
)""",
    """CREATE TABLE regions (
    seq         BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    key         TEXT NOT NULL REFERENCES images(key) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,
    count       INTEGER NOT NULL,
    dim         INTEGER NOT NULL,
    vectors     BYTEA NOT NULL,
    checksum    TEXT NOT NULL,
    created     DOUBLE PRECISION NOT NULL,
    UNIQUE (key, fingerprint)
)""",
    "CREATE INDEX regions_by_fingerprint ON regions (fingerprint, seq)",
    """CREATE TABLE region_deletions (
    fingerprint TEXT PRIMARY KEY,
    deletions   BIGINT NOT NULL
)""",
    """CREATE FUNCTION regions_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO region_deletions (fingerprint, deletions) VALUES (OLD.fingerprint, 1)
        ON CONFLICT (fingerprint) DO UPDATE SET deletions = region_deletions.deletions + 1;
    RETURN NULL;
END $$""",
    "CREATE TRIGGER regions_deleted AFTER DELETE ON regions FOR EACH ROW EXECUTE FUNCTION regions_deleted()",
    "CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL)",
)
_MIGRATION_LOCK = 0x50_54_73_63          # the advisory lock a migration takes (any constant of our own)


def migrate_postgres(conn, location: str) -> None:
    """Bring the database on `conn` (store.postgres's connection, inside a transaction) to VERSION. Raises
    PixelTriageError for a database of a newer version, or one with tables of ours and no version."""
    conn.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
    version = postgres_version(conn, location)
    if version == 0:
        if conn.execute("SELECT to_regclass('images')").fetchone()[0] is not None:
            raise PixelTriageError(f"cache {location}: holds a table 'images' but no schema_version: not a cache "
                                   "of pixeltriage (give it a database, or a schema, of its own)")
        for statement in _POSTGRES:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version (id, version) VALUES (0, ?)", (VERSION,))


def postgres_version(conn, location: str) -> int:
    """The database's version (0: no tables of ours); PixelTriageError for a version this code does not know."""
    if conn.execute("SELECT to_regclass('schema_version')").fetchone()[0] is None:
        return 0
    row = conn.execute("SELECT version FROM schema_version WHERE id = 0").fetchone()
    if row is None or row[0] < VERSION:
        raise PixelTriageError(f"cache {location}: schema_version holds no valid version ({row})")
    if row[0] > VERSION:
        raise PixelTriageError(f"cache {location}: schema version {row[0]} is newer than this version of pixeltriage "
                               f"reads ({VERSION})")
    return row[0]
