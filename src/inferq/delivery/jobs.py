"""A batch as an RQ job: the one function it may run, and who runs it in a worker process.

Rules from measuring RQ 2.12, recorded in docs/architecture.md:

- JSON serializer everywhere, never pickle; and even with JSON a forged job
  could name any importable function, so :class:`BatchJob` runs only
  :data:`BATCH_FUNC` and ignores every callback.
- Batch ids are unique per dispatch (a retried request joins a new batch), so
  a job id never repeats and RQ never runs the same job twice.
- RQ's ``Retry`` is never used (it re-enqueues onto the dead worker's queue),
  and results/failures get short TTLs (RQ's failure default is one year).

The job's function, :func:`run_batch`, lives here and hands the batch to the
:class:`BatchHandler` the worker process bound with :func:`bind`: the seam never
imports the worker's runtime, the worker registers itself with the seam.
"""

from __future__ import annotations

from typing import Any, Protocol

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from inferq.store.connection import open_redis
from inferq.store.keys import Keys

#: The only function a :class:`BatchJob` may run (a stable name: jobs carry it).
BATCH_FUNC = "inferq.delivery.run_batch"
#: Seconds RQ keeps a finished batch job (results live in inferq's request hashes).
JOB_RESULT_TTL_S = 60
#: Seconds RQ keeps a failed batch job (its requests were already requeued or failed).
JOB_FAILURE_TTL_S = 3600
#: A queued batch job not picked up within this many seconds is dropped by RQ;
#: its requests' leases lapse first and the reaper requeues them.
JOB_TTL_S = 600


class ForbiddenJob(Exception):
    """A job on an inferq queue names a function other than the batch runner."""


class NotThisWorker(Exception):
    """A batch job reached a process that is not the worker it was dispatched to."""


class BatchHandler(Protocol):
    """What a worker process gives the delivery seam (``inferq.workers.runtime.Engine``).

    The seam calls :meth:`accept` for each batch job, and drives the drain: the first
    stop signal calls :meth:`begin_drain`, a second :meth:`cold_shutdown`.
    """

    @property
    def worker_id(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def lease_s(self) -> float:
        """The deployment's lease, seconds: how long a claimed batch may still arrive."""
        ...

    @property
    def draining(self) -> bool: ...

    def accept(self, batch_id: str, items: list[tuple[str, int]]) -> dict[str, int]:
        """Start a batch's (request id, attempt) pairs; counts of ``run``/``stale``/``expired``."""
        ...

    def begin_drain(self) -> None:
        """Take no new batches from now on."""
        ...

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing runs (False on timeout)."""
        ...

    def unreceived(self) -> set[str]:
        """Requests claimed for this worker whose batch has not been accepted yet."""
        ...

    def cold_shutdown(self) -> None:
        """Hand every in-flight request back at once and leave the fleet."""
        ...


_handler: BatchHandler | None = None


def bind(handler: BatchHandler | None) -> None:
    """Make ``handler`` the target of batch jobs run in this process (None to unbind)."""
    global _handler
    _handler = handler


def run_batch(
    *, namespace: str, batch_id: str, worker_id: str, items: list[list[Any]]
) -> dict[str, int]:
    """Accept a batch: ``items`` = [[request id, attempt], ...] claimed for ``worker_id``.

    Returns counts of requests started (``run``), skipped as re-dispatched elsewhere
    (``stale``) and expired before starting (``expired``).

    Raises:
        NotThisWorker: no handler is bound here, or it is another worker or namespace
            (the requests' leases lapse and the reaper requeues them).
    """
    handler = _handler
    if handler is None:
        raise NotThisWorker(f"batch {batch_id}: no inferq worker runs in this process")
    if handler.worker_id != worker_id or handler.namespace != namespace:
        raise NotThisWorker(
            f"batch {batch_id} is for worker {worker_id} in {namespace}, "
            f"not {handler.worker_id} in {handler.namespace}"
        )
    pairs = [(str(rid), int(attempt)) for rid, attempt in items]
    return handler.accept(batch_id, pairs)


class BatchJob(Job):
    """An RQ job that can only run :data:`BATCH_FUNC`, with no callbacks.

    Its serializer is always JSON, whatever the caller passes: RQ's default is
    pickle, and unpickling a job planted in Redis would run arbitrary code.
    """

    def __init__(
        self, id: str | None = None, connection: redis.Redis | None = None, serializer: Any = None
    ) -> None:
        super().__init__(id, connection=connection, serializer=JSONSerializer)
        self._early: tuple[Any, Exception | None] | None = None

    def run_early(self) -> None:
        """Run the batch function now, ahead of RQ's bookkeeping; ``perform()`` then
        returns its result (or raises its error) without running it again.

        RQ writes four round trips of its own records (the worker's state, the
        execution, the started registry, the job's status) before it calls a job's
        function: run first, the batch's requests start that much sooner (issue 17).
        RQ's records, and its failure handling of an error raised here, are unchanged.
        """
        try:
            self._early = (self.func(*self.args, **self.kwargs), None)
        except Exception as exc:  # replayed inside RQ's perform, which records the failure
            self._early = (None, exc)

    @property
    def func(self) -> Any:
        if self.func_name != BATCH_FUNC or self.instance is not None:
            raise ForbiddenJob(
                f"job {self.id} names {self.func_name!r}; inferq workers run only {BATCH_FUNC}"
            )
        early = self._early
        if early is None:
            return run_batch
        value, error = early

        def replay(*args: Any, **kwargs: Any) -> Any:
            if error is not None:
                raise error
            return value

        return replay

    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None


def rq_connection(url: str) -> redis.Redis:
    """A connection for RQ: RQ needs bytes replies (``decode_responses=False``).

    Any URL form of :mod:`inferq.store.connection` (TLS options, Sentinel), with the
    same retries as :func:`inferq.store.connect`; no round trip is made.

    Raises:
        ConfigError: the URL is malformed (password redacted).
    """
    return open_redis(url, decode_responses=False)


def job_id(keys: Keys, batch_id: str) -> str:
    """RQ job id of a batch: namespaced so tests and deployments never collide."""
    return f"{keys.namespace}-{batch_id}"


def job_key(keys: Keys, batch_id: str) -> str:
    """The Redis key of a batch's RQ job (RQ's own ``rq:job:<id>`` layout)."""
    return str(Job.key_for(job_id(keys, batch_id)))
