"""One scoring service's life: the scorer loaded, a warm-up forward at the full batch budget, the batcher started
(loading -> ready -> draining -> stopped, or failed), the admission the guard asks before reading a body, the drain
on SIGTERM and the idle trim. Once loaded, `Service.infer` (`infer.Infer`) answers the routes; a server process and
each Ray Serve replica hold one `Service`.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from pixeltriage.config import default_dtype
from pixeltriage.errors import OverloadedError, ServiceUnavailableError
from pixeltriage.media.policy import THUMBNAIL_SIDE
from pixeltriage.serve.batcher import Batcher
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.infer import Infer
from pixeltriage.serve.metrics import Metrics

if TYPE_CHECKING:
    from pixeltriage.store.cache import Cache
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.retrieval.index import RegionIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a checkpoint on a device, with an optional write-time cache file (plain values, so that a Ray
    replica can be handed one)."""

    checkpoint: str
    device: str = "cpu"
    dtype: str | None = None           # None: float32 on the CPU, bfloat16 on CUDA
    cache: str | None = field(default=None, repr=False)   # a path or a postgresql:// URL (its password unshown)
    cache_timeout: float | None = None # seconds a cache call waits for a lock or a connection (None: the cache's)
    verify: bool = False
    threads: int | None = None         # torch's intra-op threads for the forward (None: torch's default)
    index_encoder: str | None = None   # a SigLIP 2 directory: /v1/memories also indexes regions, /v1/retrieve ranks
    index_overlap: float | None = None # the region grid's overlap (None: the retrieval default)

    def load(self) -> "Scorer":
        import torch

        from pixeltriage.store.cache import Cache
        from pixeltriage.engine.scorer import Scorer

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        dtype = self.dtype or default_dtype(self.device)
        timeout = {} if self.cache_timeout is None else {"busy_timeout_ms": max(1, round(1000 * self.cache_timeout))}
        cache = Cache(self.cache, **timeout) if self.cache else None
        try:
            return Scorer.load(self.checkpoint, device=self.device, dtype=dtype, cache=cache,
                               verify=self.verify or None)
        except BaseException:
            if cache is not None:
                cache.close()
            raise

    def load_index(self, cache: "Cache") -> "RegionIndex | None":
        """The region index over the scorer's cache (DeliverMem R1), when an encoder was given."""
        if self.index_encoder is None:
            return None
        from pixeltriage.retrieval.encoder import SiglipEncoder
        from pixeltriage.retrieval.index import RegionIndex
        from pixeltriage.retrieval.regions import RegionGrid

        encoder = SiglipEncoder.load(self.index_encoder, device=self.device)
        grid = RegionGrid() if self.index_overlap is None else RegionGrid(self.index_overlap)
        return RegionIndex(cache, encoder, grid)


class IdleTrim:
    """Gives the memory that requests freed back to the OS (`cpu_memory.trim_malloc`) once the service has held no
    request and admitted no question for `after_s` seconds, once per idle spell (and once after the warm-up).

    Why: the server's malloc settings (`tune_malloc`: no mmap, a 1 GiB trim threshold) keep freed memory for the
    next forward, so without a trim the memory of every large body parsed and thrown away (a 4 MiB note refused
    with 422) stays with the process: over a 10-minute soak RSS rose 16% and stayed there. An idle server now holds
    what it uses; the first forward after a pause takes its buffers (the Scorer's workspace among them, released
    just before the trim) from the OS again."""

    POLLS = 4                           # looks per `after_s`

    def __init__(self, service: Service, after_s: float):
        self.service, self.after_s = service, after_s
        self.trims = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pixeltriage-idle-trim", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _busy(self) -> bool:
        service = self.service
        return bool(service.open_requests or service.pending_writes
                    or (service.batcher is not None and service.batcher.admitted))

    def _run(self) -> None:
        from pixeltriage.engine import cpu_memory

        if not cpu_memory.can_trim():
            return                              # no malloc_trim here (not glibc), or turned off
        seen, trimmed, last_busy = self.service.requests_held, None, time.monotonic()
        while not self._stop.wait(self.after_s / self.POLLS):
            now, held = time.monotonic(), self.service.requests_held
            if held != seen or self._busy():
                seen, last_busy = held, now
            elif trimmed != seen and now - last_busy >= self.after_s:
                start = time.perf_counter()
                scorer = self.service.scorer    # its workspace's buffers first, then all that malloc holds free
                released = scorer.workspace.release() if scorer is not None else 0
                if not cpu_memory.trim_malloc():
                    return
                self.trims += 1
                trimmed = seen
                log.debug("idle %.1f s: workspace (%d B) and malloc's free memory given back in %.1f ms",
                          now - last_busy, released, 1000 * (time.perf_counter() - start))


