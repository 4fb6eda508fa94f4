"""A PostgreSQL server on a test host (tests/postgres.py's server, its postmaster started in the host's network
namespace, listening on the host's address, the test hosts' subnet allowed in pg_hba.conf) and a database of the
test on it, for every node's replicas to share."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import pytest
from netns import PREFIX_LENGTH, SUBNET, Hosts
from postgres import ROLE, PostgresServer, start_server, unavailable

PORT = 5432


@dataclass(frozen=True)
class Database:
    """url: what the nodes are given (TCP to the host's address); local_url: the same database for the test
    process itself, over the server's socket directory (the test process stays in the machine's own network)."""

    server: PostgresServer
    url: str
    local_url: str


@contextlib.contextmanager
def postgres_on(hosts: Hosts, name: str) -> Iterator[Database]:
    """A server on host `name` with a fresh database; skipped, saying why, where no server can be started."""
    reason = unavailable()
    if reason:
        pytest.skip(f"PostgreSQL: {reason}")
    with contextlib.ExitStack() as stack:
        with hosts.entered(name):          # pg_ctl, so the server it starts, in the host's namespace
            server = stack.enter_context(start_server(listen=hosts.address(name), port=PORT,
                                                      hba_hosts=(f"{SUBNET}.0/{PREFIX_LENGTH}",)))
        database = server.create_database().rsplit("/", 1)[1]
        yield Database(server, f"postgresql://{ROLE}:{server.password}@{hosts.address(name)}:{PORT}/{database}",
                       f"postgresql://{ROLE}:{server.password}@/{database}?host={server.socket_dir}&port={PORT}")
