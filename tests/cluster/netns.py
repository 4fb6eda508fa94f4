"""Test hosts on this machine: one network namespace per host, each with a veth pair to a bridge that lives in a
namespace of its own (the switch), addresses from 198.18.0.0/15 (the benchmarking range). Nothing is added to the
machine's own namespace, and the namespaces, the processes started in them and the links go when the `Hosts` is
closed, also after a failure. Names carry a per-run suffix, so that runs side by side do not meet.

    with Hosts(["head", "w1", "w2"]) as hosts:
        proc = hosts.popen("head", ["python", "-m", "..."], log=path)
        hosts.address("head")          # "198.18.0.1"
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "198.18.0"                 # the test hosts' /24: .1, .2, ... in the order the hosts were named
PREFIX_LENGTH = 24
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class NamespacesUnavailable(RuntimeError):
    """This machine (or this user) cannot create network namespaces: the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def probe() -> None:
    """Raise NamespacesUnavailable unless a namespace with a veth pair can be made (and is removed again)."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NamespacesUnavailable("creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    name = f"ptprobe-{secrets.token_hex(4)}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        raise NamespacesUnavailable(f"`ip netns add` failed: {made.stderr.strip()}")
    try:
        veth = _ip("-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode != 0:
            raise NamespacesUnavailable(f"no veth pair in a namespace: {veth.stderr.strip()}")
    finally:
        _ip("netns", "del", name, check=False)


class Hosts:
    """Network namespaces `pt-<run>-<name>` on one bridge, host i (from 0) at 198.18.0.<i+1>/24, loopback up."""

    def __init__(self, names: list[str]):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one: {names}")
        self.tag = secrets.token_hex(3)
        self.names = list(names)
        self.switch = f"pt-{self.tag}-sw"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def namespace(self, name: str) -> str:
        return f"pt-{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def __enter__(self) -> "Hosts":
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = self.namespace(name)
                self._add(ns)
                port = f"p{i}"
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/{PREFIX_LENGTH}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def __exit__(self, *exc) -> None:
        self.close()

    def popen(self, name: str, command: list[str], *, log: Path, env: dict | None = None) -> subprocess.Popen:
        """`command` in host `name`'s namespace, as the leader of a new session (so that every process it starts can
        be found and killed by its session id), its output appended to `log`."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(name), *command], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, name: str, command: list[str], *, env: dict | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace(name), *command], capture_output=True,
                              text=True, env=env, timeout=timeout)

    @contextlib.contextmanager
    def entered(self, name: str):
        """This thread in host `name`'s network namespace for the block: the sockets it opens there belong to that
        host (a client of the test process, beside the processes started in the host)."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.namespace(name)}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def pids(self, name: str) -> list[int]:
        """Every process in host `name`'s namespace."""
        listed = _ip("netns", "pids", self.namespace(name), check=False)
        return [int(p) for p in listed.stdout.split()]

    def close(self) -> None:
        """Kill whatever still runs in the namespaces (SIGKILL), then remove them (the veth pairs and the bridge go
        with them)."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_session(proc.pid, signal.SIGKILL)
        for ns in reversed(self._made):
            for _ in range(50):
                listed = _ip("netns", "pids", ns, check=False).stdout.split()
                if not listed:
                    break
                for pid in listed:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def kill_session(sid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to every process of session `sid` (a `popen` leader's pid); the pids it reached."""
    reached = []
    for pid in session_members(sid):
        try:
            os.kill(pid, sig)
            reached.append(pid)
        except ProcessLookupError:
            pass
    return reached
