"""The worker's engine: one asyncio loop running requests on the model server, and the heartbeat.

RQ delivers batches (see :mod:`inferq.delivery`); the batch job only
*accepts* its requests — checks atomically that they are still this worker's
under this attempt, expires the late ones — and hands them to this engine,
which runs them concurrently up to the worker's slots, continuously: a new
batch never waits for an earlier one to finish (the way vLLM's continuous
batching admits new sequences). Results are written through the fenced
completion script, coalesced: whatever finished while the previous write was in
flight goes in the next one.

A background heartbeat thread publishes the worker's state every
``heartbeat_interval_s`` with a TTL of three intervals and extends the leases
of its in-flight requests. Because the beat extends every lease the worker holds
in Redis, the engine keeps the set of requests it actually holds (accepted and
not yet written back); each beat, requests Redis says it holds but the engine
never received for longer than one lease (a dispatcher killed between its claim
and the RQ enqueue, a reply lost to a dropped connection, a truncated RQ job)
are handed back to their queue (:meth:`Engine.recover_orphans`).

A third thread reads the worker's control channel (:mod:`inferq.workers.control`):
an abort command (a preemption, a cancel) cancels that request's model-server call,
frees its slot and writes the outcome (:meth:`Engine.abort`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from inferq import defaults, delivery
from inferq.config import ModelSpec
from inferq.errors import ConfigError, CorruptRecord, RequestNotFound
from inferq.latency import prefill_s, resident_kv_tokens, step_s
from inferq.models import RequestRecord, ToolCallDelta, WorkerInfo, WorkerState, merge_tool_deltas
from inferq.store import (
    CONNECTION_ERRORS,
    REDIS_ERRORS,
    REPLY_ERRORS,
    Abort,
    AsyncStore,
    Beat,
    Chunk,
    Completion,
    Store,
)
from inferq.workers import failures
from inferq.workers.clock import RedisClock
from inferq.workers.control import ControlReader
from inferq.workers.gpu import GpuReader
from inferq.workers.health import HealthMonitor
from inferq.workers.pulse import HeartbeatProcess
from inferq.workers.rejections import RejectionStreak, signature
from inferq.workers.servers import (
    ChunkSink,
    FailureKind,
    ModelServer,
    ServerError,
    ServerRequest,
    ServerResult,
)
from inferq.workers.telemetry import TelemetryPoller, booked_kv_cache_mib, measured_kv_free_mib

log = logging.getLogger(__name__)

#: Error of a request handed back because its batch never reached this worker.
ORPHAN_ERROR = "its batch job never reached the worker (lost or unreadable RQ job)"

#: What :meth:`Engine.abort` does with an aborted request.
AbortAction = Literal["requeue", "cancel", "expire"]
#: Shortest pause between two starts of a heartbeat process that exited, seconds.
PULSE_RESTART_S = 5.0
#: Heartbeat intervals an earlier process of a worker's id must have been silent before a
#: new process takes the id over (:meth:`Engine._replace_earlier_process`): one beat late is
#: a busy host, two is a process gone (the reaper waits the TTL, three).
REPLACE_SILENT_INTERVALS = 2
#: Longest wait of an abort for a request whose start was accepted but whose task is
#: not launched yet (the engine loop schedules it right after ``start.lua``), seconds.
ABORT_LAUNCH_WAIT_S = 1.0


@dataclass
class WorkerConfig:
    """A worker's identity and capacity.

    Attributes:
        worker_id: unique id (default: ``<host>-<pid>``).
        spec: the model it serves.
        slots: concurrent requests at most.
        gpu: the GPUs (their CUDA indices: ``gpu.indices``), read again on every beat
            (NVML, or the configured VRAM).
        labels: free-form labels published in the heartbeat.
        heartbeat_interval_s: seconds between beats.
        heartbeat_process: beat from a child process (:mod:`inferq.workers.pulse`), so
            a stall of this process shorter than ``HEARTBEAT_STALL_S`` does not get it
            reaped; False beats from a thread (tests that run engines in-process).
    """

    worker_id: str
    spec: ModelSpec
    slots: int
    gpu: GpuReader
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    heartbeat_process: bool = False


class Engine:
    """Runs accepted requests on the model server in a private event loop thread.

    It is the worker's :class:`~inferq.delivery.BatchHandler`: the delivery seam hands
    it batches (:meth:`accept`) and drives its drain.

    Args:
        store: the deployment's store.
        config: identity and capacity.
        server: the model server (sim, openai, a plugin).

    Raises:
        ConfigError: the model cannot fit the GPU (:func:`booked_kv_cache_mib`).
    """

    def __init__(self, store: Store, config: WorkerConfig, server: ModelServer) -> None:
        self.store = store
        self.config = config
        self.server = server
        self.state = WorkerState.STARTING
        self.clock = RedisClock()  # every timing on Redis TIME (issue 13, fault 4)
        self.started_at = 0.0  # set on the first beat, on Redis TIME
        self._pulse: HeartbeatProcess | None = None
        self._pulse_restart_at = 0.0  # monotonic: no new heartbeat process before this
        self._drain_asked = threading.Event()
        self._beats = 0
        # Heartbeats built so far; a heartbeat is built whole under _snapshot_lock, so a
        # higher beat_seq never carries an older state (heartbeat.lua refuses a lower one).
        self._beat_seq = 0
        self._snapshot_lock = threading.Lock()
        self.kv_cache_mib = booked_kv_cache_mib(
            config.spec, config.gpu.read(), config.gpu.indices, external=server.external
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine", daemon=True)
        # Tracked by (request id, attempt): an old attempt finishing (a worker reaped and
        # the request re-dispatched here) must never clear the live one.
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        # (request id, attempt) -> (Redis epoch s its server call began, prompt tokens,
        # max_tokens)
        self._begun: dict[tuple[str, int], tuple[float, int, int]] = {}
        self._pending: list[tuple[Completion, str | None]] = []
        self._flush_wanted: asyncio.Event | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._write_lock: asyncio.Lock | None = None  # one writer of results at a time
        # Output chunks of streamed requests not yet in Redis, by (request, attempt):
        # chunks that arrive while a write is in flight merge into one entry.
        self._chunks: dict[tuple[str, int], Chunk] = {}
        self._chunk_wanted: asyncio.Event | None = None
        self._chunk_lock: asyncio.Lock | None = None  # one writer of chunks at a time
        self._publisher: asyncio.Task[None] | None = None
        # Chunks are written from the loop itself (redis.asyncio), not through its thread
        # pool: no thread hand-off between a token and its XADD (issue 14).
        self._chunk_store: AsyncStore | None = None
        self._idle = threading.Condition()
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        # Requests this engine holds: accepted (from before start.lua) until their
        # result is written or they are handed back. Guarded by _held_lock.
        self._held: set[tuple[str, int]] = set()
        self._held_lock = threading.Lock()
        # Attempts an abort is under way for (the control channel's command and the same
        # abort delivered again by a beat may meet): one at a time. Guarded by _held_lock.
        self._aborting: set[tuple[str, int]] = set()
        self.on_drain_requested: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)
        self.finished = 0
        self.failed = 0
        self.aborted = 0
        #: (prompt, server-reported cached, index-forecast cached) tokens served, totals
        self.prefix_tokens = [0, 0, 0]
        self._control = ControlReader(store, config.worker_id, self._on_control)
        self._rq: Any = None  # RQ's connection, opened when a broken job must be inspected
        self.telemetry = TelemetryPoller(server, worker_id=config.worker_id, slots=config.slots)
        self.health = HealthMonitor(
            server,
            worker_id=config.worker_id,
            get_state=lambda: self.state,
            set_state=self._set_health_state,
        )
        # The run of identical refusals: a server that refuses every request is broken.
        self._refusals = RejectionStreak()

    # --- identity, as the delivery seam sees it ----------------------------------------

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def namespace(self) -> str:
        return self.store.keys.namespace

    @property
    def lease_s(self) -> float:
        return self.store.settings.lease_s

    @property
    def draining(self) -> bool:
        return self.state is WorkerState.DRAINING

    # --- lifecycle ---------------------------------------------------------------

    def start(self, stop: threading.Event | None = None) -> bool:
        """Start the loop and heartbeat, load the model (state ``starting``), then ``ready``.

        Returns False, without becoming ``ready``, when ``stop`` (the process's stop
        signal) is set while the model server loads; True once ready.

        Raises:
            ServerError: the model server could not load the model.
            ConfigError: another live process beats under this worker id.
        """
        self._replace_earlier_process()
        if self.config.heartbeat_process:  # first: forked before this engine's threads
            self._start_pulse()
        self._thread.start()
        self._call(self._init_loop())
        self.started_at = time.time()  # replaced by Redis TIME once the first beat replies
        try:
            self.beat()
        except ConfigError:  # another process registered first: leave without a trace
            self._abandon_start()
            raise
        self.started_at = self.clock.now()
        self._beat_thread = threading.Thread(
            target=self._beat_forever, name="heartbeat", daemon=True
        )
        self._beat_thread.start()
        self._control.start()
        if not self._load_until(stop):
            log.warning(
                "worker %s: stop signal while the model server was loading; leaving",
                self.config.worker_id,
            )
            return False
        self._call(self.telemetry.read_once())  # the first ready beat carries the server's figures
        self._loop.call_soon_threadsafe(self.telemetry.start)
        self._note_prefix(reset=1)  # a restarted worker of the same id: its cache is empty
        self.state = WorkerState.READY
        self.beat()
        log.info(
            "worker %s ready: %s, %d slots, %d MiB KV cache",
            self.config.worker_id,
            self.config.spec.name,
            self.config.slots,
            self.kv_cache_mib,
        )
        return True

    def _replace_earlier_process(self) -> None:
        """Take over this worker id from an earlier process still registered under it.

        A worker killed and restarted in place (Kubernetes restarts a crashed container
        under the same pod name) beats again before its old heartbeat lapses: the reaper
        never sees it lost, and the new process's beats would extend the leases of the
        requests the dead one ran, so they waited a lease and more before the orphan
        check handed them back (5.2 s for a realtime request). The earlier process is
        taken for dead once it has been silent for ``REPLACE_SILENT_INTERVALS`` heartbeat
        intervals (this waits out the rest of that, under 2 s at the default interval),
        then removed as a lost worker, as the reaper would a TTL later: its requests are
        requeued now, each counting the crash (``remove_worker.lua``), and a
        ``worker_lost`` event says why; this process then joins afresh.

        Raises:
            ConfigError: another live process beats under this id (two workers given
                one ``--id``): it is left alone, and this one does not start.
        """
        wid = self.config.worker_id
        quiet_s = self.config.heartbeat_interval_s * REPLACE_SILENT_INTERVALS
        now, beat = self.store.last_beat(wid)
        if beat is None:
            return
        # A beat stamped after Redis's now (its clock moved back: a failover, an NTP step)
        # is not waited out: two intervals from now at most, then the score is read again,
        # since a live process's next beat would be stamped earlier, not later.
        wait = min(beat + quiet_s - now, quiet_s)
        if wait > 0:
            time.sleep(wait)
        if beat > now and self.store.last_beat(wid)[1] not in (beat, None):
            raise _id_in_use(wid)
        requeued = self.store.remove_worker(
            wid,
            reason="its process was replaced by a new process of the same id",
            dead=True,
            stale_before=beat + 0.001,  # removed only if it has not beaten since
        )
        if requeued is None:
            if self.store.last_beat(wid)[1] is None:
                return  # the reaper removed it meanwhile
            raise _id_in_use(wid)
        log.warning(
            "worker %s: an earlier process of this id was still registered; took over, "
            "requeued its %d requests",
            wid,
            len(requeued),
        )
        # What the reaper does after removing a worker (BatchSender.purge): the dead
        # process's jobs must never run, and its RQ record (no death recorded) would make
        # this process's RQ loop fail its birth and pause before serving.
        if self._rq is None:
            self._rq = delivery.rq_connection(self.store.settings.redis_url)
        try:
            delivery.purge_worker_queue(self._rq, self.store.keys, wid)
        except REDIS_ERRORS as exc:  # its jobs are fenced anyway; RQ's loop retries its birth
            log.warning("worker %s: could not empty the earlier process's RQ queue: %s", wid, exc)

    def _abandon_start(self) -> None:
        """Undo what :meth:`start` began before its first beat: the heartbeat process and
        the engine loop (nothing was published, so nothing is removed from Redis)."""
        if self._pulse is not None:
            self._pulse.close()
            self._pulse = None
        self._call(self._shutdown_loop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _set_health_state(self, state: WorkerState) -> None:
        """The health monitor's transition (ready <-> unhealthy), published at once. Back
        to ready, the model server may have been restarted or replaced: the prefix index
        forgets what it held (a ``reset`` of the prefix log)."""
        recovered = self.state is WorkerState.UNHEALTHY and state is WorkerState.READY
        self.state = state
        if recovered:
            self._note_prefix(reset=1)
        self._publish_state()

    def _note_prefix(self, **fields: str | int) -> None:
        """A ``reset`` or ``miss`` entry of the prefix log (:mod:`inferq.store.prefixlog`);
        a Redis error only costs the index its correction."""
        try:
            self.store.note_prefix(self.config.worker_id, **fields)
        except REDIS_ERRORS as exc:
            log.warning("prefix log: %s", exc)

    def _count_prefix(self, record: RequestRecord, result: ServerResult) -> dict[str, int]:
        """Add a success's prompt tokens to the heartbeat's totals. Returns the ``miss``
        to tell the index (:meth:`~inferq.policy.prefix_index.PrefixIndex.observe`) when
        the server reports reusing fewer prompt tokens than the index forecast by more
        than a block, else ``{}``."""
        forecast = record.cached_forecast
        served = result.cached_tokens
        counts = self.prefix_tokens
        counts[0] += result.prompt_tokens
        counts[1] += served or 0
        counts[2] += forecast
        block = record.request.prefix_block_tokens
        if served is not None and forecast > 0 and served + block < forecast:
            return {"fc": forecast, "got": served, "bt": block}
        return {}

    def begin_drain(self) -> None:
        """Take no new batches (the dispatcher sees ``draining`` on the next beat)."""
        if self.state is not WorkerState.DRAINING:
            log.info("worker %s draining (%d in flight)", self.config.worker_id, self.in_flight)
            self.state = WorkerState.DRAINING
            self._publish_state()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing runs; True if idle (False on timeout)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._running, timeout=timeout_s)

    def hand_back(self, reason: str) -> int:
        """Requeue every in-flight request at once (not counted as a failed attempt)."""
        items = self._call(self._cancel_all())
        if items:
            self.store.requeue(
                [(rid, attempt, self.config.worker_id, reason) for rid, attempt in items],
                penalize=False,
            )
        self._unhold(items)
        return len(items)

    def cold_shutdown(self) -> None:
        """A second stop signal: hand every in-flight request back at once and leave."""
        n = self.hand_back("worker shut down before finishing")
        log.warning("cold shutdown: handed %d requests back", n)
        self.stop(reason="cold shutdown")

    def stop(self, reason: str = "drained") -> None:
        """Flush results, leave the fleet (anything still held is requeued), stop threads."""
        self._control.stop()
        self._call(self._flush_all())
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=5)
        if self._pulse is not None:  # before leaving: it would register the worker again
            self._pulse.close()
        self.store.remove_worker(self.config.worker_id, reason=reason, dead=False)
        self._call(self._shutdown_loop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.config.gpu.close()
        log.info(
            "worker %s left: %d finished, %d failed",
            self.config.worker_id,
            self.finished,
            self.failed,
        )

    # --- heartbeat -----------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def info(self) -> WorkerInfo:
        """The heartbeat as of now: the bookkeeping, NVML read now, the server's last
        telemetry (:mod:`inferq.workers.telemetry`), numbered by ``beat_seq``.

        Two threads build heartbeats (the heartbeat thread, and a state change published
        at once from the loop or the control reader); each is built whole under one lock
        and numbered, so the one built later carries the higher number and heartbeat.lua
        refuses the other if it arrives last: a beat built before an ``unhealthy`` and
        sent after it published ``ready`` again (issue 25's loaded run).
        """
        with self._snapshot_lock:
            self._beat_seq += 1
            return self._build_info(self._beat_seq)

    def _build_info(self, beat_seq: int) -> WorkerInfo:
        c = self.config
        reserved = int(self.store.reserved_mib(c.worker_id))
        gpu = c.gpu.read()
        server = self.telemetry.latest
        return WorkerInfo(
            id=c.worker_id,
            host=socket.gethostname(),
            model=c.spec.name,
            params_b=c.spec.params_b,
            vram_total_mib=gpu.total_mib,
            vram_free_mib=max(0, gpu.total_mib - c.spec.weights_mib - reserved),
            vram_measured_free_mib=gpu.free_mib if gpu.measured else None,
            vram_measured_used_mib=gpu.used_mib if gpu.measured else None,
            kv_cache_mib=self.kv_cache_mib,
            kv_measured_free_mib=measured_kv_free_mib(
                c.spec, self.kv_cache_mib, server, gpu, external=self.server.external
            ),
            server=server,
            slots=c.slots,
            in_flight=self.in_flight,
            state=self.state,
            last_heartbeat=self.clock.now(),
            started_at=self.started_at,
            gpu_name=gpu.name,
            gpu_index=c.gpu.indices,
            gpu_uuids=gpu.uuids,
            labels=c.labels,
            prompt_tokens_total=self.prefix_tokens[0],
            cached_tokens_total=self.prefix_tokens[1],
            forecast_tokens_total=self.prefix_tokens[2],
            health_reason=self.health.reason if self.state is WorkerState.UNHEALTHY else "",
            beat_seq=beat_seq,
        )

    @property
    def _ttl_s(self) -> float:
        return self.config.heartbeat_interval_s * defaults.HEARTBEAT_TTL_INTERVALS

    def beat(self) -> None:
        """Publish one heartbeat from this process and act on its reply (:meth:`_on_beat`).

        Raises:
            ConfigError: the first beat was refused: another process of this id
                registered between this one's look for it and this beat (``heartbeat.lua``).
        """
        beat = self.store.heartbeat(self.info(), ttl_s=self._ttl_s, held=self.held())
        if beat.refused:
            raise _id_in_use(self.config.worker_id)
        self._on_beat(beat)

    def _on_beat(self, beat: Beat) -> None:
        """A heartbeat's reply (from this process or the heartbeat process): set the clock,
        stop attempts that are no longer ours, drain when asked."""
        self.clock.observe(beat.now_ms)
        if beat.joined and self._beats:
            log.warning(
                "worker %s was declared dead (no heartbeat within %.1f s) and registered again",
                self.config.worker_id,
                self._ttl_s,
            )
        self._beats += 1
        if beat.lost:
            self.forget_lost(beat.lost)
        if beat.aborts:
            self._abort_again(beat.aborts)
        if (
            beat.drain
            and self.state in (WorkerState.READY, WorkerState.UNHEALTHY)
            and not self._drain_asked.is_set()
        ):
            # Once: the replies of two beaters may both carry the flag before the drain
            # begins, and a second stop signal would be a cold shutdown.
            self._drain_asked.set()
            log.info("worker %s: drain requested remotely", self.config.worker_id)
            self.on_drain_requested()

    def forget_lost(self, lost: Iterable[tuple[str, int]]) -> None:
        """Stop the (request id, attempt) pairs that are no longer this worker's own.

        The reaper requeued them (this worker was declared dead) or they finished: their
        result would be stale, and running them on wastes a slot beside the live attempt.
        Nothing is written for them; a later attempt of the same request is untouched.
        """
        pairs = set(lost)
        self._unhold(pairs)
        self._loop.call_soon_threadsafe(self._cancel_lost, pairs)

    def _cancel_lost(self, pairs: set[tuple[str, int]]) -> None:
        stopped = [key for key in pairs if key in self._running]
        for key in stopped:  # out of _running at once: a repeated report stops nothing twice
            self._running.pop(key).cancel()
            self._begun.pop(key, None)
        if stopped and not self._running:
            with self._idle:
                self._idle.notify_all()
        if stopped:
            log.warning(
                "worker %s: stopped %d attempts that are no longer its own (requeued "
                "while it was silent): %s",
                self.config.worker_id,
                len(stopped),
                ", ".join(f"{rid}#{attempt}" for rid, attempt in sorted(stopped)[:5]),
            )

    def _safe_beat(self) -> None:
        try:
            self.beat()
        except CONNECTION_ERRORS as exc:
            log.warning("heartbeat failed: %s", exc)

    def _publish_state(self) -> None:
        """A state change (unhealthy, ready again, draining), published at once.

        Beats from here, and hands the heartbeat process the new line with a beat at once:
        otherwise its next beat writes the line it held, with the old state, back over
        this one (a worker seen ``ready`` again while still ``unhealthy`` was given work).
        """
        self._safe_beat()
        if self._pulse is not None:
            try:
                self._pulse.send(self.info().to_fields(), self.held(), now=True)
            except CONNECTION_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)

    def _start_pulse(self) -> None:
        self._pulse = HeartbeatProcess(
            self.store.settings,
            self.config.worker_id,
            ttl_s=self._ttl_s,
            interval_s=self.config.heartbeat_interval_s,
            on_beat=self._on_beat,
        )
        log.debug("heartbeat process %d", self._pulse.pid)

    def _pulse_or_beat(self) -> None:
        """Hand the heartbeat to the heartbeat process, or beat here without one.

        A heartbeat process that exited (killed alone: an OOM kill, a stray ``kill -9``)
        is replaced, at most once per ``PULSE_RESTART_S``; this process beats meanwhile.
        Without a new one a later stall of this process longer than the TTL got the
        worker reaped (issue 13 attack)."""
        if self._pulse is not None:
            try:
                fields = self.info().to_fields()
            except CONNECTION_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
                return
            if self._pulse.send(fields, self.held()):
                if not self._pulse.ready:
                    self._safe_beat()
                return
            log.warning(
                "heartbeat process %d exited; beating from the worker process until another runs",
                self._pulse.pid,
            )
            self._pulse.close(timeout_s=0.0)  # reap it
            self._pulse = None
        self._safe_beat()
        if self.config.heartbeat_process and not self._beat_stop.is_set():
            now = time.monotonic()
            if now >= self._pulse_restart_at:
                self._pulse_restart_at = now + PULSE_RESTART_S
                try:
                    self._start_pulse()
                except Exception:  # beat from here; try again later
                    log.exception("could not start a heartbeat process")

    def _beat_forever(self) -> None:
        while not self._beat_stop.wait(self.config.heartbeat_interval_s):
            try:
                self._pulse_or_beat()
            except Exception:  # a heartbeat that cannot be built must not end the beating
                log.exception("heartbeat failed")
            try:
                self.recover_orphans()
            except CONNECTION_ERRORS as exc:
                log.warning("orphan check failed: %s", exc)
            except Exception:  # never let bad data stop the heartbeat
                log.exception("orphan check failed")

    # --- aborts: preemption and cancel of running requests ---------------------------

    def abort(self, request_id: str, attempt: int, action: AbortAction, reason: str) -> str:
        """Abort a running request: cancel its model-server call, free its slot, write why.

        The model-server call is cancelled (the OpenAI-compatible servers stop a
        request whose connection closes; the sim server stops sleeping), then:

        - ``requeue`` (a preemption): ``requeue_preempted.lua`` puts it back at its
          original queue position with its deadline, spending no attempt, and keeps in
          its tenant's counter only the tokens it used: the prompt plus the tokens
          generated, estimated from the time it ran by the model's latency profile
          (a cancelled server call reports no count);
        - ``cancel`` / ``expire``: made final (``cancelled`` / ``expired``) with ``reason``.

        Fenced by ``attempt``: a newer attempt, or one that already finished, is left alone.

        Args:
            request_id: the request.
            attempt: the attempt to abort (its fencing number).
            action: ``requeue``, ``cancel`` or ``expire``.
            reason: the error text of a cancel/expire, the log line's reason otherwise.

        Returns:
            ``aborted``, ``not_running`` (this engine does not run that attempt) or
            ``under_way`` (another abort of that attempt is being carried out).
        """
        key = (request_id, attempt)
        with self._held_lock:
            if key in self._aborting:
                return "under_way"
            self._aborting.add(key)
        try:
            deadline = time.monotonic() + ABORT_LAUNCH_WAIT_S
            while True:
                verdict: str = self._call(self._abort(request_id, attempt, action, reason))
                if verdict != "launching" or time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        finally:
            with self._held_lock:
                self._aborting.discard(key)
        if verdict == "aborted":
            log.info("aborted %s (attempt %d, %s): %s", request_id, attempt, action, reason)
            return verdict
        return "not_running"

    def _abort_again(self, aborts: Iterable[tuple[str, int, str, str]]) -> None:
        """Carry out aborts a beat reports pending for attempts this engine holds: their
        control-channel command was lost, or is still on its way (then the first to arrive
        acts and the other finds it under way or done). Each in a thread of its own, so
        the beat never waits for an abort."""
        for rid, attempt, action, reason in aborts:
            if action not in ("requeue", "cancel", "expire"):
                continue
            with self._held_lock:
                if (rid, attempt) in self._aborting:
                    continue
            log.info("abort of %s (attempt %d, %s) delivered again by a beat", rid, attempt, action)
            threading.Thread(
                target=self._abort_quietly,
                args=(rid, attempt, action, reason),
                name="abort",
                daemon=True,
            ).start()

    def _abort_quietly(self, rid: str, attempt: int, action: AbortAction, reason: str) -> None:
        try:
            self.abort(rid, attempt, action, reason)
        except CONNECTION_ERRORS as exc:  # the next beat delivers it again
            log.warning("abort of %s failed: %s", rid, exc)
        except Exception:
            log.exception("abort of %s failed", rid)

    def _on_control(self, command: Abort) -> None:
        self.abort(command.request_id, command.attempt, command.action, command.reason)

    async def _abort(self, rid: str, attempt: int, action: AbortAction, reason: str) -> str:
        task = self._running.get((rid, attempt))
        if task is None:
            with self._held_lock:
                return "launching" if (rid, attempt) in self._held else "not_running"
        if task.done() or not task.cancel():
            return "not_running"  # finished: its result is on its way
        begun = self._begun.get((rid, attempt))
        await asyncio.gather(task, return_exceptions=True)
        generated = self._generated(begun)
        self.aborted += 1
        if action == "requeue":
            try:
                await asyncio.to_thread(
                    self.store.requeue_preempted,
                    self.config.worker_id,
                    [(rid, attempt, generated)],
                )
            finally:  # a failed write: recover_orphans hands it back after a lease
                self._unhold([(rid, attempt)])
        else:
            status: Literal["cancelled", "expired"] = (
                "cancelled" if action == "cancel" else "expired"
            )
            self._queue(Completion(rid, attempt, status, error=reason))
        return "aborted"

    def _generated(self, begun: tuple[float, int, int] | None) -> int:
        """Output tokens a cancelled call had produced, estimated by the latency profile:
        ``(elapsed - prefill_s(prompt)) / step_s(concurrency, resident KV)``
        (:mod:`inferq.latency`), within ``0..max_tokens``."""
        if begun is None:
            return 0
        t0, prompt, max_tokens = begun
        spec = self.config.spec
        decoding = self.clock.now() - t0 - prefill_s(spec, prompt)
        batch = max(1, self.in_flight)
        step = step_s(spec, batch, resident_kv_tokens(prompt, max_tokens, batch))
        return max(0, min(max_tokens, int(decoding / step)))

    # --- orphans: held in Redis, never received ----------------------------------------

    def recover_orphans(self) -> int:
        """Hand back requests Redis says this worker holds but the engine never received.

        A claimed batch whose RQ job never arrives, or arrives unreadable, would
        otherwise stay assigned here forever (every beat extends its leases). A
        request in ``inflight:<id>``, not held by the engine, assigned or started more
        than one lease ago, is requeued (not counted as a failed attempt; fenced by its
        attempt, so a job arriving late finds it stale), and a broken RQ job of its batch
        is quarantined. One whose record is gone (deleted, evicted) is taken off this
        worker (:meth:`~inferq.store.Store.forget_vanished`): nothing could release its
        slot otherwise. Returns how many were requeued.
        """
        wid = self.config.worker_id
        unheld = sorted(self.unreceived())
        if not unheld:
            return 0
        now_ms, rows = self.store.holdings(unheld)
        vanished = [rid for rid, (row, _) in zip(unheld, rows, strict=True) if _vanished(row)]
        gone = self.store.forget_vanished(wid, vanished) if vanished else []
        if gone:
            log.warning(
                "took %d requests whose record is gone off this worker: %s", len(gone), gone
            )
        oldest = now_ms - round(self.store.settings.lease_s * 1000)
        requeued = 0
        for rid, (row, batch) in zip(unheld, rows, strict=True):
            attempt = _orphan_attempt(row, wid, oldest)
            if attempt is None:
                continue
            if self._requeue_orphan(rid, attempt):
                requeued += 1
                self._quarantine_job(str(batch or ""))
        if requeued:
            log.warning("handed back %d requests whose batch never arrived", requeued)
        return requeued

    def unreceived(self) -> set[str]:
        """Requests Redis says this worker holds (``inflight:<id>``) that the engine does
        not: claimed for it, their batch not (yet) accepted."""
        inflight = self.store.held_by(self.config.worker_id)
        with self._held_lock:
            return inflight - {rid for rid, _ in self._held}

    def _requeue_orphan(self, rid: str, attempt: int) -> bool:
        # Under the lock, so accept() cannot start it between the check and the requeue.
        with self._held_lock:
            if (rid, attempt) in self._held:
                return False  # its batch arrived meanwhile
            try:
                [verdict] = self.store.requeue(
                    [(rid, attempt, self.config.worker_id, ORPHAN_ERROR)], penalize=False
                )
            except REPLY_ERRORS as exc:  # a record the script cannot read
                log.warning("could not hand back %s: %s", rid, exc)
                return False
        return verdict != "stale"

    def _quarantine_job(self, batch: str) -> None:
        """Quarantine the RQ job of ``batch`` when it exists and is broken (no data, failed)."""
        if not batch:
            return
        if self._rq is None:
            self._rq = delivery.rq_connection(self.store.settings.redis_url)
        broken = delivery.broken_job(self._rq, self.store.keys, batch)
        if broken is not None:
            key, reason = broken
            self.store.quarantine(key, f"{reason} (batch {batch}, worker {self.config.worker_id})")

    def _hold(self, pairs: Iterable[tuple[str, int]]) -> None:
        with self._held_lock:
            self._held.update(pairs)

    def _unhold(self, pairs: Iterable[tuple[str, int]]) -> None:
        with self._held_lock:
            self._held.difference_update(pairs)

    def held(self) -> list[tuple[str, int]]:
        """The (request id, attempt) pairs this engine holds now."""
        with self._held_lock:
            return sorted(self._held)

    # --- accepting work (called from the RQ job, main thread) ---------------------

    def accept(self, batch_id: str, items: list[tuple[str, int]]) -> dict[str, int]:
        """Start a batch's requests: only those still held by this worker under this attempt.

        Returns counts of ``run``, ``stale`` and ``expired`` verdicts. A request whose
        record does not parse is failed with the reason and its record quarantined.
        """
        self._hold(items)
        launched: set[tuple[str, int]] = set()
        try:
            verdicts, records = self.store.start_and_read(self.config.worker_id, items)
            for (rid, attempt), verdict, record in zip(items, verdicts, records, strict=True):
                if verdict != "run":
                    continue
                record = record or self._reread(rid, attempt)
                if record is not None:
                    self._loop.call_soon_threadsafe(self._launch, record, attempt)
                    launched.add((rid, attempt))
        finally:  # what did not start here (a failed call included): recover_orphans' job
            self._unhold(item for item in items if item not in launched)
        counts = {"run": 0, "stale": 0, "expired": 0}
        for v in verdicts:
            counts[v] = counts.get(v, 0) + 1
        log.debug("batch %s: %s", batch_id, counts)
        return counts

    def _reread(self, rid: str, attempt: int) -> RequestRecord | None:
        """A started request :meth:`Store.records` could not read: its record, or None when
        it vanished (purged) or does not parse (failed with the reason, record quarantined)."""
        try:
            return self.store.record(rid)
        except RequestNotFound:
            self._unhold([(rid, attempt)])
            return None
        except CorruptRecord as exc:
            reason = exc.reason
        try:
            self.store.complete(
                self.config.worker_id,
                [Completion(rid, attempt, "failed", error=f"corrupt request record: {reason}")],
                self.config.spec.name,
            )
        finally:
            self._unhold([(rid, attempt)])
        self.store.quarantine(self.store.keys.req(rid), f"request record: {reason}")
        return None

    # --- inside the loop ------------------------------------------------------------

    async def _init_loop(self) -> None:
        self._flush_wanted = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._flusher = asyncio.create_task(self._flush_forever())
        self._chunk_wanted = asyncio.Event()
        self._chunk_lock = asyncio.Lock()
        self._chunk_store = AsyncStore.from_settings(self.store.settings)
        self._publisher = asyncio.create_task(self._publish_forever())

    def _launch(self, record: RequestRecord, attempt: int) -> None:
        key = (record.request.id, attempt)
        task = asyncio.create_task(self._run(record, attempt))
        self._running[key] = task
        task.add_done_callback(lambda _t: self._done(key))

    def _done(self, key: tuple[str, int]) -> None:
        self._running.pop(key, None)
        self._begun.pop(key, None)
        if not self._running:
            with self._idle:
                self._idle.notify_all()

    async def _run(self, record: RequestRecord, attempt: int) -> None:
        req = record.request
        remaining = req.deadline - self.clock.now()
        breq = ServerRequest(
            id=req.id,
            model=self.config.spec.name,
            payload=req.payload,
            max_tokens=req.max_tokens,
            prompt_tokens=req.prompt_tokens,
            timeout_s=max(0.001, remaining),
            on_chunk=self._sink(req.id, attempt, req.deadline) if req.stream else None,
            prefix=req.prefix_hashes,
            block_tokens=req.prefix_block_tokens,
        )
        t0 = self.clock.now()
        self._begun[(req.id, attempt)] = (t0, req.prompt_tokens, req.max_tokens)
        try:
            result = await asyncio.wait_for(
                self.server.generate(breq, concurrency=self.in_flight),
                timeout=max(0.001, remaining),
            )
        except TimeoutError:
            self._queue(
                Completion(req.id, attempt, "expired", error="deadline passed while running")
            )
            return
        except ServerError as exc:
            await self._failed(req.id, attempt, exc, tenant=req.tenant)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a model server bug must not kill the worker: retry elsewhere
            log.exception("backend raised on request %s", req.id)
            await self._failed(
                req.id, attempt, ServerError(f"backend crashed: {exc!r}", retryable=True)
            )
            return
        self._refusals.succeeded()
        if result.cached_tokens is not None and result.cached_tokens > result.prompt_tokens:
            # a server that says it reused more than the prompt: metered as the whole prompt
            # (more made the request's cost negative and the hit rate above 100%)
            result = replace(result, cached_tokens=result.prompt_tokens)
        first = t0 + result.ttft_s if result.ttft_s is not None else None
        miss = self._count_prefix(record, result)
        if miss:
            await asyncio.to_thread(self._note_prefix, **miss)
        outcome = Completion(
            req.id,
            attempt,
            "succeeded",
            output=result.output,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            first_token_at=first,
            finish_reason=result.finish_reason,
            cached_tokens=result.cached_tokens or 0,
            tool_calls=result.tool_calls,
        )
        self._queue(outcome, req.task_type)

    # --- streamed output ---------------------------------------------------------------

    def _sink(self, rid: str, attempt: int, deadline: float) -> ChunkSink:
        """The model server's :data:`ChunkSink` for one attempt of a streamed request.

        Called in the loop; it only buffers. A chunk that arrives while the previous
        write is in flight merges into the pending one (same seq), so a slow Redis costs
        fewer, larger entries, never a stalled generation. The first chunk carries the
        time the worker received the first token.
        """
        seq = 0
        # On Redis TIME (self.clock), as every timing: the host's clock may be off by
        # seconds (a first chunk stamped 15 s late on a skewed host, issue 13 attack).
        ttl_s = max(1, math.ceil(deadline - self.clock.now())) + self.store.settings.result_ttl_s

        def on_chunk(
            delta: str,
            tokens: int,
            finish: str | None,
            /,
            tool_calls: tuple[ToolCallDelta, ...] = (),
        ) -> None:
            nonlocal seq
            key = (rid, attempt)
            pending = self._chunks.get(key)
            if pending is not None and pending.finish_reason is None:
                self._chunks[key] = Chunk(
                    rid,
                    attempt,
                    pending.seq,
                    pending.delta + delta,
                    tokens,
                    finish,
                    pending.first_token_at,
                    ttl_s,
                    merge_tool_deltas(pending.tool_calls, tuple(tool_calls)),
                )
            else:
                first = self.clock.now() if seq == 0 else None
                self._chunks[key] = Chunk(
                    rid, attempt, seq, delta, tokens, finish, first, ttl_s, tuple(tool_calls)
                )
                seq += 1
            assert self._chunk_wanted is not None
            self._chunk_wanted.set()

        return on_chunk

    async def _publish_forever(self) -> None:
        assert self._chunk_wanted is not None
        while True:
            await self._chunk_wanted.wait()
            self._chunk_wanted.clear()
            await self._publish_chunks()

    async def _publish_chunks(self) -> None:
        """Write every buffered chunk (one pipeline per round, from the loop). Chunks are a
        live view: a write that fails is dropped with a warning (readers see the gap by
        ``seq`` and take the whole text from the final result), never retried into a
        later one."""
        assert self._chunk_lock is not None and self._chunk_store is not None
        async with self._chunk_lock:
            while self._chunks:
                batch, self._chunks = list(self._chunks.values()), {}
                try:
                    await self._chunk_store.publish_chunks(batch)
                except Exception as exc:  # the result path must go on regardless
                    log.warning("dropped %d output chunks: %s", len(batch), exc)

    async def _failed(
        self, rid: str, attempt: int, exc: ServerError, *, tenant: str = "default"
    ) -> None:
        """Fail ``rid`` at once (a request error) or requeue it with a backoff, spending
        an attempt unless the model server's infrastructure failed
        (:mod:`inferq.workers.failures`); any retryable failure has the server probed.

        A refusal that completes a run of identical ones (:mod:`inferq.workers.rejections`),
        or comes while the server is held broken for them, is the server's fault: the
        worker turns ``unhealthy`` and the request goes back to its queue, no attempt
        spent, for a server that serves it."""
        self.failed += 1
        retry = failures.plan(exc, attempt)
        if not retry.retry:
            refusal = exc.rejection or str(exc)
            if not self.health.refusing:
                if not self._refusals.refused(
                    signature(exc.status, refusal), request_id=rid, tenant=tenant
                ):
                    self._queue(
                        Completion(
                            rid, attempt, "failed", error=str(exc), rejection=exc.rejection or ""
                        )
                    )
                    return
                run = self._refusals.run
                self._refusals.succeeded()  # the next run starts after the server is back
                self.health.broken(
                    exc,
                    f"model server refused {run} requests in a row from several tenants"
                    f" alike: {refusal}"[:500],
                )
            retry = failures.RetryPlan(
                FailureKind.INFRASTRUCTURE,
                retry=True,
                spend_attempt=False,
                delay_s=failures.backoff_s(attempt),
            )
        else:
            self.health.suspect(exc if exc.server_down else None)
        await self.health.judged()  # the worker unhealthy before its slot frees
        log.info(
            "request %s attempt %d: %s failure, retry in %.2f s%s: %s",
            rid,
            attempt,
            retry.kind,
            retry.delay_s,
            "" if retry.spend_attempt else " (no attempt spent)",
            exc,
        )
        try:
            await asyncio.to_thread(
                self.store.requeue,
                [(rid, attempt, self.config.worker_id, str(exc))],
                infra=retry.kind is FailureKind.INFRASTRUCTURE,
                delay_s=retry.delay_s,
                kind=retry.kind.value,
            )
        finally:  # requeue failed (Redis down): recover_orphans hands it back later
            self._unhold([(rid, attempt)])

    def _queue(self, outcome: Completion, task_type: str | None = None) -> None:
        self._pending.append((outcome, task_type))
        assert self._flush_wanted is not None
        self._flush_wanted.set()

    async def _flush_forever(self) -> None:
        assert self._flush_wanted is not None
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            await self._flush_all()

    async def _flush_all(self) -> None:
        """Write every pending result. Under a lock: :meth:`stop` must also wait for a
        write the flusher has in progress, or the worker would leave (handing those
        requests back) before their results are in."""
        assert self._write_lock is not None
        async with self._write_lock:
            await self._flush_pending()

    async def _flush_pending(self) -> None:
        # A result ends its request's stream (finalize appends ``end``): its chunks first.
        await self._publish_chunks()
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._write, batch)
            except CONNECTION_ERRORS as exc:
                log.warning("could not write %d results (%s); retrying", len(batch), exc)
                self._pending[:0] = batch
                await asyncio.sleep(0.5)
            except Exception:  # one unwritable result must not stop every later one
                log.exception("could not write %d results; writing them one by one", len(batch))
                self._pending[:0] = [(o, t) for o, t in batch if self._write_alone(o, t)]

    def _write_alone(self, outcome: Completion, task_type: str | None) -> bool:
        """Write one result; True to retry it (Redis unavailable), False when done or dropped."""
        try:
            self._write([(outcome, task_type)])
        except CONNECTION_ERRORS:
            return True
        except Exception:
            log.exception("dropped the result of %s", outcome.request_id)
            self._unhold([(outcome.request_id, outcome.attempt)])
        return False

    def _write(self, batch: list[tuple[Completion, str | None]]) -> None:
        verdicts = self.store.complete(
            self.config.worker_id, [o for o, _ in batch], self.config.spec.name
        )
        self._unhold((o.request_id, o.attempt) for o, _ in batch)
        observed = []
        for (outcome, task), verdict in zip(batch, verdicts, strict=True):
            if verdict == "ok" and outcome.status == "succeeded":
                self.finished += 1
                observed.append((self.config.spec.name, task, outcome.completion_tokens))
            elif verdict == "stale":
                log.info("result of %s (attempt %d) was stale", outcome.request_id, outcome.attempt)
        self.store.update_estimates(observed, defaults.OUTPUT_ESTIMATE_ALPHA)

    async def _cancel_all(self) -> list[tuple[str, int]]:
        held = list(self._running.items())
        for _, task in held:
            task.cancel()
        await asyncio.gather(*(task for _, task in held), return_exceptions=True)
        return [key for key, _ in held]

    async def _shutdown_loop(self) -> None:
        await self.health.close()
        await self.telemetry.close()
        for task in (self._flusher, self._publisher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._chunk_store is not None:
            await self._chunk_store.close()
        await self.server.close()

    def _load_until(self, stop: threading.Event | None) -> bool:
        """Load the model server; False (the load cancelled) when ``stop`` is set first.

        A model server that is not up yet is polled for up to its load timeout (600 s
        for ``openai``): a stop signal meanwhile must not wait that long.
        """
        future: Future[Any] = asyncio.run_coroutine_threadsafe(self.server.load(), self._loop)
        while not future.done():
            if stop is not None and stop.is_set():
                future.cancel()
                return False
            wait_futures([future], timeout=0.2)
        future.result()
        return True

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()


def _id_in_use(worker_id: str) -> ConfigError:
    """The error of a worker whose id another live process holds."""
    return ConfigError(
        f"worker id {worker_id!r} is in use: another live process beats under it; "
        "give each worker its own --id"
    )


def _vanished(row: Any) -> bool:
    """Whether an ``hmget`` row of :meth:`~inferq.store.Store.holdings` is of a record
    that does not exist (every field absent)."""
    return isinstance(row, list) and all(v is None for v in row)


def _orphan_attempt(row: Any, worker_id: str, oldest_ms: int) -> int | None:
    """The attempt to hand back when an ``hmget`` row (state, worker, attempts,
    dispatched_ms, started_ms) is this worker's and assigned/started before
    ``oldest_ms``; None otherwise (not ours, too recent, or unreadable)."""
    if isinstance(row, Exception):
        return None
    state, worker, attempts, dispatched, started = row
    if worker != worker_id or state not in ("assigned", "running"):
        return None
    try:
        since = max(int(dispatched or 0), int(started or 0))
        attempt = int(attempts)
    except (TypeError, ValueError):
        return None
    return attempt if since < oldest_ms else None
