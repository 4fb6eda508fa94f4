"""Fixtures of the adapter tests: the library Scorer every adapter's scores are compared with, a server for the
remote path, and the network guard."""
import os
from pathlib import Path

import pytest
from integration_inputs import guard_network

from pixeltriage import Scorer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def scorer(tiny_checkpoint):
    """The in-process Scorer (float32, no cache)."""
    return Scorer.load(tiny_checkpoint)


@pytest.fixture
def no_network(monkeypatch):
    """The test's connection attempts (each refused); assert it stays empty."""
    return guard_network(monkeypatch)


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    """`pixeltriage serve` on the tiny checkpoint (loopback, port 0), for the adapters' remote path."""
    from pixeltriage.serve.process import ServerProcess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PIXELTRIAGE_MALLOC_TUNING": "0"}
    process = ServerProcess(["--checkpoint", str(tiny_checkpoint)], log=tmp_path_factory.mktemp("serve") / "log",
                            env=env)
    process.wait_ready(120.0)             # stops the server itself when it is not ready in time
    yield process
    process.stop()
