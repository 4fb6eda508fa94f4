"""A real PostgreSQL server for the tests, started in a temporary directory and removed after.

    postgres_server   (session) a `PostgresServer`: initdb + pg_ctl in a fresh directory, listening on a free port
                      of 127.0.0.1 and on a socket directory of its own; stopped and removed at the session's end
    postgres_url      (per test) a fresh database on it, owned by a login role with a password:
                      postgresql://pixeltriage:PASSWORD@127.0.0.1:PORT/t_..., dropped after the test

Both are imported into tests/conftest.py, so any test may ask for them. Where no server can be started (no
PostgreSQL server binaries, no psycopg, running as root with no `postgres` user to run them as) every test asking
for one is skipped, saying why. `start_server` starts one of its own (other addresses to listen on, other clients
allowed in pg_hba.conf) as a context manager.

The server binaries come from $PIXELTRIAGE_PG_BIN when set, else from the newest /usr/lib/postgresql/*/bin (Debian's
layout), else from the PATH. PostgreSQL refuses to run as root: as root they run as the `postgres` user (runuser),
in directories that user owns; as anyone else they run as that user. The server is tuned for tests (fsync off: a
crash of the machine may lose it, which a test server can afford; nothing else differs from a default server).
"""
from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

ROLE = "pixeltriage"                   # the login role the tests' URLs name (a password, scram-sha-256 over TCP)
SUPERUSER = "postgres"                 # the administrator, over the socket only (trust)
START_TIMEOUT_S = 120                  # pg_ctl's wait for a start or a stop, on a loaded machine


def bin_dir() -> Path | None:
    """The directory of the server binaries (initdb, pg_ctl, postgres), or None."""
    needed = ("initdb", "pg_ctl", "postgres")
    if os.environ.get("PIXELTRIAGE_PG_BIN"):
        candidates = [Path(os.environ["PIXELTRIAGE_PG_BIN"])]
    else:
        def version(path: Path) -> tuple:
            return tuple(int(p) for p in re.findall(r"\d+", path.parent.name))

        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
        if shutil.which("pg_ctl"):
            candidates.append(Path(shutil.which("pg_ctl")).parent)
    return next((d for d in candidates if all((d / name).is_file() for name in needed)), None)


