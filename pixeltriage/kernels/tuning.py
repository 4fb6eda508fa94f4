"""Choices measured once per machine: which of two implementations runs faster here, timed on the machine itself
and kept in a file (`path()`: $PIXELTRIAGE_TUNING, else `cache_dir() / "tuning.json"`), so that every later process
on it makes the same choice (and so computes the same bits) without measuring again. As Triton's and fla's
autotuners keep their choices, with one difference: the key is the machine (CPU model, its flags, torch's version, the
malloc condition and thread count), not a kernel's shapes.

Processes that start together serialise on a lock file: the first measures, the others read its result.
`pixeltriage bench tune` shows this machine's records (`--again`: `forget` them and measure anew); changing the
machine, torch, the malloc condition or the thread count measures again too. A cache that cannot be written
costs a measurement per process, never an error.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from pixeltriage import settings
from pixeltriage.kernels import native, workspace
from pixeltriage.paths import cache_dir, locked

log = logging.getLogger(__name__)

FILE = "tuning.json"
ENV = "PIXELTRIAGE_TUNING"
_memo: dict[str, dict] = {}

# Whether this process's glibc malloc keeps freed memory and serves large blocks from it (`engine.cpu_memory.
# tune_malloc` sets it once applied) or maps each large block afresh (the default, where every tensor past the
# mmap threshold pays its page faults). Two implementations that allocate differently compare differently under
# each (the bench-small float32 decoder MLP in row blocks: 0.53x the whole's time with malloc as is, 0.94x tuned),
# so it is part of `machine_key`.
malloc_tuned = False


def malloc_condition() -> str:
    return "malloc tuned" if malloc_tuned else "malloc as is"


def workspace_condition() -> str:
    """Whether forwards write their widest intermediates into a workspace (`kernels.workspace`, on unless
    PIXELTRIAGE_WORKSPACE=0): in a process with malloc as is it decides which of them page-fault, so what the
    forward's MLP measures in row blocks against whole depends on it too."""
    return "workspace on" if workspace.enabled() else "workspace off"


@functools.lru_cache(maxsize=1)
def _cpu() -> str:
    """The CPU's part of `machine_key`: its model and flags (hashed), read once per process (reading /proc/cpuinfo
    and hashing it took ~70 us, and `measured` runs on every call of a layer that follows a record)."""
    fields = native.cpuinfo_fields()
    flags = fields.get("flags") or fields.get("Features") or ""
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{fields.get('model name', 'unknown CPU')} [{digest}]"


def machine_key() -> str:
    """What a measured choice depends on: the CPU's model and flags (hashed), torch's version, the process's malloc
    condition (`malloc_condition`) and workspace (`workspace_condition`), its thread count."""
    return (f"{_cpu()} torch {torch.__version__}, {malloc_condition()}, {workspace_condition()} "
            f"x{torch.get_num_threads()}")


def path() -> Path:
    """The records' file: $PIXELTRIAGE_TUNING, else tuning.json in the cache. A file of its own keeps one process's
    measurements (a test run's, taken on a loaded machine) from the choices every other process follows."""
    return settings.current().tuning or cache_dir() / FILE


def _lock_path(file: Path) -> Path:
    return file.parent / f".{file.name}.lock"


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): measuring again", file, e)
        return {}
    return data if isinstance(data, dict) else {}


def measured(name: str, measure: Callable[[], dict], fits: Callable[[dict], bool] | None = None) -> dict:
    """`measure()`'s record for this machine under `name`: from this process's memory, else the cache file, else
    measured now (under the cache's lock) and written there. The record is a JSON object; `measure` should put
    its figures in it beside the choice, so that the file says why. fits: whether a kept record still applies to
    this process (e.g. was measured on the engine it would run); one that does not is measured anew and replaced."""
    def usable(record) -> bool:
        return isinstance(record, dict) and (fits is None or fits(record))

    key = f"{name} @ {machine_key()}"
    if usable(_memo.get(key)):
        return _memo[key]
    file = path()
    record = _read(file).get(key)
    if not usable(record):
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with locked(_lock_path(file)):
                data = _read(file)
                record = data.get(key)
                if not usable(record):
                    record = measure()
                    data[key] = record
                    _write(file, data)
                    log.info("measured %s on this machine: %s (kept in %s)", name, record, file)
        except OSError as e:
            log.warning("cannot keep the measured %s in %s (%s): measured for this process only", name, file, e)
            if not usable(record):
                record = measure()
    _memo[key] = record
    return record


def _mine(records: dict, prefix: str = "") -> dict:
    """The entries of `records` (the cache file's or `_memo`) for this machine whose names start with `prefix`, by
    name (the key without " @ <machine>")."""
    suffix = f" @ {machine_key()}"
    return {k[:-len(suffix)]: v for k, v in records.items() if k.startswith(prefix) and k.endswith(suffix)}


def kept(prefix: str, this_process: bool = False) -> dict[str, dict]:
    """This machine's kept records whose names start with `prefix` (those a forward measured, e.g. "row blocks: "):
    {name: record}, from the cache file and this process's memory, or (this_process) only those this process has
    asked `measured` for; none are measured here."""
    found = {} if this_process else _mine(_read(path()), prefix)
    found.update(_mine(_memo, prefix))
    return dict(sorted(found.items()))


def forget() -> list[str]:
    """Drop this machine's records (every name) from the cache file and this process's memory, so that the next
    `measured` measures anew. -> the names dropped."""
    suffix = f" @ {machine_key()}"
    for name in _mine(_memo):
        del _memo[name + suffix]
    file = path()
    if not file.exists():
        return []
    with locked(_lock_path(file)):
        data = _read(file)
        dropped = list(_mine(data))
        for name in dropped:
            del data[name + suffix]
        if dropped:
            _write(file, data)
    return dropped


def _write(file: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def interleaved_ratio(first: Callable[[], object], second: Callable[[], object], pairs: int = 7,
                      warmup: int = 2) -> list[float]:
    """second's time over first's, one ratio per pair, the order alternating between pairs (so that a machine whose
    speed drifts hits both alike); after `warmup` untimed calls of each. -> the ratios, sorted."""
    for _ in range(warmup):
        first(), second()
    ratios = []
    for i in range(pairs):
        times = {}
        for which, fn in ((0, first), (1, second)) if i % 2 == 0 else ((1, second), (0, first)):
            t0 = time.perf_counter()
            fn()
            times[which] = time.perf_counter() - t0
        ratios.append(times[1] / times[0])
    return sorted(ratios)
