"""Every PIXELTRIAGE_* environment variable, read and checked in one place, once per process.

`current()` parses them the first time it is asked and keeps the result (a `Settings`); a value outside a
variable's accepted values is a ValueError naming the variable and those values. Whoever changes a variable after
that re-reads with `reload()` (the next `current()` parses the environment again) or sets it for a block with
`environment(...)`: tests and tools do (the test suite's `monkeypatch` re-reads on every setenv and delenv). The
kernels take their switches from here (`kernels.registry`: which kernel may run each op); docs/api.md has the
table of variables.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# The words a switch may say (any case, spaces around ignored)
ON_WORDS = ("1", "true", "on", "yes")
OFF_WORDS = ("0", "false", "off", "no")
AUTO = "auto"


@dataclass(frozen=True)
class Settings:
    """The parsed environment. Tri-state switches hold "auto", "on" or "off"."""
    cache: Path | None              # PIXELTRIAGE_CACHE (None: ~/.cache/pixeltriage, `paths.cache_dir`)
    tuning: Path | None             # PIXELTRIAGE_TUNING (None: tuning.json in the cache)
    native: bool                    # PIXELTRIAGE_NATIVE: build and use the C kernels
    native_isa: str                 # PIXELTRIAGE_NATIVE_ISA: "native" or "emulated"
    delta_bf16: str                 # PIXELTRIAGE_DELTA_BF16
    onednn: str                     # PIXELTRIAGE_ONEDNN
    prepack: str                    # PIXELTRIAGE_PREPACK
    workspace: bool                 # PIXELTRIAGE_WORKSPACE
    malloc_tuning: bool             # PIXELTRIAGE_MALLOC_TUNING
    malloc_trim: bool               # PIXELTRIAGE_MALLOC_TRIM
    emulate_cuda: bool              # PIXELTRIAGE_EMULATE_CUDA (with TRITON_INTERPRET=1)
    triton_interpret: bool          # TRITON_INTERPRET, Triton's own variable, read for the head and the switch above
    test_decline: frozenset[str]    # PIXELTRIAGE_TEST_DECLINE: C entry points forced to decline (tests)


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _flag(name: str, default: bool) -> bool:
    value = _raw(name).lower()
    if not value:
        return default
    if value in ON_WORDS:
        return True
    if value in OFF_WORDS:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(ON_WORDS + OFF_WORDS)} "
                     f"(unset: {'on' if default else 'off'})")


def _tri_state(name: str) -> str:
    value = _raw(name).lower()
    if value in ("", AUTO):
        return AUTO
    if value in ON_WORDS:
        return "on"
    if value in OFF_WORDS:
        return "off"
    raise ValueError(f"{name}={os.environ[name]!r}: expected auto (unset: the choice measured on this machine), "
                     f"{' / '.join(ON_WORDS)} or {' / '.join(OFF_WORDS)}")


def _choice(name: str, accepted: tuple[str, ...]) -> str:
    value = _raw(name).lower() or accepted[0]
    if value not in accepted:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(map(repr, accepted))} (unset: "
                         f"{accepted[0]!r})")
    return value


def _path(name: str) -> Path | None:
    value = _raw(name)
    return Path(value).expanduser() if value else None


_ENTRY_POINT = re.compile(r"pt_[a-z0-9_]+")


def _entry_points(name: str) -> frozenset[str]:
    names = [n.strip() for n in _raw(name).split(",") if n.strip()]
    wrong = [n for n in names if not _ENTRY_POINT.fullmatch(n)]
    if wrong:
        raise ValueError(f"{name}={os.environ[name]!r}: expected C entry point names separated by commas "
                         f"(pt_add_norm,pt_silu_mul), not {', '.join(map(repr, wrong))}")
    return frozenset(names)


def parse() -> Settings:
    """The environment as it is now, parsed (no caching: `current` keeps one)."""
    settings = Settings(
        cache=_path("PIXELTRIAGE_CACHE"), tuning=_path("PIXELTRIAGE_TUNING"),
        native=_flag("PIXELTRIAGE_NATIVE", True),
        native_isa=_choice("PIXELTRIAGE_NATIVE_ISA", ("native", "emulated")),
        delta_bf16=_tri_state("PIXELTRIAGE_DELTA_BF16"), onednn=_tri_state("PIXELTRIAGE_ONEDNN"),
        prepack=_tri_state("PIXELTRIAGE_PREPACK"), workspace=_flag("PIXELTRIAGE_WORKSPACE", True),
        malloc_tuning=_flag("PIXELTRIAGE_MALLOC_TUNING", True), malloc_trim=_flag("PIXELTRIAGE_MALLOC_TRIM", True),
        emulate_cuda=_flag("PIXELTRIAGE_EMULATE_CUDA", False), triton_interpret=_flag("TRITON_INTERPRET", False),
        test_decline=_entry_points("PIXELTRIAGE_TEST_DECLINE"))
    if settings.emulate_cuda and not settings.triton_interpret:
        raise ValueError("PIXELTRIAGE_EMULATE_CUDA=1 runs the CUDA kernels on CPU tensors in Triton's interpreter, "
                         "which needs TRITON_INTERPRET=1 (set before triton is first imported); it is not set")
    return settings


_current: Settings | None = None


def current() -> Settings:
    """The settings of this process: the environment parsed at the first call (or the first after `reload`)."""
    global _current
    if _current is None:
        _current = parse()
    return _current


def reload() -> None:
    """Forget the parsed settings: the next `current()` reads the environment again."""
    global _current
    _current = None


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[Settings]:
    """Inside the block the variables named (a value of None unsets one) are set in os.environ and read anew; after
    it, the previous values are restored and read anew. Process-wide: for tests and tools."""
    previous = {name: os.environ.get(name) for name in values}

    def put(items) -> None:
        for name, value in items:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload()

    put(values.items())
    try:
        yield current()
    finally:
        put(previous.items())
