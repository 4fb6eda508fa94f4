"""PixelTriage: decide which retrieved memories deserve pixels, in one forward pass.

The public names below are imported on first use (PEP 562), so `import pixeltriage` and the command line's
`--help` do not pay for torch until a name that needs it is touched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pixeltriage.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Cache": "pixeltriage.store.cache",
    "Memory": "pixeltriage.engine.types",
    "Scores": "pixeltriage.engine.types",
    "Scorer": "pixeltriage.engine.scorer",
    "State": "pixeltriage.engine.state",
    "RateGate": "pixeltriage.delivery.policy",
    "downsize_all": "pixeltriage.delivery.policy",
    "random_policy": "pixeltriage.delivery.policy",
    "retrieval_order": "pixeltriage.delivery.policy",
    "token_budget": "pixeltriage.delivery.policy",
    "top_k": "pixeltriage.delivery.policy",
    "cost_ratio": "pixeltriage.delivery.cost",
    "delivery_cost": "pixeltriage.delivery.cost",
    "visual_tokens": "pixeltriage.delivery.cost",
    "ANSWERING_MODELS": "pixeltriage.delivery.profiles",
    "AnsweringModel": "pixeltriage.delivery.profiles",
    "answering_model": "pixeltriage.delivery.profiles",
    "DEFAULT_ANSWERING_MODEL": "pixeltriage.delivery.profiles",
    "UnknownAnsweringModelError": "pixeltriage.delivery.profiles",
    "pixel_host_messages": "pixeltriage.delivery.host",
    "stamp_tag": "pixeltriage.delivery.host",
    "text_host_messages": "pixeltriage.delivery.host",
    "tune_malloc": "pixeltriage.engine.cpu_memory",
    "load_episodes": "pixeltriage.episode",
    "EpisodeError": "pixeltriage.episode",
    "BackendUnavailableError": "pixeltriage.errors",
    "CheckpointError": "pixeltriage.errors",
    "InvalidMemoryError": "pixeltriage.errors",
    "NonFiniteScoreError": "pixeltriage.errors",
    "PixelTriageError": "pixeltriage.errors",
    "StateTooLongError": "pixeltriage.errors",
}

__all__ = [*_EXPORTS, "__version__"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:                      # for type checkers and IDEs: the same names, imported eagerly
    from pixeltriage.store.cache import Cache
    from pixeltriage.delivery.cost import cost_ratio, delivery_cost, visual_tokens
    from pixeltriage.engine.cpu_memory import tune_malloc
    from pixeltriage.delivery.profiles import (ANSWERING_MODELS, DEFAULT_ANSWERING_MODEL, AnsweringModel,
                                               UnknownAnsweringModelError, answering_model)
    from pixeltriage.delivery.host import pixel_host_messages, stamp_tag, text_host_messages
    from pixeltriage.delivery.policy import RateGate, downsize_all, random_policy, retrieval_order, token_budget, top_k
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.engine.state import State
    from pixeltriage.engine.types import Memory, Scores
    from pixeltriage.episode import EpisodeError, load_episodes
    from pixeltriage.errors import (BackendUnavailableError, CheckpointError, InvalidMemoryError, NonFiniteScoreError,
                                    PixelTriageError, StateTooLongError)
