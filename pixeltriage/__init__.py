"""PixelTriage: decide which retrieved memories deserve pixels, in one forward pass."""
from pixeltriage.errors import (
    BackendUnavailableError,
    CheckpointError,
    InvalidMemoryError,
    NonFiniteScoreError,
    PixelTriageError,
    StateTooLongError,
)
from pixeltriage.engine.cache import Cache
from pixeltriage.engine.cost import cost_ratio, delivery_cost, visual_tokens
from pixeltriage.engine.host import pixel_host_messages, stamp_tag, text_host_messages
from pixeltriage.engine.policy import RateGate, downsize_all, random_policy, retrieval_order, token_budget, top_k
from pixeltriage.engine.scorer import Scorer
from pixeltriage.engine.state import State
from pixeltriage.engine.types import Memory, Scores

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "RateGate",
    "cost_ratio",
    "delivery_cost",
    "downsize_all",
    "pixel_host_messages",
    "random_policy",
    "retrieval_order",
    "stamp_tag",
    "text_host_messages",
    "token_budget",
    "top_k",
    "visual_tokens",
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
