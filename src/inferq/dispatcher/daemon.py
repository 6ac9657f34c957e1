"""The dispatcher daemon: snapshot -> policy decision -> atomic claims -> RQ batch jobs.

Stateless: every piece of state (queues, reservations, fairness credits and
counters) lives in Redis, so any number of replicas may run and any may be
restarted at any time. Each step:

1. expire due requests (the deadlines index; the waiting clients are told), move
   retries whose backoff has passed back to their queues (``promote.lua``) and
   delete dead-lettered ones past their retention (``dead_letter_ttl_s``);
2. recover: remove workers whose heartbeat lapsed (their requests go back to
   their queues, their RQ queue is emptied), requeue lapsed leases, and cancel the
   requests of gateways whose liveness lease lapsed (``reap_callers.lua``: the gateway
   died mid-answer, nobody reads them; a running one is aborted on its worker);
3. read a snapshot (at most five pipelined round trips; once a second also the
   models of a running scaler's pools, so a request only a pool serves waits for
   its cold start instead of being reported unschedulable), bring the prefix-cache
   index up to date from the prefix log (one XRANGE, :mod:`.prefix_cache`), call
   :func:`inferq.policy.dispatch.decide`, quarantine corrupt records, note on each
   unschedulable request why (an expiry then gives that reason);
4. per batch: one Lua call claims it (ZREM is the compare-and-set, so two
   dispatchers never assign the same request), one pipeline enqueues its RQ job;
5. preemption: when the decision left a reservation waiting (an overdue request
   that fits no worker), read what the reserved workers hold and abort the fewest
   lower-class requests that make room (:mod:`inferq.policy.preemption`,
   ``abort.lua``; the worker requeues them without spending an attempt);
6. write the fairness state forward (and fold idle tenants: ``fairness.lua``).

It wakes on a submission or a freed slot (BLPOP on the wake list) or every tick;
in a step the wake list started, 1 and 2 run last (see :meth:`Dispatcher.step`).
A step that fails on something other than a connection error (a key of the wrong
type planted where a request hash belongs, a malformed queue name) is logged, the
offending records are quarantined, and the loop goes on: the daemon never dies of
bad data.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from inferq import defaults
from inferq.config import Settings
from inferq.delivery import BatchSender
from inferq.dispatcher.prefix_cache import PrefixCache
from inferq.errors import InvalidRequest, RequestNotFound
from inferq.ids import new_id
from inferq.policy.dispatch import decide
from inferq.policy.preemption import choose_victims
from inferq.policy.routing import route_models
from inferq.policy.snapshot import Batch, Decision, DispatchPolicy
from inferq.store import CONNECTION_ERRORS, REDIS_ERRORS, Abort, DispatchView, Store

log = logging.getLogger(__name__)

#: RQ's own job timeout for a batch, seconds: a backstop far above any deadline;
#: inferq's per-request timeouts end requests long before.
BATCH_JOB_TIMEOUT_S = 3600
#: Seconds between two checks of the ``queues`` set for malformed names (one SMEMBERS):
#: the dispatcher skips them, but the scaler, metrics and the CLI read every name.
QUEUE_NAMES_CHECK_S = 1.0
#: How often the scaler's pools are read, seconds: they change only when a scaler
#: starts or stops, and a request they serve is told apart only in its reason.
SCALER_POOLS_CHECK_S = 1.0
#: Shortest wait after a Redis outage before reaping, seconds: workers reconnect
#: through the client's retry backoff (50 ms doubling to 1.6 s between attempts, see
#: ``inferq.store.connection.connection_kwargs``), so a live one may need ~2 s and a
#: beat to show up.
OUTAGE_GRACE_MIN_S = 3.0


@dataclass
class StepReport:
    """What one dispatcher step did (counts), and how long its decision took (seconds)."""

    expired: int = 0
    promoted: int = 0
    requeued: int = 0
    workers_lost: int = 0
    batches: int = 0
    dispatched: int = 0
    unschedulable: int = 0
    quarantined: int = 0
    preempted: int = 0
    orphans_cancelled: int = 0
    decide_s: float = 0.0
    step_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


class Dispatcher:
    """One dispatcher replica.

    Args:
        store: the deployment's store.
        policy: the dispatch policy (default: from the store's settings).
        tick_s: longest sleep between steps when nothing wakes it, seconds.
        queue_head: requests read from the head of each queue per step.
    """

    def __init__(
        self,
        store: Store,
        *,
        policy: DispatchPolicy | None = None,
        tick_s: float = defaults.DISPATCH_TICK_S,
        queue_head: int = defaults.QUEUE_HEAD,
    ) -> None:
        self.store = store
        self.settings: Settings = store.settings
        self.policy = policy or DispatchPolicy.from_settings(store.settings)
        self.tick_s = tick_s
        self.queue_head = queue_head
        self.sender = BatchSender(self.settings.redis_url, store.keys)
        self.classes = [c.name for c in self.policy.classes]
        self.models = [m.name for m in self.policy.models]
        self.heartbeat_ttl_s = self.settings.heartbeat_interval_s * defaults.HEARTBEAT_TTL_INTERVALS
        self._stop = threading.Event()
        self._names_checked_at = 0.0
        self._pools: frozenset[str] = frozenset()
        self._pools_checked_at = -1e9
        self._housekept_at = -1e9
        #: since the last step that could reap: how long the loop stalled, seconds (0.0
        #: for a connection error); None while Redis answered in time
        self._outage: float | None = None
        self._reap_from = 0.0  # monotonic: no reaping before (grace after an outage)
        self._next_due: float | None = None  # monotonic: the next delayed retry is due
        #: the prefix-cache index (None: affinity off), kept in step with the prefix log
        self.prefix = PrefixCache(store, self.policy) if self.policy.affinity.enabled else None

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step."""
        self._stop.set()

    def run(self) -> None:
        """Step until :meth:`stop`; survive Redis outages with backoff."""
        backoff = 0.1
        log.info("dispatcher started (namespace %s)", self.settings.namespace)
        try:
            self.store.set_usage_retention()
        except REDIS_ERRORS as exc:  # the metering keeps its default retention meanwhile
            log.warning("usage retention not written: %s", exc)
        self._warn_if_evicting()
        previous: float | None = None
        woken = False
        while not self._stop.is_set():
            now = time.monotonic()
            if previous is not None and now - previous > self.heartbeat_ttl_s + self.tick_s:
                self._outage = max(self._outage or 0.0, now - previous)  # it stalled
            previous = now
            try:
                report = self.step(woken=woken)
                backoff = 0.1
                woken = False
                if report.dispatched == 0:
                    woken = self._wait()
            except CONNECTION_ERRORS as exc:
                log.warning("redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self._outage = self._outage or 0.0
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # bad data must not kill the daemon: repair, back off, go on
                log.exception("dispatcher step failed; looking for corrupt records")
                self._repair()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        log.info("dispatcher stopped")

    @property
    def recovery_every_s(self) -> float:
        """Seconds between expiry-and-recovery passes: the tick, at most
        ``RECOVERY_EVERY_MAX_S``."""
        return min(self.tick_s, defaults.RECOVERY_EVERY_MAX_S)

    def _wait(self) -> bool:
        """Sleep until woken, the tick, the next recovery pass, or a retry whose backoff
        ends first. Returns True when a submission, requeue or freed slot woke it."""
        timeout = min(self.tick_s, self._housekept_at + self.recovery_every_s - time.monotonic())
        if self._next_due is not None:  # wake for a retry whose backoff ends before the tick
            timeout = min(timeout, max(0.01, self._next_due - time.monotonic()))
        return self.store.wait_for_work(max(0.0, timeout))

    def step(self, *, woken: bool = False) -> StepReport:
        """One expire / recover / decide / claim round. Returns what it did.

        Expiry and recovery (housekeeping) run once per ``recovery_every_s``, before the
        decision; in a step ``woken`` by a submission they run after it instead, so the
        request that woke the dispatcher does not wait for them (issue 17: ~0.5 ms, six
        round trips). Nothing is lost meanwhile: the decision expires overdue requests
        itself, a lapsed worker's heartbeat hash is gone (it gets nothing), and what the
        housekeeping requeues pushes the wake token for the next step.
        """
        t0 = time.perf_counter()
        started = time.monotonic()
        report = StepReport()
        if time.monotonic() - self._names_checked_at >= QUEUE_NAMES_CHECK_S:
            report.quarantined += self.store.quarantine_bad_queue_names()
            self._names_checked_at = time.monotonic()
        housekeeping = started - self._housekept_at >= self.recovery_every_s
        if housekeeping and not woken:
            # Expiry and recovery once per tick, not on every wake-up: a burst of
            # submissions then costs one snapshot and one claim per step.
            self._housekeep(report, started)
        elif self._next_due is not None and started >= self._next_due:
            report.promoted = self._promote()  # a backoff ended between two ticks
        if started - self._pools_checked_at >= SCALER_POOLS_CHECK_S:
            self._pools = self.store.scaler_pools()
            self._pools_checked_at = started
        view = self.store.dispatch_view(
            self.classes,
            self.queue_head,
            self.heartbeat_ttl_s,
            tenant_weight=self.policy.tenant_weight,
            models=self.models,
            route_models=self._route_models,
            policy=self.policy,
        )
        self._quarantine(view, report)
        index = None if self.prefix is None else self.prefix.refresh(view.snapshot.workers)
        snapshot = replace(view.snapshot, scaler_pools=self._pools, prefix_index=index)
        t1 = time.perf_counter()
        decision = decide(snapshot, self.policy, view.fleet)
        report.decide_s = time.perf_counter() - t1
        if decision.expired:
            report.expired += len(self.store.expire_ids(decision.expired))
        report.unschedulable = len(self.store.mark_unschedulable(decision.unschedulable))
        for batch in decision.batches:
            self._dispatch(batch, view, report)
        if decision.reservations:
            self._preempt(view, decision, report)
        self.store.write_fairness(decision, self.classes, self.policy.tenant_weight)
        if housekeeping and woken:
            self._housekeep(report, started)
        report.step_s = time.perf_counter() - t0
        if report.dispatched or report.expired or report.requeued:
            log.debug(
                "step: dispatched %d in %d batches, expired %d, requeued %d (%.1f ms)",
                report.dispatched,
                report.batches,
                report.expired,
                report.requeued,
                report.step_s * 1000,
            )
        return report

    def _housekeep(self, report: StepReport, started: float) -> None:
        """Expire due requests, promote due retries, delete old dead letters, reap lost
        workers and lapsed leases (``started``: the step's monotonic start)."""
        self.store.beat_dispatcher(self.heartbeat_ttl_s)  # a waiting client reads it
        report.expired += len(self.store.expire_due())
        report.promoted += self._promote()
        self.store.delete_dead()  # past dead_letter_ttl_s
        if self._may_reap(stalled_s=time.monotonic() - started):
            self._recover(report)
        self._housekept_at = started

    def _route_models(self, route: str) -> tuple[str, ...]:
        """Models that may serve ``route``, fallbacks included (sizes a queue's read);
        a route that does not parse is served by none (the policy reports it)."""
        try:
            return route_models(self.policy, route, degrade=True)
        except InvalidRequest:
            return ()

    def _promote(self) -> int:
        """Retries whose backoff has passed back to their queues; remembers the next due."""
        promoted, wait_s = self.store.promote_due()
        self._next_due = None if wait_s is None else time.monotonic() + wait_s
        return promoted

    def _dispatch(self, batch: Batch, view: DispatchView, report: StepReport) -> None:
        batch_id = new_id()
        items = [
            (a.request_id, view.queue_of[a.request_id], a.need_mib, a.cached_tokens)
            for a in batch.items
        ]
        claimed = self.store.assign(batch.worker_id, batch_id, items)
        if not claimed:
            return
        self.sender.send(batch.worker_id, batch_id, claimed, timeout_s=BATCH_JOB_TIMEOUT_S)
        report.batches += 1
        report.dispatched += len(claimed)
        report.batch_sizes.append(len(claimed))

    def _preempt(self, view: DispatchView, decision: Decision, report: StepReport) -> None:
        """Abort the fewest lower-class requests that make room for waiting reservations."""
        running = self.store.running_on(sorted({r.worker_id for r in decision.reservations}))
        victims = choose_victims(
            decision.reservations, running, view.snapshot, self.policy, decision.batches, view.fleet
        )
        if not victims:
            return
        aborts = [
            Abort(
                v.request_id,
                v.attempt,
                v.worker_id,
                "requeue",
                v.reason,
                v.charged,
                tenant_weight=self.policy.tenant_weight(v.tenant),
            )
            for v in victims
        ]
        verdicts = self.store.abort(aborts, output_weight=self.policy.vtc_output_weight)
        report.preempted += sum(1 for v in verdicts if v in ("done", "sent"))
        for victim, verdict in zip(victims, verdicts, strict=True):
            if verdict in ("done", "sent"):
                log.info(
                    "preempting %s on %s: %s", victim.request_id, victim.worker_id, victim.reason
                )

    def _may_reap(self, stalled_s: float) -> bool:
        """False for one heartbeat TTL (at least ``OUTAGE_GRACE_MIN_S``) after Redis was
        unavailable.

        Unavailable = a connection error reached :meth:`run`, or a step or wait of
        :meth:`run` stalled longer than a TTL (the client's retries absorbing an
        outage), or this step's first call did.
        Workers could not beat meanwhile either: reaping them, and lapsed leases, at
        once would requeue live work. The grace lets live workers beat again first; a
        dead one is reaped that much later; the pause goes on the events stream
        (``reap_paused``), so an operator, and the kill tests, can tell it from a slow
        reaper.
        """
        now = time.monotonic()
        if stalled_s > self.heartbeat_ttl_s:
            self._outage = max(self._outage or 0.0, stalled_s)
        if self._outage is None:
            return now >= self._reap_from
        stalled, self._outage = self._outage, None
        grace = max(self.heartbeat_ttl_s, OUTAGE_GRACE_MIN_S)
        self._reap_from = now + grace
        log.warning(
            "redis was unavailable; reaping resumes in %.1f s, once live workers have beaten again",
            grace,
        )
        try:
            self.store.reap_paused(grace, stalled)
        except REDIS_ERRORS as exc:  # the pause holds whether or not it is recorded
            log.warning("reap pause not recorded: %s", exc)
        return False

    def _warn_if_evicting(self) -> None:
        """Log once, at start, when the Redis server may evict inferq's keys
        (:attr:`~inferq.store.glance.RedisMemory.eviction_warning`)."""
        try:
            warning = self.store.memory().eviction_warning
        except REDIS_ERRORS as exc:
            log.warning("redis memory policy not read: %s", exc)
            return
        if warning:
            log.warning("%s", warning)

    def _recover(self, report: StepReport) -> None:
        now = self.store.now()
        stale_before = now - self.heartbeat_ttl_s
        for wid in self.store.silent_workers(stale_before):
            silent = now - stale_before
            requeued = self.store.remove_worker(
                wid,
                reason=f"no heartbeat for more than {silent:.1f} s",
                dead=True,
                stale_before=stale_before,
            )
            if requeued is None:
                continue
            report.workers_lost += 1
            report.requeued += len(requeued)
            try:
                self.sender.purge(wid)
            except REDIS_ERRORS as exc:  # best effort: its jobs are fenced anyway
                log.warning("could not empty RQ queue of lost worker %s: %s", wid, exc)
            log.warning("worker %s lost; requeued %d requests", wid, len(requeued))
        report.requeued += sum(
            1 for _, v in self.store.reap_leases() if v in ("queued", "preempted")
        )
        report.orphans_cancelled += self._cancel_orphans()

    def _cancel_orphans(self) -> int:
        """Cancel the requests of gateways whose liveness lease lapsed (their caller died:
        SIGKILL, OOM, a lost host), a running one on its worker; returns how many were
        cancelled or aborted. A request whose abort is pending is listed again until its
        worker has ended it (the abort is idempotent: ``pending``). Each cancel is
        guarded by the gateway (``orphan_of``): a same-key retry that took a request over
        after the listing, or a stalled gateway that renewed its lease, keeps it
        (``kept``, includes/orphan.lua)."""
        total = 0
        for caller, ids in self.store.lapsed_callers():
            reason = f"its gateway {caller} is gone ({defaults.CALLER_LAPSED})"
            cancelled = 0
            for rid in ids:
                try:
                    state = self.store.cancel(rid, reason, orphan_of=caller)
                    if state == "running":
                        state = self.store.cancel_running(rid, reason, orphan_of=caller)
                except RequestNotFound:  # its record went meanwhile
                    continue
                cancelled += state in ("cancelled", "sent", "done")
            if cancelled:
                log.warning("gateway %s lost; cancelled %d of its requests", caller, cancelled)
            total += cancelled
        return total

    def _quarantine(self, view: DispatchView, report: StepReport) -> None:
        for key, reason, members in view.corrupt:
            self.store.quarantine(key, reason, members)
            report.quarantined += 1

    def _repair(self) -> int:
        """After a failed step: quarantine what breaks the scripts and reads; returns how many."""
        try:
            return (
                self.store.quarantine_bad_queue_names()
                + self.store.quarantine_mistyped_queues(self.classes)
                + self.store.quarantine_mistyped_workers()
                + self.store.quarantine_non_hash_requests(self.classes, self.queue_head)
                + self.store.quarantine_mistyped_prefix_log()
            )
        except Exception:  # the repair itself must not kill the loop either
            log.exception("could not look for corrupt records")
            return 0
