"""System One as a service: `pixeltriage serve` (an ASGI app over a dynamic batcher), its clients, Ray Serve replicas.

    from pixeltriage.serve import Client
    scores = Client("http://127.0.0.1:8080").score(question, memories)   # the same Scores as Scorer.score

Names are imported on first use, as in `pixeltriage`: importing the package loads neither FastAPI nor torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pixeltriage.lazy import lazy_exports

_EXPORTS = {
    "Client": "pixeltriage.serve.client",
    "AsyncClient": "pixeltriage.serve.client",
    "Decided": "pixeltriage.serve.client",
    "Decision": "pixeltriage.delivery.decision",
    "Reranking": "pixeltriage.serve.client",
    "RankedDocument": "pixeltriage.delivery.decision",
    "ServeConfig": "pixeltriage.serve.config",
    "Service": "pixeltriage.serve.service",
    "ModelSpec": "pixeltriage.serve.service",
    "Batcher": "pixeltriage.serve.batcher",
    "create_app": "pixeltriage.serve.app",
    "ServerProcess": "pixeltriage.serve.process",
    "AuthenticationError": "pixeltriage.errors",
    "DeadlineExceededError": "pixeltriage.errors",
    "InvalidRequestError": "pixeltriage.errors",
    "OverloadedError": "pixeltriage.errors",
    "ServiceError": "pixeltriage.errors",
    "ServiceUnavailableError": "pixeltriage.errors",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from pixeltriage.delivery.decision import Decision, RankedDocument
    from pixeltriage.errors import (AuthenticationError, DeadlineExceededError, InvalidRequestError, OverloadedError,
                                    ServiceError, ServiceUnavailableError)
    from pixeltriage.serve.app import create_app
    from pixeltriage.serve.batcher import Batcher
    from pixeltriage.serve.client import AsyncClient, Client, Decided, Reranking
    from pixeltriage.serve.config import ServeConfig
    from pixeltriage.serve.process import ServerProcess
    from pixeltriage.serve.service import ModelSpec, Service
