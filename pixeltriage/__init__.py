"""PixelTriage: decide which retrieved memories deserve pixels, in one forward pass."""
from pixeltriage.errors import (
    BackendUnavailableError,
    CheckpointError,
    InvalidMemoryError,
    NonFiniteScoreError,
    PixelTriageError,
    StateTooLongError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "InvalidMemoryError",
    "NonFiniteScoreError",
    "PixelTriageError",
    "StateTooLongError",
    "__version__",
]
