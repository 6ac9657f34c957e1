"""RQ behind one seam: how a claimed batch travels from the dispatcher to its worker.

RQ carries a batch from the dispatcher to the chosen worker; it is not the
reliability layer (leases, fencing and the reaper are inferq's own, in the store).
Everything that knows RQ is here, and nothing else in inferq imports ``rq``:

- :mod:`~inferq.delivery.jobs`: a batch as an RQ job (:class:`BatchJob`, JSON only,
  one allowed function :data:`BATCH_FUNC`) and the :class:`BatchHandler` a worker
  process binds to receive them;
- :mod:`~inferq.delivery.queues`: the dispatcher's end (:class:`BatchSender`: send a
  batch, purge a lost worker's queue and registries);
- :mod:`~inferq.delivery.consumer`: the worker's end (:class:`InferqWorker`, RQ's
  consume loop with inferq's drain; :func:`broken_job` to inspect a bad job).

A later change of transport (e.g. a per-worker list filled by ``assign.lua``) touches
only this package.
"""

from inferq.delivery.consumer import InferqWorker, broken_job, make_consumer
from inferq.delivery.jobs import (
    BATCH_FUNC,
    BatchHandler,
    BatchJob,
    ForbiddenJob,
    NotThisWorker,
    bind,
    job_id,
    job_key,
    rq_connection,
    run_batch,
)
from inferq.delivery.queues import (
    BatchSender,
    enqueue_batch,
    purge_namespace_rq,
    purge_worker_queue,
    worker_queue,
)

__all__ = [
    "BATCH_FUNC",
    "BatchHandler",
    "BatchJob",
    "BatchSender",
    "ForbiddenJob",
    "InferqWorker",
    "NotThisWorker",
    "bind",
    "broken_job",
    "enqueue_batch",
    "job_id",
    "job_key",
    "make_consumer",
    "purge_namespace_rq",
    "purge_worker_queue",
    "rq_connection",
    "run_batch",
    "worker_queue",
]
