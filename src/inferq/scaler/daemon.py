"""The scaler daemon: Redis facts -> :func:`~inferq.policy.scaling.decide_scale` -> a platform.

Each decision (every ``interval_s``, default 5 s):

1. take or renew the lease (``P scaler:lease``, a compare-and-set in
   ``lua/lease.lua``): any number of replicas may run, one acts, the
   others stand by and take over within the lease time when it stops;
2. read queues, heartbeats, reservations, the events stream of the last
   ``rate_window_s`` and the scaler's own state (``P scaler:state``: trend and
   cooldowns; ``P scaler:workers``: per-worker idle and drain tracking), and the
   platform's listing; merge them (:func:`~inferq.policy.scaling_inputs.reconcile`);
3. stop the workers that drained and deregistered (or left, or never started):
   ``platform.prepare_scale_down`` then ``platform.stop``;
4. build one :class:`~inferq.policy.scaling.ModelLoad` per managed model, decide.
   Every live worker of the model counts as capacity, but only the workers the
   platform lists (the ones this deployment's scaler launched: its own processes,
   containers and pods labelled ``inferq.managed-by=scaler``) may be chosen to
   drain; a worker started by hand or by compose is named once at INFO and never
   drained or stopped;
5. carry the decisions out: launch workers; for a scale-down, ask the chosen
   idle workers to drain through Redis (``Store.request_drain``) and remember
   it, never waiting: a later decision stops them once their heartbeat is gone.
   No in-flight request is ever killed by the scaler.
6. write the state, the tracking and the desired counts (``P scaler:desired``),
   scale events (``scale_up``/``scale_down``) to the events stream, and log each
   action with its reasons at INFO (holds at DEBUG).

Modes: ``act`` (the above), ``dry-run`` (no lease, nothing written, nothing
started or drained: decisions go to ``on_decision``; state stays in memory) and
``metrics`` (no platform: only the desired counts are written, for KEDA or an
HPA; a hold keeps the last published count so the external scaler sees a
steady target, not one that flips back while it acts).

Redis outages are retried with backoff; a corrupt record is quarantined and the
decision goes on without it; a decision that fails on malformed data anyway is
logged and skipped (malformed queue names are quarantined), never fatal.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

from inferq import defaults
from inferq.config import Settings
from inferq.errors import ConfigError, CorruptRecord
from inferq.models import Event, WorkerState
from inferq.policy.capacity import strictest_tpot
from inferq.policy.scaling import (
    ModelLoad,
    ScaleDecision,
    ScalerState,
    ScalingConfig,
    decide_scale,
)
from inferq.policy.scaling_inputs import (
    LiveWorker,
    LoadInputs,
    ReconciledFleet,
    Tracked,
    arrival_rates,
    build_loads,
    estimated_service_s,
    reconcile,
    service_logs,
    service_times,
    worker_activity,
)
from inferq.scaler.platforms.base import Platform, PlatformError, WorkerHandle
from inferq.store import CONNECTION_ERRORS, REPLY_ERRORS, Store

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A decision that failed on these is logged and skipped (a platform error, or Redis
#: refusing a command); anything else is malformed data, repaired after logging.
_STEP_ERRORS: tuple[type[BaseException], ...] = (PlatformError, *REPLY_ERRORS)


class Mode(StrEnum):
    """What the daemon does with its decisions (see the module docstring)."""

    ACT = "act"
    DRY_RUN = "dry-run"
    METRICS = "metrics"


@dataclass
class ScalerReport:
    """What one decision did.

    Attributes:
        acting: false when another replica holds the lease (nothing else was done).
        now: the decision's time, epoch s (Redis clock).
        decisions: one per managed model.
        launched / drained / stopped: worker ids launched, asked to drain, stopped.
        replaced: unhealthy workers asked to drain (unhealthy past ``unhealthy_replace_s``).
        quarantined: corrupt records moved aside.
    """

    acting: bool
    now: float = 0.0
    decisions: list[ScaleDecision] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    quarantined: int = 0


def new_worker_id(model: str) -> str:
    """A fresh worker id for ``model``: ``llama-3-1-8b-3f9a0c1e`` (fits ``[A-Za-z0-9_-]{1,64}``)."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", model).strip("-")[:50] or "worker"
    return f"{slug}-{secrets.token_hex(4)}"


