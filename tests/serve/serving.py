"""What the serve tests share: real `python -m pixeltriage serve` subprocesses on loopback (port 0: the OS picks a
free one, the server prints it), waited for until /ready answers 200, bounded in time; the same server with gates
its test holds (gated_serve.py); polls with a deadline; inputs; comparisons."""
import base64
import io
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx
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

    def __init__(self, checkpoint, log: Path, *flags: str, env: dict | None = None,
                 command: list[str] | None = None):
        super().__init__(["--checkpoint", str(checkpoint), *flags], log=log, env=env or ENV, command=command)

    def wait_ready(self, timeout: float = READY_TIMEOUT, path: str = "/ready") -> "ServerProcess":
        try:
            return super().wait_ready(timeout, path)
        except process.ServerProcessError as e:
            pytest.fail(str(e))

    def stop(self, timeout: float = 30.0) -> int:
        return super().stop(timeout)


class GatedServer(ServerProcess):
    """A real `pixeltriage serve` process started through gated_serve.py, its files under `base`: the gates named in
    `hold` ("load", "forward") stay shut until `open(gate)`; `close("forward")` shuts that gate again; `forwards()`
    lists every forward begun so far; `send("close batcher")` stops the batcher's threads. Each command has taken
    effect when its call returns. Closing the control pipe (`stop`) opens every gate."""

    def __init__(self, checkpoint, base: Path, *flags: str, hold: tuple[str, ...] = (), env: dict | None = None):
        base.mkdir(parents=True, exist_ok=True)
        self.control_path, self.forwards_path, self.done_path = base / "control", base / "forwards", base / "done"
        os.mkfifo(self.control_path)
        self._control = os.open(self.control_path, os.O_RDWR)   # the server's end then opens without waiting
        self.forwards_path.touch()
        self.done_path.touch()
        self._sent = 0
        launcher = [sys.executable, str(LAUNCHER), str(self.control_path), str(self.forwards_path),
                    str(self.done_path), ",".join(hold) or "none"]
        super().__init__(checkpoint, base / "server.log", *flags, env=env, command=launcher)

    def send(self, command: str, timeout: float = 60.0) -> None:
        """Write `command` to the control pipe and wait until the launcher has run it."""
        os.write(self._control, f"{command}\n".encode())
        self._sent += 1

        def done() -> bool:
            exited = self.proc.poll() is not None            # read first: it may run the command, then exit
            if len(self.done_path.read_text().splitlines()) >= self._sent:
                return True
            if exited:
                pytest.fail(f"the server exited with {self.proc.returncode} before running {command!r}:\n"
                            f"{self.output()[-4000:]}")
            return False

        wait_for(f"the launcher to run {command!r}", done, timeout)

    def open(self, gate: str) -> None:
        self.send(f"open {gate}")

    def close(self, gate: str) -> None:
        """Shut a gate again: the next forward to begin waits (only "forward")."""
        self.send(f"close {gate}")

    def forwards(self) -> list[tuple[int, int]]:
        """(states, state tokens) of every forward begun, the warm-up's first."""
        return [tuple(map(int, line.split())) for line in self.forwards_path.read_text().splitlines()]

    def wait_listening(self, timeout: float = READY_TIMEOUT) -> "GatedServer":
        """Until the server printed its URL and /health answers 200 (the model may still be loading)."""
        return self.wait_ready(timeout, path="/health")

    def close_control(self) -> None:
        if self._control is not None:
            os.close(self._control)
            self._control = None

    def stop(self, timeout: float = 30.0) -> int:
        self.close_control()
        return super().stop(timeout)


LAUNCHER = Path(__file__).with_name("gated_serve.py")


metric = process.metric

T = TypeVar("T")


_polls: httpx.Client | None = None


def get(url: str, **kwargs) -> httpx.Response:
    """A GET through one client kept for this process: what a test polls (/metrics, /ready) in a loop. httpx.get
    builds a client, and its TLS context, per call: 25 ms of CPU each (measured), taken from the server polled."""
    global _polls
    if _polls is None:
        _polls = httpx.Client(timeout=30.0)
    return _polls.get(url, **kwargs)


def wait_for(what: str, check: Callable[[], T], timeout: float = 60.0) -> T:
    """Call `check` until it returns a true value, and return that; fail the test naming `what` after `timeout` s.
    For a state only another process can tell (a status, a metric); within this process, wait on an event."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:g} s for {what}; the last check gave {value!r}")
        time.sleep(0.01)
    return value


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
