"""``inferq worker``: an RQ ``SimpleWorker`` on a private queue, beside one loaded model.

RQ delivers batch jobs; :class:`~inferq.workers.runtime.Engine` runs them.
Signals:

- first SIGTERM or SIGINT (or ``inferq drain WORKER``): drain — state
  ``draining``, no new batches (batches claimed for it before are still
  accepted), finish what runs, leave the fleet, exit 0;
- a second one: hand every in-flight request back to its queue at once, exit 1.

With ``--stay-after-drain`` a drain asked through Redis (the scaler, ``inferq
drain``) still leaves the fleet, but the process then waits for SIGTERM and exits
0: under Kubernetes an exited container is restarted in place and would register
again, so the worker waits for the scaler to remove its pod.

A crashed worker loses nothing: its heartbeat lapses and the dispatcher's
reaper requeues its requests and empties its RQ queue.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.serializers import JSONSerializer
from rq.worker.base import WorkerStatus

from inferq import defaults
from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.jobs import BatchJob, purge_worker_queue, rq_connection, worker_queue
from inferq.models import WORKER_ID_PATTERN, WorkerState
from inferq.store import CONNECTION_ERRORS, Store, connect
from inferq.workers import batch
from inferq.workers.backends import make_backend
from inferq.workers.gpu import probe_gpu
from inferq.workers.runtime import Engine, WorkerConfig

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


class InferqWorker(SimpleWorker):
    """RQ ``SimpleWorker`` whose signals drain the engine instead of killing jobs."""

    engine: Engine

    def _install_signal_handlers(self) -> None:
        draining = self.engine.state is WorkerState.DRAINING  # a second pass of work()
        handler = self._on_second_signal if draining else self._on_first_signal
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

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
            if self.engine.state is WorkerState.DRAINING:
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
        while Redis holds requests for this worker that the engine has not received, for
        one lease at most (after that they are orphans, handed back by ``stop``).
        """
        patience = time.monotonic() + self.engine.store.settings.lease_s
        while True:
            self._stop_requested = False
            self._undo_dequeue()
            self.work(burst=True, logging_level="WARNING")
            self.engine.wait_idle()
            if any(q.count for q in self.queues):
                continue
            if time.monotonic() >= patience or not self.engine.unreceived():
                return
            time.sleep(CLAIM_POLL_S)

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
        self.engine.begin_drain()
        if self.get_state() == WorkerStatus.BUSY:
            self._stop_requested = True
        else:
            raise StopRequested()

    def _on_second_signal(self, signum: int, frame: FrameType | None) -> None:
        n = self.engine.hand_back("worker shut down before finishing")
        log.warning("cold shutdown: handed %d requests back", n)
        self.engine.stop(reason="cold shutdown")
        os._exit(1)


@dataclass
class WorkerOptions:
    """Options of ``inferq worker`` (see the CLI for their meaning)."""

    model: str
    backend: str = "sim"
    backend_options: dict[str, Any] = field(default_factory=dict)
    slots: int = 8
    vram_mib: int | None = None
    gpu_index: int | None = None
    worker_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    stay_after_drain: bool = False


def build_engine(settings: Settings, opts: WorkerOptions, store: Store | None = None) -> Engine:
    """Resolve the model, probe the GPU, build the backend and the engine.

    Raises:
        ConfigError: unknown model, bad slots, or the weights do not fit the card.
    """
    spec = settings.model_by_name.get(opts.model)
    if spec is None:
        known = ", ".join(settings.model_by_name)
        raise ConfigError(f"model: unknown model {opts.model!r} (registry: {known})")
    if not 1 <= opts.slots <= 4096:
        raise ConfigError(f"slots: {opts.slots} is outside 1..4096")
    gpu = probe_gpu(opts.gpu_index, opts.vram_mib)
    if gpu.total_mib <= 0:
        raise ConfigError("vram_mib: no GPU found; give the card's VRAM with --vram-mib")
    worker_id = opts.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    if not re.match(WORKER_ID_PATTERN, worker_id):
        raise ConfigError(
            f"id: {worker_id!r} is not a worker id (letters, digits, '.', '_', '-'; "
            "at most 128, starting with a letter or digit)"
        )
    config = WorkerConfig(
        worker_id=worker_id,
        spec=spec,
        slots=opts.slots,
        gpu=gpu,
        gpu_index=opts.gpu_index,
        labels=opts.labels,
        heartbeat_interval_s=opts.heartbeat_interval_s,
    )
    backend = make_backend(opts.backend, spec, **opts.backend_options)
    return Engine(store or Store(connect(settings.redis_url), settings), config, backend)


def run_worker(settings: Settings, opts: WorkerOptions) -> int:
    """Run a worker until it drains; returns the process exit code (0 after a drain).

    Must run in the main thread (RQ installs signal handlers).
    """
    engine = build_engine(settings, opts)
    wid = engine.config.worker_id
    rq = rq_connection(settings.redis_url)
    queue = worker_queue(rq, engine.store.keys, wid)
    rq_worker = InferqWorker(
        [queue],
        name=f"{settings.namespace}-{wid}",
        connection=rq,
        serializer=JSONSerializer,
        job_class=BatchJob,
        worker_ttl=RQ_WORKER_TTL_S,
        default_result_ttl=60,
    )
    rq_worker.engine = engine
    asked = threading.Event()  # the drain came through Redis, not from a signal
    if opts.stay_after_drain:
        signal_self = engine.on_drain_requested

        def on_drain_requested() -> None:
            asked.set()
            signal_self()

        engine.on_drain_requested = on_drain_requested
    batch.bind(engine)
    try:
        engine.start()
        rq_worker.serve()
        engine.begin_drain()
        rq_worker.accept_claimed()
        engine.stop()
        purge_worker_queue(rq, engine.store.keys, wid)  # batches that arrived while draining
        if asked.is_set():
            _wait_for_signal(wid)
        return 0
    finally:
        batch.bind(None)


def _wait_for_signal(worker_id: str) -> None:
    """After a drain asked through Redis: wait, out of the fleet, for SIGTERM or SIGINT."""
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    log.info("worker %s left the fleet; waiting for SIGTERM (--stay-after-drain)", worker_id)
    while not done.wait(0.5):  # a timeout keeps the main thread's signal handling prompt
        pass
