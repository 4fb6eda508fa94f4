"""What the adapter tests share: images, memories built the plain library way, a guard that fails on any network
connection, and a hub cache in huggingface_hub's standard layout."""
import hashlib
import io
import os
import socket
from pathlib import Path

from PIL import Image

QUESTION = "what colour was the mug on the desk?"
COLORS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (120, 60, 200)]


def png(color, size=(64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def guard_network(monkeypatch) -> list:
    """Every outgoing connection or name lookup of the test, each refused (and recorded: a library that catches the
    refusal and carries on still leaves its attempt in the list)."""
    attempts = []

    def refuse(name):
        def refused(*args, **kwargs):
            attempts.append((name, args[1:] if name.startswith("socket.") else args))
            raise OSError(f"network access in a test: {name}{args[1:] if name.startswith('socket.') else args}")
        return refused

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    return attempts


def hub_cache(cache: Path, repo_id: str, source: Path, commit: str = "0123456789abcdef" * 2 + "01234567",
              refs: tuple = ("main",)) -> Path:
    """`source`'s files as the snapshot `commit` of `repo_id` in a hub cache at `cache`, the way huggingface_hub
    writes one (blobs named by their hash, the snapshot's files symlinks to them, refs/<name> holding the commit);
    the snapshot folder."""
    org, name = repo_id.split("/")
    storage = cache / f"models--{org}--{name}"
    snapshot = storage / "snapshots" / commit
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot
