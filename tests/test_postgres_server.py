"""The test PostgreSQL server (tests/postgres.py) is what its fixtures promise: a real server, a database per test
reached with the login role's password over TCP, a restart that keeps the data, the directory removed after."""
import pytest

from postgres import start_server, unavailable

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")


def test_a_database_per_test_reached_with_its_password(postgres_server, postgres_url):
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.execute("INSERT INTO t VALUES (1)")
        assert conn.execute("SELECT current_user, version()").fetchone()[1].startswith("PostgreSQL")
    wrong = postgres_url.replace(postgres_server.password, "not-the-password")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong, connect_timeout=10)


def test_the_next_test_gets_a_fresh_database(postgres_url):
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT COUNT(*) FROM pg_tables WHERE tablename = 't'").fetchone()[0] == 0


def test_a_server_of_its_own_restarts_with_its_data_and_is_removed():
    if unavailable():
        pytest.skip(f"PostgreSQL: {unavailable()}")
    with start_server() as server:
        url = server.create_database("kept")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t AS SELECT 42 AS x")
        server.restart()
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT x FROM t").fetchone() == (42,)
        root = server.root
        assert (root / "data" / "PG_VERSION").is_file()
    assert not root.exists()