def describe(decision: ScaleDecision) -> str:
    """One line: ``model: up 1 -> 3: reason; reason``."""
    reasons = "; ".join(decision.reasons) or "no change needed"
    return (
        f"{decision.model}: {decision.action} {decision.current} -> {decision.desired}: {reasons}"
    )


class Scaler:
    """One scaler replica.

    Args:
        store: the deployment's store.
        config: the policy's knobs (:meth:`ScalingConfig.from_settings`); ``config.interval_s``
            is the loop period.
        platform: where workers run; required in ``act`` mode, optional in ``dry-run``
            (its listing counts starting workers), unused in ``metrics`` mode.
        mode: ``act``, ``dry-run`` or ``metrics``.
        models: the managed models, in priority order (default: the models of
            ``config.limits``, else every registry model).
        replica_id: this replica's lease id (default ``<host>-<pid>-<random>``).
        lease_s: lease time, s (default: ``SCALER_LEASE_S`` or 3 intervals if longer).
        rate_window_s: seconds of events measured for arrival and service rates.
        start_timeout_s: a launched worker not registered after this long is stopped.
        default_slots: slots per worker assumed before any worker of a model is live.
        on_decision: called with every decision (the CLI prints them in dry-run).

    Raises:
        ConfigError: ``act`` mode without a platform, or an unknown managed model.
    """

    def __init__(
        self,
        store: Store,
        *,
        config: ScalingConfig,
        platform: Platform | None = None,
        mode: Mode = Mode.ACT,
        models: Sequence[str] | None = None,
        replica_id: str | None = None,
        lease_s: float | None = None,
        rate_window_s: float = defaults.SCALER_RATE_WINDOW_S,
        start_timeout_s: float = defaults.SCALER_START_TIMEOUT_S,
        default_slots: int = defaults.SIM_WORKER_SLOTS,
        on_decision: Callable[[ScaleDecision], None] | None = None,
        unhealthy_replace_s: float = defaults.UNHEALTHY_REPLACE_S,
    ) -> None:
        if mode is Mode.ACT and platform is None:
            raise ConfigError("backend: the scaler needs a backend unless --dry-run/--metrics-only")
        self.store = store
        self.settings: Settings = store.settings
        self.config = config
        self.platform = platform if mode is not Mode.METRICS else None
        self.mode = mode
        registry = [m.name for m in self.settings.models]
        self.models = tuple(models or config.limits or registry)
        unknown = [m for m in self.models if m not in registry]
        if unknown:
            raise ConfigError(f"pool: model {unknown[0]!r} is not in the registry ({registry})")
        self.replica_id = (
            replica_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        )
        self.interval_s = config.interval_s
        self.lease_s = lease_s or max(defaults.SCALER_LEASE_S, 3 * self.interval_s)
        self.rate_window_s = rate_window_s
        self.start_timeout_s = start_timeout_s
        self.default_slots = default_slots
        self.on_decision = on_decision
        hb_ttl = self.settings.heartbeat_interval_s * defaults.HEARTBEAT_TTL_INTERVALS
        self.lost_grace_s = self.settings.lease_s + hb_ttl
        self._holding: bool | None = None  # unknown until the first decision
        self._memory: tuple[ScalerState, dict[str, Tracked]] | None = None
        self._measured: dict[str, float] = {}
        self._ignored: set[str] = set()  # live workers not launched by this scaler, logged
        self._stop = threading.Event()
        self.unhealthy_replace_s = unhealthy_replace_s
        self._unhealthy_since: dict[str, float] = {}  # worker id -> first seen unhealthy
        self._replacing: set[str] = set()  # unhealthy workers already asked to drain

    # --- loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Decide every ``interval_s`` until :meth:`stop`; survive Redis outages with backoff.

        Releases the lease on the way out.
        """
        log.info(
            "scaler %s started: %s mode, every %.1f s, models %s",
            self.replica_id,
            self.mode.value,
            self.interval_s,
            ", ".join(self.models),
        )
        backoff = 0.1
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    self.step()
                    backoff = 0.1
                except CONNECTION_ERRORS as exc:
                    log.warning("redis unavailable (%s); retrying in %.1f s", exc, backoff)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                except _STEP_ERRORS as exc:
                    log.warning("scaler step failed: %s", exc)
                except Exception:  # malformed data the store let through: skip this decision
                    log.exception("scaler step failed on malformed data")
                    self._repair()
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            self.close()
        log.info("scaler %s stopped", self.replica_id)

    def _repair(self) -> None:
        """After a failed decision: quarantine malformed queue names (``queue_depths`` needs
        ``<class>|<route>``), unless in dry-run mode, which writes nothing."""
        if self.mode is Mode.DRY_RUN:
            return
        try:
            self.store.quarantine_bad_queue_names()
        except Exception:  # the repair must not end the loop either
            log.exception("could not look for malformed queue names")

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current decision."""
        self._stop.set()

    def close(self) -> None:
        """Give the lease up (another replica takes over at its next decision)."""
        if not self._holding:
            return
        self._holding = False
        try:
            self.store.release_scaler_lease(self.replica_id)
        except CONNECTION_ERRORS as exc:
            log.warning("could not release the scaler lease (%s); it lapses on its own", exc)

    # --- one decision ---------------------------------------------------------------

    def step(self) -> ScalerReport:
        """One decision: read, reconcile, decide, act, write. Returns what it did."""
        now = self.store.now()
        report = ScalerReport(acting=True, now=now)
        if self.mode is not Mode.DRY_RUN and not self._lease():
            report.acting = False
            return report
        state, tracked = self._records(report)
        live = self._live(report)
        handles = self._listed()
        events, start, span = self._events(now)
        fleet = reconcile(
            tracked,
            live,
            {wid: h.model for wid, h in handles.items()},
            now,
            activity=worker_activity(events),
            start_timeout_s=self.start_timeout_s,
            lost_grace_s=self.lost_grace_s,
        )
        tracked = dict(fleet.tracked)
        if self.mode is Mode.ACT:
            self._stop_workers(fleet.to_stop, handles, tracked, report)
            self._replace_unhealthy(live, handles, now, report)
        inputs = self._inputs(live, replace(fleet, tracked=tracked), events, start, span)
        loads = build_loads(self.models, self.settings.models, inputs, now)
        loads = self._drainable(loads, live, handles)
        decisions, state = decide_scale(loads, state, self.config, self.settings.classes, now)
        report.decisions = decisions
        desired = self._carry_out(decisions, tracked, now, report)
        self._save(state, tracked, desired)
        return report

    # --- reading --------------------------------------------------------------------

    def _lease(self) -> bool:
        held = self.store.hold_scaler_lease(self.replica_id, self.lease_s)
        if held != self._holding:
            if held:
                log.info("scaler %s holds the lease: acting", self.replica_id)
            else:
                log.info("scaler %s standing by: another replica holds the lease", self.replica_id)
        self._holding = held
        return held

    def _records(self, report: ScalerReport) -> tuple[ScalerState, dict[str, Tracked]]:
        if self.mode is Mode.DRY_RUN and self._memory is not None:
            return self._memory[0], dict(self._memory[1])
        k = self.store.keys
        state = self._parsed(
            k.scaler_state, lambda f: ScalerState.from_fields(f, k.scaler_state), report
        )
        tracked = self._parsed(
            k.scaler_workers,
            lambda f: {w: Tracked.from_json(w, raw, k.scaler_workers) for w, raw in f.items()},
            report,
        )
        return state or ScalerState(), tracked or {}

    def _parsed(
        self, key: str, parse: Callable[[dict[str, str]], T], report: ScalerReport
    ) -> T | None:
        """Read and parse one of the scaler's hashes; quarantine it (None) when corrupt."""
        try:
            return parse(self.store.scaler_hash(key))
        except CorruptRecord as exc:
            if self.mode is not Mode.DRY_RUN:
                self.store.quarantine(key, exc.reason)
                report.quarantined += 1
            else:
                log.warning("dry run: %s is corrupt (%s); ignoring it", key, exc.reason)
            return None

    def _live(self, report: ScalerReport) -> list[LiveWorker]:
        k = self.store.keys
        infos, bad = self.store.workers()
        for key, reason in bad:
            if self.mode is not Mode.DRY_RUN:
                wid = key.removeprefix(k.worker(""))
                self.store.quarantine(key, f"heartbeat: {reason}", [(k.workers, wid)])
                report.quarantined += 1
        mine = [w for w in infos if w.model in self.models]
        reserved = self.store.worker_reservations([w.id for w in mine])
        return [
            LiveWorker(
                w.id,
                w.model,
                w.state,
                w.slots,
                w.in_flight,
                reserved.get(w.id, 0),
                kv_cache_mib=w.kv_cache_mib,
            )
            for w in mine
        ]

    def _listed(self) -> dict[str, WorkerHandle]:
        if self.platform is None:
            return {}
        return {h.worker_id: h for h in self.platform.list() if h.model in self.models}

    def _drainable(
        self,
        loads: Sequence[ModelLoad],
        live: Sequence[LiveWorker],
        handles: dict[str, WorkerHandle],
    ) -> list[ModelLoad]:
        """``loads`` with drain candidates limited to the workers the platform lists.

        A live worker the platform does not list was not launched by this scaler
        (started by hand, by compose, by another Deployment): it still counts as
        capacity, but it is never drained, so it is never stopped either. Each one
        is named once at INFO. Without a platform (metrics mode, a dry run without
        one) every worker is a candidate: the external autoscaler owns them all.
        """
        if self.platform is None:
            return list(loads)
        ignored = {w.id: w.model for w in live if w.id not in handles}
        for wid in sorted(ignored.keys() - self._ignored):
            log.info(
                "ignoring worker %s (%s): not launched by this scaler (the %s platform does "
                "not list it); it counts as capacity and is never drained",
                wid,
                ignored[wid],
                self.platform.name,
            )
        self._ignored = set(ignored)
        if not ignored:
            return list(loads)
        return [
            replace(
                load,
                idle_workers={w: s for w, s in load.idle_workers.items() if w not in ignored},
                busy={w: n for w, n in load.busy.items() if w not in ignored},
            )
            for load in loads
        ]

    def _events(self, now: float) -> tuple[list[Event], float, float]:
        """Events of the last ``rate_window_s``, when they start (epoch s) and the seconds
        they span (short of ``now`` where the read was capped)."""
        start = now - self.rate_window_s
        cap = defaults.SCALER_EVENTS_CAP
        events = self.store.events(count=cap, after=f"{round(start * 1000)}-0")
        if len(events) >= cap:
            return events, start, max(events[-1].at - start, 1e-3)
        return events, start, self.rate_window_s

    def _inputs(
        self,
        live: Sequence[LiveWorker],
        fleet: ReconciledFleet,
        events: Sequence[Event],
        start: float,
        span: float,
    ) -> LoadInputs:
        """What :func:`build_loads` combines; ``events`` cover ``span`` seconds from
        ``start`` (epoch s; short of now where the read was capped)."""
        owner = {wid: t.model for wid, t in fleet.tracked.items()} | {w.id: w.model for w in live}
        measured = service_times(events, owner)
        self._measured.update({m: s.service_s for m, s in measured.items()})
        return LoadInputs(
            depths=self.store.queue_depths(),
            live=live,
            fleet=fleet,
            arrivals=arrival_rates(events, span, self.settings.models, self.models),
            service=measured,
            fallback_service_s=self._fallback_service(),
            default_slots=self.default_slots,
            tpot_s=strictest_tpot(self.settings.classes),
            rate_window_s=span,
            service_logs=service_logs(events, owner, start, start + span),
        )

    def _fallback_service(self) -> dict[str, float]:
        """Per model: the last measured service time, else the latency model's estimate."""
        estimates = self.store.output_estimates()
        out: dict[str, float] = {}
        for model in self.models:
            if model in self._measured:
                out[model] = self._measured[model]
                continue
            spec = self.settings.model_by_name[model]
            out[model] = estimated_service_s(spec, estimates, self.settings.default_max_tokens)
        return out

    # --- acting ---------------------------------------------------------------------

    def _stop_workers(
        self,
        to_stop: dict[str, str],
        handles: dict[str, WorkerHandle],
        tracked: dict[str, Tracked],
        report: ScalerReport,
    ) -> None:
        assert self.platform is not None
        for wid, why in to_stop.items():
            handle = handles[wid]
            try:
                self.platform.prepare_scale_down(handle)
                self.platform.stop(handle)
            except PlatformError as exc:
                log.warning("could not stop worker %s (%s): %s; retrying", wid, why, exc)
                continue
            tracked.pop(wid, None)
            report.stopped.append(wid)
            log.info("stopped worker %s (%s): %s", wid, handle.model, why)

    def _carry_out(
        self,
        decisions: Sequence[ScaleDecision],
        tracked: dict[str, Tracked],
        now: float,
        report: ScalerReport,
    ) -> dict[str, int] | None:
        """Act on (or only publish) the decisions; returns the desired counts to write."""
        for d in decisions:
            if self.on_decision is not None:
                self.on_decision(d)
        if self.mode is Mode.DRY_RUN:
            for d in decisions:
                log.log(
                    logging.DEBUG if d.action == "hold" else logging.INFO,
                    "dry run: %s",
                    describe(d),
                )
            return None
        if self.mode is Mode.METRICS:
            return self._published(decisions)
        for d in decisions:
            if d.action == "up":
                self._launch(d, report)
            elif d.action == "down":
                self._drain(d, tracked, now, report)
            else:
                log.debug("%s", describe(d))
        return {d.model: d.desired for d in decisions}

    def _replace_unhealthy(
        self,
        live: Sequence[LiveWorker],
        handles: dict[str, WorkerHandle],
        now: float,
        report: ScalerReport,
    ) -> None:
        """Drain each worker this scaler launched that has been ``unhealthy`` for
        ``unhealthy_replace_s`` (by this replica's observation, on Redis time). An
        unhealthy worker already counts as no capacity, so the pool's minimum and the
        backlog launch its replacement; the drain removes the broken one."""
        unhealthy = {w.id for w in live if w.state is WorkerState.UNHEALTHY}
        self._unhealthy_since = {w: self._unhealthy_since.get(w, now) for w in unhealthy}
        self._replacing &= unhealthy
        for wid, since in sorted(self._unhealthy_since.items()):
            if wid not in handles or wid in self._replacing:
                continue
            if now - since < self.unhealthy_replace_s:
                continue
            self._replacing.add(wid)
            if self.store.request_drain(wid):
                report.replaced.append(wid)
                log.warning(
                    "worker %s unhealthy for %.0f s: draining it for a replacement",
                    wid,
                    now - since,
                )

    def _launch(self, d: ScaleDecision, report: ScalerReport) -> None:
        assert self.platform is not None
        launched = []
        for _ in range(d.launch):
            wid = new_worker_id(d.model)
            try:
                self.platform.launch(d.model, wid)
            except PlatformError as exc:
                log.warning("could not launch a %s worker: %s", d.model, exc)
                break
            launched.append(wid)
        report.launched += launched
        log.info("%s (launched %s)", describe(d), ", ".join(launched) or "none")
        if launched:
            after = d.current + len(launched)
            self.store.scale_event("scale_up", d.model, d.current, after, d.reasons, launched)

    def _drain(
        self, d: ScaleDecision, tracked: dict[str, Tracked], now: float, report: ScalerReport
    ) -> None:
        drained = []
        for wid in d.drain:
            if not self.store.request_drain(wid):
                continue  # gone meanwhile
            t = tracked.get(wid) or Tracked(model=d.model, last_busy_at=now)
            tracked[wid] = replace(t, draining_since=now)
            drained.append(wid)
        report.drained += drained
        log.info("%s (draining %s)", describe(d), ", ".join(drained) or "none")
        if drained:
            after = d.current - len(drained)
            self.store.scale_event("scale_down", d.model, d.current, after, d.reasons, drained)

    def _published(self, decisions: Sequence[ScaleDecision]) -> dict[str, int]:
        """Metrics mode: the decision's count, except that a hold keeps the last one published."""
        try:
            previous = self.store.desired_workers()
        except ValueError as exc:
            self.store.quarantine(self.store.keys.scaler_desired, f"desired count: {exc}")
            previous = {}
        out: dict[str, int] = {}
        for d in decisions:
            limits = self.config.limits_for(d.model)
            if d.action == "hold" and d.model in previous:
                out[d.model] = min(max(previous[d.model], limits.min_workers), limits.max_workers)
            else:
                out[d.model] = d.desired
            if d.action != "hold" or out[d.model] != previous.get(d.model):
                log.info("metrics: desired %s = %d: %s", d.model, out[d.model], describe(d))
        return out

    def _save(
        self, state: ScalerState, tracked: dict[str, Tracked], desired: dict[str, int] | None
    ) -> None:
        if self.mode is Mode.DRY_RUN:
            self._memory = (state, dict(tracked))
            return
        self.store.save_scaler(
            state.to_fields(), {w: t.to_json() for w, t in tracked.items()}, desired
        )
