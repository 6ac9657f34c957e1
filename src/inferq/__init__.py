"""inferq: priority-, deadline- and GPU-aware scheduling of LLM inference requests on Redis.

The public API::

    from inferq import Client, AsyncClient, Settings

The names below are loaded on first use (PEP 562), so ``import inferq.sim`` or
``import inferq.policy`` does not pull in the client, the store or Redis. This
module is the package's public facade: it may name every layer (the import-layer
contract in ``pyproject.toml`` leaves it out).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferq.client import AsyncClient, Client, RequestHandle
    from inferq.config import ModelSpec, PriorityClass, Settings
    from inferq.errors import (
        IdempotencyConflict,
        InferqError,
        InvalidRequest,
        QueueFull,
        ResultTimeout,
    )
    from inferq.models import InferenceRequest, RequestState, Result, StreamChunk, WorkerInfo

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_HOMES = {
    "AsyncClient": "inferq.client",
    "Client": "inferq.client",
    "RequestHandle": "inferq.client",
    "ModelSpec": "inferq.config",
    "PriorityClass": "inferq.config",
    "Settings": "inferq.config",
    "IdempotencyConflict": "inferq.errors",
    "InferqError": "inferq.errors",
    "InvalidRequest": "inferq.errors",
    "QueueFull": "inferq.errors",
    "ResultTimeout": "inferq.errors",
    "InferenceRequest": "inferq.models",
    "RequestState": "inferq.models",
    "Result": "inferq.models",
    "StreamChunk": "inferq.models",
    "WorkerInfo": "inferq.models",
}

__all__ = [
    "AsyncClient",
    "Client",
    "IdempotencyConflict",
    "InferenceRequest",
    "InferqError",
    "InvalidRequest",
    "ModelSpec",
    "PriorityClass",
    "QueueFull",
    "RequestHandle",
    "RequestState",
    "Result",
    "ResultTimeout",
    "Settings",
    "StreamChunk",
    "WorkerInfo",
    "__version__",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'inferq' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
