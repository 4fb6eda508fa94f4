"""The server's `IdleTrim`: malloc's free memory given back once per idle spell, never while a request is open, a
cache write waits or a question is admitted.

The trim thread's looks are counted (its stop event's waits): "never" is checked over enough looks that a trim that
ignored the state would have run, not over a sleep the thread may not get the processor in."""
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from serving import wait_for


class FakeService:
    """What IdleTrim reads of a Service: the open requests, the cache writes, the batcher's admitted questions, the
    count of requests held so far and the scorer's workspace (with a buffer in it)."""

    def __init__(self):
        from pixeltriage.kernels.workspace import Workspace

        self.open_requests = self.pending_writes = self.requests_held = 0
        self.batcher = SimpleNamespace(admitted=0)
        self.scorer = SimpleNamespace(workspace=Workspace())
        self.scorer.workspace.take("in_proj", (64, 64), torch.float32)


class Looks(threading.Event):
    """IdleTrim's stop event, counting its waits: the thread looks at the service after each, so once `waits` is n,
    its first n - 1 looks are done."""

    def __init__(self):
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def test_idle_trim_once_per_idle_spell_and_never_while_busy(monkeypatch):
    import pixeltriage.engine.cpu_memory as cpu_memory
    from pixeltriage.serve.service import IdleTrim

    calls, busy_at_trim, held_at_trim = [], [], []
    service = FakeService()

    def trim():
        calls.append(time.monotonic())
        busy_at_trim.append(service.open_requests or service.batcher.admitted or service.pending_writes)
        held_at_trim.append(service.scorer.workspace.nbytes)
        return True

    monkeypatch.setattr(cpu_memory, "can_trim", lambda: True)
    monkeypatch.setattr(cpu_memory, "trim_malloc", trim)
    idle = IdleTrim(service, after_s=0.05)
    looks = idle._stop = Looks()

    def spell_passes():
        """Until the thread has looked, after this call, for long enough that an idle spell would end in a trim (a
        look every after_s / POLLS: POLLS of them, and one more each side)."""
        target = looks.waits + IdleTrim.POLLS + 3
        wait_for(f"{IdleTrim.POLLS + 2} looks of the trim thread", lambda: looks.waits >= target, 20)

    idle.start()
    try:
        wait_for("the first trim", lambda: len(calls) == 1, 20)   # after the warm-up: once
        spell_passes()
        assert len(calls) == 1                                  # idle on: not again
        for field in ("open_requests", "pending_writes"):       # a request held, then a cache write
            before = len(calls)
            setattr(service, field, 1)
            service.requests_held += 1
            spell_passes()
            assert len(calls) == before                         # busy: never
            setattr(service, field, 0)
            wait_for(f"a trim once {field} is 0", lambda: len(calls) == before + 1, 20)   # idle again: once
        service.batcher.admitted = 2                            # questions still admitted after their request
        service.requests_held += 1
        spell_passes()
        assert len(calls) == 3
        service.batcher.admitted = 0
        wait_for("a trim once no question is admitted", lambda: len(calls) == 4, 20)
        service.requests_held += 1                              # a request that came and went between two looks
        wait_for("a trim after a request that came and went", lambda: len(calls) == 5, 20)
        spell_passes()
        assert len(calls) == 5 and not any(busy_at_trim) and idle.trims == 5
        assert held_at_trim == [0] * 5              # the workspace released before each trim
    finally:
        idle.stop()


def test_idle_trim_stops_where_there_is_no_malloc_trim(monkeypatch):
    """No malloc_trim (not glibc) or PIXELTRIAGE_MALLOC_TRIM=0: the thread ends at once, the workspace kept."""
    import pixeltriage.engine.cpu_memory as cpu_memory
    from pixeltriage.serve.service import IdleTrim

    monkeypatch.setattr(cpu_memory, "can_trim", lambda: False)
    monkeypatch.setattr(cpu_memory, "trim_malloc", lambda: pytest.fail("trimmed where it cannot"))
    service = FakeService()
    idle = IdleTrim(service, after_s=0.05)
    idle.start()
    idle._thread.join(timeout=20)
    assert not idle._thread.is_alive() and idle.trims == 0 and service.scorer.workspace.nbytes == 64 * 64 * 4
    idle.stop()


def test_can_trim_follows_the_switch(monkeypatch):
    from pixeltriage.engine import cpu_memory

    monkeypatch.setenv("PIXELTRIAGE_MALLOC_TRIM", "0")
    assert not cpu_memory.can_trim() and not cpu_memory.trim_malloc()
    monkeypatch.setenv("PIXELTRIAGE_MALLOC_TRIM", "1")
    assert cpu_memory.can_trim() == sys.platform.startswith("linux")


def test_the_config_takes_a_positive_idle_time_or_none():
    from pixeltriage.serve.config import ConfigError, ServeConfig

    assert ServeConfig().trim_idle_s == 1.0 and ServeConfig(trim_idle_s=None).trim_idle_s is None
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="trim_idle_s"):
            ServeConfig(trim_idle_s=bad)


def test_real_servers_give_their_workspace_back_when_idle_and_not_without_the_trim(served, client, tiny_checkpoint,
                                                                                   tmp_path):
    """Servers on loopback, scored over HTTP: the main one (an idle trim after 1 s) shows its workspace's bytes at 0
    once idle after a question; one started with --trim-idle-s 0 keeps them after the same question and an idle
    spell longer than the main one's."""
    import httpx
    from serving import API_KEY, ServerProcess, episode, get, metric

    def held(server) -> float:
        page = get(server.url + "/metrics", headers={"authorization": f"Bearer {API_KEY}"})
        assert page.status_code == 200
        return metric(page.text, "pixeltriage_workspace_bytes")

    keeper = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--trim-idle-s", "0")   # loads meanwhile
    try:
        client.score(*episode(31))
        wait_for("the main server's workspace given back at idle", lambda: held(served) == 0, 60)
        keeper.wait_ready()
        question, memories = episode(32)
        from pixeltriage.serve import Client

        with Client(keeper.url, retries=0) as plain:
            plain.score(question, memories)
        assert held(keeper) > 0
        time.sleep(1.5)                             # past the main server's idle time: nothing gives it back here
        assert held(keeper) > 0
    finally:
        keeper.stop()
