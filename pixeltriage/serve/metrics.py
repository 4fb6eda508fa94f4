"""Prometheus metrics of one service, on its own registry (never the process-wide default one, so that two services
in one process, or a host's own metrics, do not collide)."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from typing import TYPE_CHECKING

from pixeltriage.serve.batcher import Observer, Timing
from pixeltriage.serve.schemas import DOCUMENT_STATUSES

if TYPE_CHECKING:
    from pixeltriage.kernels.registry import KernelCounts

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUESTIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

# why a request failed: the `reason` label of pixeltriage_request_failures_total
FAILURE_REASONS = ("overloaded", "payload_too_large", "unsupported_media_type", "invalid_input", "state_too_long",
                   "deadline", "disconnected", "unauthorized", "unavailable", "not_found", "no_cache", "store", "internal")


class Metrics(Observer):
    """Every metric the service exports; also the batcher's Observer."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pixeltriage_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.failures = Counter("pixeltriage_request_failures", "requests answered with an error, by reason",
                                ["reason"], registry=r)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.forward_failures = Counter("pixeltriage_forward_failures", "forwards that raised (a batch's failure "
                                        "is followed by one forward per question)", registry=r)
        self.questions = Counter("pixeltriage_questions", "questions scored", registry=r)
        self.queue_size = Gauge("pixeltriage_queue_size", "questions admitted and not yet in a forward", registry=r)
        self.queue_running = Gauge("pixeltriage_queue_running", "questions in the current forward", registry=r)
        self.queue_capacity = Gauge("pixeltriage_queue_capacity", "questions the queue admits (--max-queued)",
                                    registry=r)
        self.batch_questions = Histogram("pixeltriage_batch_questions", "questions per forward", buckets=QUESTIONS,
                                         registry=r)
        self.batch_tokens = Histogram("pixeltriage_batch_tokens", "state tokens per forward", buckets=TOKENS,
                                      registry=r)
        self.queue_duration = Histogram("pixeltriage_queue_duration_seconds", "per question: admitted -> its "
                                        "forward began, preprocessing excluded", buckets=SECONDS, registry=r)
        self.preprocess_duration = Histogram("pixeltriage_preprocess_duration_seconds", "per question: image "
                                             "decoding, thumbnails, tokenizing, packing", buckets=SECONDS, registry=r)
        self.forward_duration = Histogram("pixeltriage_forward_duration_seconds", "per forward", buckets=SECONDS,
                                          registry=r)
        self.request_duration = Histogram("pixeltriage_request_duration_seconds", "per scoring request: arrival -> "
                                          "response", buckets=SECONDS, registry=r)
        self.rerank_documents = Counter("pixeltriage_rerank_documents", "rerank documents answered, by status "
                                        "(scored, or why not: docs/serve.md, Rerank)", ["status"], registry=r)
        for status in DOCUMENT_STATUSES:
            self.rerank_documents.labels(status)
        self.vision_images = Counter("pixeltriage_vision_images", "images through the vision tower (computed) or "
                                     "read from the write-time cache (cached)", ["source"], registry=r)
        self.workspace_bytes = Gauge("pixeltriage_workspace_bytes", "bytes the scorer's forward workspace holds "
                                     "(given back before each idle trim)", registry=r)
        self.ready = Gauge("pixeltriage_ready", "1 once the model is loaded and warmed up, 0 while loading or "
                           "shutting down", registry=r)
        self.build = Info("pixeltriage_build", "version, checkpoint, device and dtype", registry=r)
        self.kernel_calls = Counter("pixeltriage_kernel_calls", "the scorer's op calls, by the kernel that ran "
                                    "each (kernels.registry)", ["op", "kernel"], registry=r)
        self.kernel_declines = Counter("pixeltriage_kernel_declines", "the scorer's op calls a kernel declined, "
                                       "by reason: the next kernel ran them", ["op", "kernel", "reason"], registry=r)
        self._vision_seen = {"cached": 0, "computed": 0}
        self._kernels_seen: dict[tuple[str, ...], int] = {}
        self._seen_lock = threading.Lock()        # two scrapes at once would count one gain twice

    def expose(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def vision_counts(self, counts: dict[str, int]) -> None:
        """Add what a scorer's `vision_counts` gained since the last call (safe from several threads at once)."""
        with self._seen_lock:
            for source in ("cached", "computed"):
                gained = counts.get(source, 0) - self._vision_seen[source]
                if gained > 0:
                    self.vision_images.labels(source).inc(gained)
                    self._vision_seen[source] += gained

    def kernel_counts(self, counts: KernelCounts) -> None:
        """Add what a scorer's `kernel_counts()` gained since the last call (safe from several threads at once)."""
        with self._seen_lock:
            for kind, counter, items in (("calls", self.kernel_calls, counts.calls),
                                         ("declines", self.kernel_declines, counts.declines)):
                for labels, n in items.items():
                    key = (kind, *labels)
                    gained = n - self._kernels_seen.get(key, 0)
                    if gained > 0:
                        counter.labels(*labels).inc(gained)
                        self._kernels_seen[key] = n

    # -- Observer ------------------------------------------------------------------------------------------------
    def batch(self, questions: int, tokens: int, seconds: float) -> None:
        self.batch_questions.observe(questions)
        self.batch_tokens.observe(tokens)
        self.forward_duration.observe(seconds)

    def question(self, timing: Timing) -> None:
        self.questions.inc()
        self.queue_duration.observe(timing.queue)
        self.preprocess_duration.observe(timing.preprocess)

    def queue(self, waiting: int, running: int) -> None:
        self.queue_size.set(waiting)
        self.queue_running.set(running)

    def forward_failed(self) -> None:
        self.forward_failures.inc()
