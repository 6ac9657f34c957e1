"""The worker's end of the seam: RQ's consume loop on the worker's private queue.

:class:`InferqWorker` is an RQ ``SimpleWorker`` (no fork: the model stays loaded)
whose jobs hand batches to the bound :class:`~inferq.delivery.jobs.BatchHandler`,
and whose stop signals drain the handler instead of killing jobs:

- first SIGTERM or SIGINT: :meth:`BatchHandler.begin_drain` and RQ's loop stops
  (after the job it runs, if any); :meth:`InferqWorker.accept_claimed` then takes
  the batches claimed for the worker before its drain;
- a second one: :meth:`BatchHandler.cold_shutdown` and the process exits 1.

:func:`broken_job` tells a truncated or failed batch job apart, for the worker to
quarantine when it hands back a batch that never arrived.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import redis
from redis.client import Pipeline
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker.base import WorkerStatus

from inferq.delivery.jobs import BatchHandler, BatchJob, job_key, rq_connection
from inferq.delivery.queues import purge_worker_queue, worker_queue
from inferq.store.connection import CONNECTION_ERRORS
from inferq.store.keys import Keys

log = logging.getLogger(__name__)

#: RQ's worker TTL, seconds: RQ blocks on its queue for TTL - 15 s, so 16 makes the
#: loop check for a drain request every second.
RQ_WORKER_TTL_S = 16
#: While draining, how often to look for a batch claimed before the drain and still
#: on its way (its claim and its RQ enqueue are two round trips of the dispatcher), s.
CLAIM_POLL_S = 0.01
#: First pause before RQ's loop is started again after it quit on an error, s
#: (doubling to RQ_RESTART_MAX_S while it keeps quitting).
RQ_RESTART_S = 1.0
RQ_RESTART_MAX_S = 30.0
#: Seconds RQ keeps the return value of a job (a batch's counts; nothing reads them).
RQ_RESULT_TTL_S = 60
#: A plain RQ heartbeat this soon after the last one (same TTL) is skipped, s: RQ
#: beats before each dequeue, which blocks for RQ_WORKER_TTL_S - 15 = 1 s, so its
#: worker key (TTL RQ_WORKER_TTL_S + 60 s) is still renewed at least every ~2 s.
RQ_BEAT_SKIP_S = 1.0


class InferqWorker(SimpleWorker):
    """RQ ``SimpleWorker`` whose signals drain the handler instead of killing jobs.

    A dequeued batch starts before RQ records it (:meth:`execute_job`), and RQ's worker
    heartbeat is one round trip, not repeated right after a dequeue (:meth:`heartbeat`):
    the hand-off from the dispatcher's enqueue to the batch's start is then RQ's dequeue
    (BLMOVE, the job's HGETALL) and the start script, three round trips instead of eight.
    """

    handler: BatchHandler
    #: Set by the process's own handler for a stop signal that came before RQ's loop
    #: installed its handlers (see :meth:`_install_signal_handlers`).
    stop_pending: threading.Event | None = None
    #: Inside :meth:`execute_job` (a stop signal then lets the batch finish).
    _in_job = False
    #: (monotonic time, TTL) of the last heartbeat RQ wrote (see :meth:`heartbeat`).
    _last_beat: tuple[float, int] = (-1e9, 0)

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Start the batch (:meth:`BatchJob.run_early`), then let RQ record and finish it."""
        self._in_job = True
        try:
            if isinstance(job, BatchJob):
                job.run_early()
            super().execute_job(job, queue)
        finally:
            self._in_job = False

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        """RQ's worker heartbeat (its worker key's TTL), in one round trip instead of two.

        RQ beats before every dequeue (a blocking call of at most one second here) and
        again right after one returns a job: that second plain beat, less than
        ``RQ_BEAT_SKIP_S`` after the first with the same TTL, is skipped, so it is not on
        the batch's way to its start. A beat with another TTL (RQ's per-job one) or on a
        caller's pipeline is always written.
        """
        ttl = timeout or self.worker_ttl + 60
        now = time.monotonic()
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)
            self._last_beat = (now, ttl)
            return
        last_at, last_ttl = self._last_beat
        if ttl == last_ttl and now - last_at < RQ_BEAT_SKIP_S:
            return
        # No MULTI/EXEC: two commands on one key, nothing to make atomic (issue 17 counts
        # every command the server runs).
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)
            pipe.execute()
        self._last_beat = (now, ttl)

    def subscribe(self) -> None:
        """No RQ command channel: this worker takes its commands (drain, abort) from its
        own control list (:mod:`inferq.workers.control`), so RQ's pub/sub thread is not
        started.

        RQ's teardown stops that thread with redis-py's ``PubSubWorkerThread.stop()``,
        which joins it (redis-py 8) while it may wait up to 60 s in ``get_message`` for a
        subscription a stop signal interrupted: a worker told to drain right after it
        became ready then sat ``draining`` with nothing in flight until it was killed
        (issue 25, ``test_close_drains_every_worker_it_started``).
        """
        self.pubsub = None
        self.pubsub_thread = None

    def _install_signal_handlers(self) -> None:
        draining = self.handler.draining  # a second pass of work()
        if not draining and self.stop_pending is not None and self.stop_pending.is_set():
            # A stop signal came before these handlers (after the worker last looked):
            # it is this loop's first signal, so drain before dequeuing anything.
            self.handler.begin_drain()
            self._stop_requested = True
            draining = True
        on_signal = self._on_second_signal if draining else self._on_first_signal
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def serve(self) -> None:
        """Run RQ's loop until a drain stops it.

        RQ quits its loop on an error it does not expect, e.g. a Redis call outside its
        dequeue failing after the client's retries (an outage of more than ~3 s, or
        ``BusyLoadingError`` while a restarted Redis loads its data): the worker would
        then drain and leave although it is healthy. Unless it is draining, the loop is
        started again after a pause instead (1 s, doubling to 30 s).
        """
        pause = RQ_RESTART_S
        while True:
            try:  # RQ logs a line per job at INFO; inferq's own log says what matters
                self.work(logging_level="WARNING")
            except StopRequested:
                pass
            except Exception:  # e.g. its teardown failed too, Redis still away
                log.exception("RQ's loop failed")
            if self.handler.draining:
                return
            log.error("RQ's loop stopped (Redis unavailable?); starting it in %.0f s", pause)
            try:
                time.sleep(pause)
                self.register_death()  # type: ignore[no-untyped-call]  # allows the next birth
            except StopRequested:  # the drain signal arrived meanwhile
                return
            except CONNECTION_ERRORS as exc:
                log.warning("redis still unavailable: %s", exc)
            pause = min(pause * 2, RQ_RESTART_MAX_S)

    def accept_claimed(self) -> None:
        """After the drain stopped RQ's loop: accept the batches claimed for this worker,
        and finish everything.

        They were claimed before the worker said ``draining`` (the assign script refuses
        a draining worker), so they are its work: handing them back would count a second
        attempt for requests that never ran. A batch claimed a moment before the drain
        may still be on its way from the dispatcher (claim, then enqueue), or stranded
        by the signal in RQ's dequeue (see :meth:`_undo_dequeue`), so this waits
        while Redis holds requests for this worker that the handler has not received, for
        one lease at most (after that they are orphans, handed back when it leaves).
        """
        patience = time.monotonic() + self.handler.lease_s
        while True:
            self._stop_requested = False
            self._undo_dequeue()
            self.work(burst=True, logging_level="WARNING")
            self.handler.wait_idle()
            if any(q.count for q in self.queues):
                continue
            if time.monotonic() >= patience or not self.handler.unreceived():
                return
            time.sleep(CLAIM_POLL_S)

    def purge(self) -> int:
        """Empty this worker's queue and registries (the batches that arrived while it
        drained: their requests were handed back); returns the jobs removed."""
        keys = Keys(self.handler.namespace)
        return purge_worker_queue(self.connection, keys, self.handler.worker_id)

    def _undo_dequeue(self) -> None:
        """Put back on the queue the jobs RQ dequeued but never started.

        RQ dequeues by moving a job id to the queue's intermediate list and removes it
        from there when the job starts; the drain signal, raised as ``StopRequested``
        inside the dequeue, can strand a job in between. Nothing runs here meanwhile,
        so every id still in the intermediate list is such a job.
        """
        for queue in self.queues:
            while self.connection.lmove(queue.intermediate_queue_key, queue.key, "RIGHT", "LEFT"):
                pass

    def _on_first_signal(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, self._on_second_signal)
        signal.signal(signal.SIGTERM, self._on_second_signal)
        self.handler.begin_drain()
        if self._in_job or self.get_state() == WorkerStatus.BUSY:
            self._stop_requested = True
        else:
            raise StopRequested()

    def _on_second_signal(self, signum: int, frame: FrameType | None) -> None:
        self.handler.cold_shutdown()
        os._exit(1)


