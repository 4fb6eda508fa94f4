"""Ray nodes of a test cluster, each in its own network namespace (netns.Hosts): `ray start --block` as a session
leader, so that a node is killed whole (its raylet, its agents, its workers: a lost machine) by its session id.

The nodes authenticate with a token of the test's own (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH: a file beside
the test's logs), passed to every process that joins the cluster: the head, each worker and each driver. Each node
keeps its session files in a short temporary folder of its own (Ray's socket paths must stay under 107 bytes)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netns import Hosts, kill_session

ROOT = Path(__file__).resolve().parents[2]
RAY_PORT = 6379
OBJECT_STORE = 80 * 2**20            # bytes of /dev/shm per node: the tests move no large objects
NODES_MARK = "pixeltriage-test-nodes: "   # prefix of the node list a driver prints
NODE_TIMEOUT = 120.0                 # seconds for a node to join (two shared cores, other work beside)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "RAY_USAGE_STATS_ENABLED": "0", "PIXELTRIAGE_MALLOC_TUNING": "0"}     # this checkout, for every process


class Cluster:
    """A Ray cluster over `hosts`: `start_head(name)`, `start_worker(name)`, `kill(name)` (SIGKILL of the node's
    session), `stop()` (every node: SIGTERM, as `ray stop` does, then SIGKILL)."""

    def __init__(self, hosts: Hosts, logs: Path):
        self.hosts, self.logs = hosts, logs
        self.token_path = logs / "ray-token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.env = {**ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        self.env.pop("RAY_ADDRESS", None)
        self.head: str | None = None
        self.nodes: dict[str, subprocess.Popen] = {}
        self._temp = Path(tempfile.mkdtemp(prefix="ptray-", dir="/tmp"))
        self._starts: dict[str, int] = {}

    @property
    def address(self) -> str:
        return f"{self.hosts.address(self.head)}:{RAY_PORT}"

    def _start(self, name: str, flags: list[str], cpus: float) -> subprocess.Popen:
        self._starts[name] = self._starts.get(name, 0) + 1
        temp = self._temp / f"{name}{self._starts[name]}"
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *flags,
                   "--node-ip-address", self.hosts.address(name), "--num-cpus", f"{cpus:g}",
                   "--object-store-memory", str(OBJECT_STORE), "--disable-usage-stats", "--temp-dir", str(temp)]
        proc = self.hosts.popen(name, command, log=self.logs / f"ray-{name}.log", env=self.env)
        self.nodes[name] = proc
        return proc

    def start_head(self, name: str, cpus: float = 0) -> None:
        self.head = name
        self._start(name, ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"], cpus)
        self.wait_nodes(1)

    def start_worker(self, name: str, cpus: float = 1) -> None:
        self._start(name, ["--address", self.address], cpus)

    def join(self, name: str, cpus: float = 1, tries: int = 3) -> int:
        """Start worker `name` and wait until Ray lists it alive; a `ray start` that gives up meanwhile (its raylet
        not registered within Ray's 30 s, as on an overloaded machine) is run again, as a service manager would,
        up to `tries` times. The number of starts it took."""
        for attempt in range(1, tries + 1):
            self.start_worker(name, cpus)
            deadline = time.monotonic() + NODE_TIMEOUT
            while self.nodes[name].poll() is None and time.monotonic() < deadline:
                if self.hosts.address(name) in {n["ip"] for n in self.alive_nodes()}:
                    return attempt
                time.sleep(2.0)
            if self.nodes[name].poll() is None:
                raise RuntimeError(f"Ray node {name} not alive after {NODE_TIMEOUT:.0f} s:\n{self.tail(name)}")
        raise RuntimeError(f"Ray node {name} did not start in {tries} tries:\n{self.tail(name)}")

    def wait_gone(self, name: str, timeout: float = NODE_TIMEOUT) -> float:
        """Wait until Ray no longer lists node `name` alive: seconds waited."""
        started = time.monotonic()
        while self.hosts.address(name) in {n["ip"] for n in self.alive_nodes()}:
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"Ray still lists {name} alive after {timeout:.0f} s")
            time.sleep(2.0)
        return time.monotonic() - started

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process of node `name` at once (`ray start`, its raylet, agents and workers)."""
        proc = self.nodes.pop(name)
        killed = kill_session(proc.pid, signal.SIGKILL)
        proc.wait(30)
        return killed

    def alive_nodes(self) -> list[dict]:
        """Ray's view of its live nodes ([{"ip":, "id":, "cpus":}]), asked by a short driver in the head's
        namespace. The answer is the one stdout line after NODES_MARK: the driver also prints the cluster's error
        reports to stdout (a node marked dead, with its possible causes), in its own threads, before or after."""
        script = ("import json, ray; ray.init(address='%s', log_to_driver=False); "
                  "print(%r + json.dumps([{'ip': n['NodeManagerAddress'], 'id': n['NodeID'], "
                  "'cpus': n['Resources'].get('CPU', 0)} for n in ray.nodes() if n['Alive']]), flush=True)"
                  ) % (self.address, NODES_MARK)
        done = self.hosts.run(self.head, [sys.executable, "-c", script], env=self.env, timeout=NODE_TIMEOUT)
        if done.returncode != 0:
            raise RuntimeError(f"cannot ask Ray for its nodes:\n{done.stderr[-3000:]}")
        answers = [line[len(NODES_MARK):] for line in done.stdout.splitlines() if line.startswith(NODES_MARK)]
        if len(answers) != 1:
            raise RuntimeError(f"Ray's driver printed {len(answers)} node lists:\n{done.stdout[-3000:]}")
        return json.loads(answers[0])

    def wait_nodes(self, count: int, timeout: float = NODE_TIMEOUT) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.nodes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"Ray node {name} exited with {proc.returncode}:\n{self.tail(name)}")
            if count == 1 and self.head in self.nodes and not self._head_listening():
                nodes = []
            else:
                nodes = self.alive_nodes()
            if len(nodes) == count:
                return nodes
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(nodes)} Ray nodes alive after {timeout:.0f} s, not {count}: {nodes}")
            time.sleep(2.0)

    def _head_listening(self) -> bool:
        probe = self.hosts.run(self.head, ["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{RAY_PORT}"], timeout=10)
        return probe.returncode == 0

    def tail(self, name: str, chars: int = 3000) -> str:
        path = self.logs / f"ray-{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        """Every node down: SIGTERM to each node's session (what `ray stop` sends), SIGKILL what is left."""
        for proc in self.nodes.values():
            kill_session(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20.0
        for proc in self.nodes.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_session(proc.pid, signal.SIGKILL)
        self.nodes.clear()
        shutil.rmtree(self._temp, ignore_errors=True)
