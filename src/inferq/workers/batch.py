"""The one function an inferq RQ job may run: accept a batch on this worker.

It runs inside the worker process (RQ ``SimpleWorker``: no fork), where
:func:`bind` has registered the worker's :class:`~inferq.workers.runtime.Engine`.
"""

from __future__ import annotations

from typing import Any

from inferq.workers.runtime import Engine

_engine: Engine | None = None


class NotThisWorker(Exception):
    """A batch job reached a process that is not the worker it was dispatched to."""


def bind(engine: Engine | None) -> None:
    """Make ``engine`` the target of batch jobs run in this process (None to unbind)."""
    global _engine
    _engine = engine


def run_batch(
    *, namespace: str, batch_id: str, worker_id: str, items: list[list[Any]]
) -> dict[str, int]:
    """Accept a batch: ``items`` = [[request id, attempt], ...] claimed for ``worker_id``.

    Returns counts of requests started (``run``), skipped as re-dispatched elsewhere
    (``stale``) and expired before starting (``expired``).

    Raises:
        NotThisWorker: no engine is bound here, or it is another worker or namespace
            (the requests' leases lapse and the reaper requeues them).
    """
    engine = _engine
    if engine is None:
        raise NotThisWorker(f"batch {batch_id}: no inferq worker runs in this process")
    if engine.config.worker_id != worker_id or engine.store.keys.namespace != namespace:
        raise NotThisWorker(
            f"batch {batch_id} is for worker {worker_id} in {namespace}, "
            f"not {engine.config.worker_id} in {engine.store.keys.namespace}"
        )
    pairs = [(str(rid), int(attempt)) for rid, attempt in items]
    return engine.accept(batch_id, pairs)