def make_consumer(
    handler: BatchHandler, redis_url: str, *, stop_pending: threading.Event | None = None
) -> InferqWorker:
    """The RQ worker consuming ``handler``'s private queue (not started: see
    :meth:`InferqWorker.serve`). Must run in the main thread (RQ installs signal handlers).

    ``stop_pending``: the event the process's own stop-signal handler sets before RQ's
    loop runs; set when the loop installs its handlers, the loop drains at once.

    Raises:
        ConfigError: the URL is malformed (password redacted).
    """
    connection = rq_connection(redis_url)
    queue = worker_queue(connection, Keys(handler.namespace), handler.worker_id)
    worker = InferqWorker(
        [queue],
        name=f"{handler.namespace}-{handler.worker_id}",
        connection=connection,
        serializer=JSONSerializer,
        job_class=BatchJob,
        worker_ttl=RQ_WORKER_TTL_S,
        default_result_ttl=RQ_RESULT_TTL_S,
    )
    worker.handler = handler
    worker.stop_pending = stop_pending
    return worker


def broken_job(connection: redis.Redis, keys: Keys, batch_id: str) -> tuple[str, str] | None:
    """(RQ job key, why) when the batch's job exists and is broken: no data field, or
    failed before accepting its batch (unreadable data?); None when it is gone, was
    never enqueued, or looks sound."""
    key = job_key(keys, batch_id)
    fields = {_text(f) for f in connection.hkeys(key)}
    if not fields:
        return None  # never enqueued, or gone: nothing to keep
    status = _text(connection.hget(key, "status"))
    if "data" not in fields:
        return key, "RQ job without a data field"
    if status == "failed":
        return key, "RQ job failed before accepting its batch (unreadable data?)"
    return None


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
