"""PixelTriage: decide which retrieved memories deserve pixels, in one forward pass."""
from pixeltriage.errors import (
    BackendUnavailableError,
    CheckpointError,
    InvalidMemoryError,
    NonFiniteScoreError,
    PixelTriageError,
    StateTooLongError,
)
from pixeltriage.engine.scorer import Scorer
from pixeltriage.engine.state import State
from pixeltriage.engine.types import Memory, Scores

__version__ = "0.1.0"

__all__ = [
    "Memory",
    "Scorer",
    "Scores",
    "State",
    "BackendUnavailableError",
    "CheckpointError",
    "InvalidMemoryError",
    "NonFiniteScoreError",
    "PixelTriageError",
    "StateTooLongError",
    "__version__",
]
