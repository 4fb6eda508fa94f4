"""The scoring service's limits and settings: one frozen dataclass, checked once (the command line checks the same
values at parse time, with the same bounds)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pixeltriage.errors import PixelTriageError

MIB = 2 ** 20
DEFAULT_CLIENT_BATCH = 32           # questions per batch request, unless --max-queued is smaller


class ConfigError(PixelTriageError, ValueError):
    """Service settings that cannot work (a limit out of range, flags that do not go together)."""


@dataclass(frozen=True)
class ServeConfig:
    """What one server process (or Ray replica) enforces. Defaults are the command line's.

    max_batch_tokens: state tokens per forward (None: the scorer's default for its device, 4096 CPU / 32768 CUDA).
    max_wait_ms: how long an idle worker holding a partial batch waits for more ready questions.
    max_queued: questions admitted at once (preparing, ready or in a forward); past it, 429.
    max_client_batch: questions per /v1/score/batch request (at most max_queued; None: 32, or max_queued when that
        is smaller); past it, 422.
    max_memories: memories per question; past it, 422.
    request_timeout: seconds from arrival to a question's forward; a request still waiting then is dropped (504).
    payload_limit: request body bytes; past it, 413.
    preprocess_threads: threads decoding images and packing states while the forward runs.
    image_root: the folder `path` memories are read from (None: `path` memories are refused).
    api_keys: Bearer keys accepted on /v1, /info and the docs (empty: no authentication).
    gate_window, max_gates: each rate gate's window of recent p_vis, and how many (stream, rate) gates are kept.
    graceful_timeout: seconds SIGTERM waits for admitted work before the remaining questions are refused (503).
    trim_idle_s: seconds without a request (none open, none admitted) after which the memory that requests freed is
        given back to the OS (`pixeltriage.engine.cpu_memory.trim_malloc`, once per idle spell); None: never.
    rerank_score, rerank_strict: a rerank request's `pixeltriage_score` and `strict` when it does not say.
    """

    max_batch_tokens: int | None = None
    max_wait_ms: float = 0.0
    max_queued: int = 256
    max_client_batch: int | None = None
    max_memories: int = 64
    request_timeout: float = 60.0
    payload_limit: int = 32 * MIB
    preprocess_threads: int = 2
    image_root: Path | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    gate_window: int = 1000
    max_gates: int = 256
    graceful_timeout: float = 30.0
    rerank_score: str = "gain"
    rerank_strict: bool = False
    trim_idle_s: float | None = 1.0

    def __post_init__(self):
        _at_least("max_batch_tokens", self.max_batch_tokens, 1, optional=True)
        _at_least("max_queued", self.max_queued, 1)
        if self.max_client_batch is None:
            object.__setattr__(self, "max_client_batch", min(DEFAULT_CLIENT_BATCH, self.max_queued))
        _at_least("max_client_batch", self.max_client_batch, 1)
        _at_least("max_memories", self.max_memories, 0)
        _at_least("payload_limit", self.payload_limit, 1)
        _at_least("preprocess_threads", self.preprocess_threads, 1)
        _at_least("gate_window", self.gate_window, 1)
        _at_least("max_gates", self.max_gates, 1)
        from pixeltriage.serve.schemas import RERANK_SCORES

        if self.rerank_score not in RERANK_SCORES:
            raise ConfigError(f"rerank_score is one of {RERANK_SCORES}, not {self.rerank_score!r}")
        if self.max_client_batch > self.max_queued:
            raise ConfigError(f"max_client_batch ({self.max_client_batch}) must be at most max_queued "
                             f"({self.max_queued}): a larger batch could never be admitted")
        for name in ("request_timeout", "graceful_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value}")
        if self.trim_idle_s is not None and not (math.isfinite(self.trim_idle_s) and self.trim_idle_s > 0):
            raise ConfigError(f"trim_idle_s must be a number of seconds > 0 or None, got {self.trim_idle_s}")
        if not (math.isfinite(self.max_wait_ms) and self.max_wait_ms >= 0):
            raise ConfigError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.image_root is not None and not Path(self.image_root).is_dir():
            raise ConfigError(f"image_root {self.image_root} is not a directory")
        if any(not key for key in self.api_keys):
            raise ConfigError("api_keys must not contain an empty key")

    def limits(self) -> dict:
        """The limits a client can plan with (for /info); the character limits are the request models' own."""
        from pixeltriage.serve.schemas import DATE_LIMIT, TEXT_LIMIT

        return {"text_chars": TEXT_LIMIT, "date_chars": DATE_LIMIT, "max_batch_tokens": self.max_batch_tokens, "max_wait_ms": self.max_wait_ms,
                "max_queued": self.max_queued, "max_client_batch": self.max_client_batch,
                "max_memories": self.max_memories, "request_timeout_s": self.request_timeout,
                "payload_limit_bytes": self.payload_limit, "preprocess_threads": self.preprocess_threads,
                "image_root": self.image_root is not None, "auth": bool(self.api_keys),
                "gate_window": self.gate_window, "max_gates": self.max_gates,
                "graceful_timeout_s": self.graceful_timeout, "trim_idle_s": self.trim_idle_s,
                "rerank_score": self.rerank_score, "rerank_strict": self.rerank_strict}


def _at_least(name: str, value, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def read_api_keys(path) -> tuple[str, ...]:
    """The Bearer keys in a key file: one per line (e.g. one per host, or the old and the new key while clients move
    over), surrounding whitespace and blank lines ignored. ConfigError when it holds none."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    keys = tuple(line.strip() for line in lines if line.strip())
    if not keys:
        raise ConfigError(f"{path}: holds no API key (one key per line)")
    if any(any(c.isspace() or not c.isprintable() for c in key) for key in keys):
        raise ConfigError(f"{path}: a key contains whitespace or an unprintable character")
    return keys
