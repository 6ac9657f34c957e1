"""``inferq worker``: one loaded model, its engine, and the RQ consumer that feeds it.

The delivery seam (:mod:`inferq.delivery`) delivers batch jobs on the worker's private
queue; :class:`~inferq.workers.runtime.Engine` runs them. Signals:

- first SIGTERM or SIGINT (or ``inferq drain WORKER``): drain — state
  ``draining``, no new batches (batches claimed for it before are still
  accepted), finish what runs, leave the fleet, exit 0;
- a second one: hand every in-flight request back to its queue at once, exit 1.

With ``--stay-after-drain`` a drain asked through Redis (the scaler, ``inferq
drain``) still leaves the fleet, but the process then waits for SIGTERM and exits
0: under Kubernetes an exited container is restarted in place and would register
again, so the worker waits for the scaler to remove its pod.

A crashed worker loses nothing: its heartbeat lapses and the dispatcher's
reaper requeues its requests and empties its RQ queue. One restarted under the same
id before that (a container restarted in place) takes the id over at start and
requeues what the dead process held (:meth:`Engine._replace_earlier_process`); two
live processes are never given one id (the second exits with an error).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferq import defaults, delivery
from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.models import WORKER_ID_PATTERN
from inferq.store import Store, connect
from inferq.workers.gpu import GpuReader
from inferq.workers.runtime import Engine, WorkerConfig
from inferq.workers.servers import make_server

log = logging.getLogger(__name__)


@dataclass
class WorkerOptions:
    """Options of ``inferq worker`` (see the CLI for their meaning)."""

    model: str
    server: str = "sim"
    server_options: dict[str, Any] = field(default_factory=dict)
    slots: int = 8
    vram_mib: int | None = None
    gpu_index: tuple[int, ...] = ()
    worker_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    stay_after_drain: bool = False
    heartbeat_process: bool = True


def build_engine(settings: Settings, opts: WorkerOptions, store: Store | None = None) -> Engine:
    """Resolve the model, open the GPUs, build the model server and the engine.

    Raises:
        ConfigError: unknown model, bad slots, a CUDA index that is not visible, or the
            model does not fit the card (or its measured free memory: the message names
            the GPU, its free MiB and the need).
    """
    spec = settings.model_by_name.get(opts.model)
    if spec is None:
        known = ", ".join(settings.model_by_name)
        raise ConfigError(f"model: unknown model {opts.model!r} (registry: {known})")
    if not 1 <= opts.slots <= 4096:
        raise ConfigError(f"slots: {opts.slots} is outside 1..4096")
    gpu = GpuReader(opts.gpu_index, opts.vram_mib)
    if gpu.read().total_mib <= 0:
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
        labels=opts.labels,
        heartbeat_interval_s=opts.heartbeat_interval_s,
        heartbeat_process=opts.heartbeat_process,
    )
    server = make_server(opts.server, spec, **opts.server_options)
    return Engine(store or Store(connect(settings.redis_url), settings), config, server)


def run_worker(
    settings: Settings, opts: WorkerOptions, on_ready: Callable[[str], None] | None = None
) -> int:
    """Run a worker until it drains; returns the process exit code (0 after a drain).

    ``on_ready(worker_id)`` runs once the model server is loaded and the worker has
    joined the fleet. Must run in the main thread (RQ installs signal handlers).
    """
    engine = build_engine(settings, opts)
    # A stop signal before RQ's loop installs its handlers (during the model's load, or a
    # drain asked through Redis that the first beats deliver) would otherwise kill the
    # process with SIGTERM's default action: record it and drain without serving; one
    # that comes after the check below but before RQ's handlers, RQ's loop finds set.
    early = threading.Event()
    consumer = delivery.make_consumer(engine, settings.redis_url, stop_pending=early)
    asked = threading.Event()  # the drain came through Redis, not from a signal
    if opts.stay_after_drain:
        signal_self = engine.on_drain_requested

        def on_drain_requested() -> None:
            asked.set()
            signal_self()

        engine.on_drain_requested = on_drain_requested
    delivery.bind(engine)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: early.set())
    try:
        loaded = engine.start(stop=early)
        if loaded and on_ready is not None:
            on_ready(engine.worker_id)
        if not early.is_set():
            consumer.serve()
        engine.begin_drain()
        consumer.accept_claimed()
        engine.stop()
        consumer.purge()  # batches that arrived while draining
        if asked.is_set():
            _wait_for_signal(engine.worker_id)
        return 0
    finally:
        delivery.bind(None)


def _wait_for_signal(worker_id: str) -> None:
    """After a drain asked through Redis: wait, out of the fleet, for SIGTERM or SIGINT."""
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    log.info("worker %s left the fleet; waiting for SIGTERM (--stay-after-drain)", worker_id)
    while not done.wait(0.5):  # a timeout keeps the main thread's signal handling prompt
        pass
