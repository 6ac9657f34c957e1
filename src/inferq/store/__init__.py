"""All of inferq's own Redis I/O: connections, keys, the Lua scripts and typed calls.

Every multi-key change is one Lua script in ``lua/`` (:mod:`~inferq.store.scripts`
loads it with the fragments it includes); :mod:`~inferq.store.calls` holds each
script's argument builder and reply parser, shared by :class:`Store` (synchronous:
the dispatcher, workers, scaler, CLI, metrics, :class:`~inferq.client.Client`) and
:class:`AsyncStore` (:class:`~inferq.client.AsyncClient`). :mod:`~inferq.store.keys`
builds every key name, :mod:`~inferq.store.connection` opens every connection (URL
forms, TLS, Sentinel, retries), and :mod:`~inferq.store.snapshot` reads the
dispatcher's snapshot. Nothing outside this package (besides the RQ delivery seam,
:mod:`inferq.delivery`, and the embedded demo server) talks to Redis.
"""

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
from inferq.store.keys import Keys
from inferq.store.snapshot import DispatchView
from inferq.store.sync import Store

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
    "Keys",
    "Store",
    "Submitted",
    "connect",
    "describe_error",
]
