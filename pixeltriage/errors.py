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
