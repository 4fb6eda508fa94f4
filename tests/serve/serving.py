"""What the serve tests share: real `python -m pixeltriage serve` subprocesses on loopback (port 0: the OS picks a
free one, the server prints it), waited for until /ready answers 200, bounded in time; inputs; comparisons."""
import base64
import io
import os
import random
from pathlib import Path

import pytest
from PIL import Image

from pixeltriage import Memory
from pixeltriage.serve import process

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "PIXELTRIAGE_MALLOC_TUNING": "0"}
API_KEY = "test-key-0123456789"
READY_TIMEOUT = 120.0


class ServerProcess(process.ServerProcess):
    """One `pixeltriage serve` subprocess of a test: this checkout on the path, its output in `log`, bounded waits."""

    def __init__(self, checkpoint, log: Path, *flags: str, env: dict | None = None):
        super().__init__(["--checkpoint", str(checkpoint), *flags], log=log, env=env or ENV)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> "ServerProcess":
        try:
            return super().wait_ready(timeout)
        except process.ServerProcessError as e:
            pytest.fail(str(e))

    def stop(self, timeout: float = 30.0) -> int:
        return super().stop(timeout)


metric = process.metric


# -- inputs ----------------------------------------------------------------------------------------------------------
def image_bytes(size=(96, 72), color=(200, 40, 40), fmt="PNG", mode="RGB", seed=0) -> bytes:
    rng = random.Random(seed)
    img = Image.new("RGB", size, color)
    for _ in range(4):
        x, y = rng.randrange(size[0]), rng.randrange(size[1])
        img.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, min(size[0], x + 20), min(size[1], y + 12)))
    img = img.convert(mode)
    buffer = io.BytesIO()
    img.save(buffer, format=fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def episode(seed: int, memories: int = 2, size=(96, 72)) -> tuple[str, list[Memory]]:
    """A small question: `memories` images of varied formats and modes, with notes, dialogue and dates."""
    rng = random.Random(seed)
    formats = [("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "L"), ("WEBP", "RGB")]
    out = []
    for i in range(memories):
        fmt, mode = formats[(seed + i) % len(formats)]
        color = tuple(rng.randrange(256) for _ in range(3))
        out.append(Memory(image=image_bytes(size, color, fmt, mode, seed * 100 + i), note=f"note {seed}.{i}",
                          dialogue="we talked about " + " ".join(rng.choice(["a", "mug", "bike", "red", "sky"])
                                                                 for _ in range(rng.randint(0, 12))),
                          date=f"2026-0{1 + i % 9}-1{i % 10}"))
    return f"question {seed}: which picture shows the {rng.choice(['mug', 'bike', 'cat'])}?", out


def assert_scores_close(got, want, tol: float = 1e-5):
    assert len(got.gains) == len(want.gains) and len(got.relevance) == len(want.relevance)
    assert abs(got.p_vis - want.p_vis) <= tol, (got.p_vis, want.p_vis)
    assert abs(got.relevance_none - want.relevance_none) <= tol
    assert all(abs(a - b) <= tol for a, b in zip(got.gains, want.gains)), (got.gains, want.gains)
    assert all(abs(a - b) <= tol for a, b in zip(got.relevance, want.relevance)), (got.relevance, want.relevance)
