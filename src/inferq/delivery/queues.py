"""The dispatcher's end of the seam: a worker's private RQ queue, sending a batch, purging.

Each worker has its own RQ queue (``inferq:<namespace>:w:<worker id>``); the
dispatcher enqueues one :class:`~inferq.delivery.jobs.BatchJob` per claimed batch on
it. After a SIGKILL a job stays "started" forever on that private queue: the reaper
calls :meth:`BatchSender.purge` when it removes a dead worker.
"""

from __future__ import annotations

import re
from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.serializers import JSONSerializer
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from inferq.delivery.jobs import (
    BATCH_FUNC,
    JOB_FAILURE_TTL_S,
    JOB_RESULT_TTL_S,
    JOB_TTL_S,
    BatchJob,
    job_id,
    rq_connection,
)
from inferq.store.keys import Keys


def worker_queue(connection: redis.Redis, keys: Keys, worker_id: str) -> Queue:
    """The worker's private RQ queue (JSON serializer, :class:`BatchJob`)."""
    return Queue(
        keys.rq_queue_name(worker_id),
        connection=connection,
        serializer=JSONSerializer,
        job_class=BatchJob,
    )


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
    """Empty a removed worker's RQ queue and registries, and remove every key RQ kept
    for it; returns the jobs removed.

    Their requests were already requeued by the store; these jobs must never run.
    A SIGKILLed RQ worker never unregisters: its intermediate list (the job it had
    moved off the queue), its ``rq:workers:<queue>`` set, its entry in the global
    ``rq:workers`` set and its worker hash stay with no TTL (~430 B each, issue 12).
    The queue is private to the worker, so every RQ worker registered on it is this
    worker's: all of them go.
    """
    queue = worker_queue(connection, keys, worker_id)
    removed = queue.count
    queue.empty()  # type: ignore[no-untyped-call]
    by_queue = WORKERS_BY_QUEUE_KEY % queue.name
    rq_workers = [m.decode() if isinstance(m, bytes) else m for m in connection.smembers(by_queue)]
    if rq_workers:
        connection.srem(REDIS_WORKER_KEYS, *rq_workers)
        connection.delete(*rq_workers)
    connection.delete(by_queue, queue.intermediate_queue_key)
    for registry_cls in (
        StartedJobRegistry,
        FinishedJobRegistry,
        FailedJobRegistry,
        ScheduledJobRegistry,
        DeferredJobRegistry,
        CanceledJobRegistry,
    ):
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


class BatchSender:
    """Hands claimed batches to workers (the dispatcher holds one).

    Args:
        redis_url: the deployment's Redis (RQ gets its own bytes connection to it).
        keys: the deployment's keys.

    Raises:
        ConfigError: the URL is malformed (password redacted).
    """

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.connection = rq_connection(redis_url)
        self.keys = keys

    def send(
        self, worker_id: str, batch_id: str, items: list[tuple[str, int]], *, timeout_s: int
    ) -> None:
        """Enqueue the batch ``items`` = [(request id, attempt)] on the worker's queue, in one
        pipelined round trip (``timeout_s``: RQ's own job timeout, a backstop)."""
        queue = worker_queue(self.connection, self.keys, worker_id)
        pipe = self.connection.pipeline()
        enqueue_batch(
            queue,
            self.keys,
            batch_id=batch_id,
            worker_id=worker_id,
            items=items,
            timeout_s=timeout_s,
            pipeline=pipe,
        )
        pipe.execute()

    def purge(self, worker_id: str) -> int:
        """Empty a removed worker's queue and registries (see :func:`purge_worker_queue`)."""
        return purge_worker_queue(self.connection, self.keys, worker_id)


def purge_namespace_rq(redis_url: str, keys: Keys) -> int:
    """Delete RQ's keys of a namespace's workers; returns how many. Irreversible.

    Every worker's private queue and its registries (``rq:<kind>:inferq:<ns>:w:<id>``),
    the batch jobs (``rq:job:<ns>-<26 hex digits>``) and the RQ worker records
    (``rq:worker:<ns>-<worker id>`` whose queues are the namespace's); the names leave
    RQ's global ``rq:queues`` and ``rq:workers`` sets. Other namespaces' keys are never
    matched, even a namespace whose name starts with this one's (``a`` and ``a-b``).
    """
    conn = rq_connection(redis_url)
    ns = keys.namespace
    queue_part = keys.rq_queue_name("")  # inferq:<ns>:w:
    job_name = re.compile(rf"^rq:job:{re.escape(ns)}-[0-9a-f]{{26}}$")

    def text(value: bytes | str | None) -> str:
        if isinstance(value, bytes):
            return value.decode(errors="replace")
        return value or ""

    def ours(key: str) -> bool:
        if key.startswith("rq:job:"):
            return bool(job_name.match(key))
        if key.startswith("rq:worker:"):
            return queue_part in text(conn.hget(key, "queues"))
        return f":{queue_part}" in key

    doomed: list[str] = []
    for pattern in (f"rq:*:{queue_part}*", f"rq:job:{ns}-*", f"rq:worker:{ns}-*"):
        for raw in conn.scan_iter(match=pattern, count=1000):
            key = text(raw)
            if ours(key):
                doomed.append(key)
    deleted = 0
    for i in range(0, len(doomed), 500):
        deleted += int(conn.unlink(*doomed[i : i + 500]))
    gone = set(doomed)
    for global_set in ("rq:queues", "rq:workers"):
        members = [
            m for m in conn.smembers(global_set) if f":{queue_part}" in text(m) or text(m) in gone
        ]
        if members:
            conn.srem(global_set, *members)
    return deleted