class Service:
    """Loads the model (`load`, or `start_loading` in the background), admits requests, drains; `infer` scores."""

    def __init__(self, config: ServeConfig, loader: Callable[[], "Scorer"], *, describe: dict | None = None,
                 index_loader: Callable[["Cache"], "RegionIndex | None"] | None = None):
        self.config = config
        self.loader = loader
        self.index_loader = index_loader
        self.index: "RegionIndex | None" = None    # the region index, when the server was given an encoder
        self.describe = dict(describe or {})
        self.metrics = Metrics()
        self.metrics.queue_capacity.set(config.max_queued)
        self.scorer: "Scorer | None" = None
        self.batcher: Batcher | None = None
        self.infer: Infer | None = None    # the facade the routes call, once loaded
        self.status = "loading"            # loading, ready, draining, stopped, failed
        self.error: BaseException | None = None
        self.open_requests = 0             # /v1 requests with a body, arrival to response (the body bound)
        self.requests_held = 0             # every such request so far (the idle trim's sign of activity)
        self._trim: IdleTrim | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> "Cache | None":
        return self.scorer.cache if self.scorer is not None else None

    @property
    def pending_writes(self) -> int:
        """Cache calls waiting for or running on a worker thread (the idle trim's sign of activity)."""
        return self.infer.pending_writes if self.infer is not None else 0

    # -- life ----------------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the scorer, run one warm-up forward at the full batch budget, start the batcher: then ready."""
        start = time.monotonic()
        scorer = self.loader()
        try:
            if self.index_loader is not None and scorer.cache is not None:
                self.index = self.index_loader(scorer.cache)
                if self.index is not None:
                    self.index.refresh()           # read the stored vectors now, not in the first search
            budget = self.config.max_batch_tokens or scorer.max_batch_tokens
            scorer.max_batch_tokens = budget
            warm_up(scorer, budget)
            scorer.vision_fingerprint          # computed once now, not in the first question's forward
        except BaseException:
            if scorer.cache is not None:       # a failed load leaves no open cache behind
                scorer.cache.close()
            raise
        batcher = Batcher(scorer.score_states, max_batch_tokens=budget, max_wait_ms=self.config.max_wait_ms,
                          max_queued=self.config.max_queued, preprocess_threads=self.config.preprocess_threads,
                          observer=self.metrics)
        with self._lock:
            if self.status != "loading":       # shut down while loading
                if scorer.cache is not None:
                    scorer.cache.close()
                return
            self.infer = Infer(self.config, scorer, batcher, self.metrics, self.index)
            self.scorer, self.batcher = scorer, batcher
            batcher.start()
            if self.config.trim_idle_s is not None:
                self._trim = IdleTrim(self, self.config.trim_idle_s)
                self._trim.start()
            self.status = "ready"
        self.metrics.ready.set(1)
        log.info("ready in %.1f s: batch budget %d tokens, queue %d questions", time.monotonic() - start, budget,
                 self.config.max_queued)

    def start_loading(self, on_failure: Callable[[BaseException], None],
                      on_ready: Callable[[], None] | None = None) -> threading.Thread:
        """`load` on a background thread (the server answers /health meanwhile); then `on_ready()`, or
        `on_failure(error)` if it failed."""
        def run():
            try:
                self.load()
            except BaseException as e:
                self.status, self.error = "failed", e
                on_failure(e)
                return
            if on_ready is not None and self.status == "ready":
                on_ready()

        thread = threading.Thread(target=run, name="pixeltriage-load", daemon=True)
        thread.start()
        return thread

    @property
    def admitting(self) -> bool:
        return self.readiness == "ready"

    @property
    def readiness(self) -> str:
        """`status`, except "stalled" when ready but its batcher's threads have stopped (what /ready and Ray's health
        check report: such a server must be restarted)."""
        status = self.status
        if status == "ready" and self.batcher is not None and not self.batcher.alive:
            return "stalled"
        return status

    def refusal(self, holds_body: bool, scoring: bool) -> ServiceUnavailableError | OverloadedError | None:
        """Why a request is refused before its body is read (None: admit it): ServiceUnavailableError while not
        ready; OverloadedError for a request with a body while --max-queued of them are open, or for a scoring one
        while the batcher has no room (its retry_after: the batcher's estimate)."""
        if not self.admitting:
            return ServiceUnavailableError(f"the service is {self.status}; retry on another replica or later")
        if holds_body and (self.open_requests >= self.config.max_queued or (scoring and self.batcher.free <= 0)):
            return OverloadedError(f"the server is full ({self.batcher.admitted} of {self.config.max_queued} "
                                   f"questions admitted, {self.open_requests} requests open)",
                                   self.batcher.retry_after())
        return None

    @contextmanager
    def holding_body(self) -> Iterator[None]:
        """Count a request body held in memory (arrival to response): at most --max-queued of them."""
        self.open_requests += 1
        self.requests_held += 1
        try:
            yield
        finally:
            self.open_requests -= 1

    def drain(self, timeout: float) -> bool:
        """Stop admitting (503 from now on) and wait up to `timeout` s for admitted questions; True if all finished.
        Past the timeout, the questions not yet in a forward are refused (503) and the batcher closes."""
        with self._lock:
            if self.status == "ready":
                self.status = "draining"
            elif self.status == "loading":
                self.status = "stopped"
        self.metrics.ready.set(0)
        if self.batcher is None:
            return True
        self.batcher.stop_admitting()
        done = self.batcher.wait_idle(timeout)
        if not done:
            log.warning("graceful timeout (%.1f s): %d questions still admitted are refused", timeout,
                        self.batcher.admitted)
            self.batcher.close("the service shut down before this request was scored (graceful timeout)")
        return done

    def close(self) -> None:
        """Refuse what is still queued (503), stop the threads, close the cache. Idempotent."""
        with self._lock:
            self.status = "stopped" if self.status != "failed" else "failed"
        self.metrics.ready.set(0)
        if self._trim is not None:
            self._trim.stop()
        try:
            if self.batcher is not None:
                self.batcher.close()
        finally:
            if self.cache is not None:
                self.cache.close()


def warm_up(scorer: "Scorer", budget: int) -> None:
    """One forward at the full batch budget (copies of a one-image state, packed varlen), then one single question:
    the first real requests then meet warm allocators and kernels. Runs without the cache (writes nothing to it)."""
    from PIL import Image

    from pixeltriage.engine.types import Memory

    plain = scorer.with_cache(None)
    plain.max_batch_tokens = budget
    image = Image.new("RGB", (THUMBNAIL_SIDE, THUMBNAIL_SIDE), (127, 127, 127))
    state = plain.pack("warm-up", [Memory(image=image, note="warm-up")])
    plain.score_states([state] * max(1, budget // state.num_tokens))
    plain.score_states([state])
