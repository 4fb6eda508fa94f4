"""Typed errors. Every error names what is wrong: the file, tensor, memory or field."""


class PixelTriageError(Exception):
    """Base class of every error the engine raises on purpose."""


class CheckpointError(PixelTriageError):
    """A checkpoint file or tensor is missing, unreadable, misshaped or unexpected."""


class InvalidMemoryError(PixelTriageError, ValueError):
    """A memory (its image, note, dialogue or date) cannot be scored.

    `index` is the memory's 0-based position in the retrieved list (None when unknown); the message numbers
    memories from 1, as every table, report and the state template do ("memory 3" is `memories[2]`).
    """

    def __init__(self, message: str, index: int | None = None):
        self.index = index
        self.reason = message
        prefix = f"memory {index + 1}: " if index is not None else ""
        super().__init__(prefix + message)


class StateTooLongError(PixelTriageError, ValueError):
    """A packed state is longer than the model accepts."""


class NonFiniteScoreError(PixelTriageError, FloatingPointError):
    """The forward produced NaN or Inf where a score was expected."""


class BackendUnavailableError(PixelTriageError, RuntimeError):
    """A requested kernel backend (Triton, fla) cannot run on this device."""


class InvalidRequestError(PixelTriageError, ValueError):
    """A request the scoring service refuses as it is: a field of the wrong type, beyond a limit, or a body too large.

    `field` names the request field (`memories[2].image`, `questions[0].policy.k`; None for the whole body) and
    `status` the HTTP status it came with (422, 413).
    """

    def __init__(self, message: str, field: str | None = None, status: int = 422):
        self.field = field
        self.status = status
        super().__init__(f"{field}: {message}" if field else message)


class ServiceError(PixelTriageError):
    """The scoring service did not answer the request; `status` is the HTTP status (None when no response came)."""

    def __init__(self, message: str, status: int | None = None):
        self.status = status
        super().__init__(message)


class OverloadedError(ServiceError):
    """The service's queue has no room for the request's questions (429); retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float, status: int | None = 429):
        self.retry_after = retry_after
        super().__init__(message, status)


class DeadlineExceededError(ServiceError, TimeoutError):
    """The request passed its deadline before it was scored (504) and was dropped from the queue."""


class ServiceUnavailableError(ServiceError):
    """The service is loading, shutting down or unreachable (503, or no response)."""


class AuthenticationError(ServiceError):
    """The service wants a valid API key (401)."""


class NoCacheError(ServiceError):
    """The service was started without what the request needs: a write-time cache (--cache) for /v1/memories, a
    region index (--index-encoder) for /v1/retrieve (501)."""


class CacheMissError(PixelTriageError, KeyError):
    """A key has no row in the cache (or no usable one). `key` is the key."""

    def __init__(self, key: str, message: str | None = None):
        self.key = key
        self.message = message or f"image {key} is not in the cache; put it first"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class CorruptEntryError(CacheMissError):
    """A stored thumbnail fails its checksum or does not decode; put the image again."""


class StoreError(PixelTriageError):
    """The write-time store (the cache's SQLite file or PostgreSQL database) could not do what was asked. Nothing
    written before is lost: a failed write leaves the store as it was. `reason` names the fault in one word (the
    service's error body carries it) and `status` is the HTTP status the service answers it with."""

    reason = "store"
    http_status = 503

    def __init__(self, message: str, status: int | None = None):
        self.status = self.http_status if status is None else status
        super().__init__(message)


class StoreFullError(StoreError, OSError):
    """The store's disk (the file system of the SQLite file, the PostgreSQL server's) is full: the write was not made
    (507). Reads go on; the next write after space is freed succeeds."""

    reason = "full"
    http_status = 507


class StoreUnavailableError(StoreError):
    """The store cannot be written, or read, now (503): its server cannot be reached or went away mid-request
    ("unreachable": the next call connects again), another process holds its lock past the wait (StoreLockedError),
    it is read-only (StoreReadOnlyError) or its file is damaged (StoreCorruptError)."""

    reason = "unreachable"


class StoreLockedError(StoreUnavailableError, TimeoutError):
    """Another process held the store's write lock past the wait (`Cache(..., busy_timeout_ms=)`; the server's
    --request-timeout): the write was not made. Reads are not blocked by it."""

    reason = "locked"


class StoreReadOnlyError(StoreUnavailableError):
    """The store is read-only (a read-only directory, file or file system; a read-only PostgreSQL server or
    transaction): every entry reads, no write is made until it is writable again."""

    reason = "read_only"


class StoreCorruptError(StoreUnavailableError):
    """The store's file has damaged pages (SQLite's "database disk image is malformed"): what they held cannot be
    read, the entries elsewhere can (and new entries are written where the damage is not in the way); the file is
    restored from a backup."""

    reason = "corrupt"


STORE_ERRORS = {cls.reason: cls for cls in (StoreUnavailableError, StoreLockedError, StoreReadOnlyError,
                                            StoreCorruptError)}
