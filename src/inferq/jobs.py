"""RQ as a thin execution layer: one RQ job per batch on the worker's private queue.

RQ carries a batch from the dispatcher to the chosen worker; it is not the
reliability layer (leases, fencing and the reaper are inferq's own). Rules
from measuring RQ 2.12, recorded in docs/architecture.md:

- JSON serializer everywhere, never pickle; and even with JSON a forged job
  could name any importable function, so :class:`BatchJob` runs only
  :data:`BATCH_FUNC` and ignores every callback.
- Batch ids are unique per dispatch (a retried request joins a new batch), so
  a job id never repeats and RQ never runs the same job twice.
- RQ's ``Retry`` is never used (it re-enqueues onto the dead worker's queue),
  and results/failures get short TTLs (RQ's failure default is one year).
- After a SIGKILL a job stays "started" forever on a private queue: the reaper
  calls :func:`purge_worker_queue` when it removes a dead worker.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from inferq.store.connection import open_redis
from inferq.store.keys import Keys

#: The only function a :class:`BatchJob` may run.
BATCH_FUNC = "inferq.workers.batch.run_batch"
#: Seconds RQ keeps a finished batch job (results live in inferq's request hashes).
JOB_RESULT_TTL_S = 60
#: Seconds RQ keeps a failed batch job (its requests were already requeued or failed).
JOB_FAILURE_TTL_S = 3600
#: A queued batch job not picked up within this many seconds is dropped by RQ;
#: its requests' leases lapse first and the reaper requeues them.
JOB_TTL_S = 600


class ForbiddenJob(Exception):
    """A job on an inferq queue names a function other than the batch runner."""


class BatchJob(Job):
    """An RQ job that can only run :data:`BATCH_FUNC`, with no callbacks.

    Its serializer is always JSON, whatever the caller passes: RQ's default is
    pickle, and unpickling a job planted in Redis would run arbitrary code.
    """

    def __init__(
        self, id: str | None = None, connection: redis.Redis | None = None, serializer: Any = None
    ) -> None:
        super().__init__(id, connection=connection, serializer=JSONSerializer)

    @property
    def func(self) -> Any:
        if self.func_name != BATCH_FUNC or self.instance is not None:
            raise ForbiddenJob(
                f"job {self.id} names {self.func_name!r}; inferq workers run only {BATCH_FUNC}"
            )
        from inferq.workers.batch import run_batch

        return run_batch

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

    Any URL form of :mod:`inferq.connection` (TLS options, Sentinel), with the
    same retries as :func:`inferq.store.connect`; no round trip is made.

    Raises:
        ConfigError: the URL is malformed (password redacted).
    """
    return open_redis(url, decode_responses=False)


def worker_queue(connection: redis.Redis, keys: Keys, worker_id: str) -> Queue:
    """The worker's private RQ queue (JSON serializer, :class:`BatchJob`)."""
    return Queue(
        keys.rq_queue_name(worker_id),
        connection=connection,
        serializer=JSONSerializer,
        job_class=BatchJob,
    )


def job_id(keys: Keys, batch_id: str) -> str:
    """RQ job id of a batch: namespaced so tests and deployments never collide."""
    return f"{keys.namespace}-{batch_id}"


def enqueue_batch(
    queue: Queue,
    keys: Keys,
    *,
    batch_id: str,
    worker_id: str,
    items: list[tuple[str, int]],
    timeout_s: int,
    pipeline: Any = None,
) -> Job:
    """Enqueue one batch job: ``items`` = [(request id, attempt)] claimed for ``worker_id``.

    With ``pipeline`` the job is only queued on it (the caller executes it), so a
    batch costs one pipelined round trip.
    """
    return queue.enqueue_call(
        BATCH_FUNC,
        kwargs={
            "namespace": keys.namespace,
            "batch_id": batch_id,
            "worker_id": worker_id,
            "items": [[rid, attempt] for rid, attempt in items],
        },
        job_id=job_id(keys, batch_id),
        timeout=timeout_s,
        result_ttl=JOB_RESULT_TTL_S,
        failure_ttl=JOB_FAILURE_TTL_S,
        ttl=JOB_TTL_S,
        description=f"batch {batch_id} ({len(items)} requests)",
        pipeline=pipeline,
    )


def purge_worker_queue(connection: redis.Redis, keys: Keys, worker_id: str) -> int:
    """Empty a removed worker's RQ queue and registries; returns the jobs removed.

    Their requests were already requeued by the store; these jobs must never run.
    """
    queue = worker_queue(connection, keys, worker_id)
    removed = queue.count
    queue.empty()  # type: ignore[no-untyped-call]
    for registry_cls in (StartedJobRegistry, FinishedJobRegistry, FailedJobRegistry):
        registry = registry_cls(queue=queue)
        ids = registry.get_job_ids()
        # StartedJobRegistry.remove raises NotImplementedError in RQ 2.12: delete the
        # jobs and the registry key directly (nothing else refers to them).
        if ids:
            connection.delete(*(Job.key_for(jid) for jid in ids))
        connection.delete(registry.key)
        removed += len(ids)
    queue.delete(delete_jobs=True)
    return removed
