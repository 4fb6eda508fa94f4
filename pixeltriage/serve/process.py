"""`pixeltriage serve` as a subprocess on loopback: started on port 0 (the OS picks a free port, the server prints
its URL), waited for until /ready answers 200, stopped with SIGTERM. What `bench serve` and the server tests drive;
also a way to run the service beside a host from Python."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from pixeltriage.errors import PixelTriageError

# the line `pixeltriage serve` prints once it listens (pixeltriage/cli/serve.py)
LISTENING = re.compile(r"listening on (http://\S+?);")


class ServerProcessError(PixelTriageError):
    """The server exited before it was ready, or was not ready in time; the message holds the end of its output."""


class ServerProcess:
    """`COMMAND serve ARGS --port 0` with its combined output in `log` (a temporary file when None); `url` once it
    printed it. command: the program that takes `serve` and its arguments, `python -m pixeltriage` of this
    interpreter when None (another is, for example, a launcher that wraps the same command line)."""

    def __init__(self, args: Sequence[str], log: str | os.PathLike | None = None, env: dict | None = None,
                 command: Sequence[str] | None = None):
        self._tmp = None if log is not None else tempfile.NamedTemporaryFile(
            "w+b", prefix="pixeltriage-serve-", suffix=".log")
        self.log = Path(log) if log is not None else Path(self._tmp.name)
        program = [sys.executable, "-m", "pixeltriage"] if command is None else list(command)
        self.argv = [*program, "serve", *args, "--port", "0"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url: str | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600.0, path: str = "/ready") -> "ServerProcess":
        """Until `path` answers 200 (/ready: the model loaded; /health: listening, maybe still loading);
        ServerProcessError (with the output) when it exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        # one client for every poll: httpx.get builds a client, and its TLS context, per call (25 ms of CPU each,
        # measured, a third of a core taken from the loading server at this poll rate)
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerProcessError(f"the server exited with {self.proc.returncode}:\n"
                                             f"{self.output()[-4000:]}")
                if self.url is None:
                    found = LISTENING.search(self.output())
                    self.url = found.group(1) if found else None
                elif status_code(self.url + path, http) == 200:
                    return self
                time.sleep(0.05)
        self.stop()
        raise ServerProcessError(f"the server's {path} did not answer 200 within {timeout:.0f} s:\n"
                                 f"{self.output()[-4000:]}")

    def memory_mib(self) -> dict:
        """Resident and peak resident memory of the server process (Linux /proc), MiB."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return {}
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {name: int(fields[key].split()[0]) / 1024 for name, key in (("rss", "VmRSS"), ("peak", "VmHWM"))
                if key in fields}

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (a graceful drain), SIGKILL after `timeout` s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from a /metrics page (Prometheus text format; 0 when absent)."""
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name}{{}} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def status_code(url: str, http: httpx.Client) -> int | None:
    """The status of a GET of `url` through `http` (None: no answer within its timeout)."""
    try:
        return http.get(url).status_code
    except httpx.HTTPError:
        return None
