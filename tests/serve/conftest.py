"""Fixtures of the serve tests: the library Scorer every response is compared with, and the main server."""
import httpx
import pytest
from serving import API_KEY, GatedServer, ServerProcess, image_bytes

from pixeltriage import Scorer


# -- fixtures --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def library(tiny_checkpoint):
    """The in-process Scorer every response is compared with (float32, no cache)."""
    return Scorer.load(tiny_checkpoint)


@pytest.fixture(scope="session")
def served(tiny_checkpoint, tmp_path_factory):
    """The main server: write-time cache, image root (with a symlink out of it), API key, a 2 MiB payload limit."""
    base = tmp_path_factory.mktemp("served")
    root = base / "images"
    (root / "photos").mkdir(parents=True)
    (root / "photos" / "mug.png").write_bytes(image_bytes((120, 90), (200, 40, 40)))
    (root / "photos" / "bike.jpg").write_bytes(image_bytes((90, 120), (40, 200, 40), "JPEG"))
    (base / "secret.png").write_bytes(image_bytes((64, 64), (1, 2, 3)))
    (root / "photos" / "out.png").symlink_to(base / "secret.png")
    (root / "photos" / "inside.png").symlink_to(root / "photos" / "mug.png")
    (root / "photos" / "up").symlink_to(base)
    key_file = base / "keys.txt"
    key_file.write_text(f"\n  {API_KEY}  \nsecond-key-abcdef\n")
    server = ServerProcess(tiny_checkpoint, base / "server.log", "--cache", str(base / "cache.db"),
                           "--image-root", str(root), "--api-key-file", str(key_file), "--payload-limit", "2")
    server.wait_ready()
    server.root, server.base, server.key = root, base, API_KEY
    yield server
    server.stop()


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory):
    from pixeltriage.retrieval.demo import write_demo_encoder

    return write_demo_encoder(tmp_path_factory.mktemp("siglip") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def indexed(tiny_checkpoint, encoder_dir, tmp_path_factory):
    """A server with a region index (--index-encoder, the tiny demo SigLIP 2) over its own cache."""
    base = tmp_path_factory.mktemp("indexed")
    server = ServerProcess(tiny_checkpoint, base / "server.log", "--cache", str(base / "cache.db"),
                           "--index-encoder", str(encoder_dir))
    server.wait_ready()
    server.db = base / "cache.db"
    yield server
    server.stop()


@pytest.fixture
def gated(tiny_checkpoint, tmp_path):
    """`gated(name, *flags, hold=("load", "forward"))` starts a GatedServer of the tiny checkpoint under
    tmp_path/name; whatever the test's outcome, each one started is stopped after it (its gates opened first)."""
    servers: list[GatedServer] = []

    def start(name: str, *flags: str, hold: tuple[str, ...] = ()) -> GatedServer:
        servers.append(GatedServer(tiny_checkpoint, tmp_path / name, *flags, hold=hold))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def client(served):
    from pixeltriage.serve import Client

    with Client(served.url, api_key=API_KEY, retries=0) as c:
        yield c


@pytest.fixture
def http(served):
    """A plain httpx client with the API key (for the bodies the Client would not send)."""
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c
