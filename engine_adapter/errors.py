"""Errors of the engine. A request the engine cannot serve raises before it is queued, so
the engine keeps serving every other request."""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error engine_adapter raises on bad input or a broken promise."""


class InvalidRequestError(EngineError, ValueError):
    """A request that cannot be served as given (empty prompt, too long, bad sampling)."""


class ModelLoadError(EngineError, ValueError):
    """Weights or a config that this Llama-architecture model cannot load."""