def unavailable() -> str | None:
    """Why no test server can be started here (None: it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[test]', or '.[postgres]')"
    if bin_dir() is None:
        return ("no PostgreSQL server binaries (initdb, pg_ctl, postgres) under /usr/lib/postgresql/*/bin, on the "
                "PATH or in $PIXELTRIAGE_PG_BIN (Debian: apt-get install postgresql)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and there is no 'postgres' user to run the server as (PostgreSQL refuses root)"
        if shutil.which("runuser") is None:
            return "running as root, and there is no runuser to run the server as the 'postgres' user"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PostgresServer:
    """One PostgreSQL server in `root` (data/ and the socket directory sock/), on `port` of `listen`.

    url(database): the login role's URL of a database, over TCP; admin(): a superuser connection over the socket;
    create_database / drop_database; stop / start / restart (the same port and data); terminate(database): end
    every session on a database, as a server restart would."""

    def __init__(self, root: Path, *, listen: str = "127.0.0.1", port: int | None = None,
                 hba_hosts: tuple[str, ...] = ("127.0.0.1/32",)):
        self.root, self.listen = Path(root), listen
        self.port = port or free_port(listen.split(",")[0].strip() if listen not in ("*", "") else "127.0.0.1")
        self.data, self.socket_dir, self.log = self.root / "data", self.root / "sock", self.root / "server.log"
        self.bin = bin_dir()
        self.password = secrets.token_urlsafe(16)
        self.hba_hosts = hba_hosts
        self.running = False

    # --- the server's life ------------------------------------------------------------------------------------

    def init(self) -> None:
        for d in (self.root, self.socket_dir):
            d.mkdir(parents=True, exist_ok=True)
            self._own(d)
        self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "-E", "UTF8", "--locale=C", "--no-sync",
                  "--auth-local=trust", "--auth-host=scram-sha-256")
        hba = ["local all all trust"] + [f"host all {ROLE} {net} scram-sha-256" for net in self.hba_hosts]
        (self.data / "pg_hba.conf").write_text("\n".join(hba) + "\n")
        settings = {"listen_addresses": f"'{self.listen}'", "port": str(self.port),
                    "unix_socket_directories": f"'{self.socket_dir}'", "fsync": "off", "full_page_writes": "off",
                    "max_connections": "200", "shared_buffers": "32MB", "dynamic_shared_memory_type": "posix"}
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("".join(f"{k} = {v}\n" for k, v in settings.items()))
        self._own(self.data / "pg_hba.conf", self.data / "postgresql.conf")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(START_TIMEOUT_S), "start")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`mode`: pg_ctl's smart, fast or immediate); an immediate stop is a crash."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", str(START_TIMEOUT_S), "stop")
        self.running = False

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def remove(self) -> None:
        if self.running:
            try:
                self.stop("fast")
            except subprocess.CalledProcessError:
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # --- databases --------------------------------------------------------------------------------------------

    def url(self, database: str, *, password: bool = True, scheme: str = "postgresql") -> str:
        secret = f":{self.password}" if password else ""
        return f"{scheme}://{ROLE}{secret}@127.0.0.1:{self.port}/{database}"

    def admin(self, database: str = "postgres"):
        """A superuser connection over the socket (autocommit); close it after use (`with`)."""
        import psycopg

        return psycopg.connect(host=str(self.socket_dir), port=self.port, user=SUPERUSER, dbname=database,
                               autocommit=True, connect_timeout=30)

    def execute(self, sql: str, params: tuple = (), database: str = "postgres") -> list[tuple]:
        """Run one statement as the superuser; its rows (none for a statement that returns none)."""
        with self.admin(database) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def create_role(self) -> None:
        from psycopg import sql

        self.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE),
                                                                       sql.Literal(self.password)).as_string())

    def create_database(self, name: str | None = None, *, tablespace: str | None = None) -> str:
        """A new database owned by the login role (in `tablespace` when given) -> its URL."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        where = f" TABLESPACE {tablespace}" if tablespace else ""
        self.execute(f'CREATE DATABASE "{name}" OWNER {ROLE}{where}')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def terminate(self, database: str) -> int:
        """End every session on `database` (as a restart of the server would, for its clients); how many."""
        return len(self.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND "
                                "pid != pg_backend_pid()", (database,)))

    # --- internals ---------------------------------------------------------------------------------------------

    def _as_server_user(self) -> bool:
        return os.geteuid() == 0

    def _own(self, *paths: Path) -> None:
        if self._as_server_user():
            user = pwd.getpwnam("postgres")
            for p in paths:
                os.chown(p, user.pw_uid, user.pw_gid)
                if p.is_dir():
                    p.chmod(0o700)

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if self._as_server_user():
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S + 30,
                              cwd=self.root if self.root.exists() else "/")
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout,
                                                f"{done.stderr}\n--- server log ---\n{self.log_tail()}")


def own_directory(path: Path) -> None:
    """Give `path` to the user the server runs as (a tablespace's directory must be the server's)."""
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(path, user.pw_uid, user.pw_gid)
        path.chmod(0o700)


@contextlib.contextmanager
def start_server(**options) -> Iterator[PostgresServer]:
    """A running server in a new temporary directory (under the system's, which the server's user can reach),
    removed on exit. options: PostgresServer's (listen, port, hba_hosts). Raises RuntimeError saying why when no
    server can be started here."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    root = Path(tempfile.mkdtemp(prefix="pixeltriage-pg-"))
    server = PostgresServer(root, **options)
    try:
        server.init()
        for attempt in range(3):             # the free port may be taken between the look and the start
            try:
                server.start()
                break
            except subprocess.CalledProcessError:
                if attempt == 2 or "port" in options:
                    raise
                server.port = free_port()
                with open(server.data / "postgresql.conf", "a") as f:
                    f.write(f"port = {server.port}\n")
        server.create_role()
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole session (skipped, saying why, where none can be started)."""
    reason = unavailable()
    if reason:
        pytest.skip(f"PostgreSQL: {reason}")
    with start_server() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a fresh database of the session's server, with the login role's password; dropped after."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url.rsplit("/", 1)[1])
