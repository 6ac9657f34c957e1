"""All of inferq's own Redis I/O: connections, keys, the Lua scripts and typed calls.

Every multi-key change is one Lua script in ``lua/`` (:mod:`~inferq.store.scripts`
loads it with the fragments it includes); :mod:`~inferq.store.calls` holds each
script's argument builder and reply parser, shared by :class:`Store` (synchronous:
the dispatcher, workers, scaler, CLI, metrics, :class:`~inferq.client.Client`) and
:class:`AsyncStore` (:class:`~inferq.client.AsyncClient`). :mod:`~inferq.store.keys`
builds every key name, :mod:`~inferq.store.connection` opens every connection (URL
forms, TLS, Sentinel, retries), and :mod:`~inferq.store.snapshot` reads the
dispatcher's snapshot. :class:`~inferq.store.glance.Glance` is the part of
:class:`Store` that needs only a connection and a namespace (no settings, no
scripts): the CLI's ``queues`` reads through it. Nothing outside this package
(besides the RQ delivery seam, :mod:`inferq.delivery`, and the embedded demo server)
talks to Redis.

The names below are loaded on first use (PEP 562): ``from inferq.store import
connect`` loads the connection module, not the store's settings and models
(pydantic), so ``inferq queues`` starts without them (issue 15).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferq.store.aio import AsyncStore
    from inferq.store.calls import Abort, Beat, Chunk, Completion, Submitted
    from inferq.store.connection import (
        CONNECTION_ERRORS,
        REDIS_ERRORS,
        REPLY_ERRORS,
        AsyncConnection,
        Connection,
        connect,
        describe_error,
    )
    from inferq.store.glance import Glance
    from inferq.store.keys import Keys
    from inferq.store.snapshot import DispatchView
    from inferq.store.sync import Store

_HOMES = {
    "AsyncStore": "inferq.store.aio",
    "Abort": "inferq.store.calls",
    "Beat": "inferq.store.calls",
    "Chunk": "inferq.store.calls",
    "Completion": "inferq.store.calls",
    "Submitted": "inferq.store.calls",
    "CONNECTION_ERRORS": "inferq.store.connection",
    "REDIS_ERRORS": "inferq.store.connection",
    "REPLY_ERRORS": "inferq.store.connection",
    "AsyncConnection": "inferq.store.connection",
    "Connection": "inferq.store.connection",
    "connect": "inferq.store.connection",
    "describe_error": "inferq.store.connection",
    "Glance": "inferq.store.glance",
    "Keys": "inferq.store.keys",
    "DispatchView": "inferq.store.snapshot",
    "Store": "inferq.store.sync",
}

__all__ = [
    "CONNECTION_ERRORS",
    "REDIS_ERRORS",
    "REPLY_ERRORS",
    "Abort",
    "AsyncConnection",
    "AsyncStore",
    "Beat",
    "Chunk",
    "Completion",
    "Connection",
    "DispatchView",
    "Glance",
    "Keys",
    "Store",
    "Submitted",
    "connect",
    "describe_error",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'inferq.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
