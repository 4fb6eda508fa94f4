"""The store's tests run on both backends: `target` is where a test's store is made, a SQLite file's path or the URL
of a fresh database on the session's PostgreSQL server (tests/postgres.py; those cases skip, saying why, where no
server can be started). `raw` runs SQL on that store from outside the Cache, as another program would: what a test
damages or inspects."""
import sqlite3

import pytest

from pixeltriage.store.cache import Cache

BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def target(backend, tmp_path, request) -> str:
    if backend == "sqlite":
        return str(tmp_path / "cache.db")
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def cache(target):
    with Cache(target) as c:
        yield c


class Raw:
    """SQL on a store outside any Cache (SQLite's spelling: `?` parameters, translated for PostgreSQL); each call
    commits at once. For SQLite, foreign keys are off, as in the sqlite3 shell."""

    def __init__(self, target: str):
        self.target = target
        self.postgres = target.startswith("postgres")

    def __call__(self, sql: str, params=()) -> list[tuple]:
        if self.postgres:
            import psycopg

            with psycopg.connect(self.target, autocommit=True) as conn:
                cur = conn.execute(sql.replace("?", "%s"), params)
                return cur.fetchall() if cur.description else []
        conn = sqlite3.connect(self.target, isolation_level=None)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def one(self, sql: str, params=()):
        """The first column of the first row."""
        return self(sql, params)[0][0]


@pytest.fixture
def raw(target) -> Raw:
    return Raw(target)
