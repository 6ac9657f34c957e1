"""The discrete-event loop: requests, a fleet and a policy in virtual time.

:func:`simulate` replays a list of :class:`~inferq.sim.workload.SimRequest`
through one :class:`~inferq.sim.policies.SimPolicy` and returns a
:class:`SimResult`: every request's outcome, the ordered assignment log, scale
events, periodic samples and the workers' accounting.

What happens at one instant ``t`` (all events due at ``t`` are taken together):

1. arrivals join their ``(class, route)`` queue with ``deadline = t + class.timeout_s``;
   completions free their slot and KV-cache MiB, fold the generated tokens into
   the ``(model, task_type)`` output estimate (``update_moving_mean``, as the
   worker does) and stop a draining worker that became idle; a starting worker
   whose cold start has passed becomes ready;
2. queued requests whose deadline has come expire (the dispatcher's
   ``expire_due``); the outcome's end time is the deadline itself;
3. if anything changed and some ready worker has a free slot and KV-cache room for
   the smallest queued request (or a queued request is past its class's
   ``may_preempt_after_s``: a wake-up is due then), one dispatch decision: a
   :class:`~inferq.policy.snapshot.Snapshot` is built (per
   ``(class, route)`` queue the ``queue_head`` oldest requests and the heads of its
   tenants' sub-queues, as
   ``Store.dispatch_view`` reads them, less those waiting for room and the parked
   ones, below; every live worker with its reservations;
   the fairness state; the backlogged tenants; the output estimates) and
   handed to the policy (``decide`` or FIFO). The decision is applied as the
   dispatcher and ``Store.write_fairness`` apply it: batches start at once,
   expiries and unschedulable reports are recorded (an unschedulable request is
   parked: out of the snapshots until a worker is launched), class credits and
   active sets replaced, tenant floors set, then tenant charges added. When the decision
   leaves reservations waiting (:mod:`inferq.policy.preemption`: an overdue request
   that fits nowhere), what the reserved workers hold goes to ``choose_victims``
   exactly as the dispatcher's preemption step does; each victim is aborted
   ``abort_delay_s`` later (``requeue_preempted.lua``'s rule): its room is freed, it
   goes back to its queue at its original position with its deadline (or expires
   if that passed), its run does not count as a failed attempt, and its tenant's
   counter keeps only the tokens it used (``preemption_refund``). Its end event is
   dropped; what it had processed is counted as wasted tokens;
4. every ``scaling.interval_s`` the scaler gets one
   :class:`~inferq.policy.scaling.ModelLoad` per managed model, built as the
   scaler daemon builds it (:mod:`inferq.sim.loads`), and its state back;
   launches are ``starting`` for the model's ``cold_start_s``; drains take the
   named workers out of dispatch, and each stops once idle;
5. while requests wait and a ready worker has a free slot, the loop wakes again
   ``tick_s`` later (the dispatcher's tick: batching delays, aging and
   degrading depend on time alone).

Approximations (documented in ``docs/evaluation.md``):

- dispatch, RQ hand-off and start take no time; no request fails or is retried;
- a request's service time is fixed when it starts, with the concurrency
  the worker has then (its running requests including the batch being
  started, as the worker's engine passes ``in_flight`` to the model server), and
  does not change when others start or finish later;
- a request still running at its deadline ends then as ``expired`` (the worker
  times it out); its slot is held until then;
- decisions are skipped while no ready worker has a free slot and KV-cache room
  for the smallest queued request, and no queued request is overdue: such a
  decision could dispatch nothing; it would only refresh the active-tenant sets,
  which the next decision with room does against the same counters;
- what waits long is not rescanned (issue 16), so a run's cost does not grow with
  what is stuck: a request a decision reported unschedulable is parked until a
  worker is launched (still queued, counted by the scaler, expiring on time); a
  request that fits no ready worker's free KV cache now, but would fit an empty
  one, is left out of the snapshot until room for it frees (unless past its
  class's preemption bound). The dispatcher reads both on every step (its
  ``window`` of each queue); a decision could not place either, so only the
  active-tenant sets and where the ``queue_head`` window ends can differ;
- a preempted run's output tokens are taken as evenly spread over its decode
  time (the latency model's shape) when counting what it generated.

The initial fleet is warm (``ready`` at time 0); scale-ups pay the cold start.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from itertools import islice

from inferq import defaults
from inferq.errors import ConfigError, InvalidRequest
from inferq.latency import ServiceTime, prefill_s
from inferq.models import WorkerState
from inferq.policy.estimate import estimate_key, update_moving_mean
from inferq.policy.fairness import newcomer_left
from inferq.policy.preemption import (
    choose_victims,
    overdue,
    preemption_refund,
    refunded_counter,
)
from inferq.policy.routing import MIB, FleetCapacity, route_models
from inferq.policy.scaling import ScalerState
from inferq.policy.snapshot import (
    Decision,
    DispatchPolicy,
    FairnessState,
    Preemption,
    QueuedRequest,
    RunningRequest,
    Snapshot,
)
from inferq.sim.caches import PrefixCaches
from inferq.sim.deployment import (
    LatencyFn,
    SimConfig,
    default_fleet,
    fixed_latency,
    initial_fleet,
    scaling_for_fleet,
)
from inferq.sim.fleet import Fleet
from inferq.sim.loads import LoadTracker
from inferq.sim.policies import POLICIES, SimPolicy
from inferq.sim.result import (
    AssignmentRecord,
    DecisionRecord,
    RequestOutcome,
    RunStats,
    Sample,
    ScaleEvent,
    SimResult,
    Status,
)
from inferq.sim.workload import SimRequest, build_requests
from inferq.traces import TraceRequest

__all__ = [
    "AssignmentRecord",
    "DecisionRecord",
    "LatencyFn",
    "RequestOutcome",
    "RunStats",
    "Sample",
    "ScaleEvent",
    "SimConfig",
    "SimResult",
    "default_fleet",
    "fixed_latency",
    "initial_fleet",
    "replay",
    "scaling_for_fleet",
    "simulate",
]

_COMPLETE, _TIMEOUT, _READY, _WAKE, _SCALE, _ABORTED, _OVERDUE = 0, 1, 2, 3, 4, 5, 6


def simulate(requests: Sequence[SimRequest], policy: SimPolicy, config: SimConfig) -> SimResult:
    """Replay ``requests`` (sorted by arrival) through ``policy`` on ``config``'s fleet.

    Deterministic: the same input gives the same result.

    Raises:
        ValueError: requests are not sorted by arrival, or ids repeat.
        ConfigError: a fleet model is unknown or does not fit the card.
        AssertionError: ``config.check`` is on and a worker exceeded its slots or VRAM.
    """
    t0 = time.perf_counter()
    sim = _Sim(requests, policy, config)
    sim.run()
    result = sim.result()
    result.stats.wall_s = time.perf_counter() - t0
    return result


def replay(
    trace: Sequence[TraceRequest],
    policy: str | SimPolicy = "inferq",
    config: SimConfig | None = None,
    *,
    priority: str | None = None,
    model: str | None = None,
    tenants: int = defaults.TRACE_TENANTS,
    seed: int = 0,
) -> SimResult:
    """Simulate trace rows as given: the entry point for tests and notebooks.

    Each row keeps its own ``priority``, ``tenant``, ``model`` and ``task_type``
    when it has them (our JSONL format); see
    :func:`~inferq.sim.workload.build_requests` for the rest. Read the result's
    ``assignments`` for the dispatch order and the model each request ran on, e.g.
    ``replay(rows, config=SimConfig(latency=fixed_latency(0.5)))``.

    Args:
        trace: rows in any order (sorted by arrival, stable).
        policy: a name of :data:`~inferq.sim.policies.POLICIES` or a policy.
        config: the deployment (default :class:`SimConfig`'s).
        priority: class of rows naming none (default ``Settings.default_priority``).
        model: route of rows naming no known model (default ``Settings.default_model``).
        tenants / seed: Zipf-drawn tenants of rows naming none.

    Raises:
        KeyError: unknown policy name.
        ConfigError: unknown class, model or fleet model.
    """
    config = config or SimConfig()
    chosen = POLICIES[policy] if isinstance(policy, str) else policy
    requests = build_requests(
        [(priority, r) for r in trace], config.settings, model=model, tenants=tenants, seed=seed
    )
    return simulate(requests, chosen, config)


class _Sim:
    """State of one run (see the module docstring for the order of an instant)."""

    def __init__(
        self, requests: Sequence[SimRequest], policy: SimPolicy, config: SimConfig
    ) -> None:
        _check_requests(requests)
        self.policy = policy
        self.config = config
        settings = config.settings
        self.settings = settings
        self.routing = DispatchPolicy.from_settings(settings)
        self.dispatch = policy.dispatcher(settings)
        # the policy's classes (baselines clear may_preempt_after_s: no preemption)
        self.dispatch_policy = policy.dispatch_policy(settings)
        self.preempt_after = {c.name: c.may_preempt_after_s for c in self.dispatch_policy.classes}
        self.scaling = config.scaling_config()
        self.classes = tuple(c.name for c in settings.classes)
        self.timeout = {c.name: c.timeout_s for c in settings.classes}
        self.requests = list(requests)
        self.outcomes = [RequestOutcome(r) for r in self.requests]
        self.by_id = {o.request.id: o for o in self.outcomes}
        self.index_of = {r.id: i for i, r in enumerate(self.requests)}
        # preemption: each request's queue entry (a requeue puts it back as it was), the
        # sequence number of a running request's end event (an abort makes it stale),
        # its run's (start, ttft, total) seconds, and the aborts on their way
        self.entries: dict[str, QueuedRequest] = {}
        self.end_event: dict[str, int] = {}
        self.run_times: dict[str, tuple[float, float, float]] = {}
        self.aborting: dict[str, Preemption] = {}
        self.now = 0.0
        self.last_activity = 0.0
        self.stats = RunStats()
        self.events: list[tuple[float, int, int, str, str]] = []
        self.seq = 0
        self.wake_pending = False
        # queues
        self.queues: dict[tuple[str, str], dict[str, QueuedRequest]] = {}
        # per queue, each tenant's part of it (the store's sub-queues and tenant index)
        self.tenant_queues: dict[tuple[str, str], dict[str, dict[str, QueuedRequest]]] = {}
        self.class_keys: dict[str, list[tuple[str, str]]] = {c: [] for c in self.classes}
        self.queued = 0
        self.tenant_counts: dict[str, dict[str, int]] = {c: {} for c in self.classes}
        self.backlogged: dict[str, frozenset[str]] = {c: frozenset() for c in self.classes}
        self.backlog_dirty: set[str] = set()
        self.deadlines: list[tuple[float, int]] = []
        # Requests a decision found unschedulable, out of the snapshots until a worker is
        # launched (the only event that can make one servable); still queued and counted.
        self.parked: dict[tuple[str, str], dict[str, QueuedRequest]] = {}
        # (prompt + max_tokens, index) of the requests in the queues, a lazy min-heap:
        # a decision runs only when some ready worker has room for the smallest.
        self.needs: list[tuple[int, int]] = []
        # fairness state, as Store.write_fairness keeps it
        self.credit: dict[str, float] = {}
        self.counters: dict[str, dict[str, float]] = {}
        self.active: dict[str, frozenset[str]] = {}
        #: class -> newcomer -> finish tag, while it waits for its first dispatch
        #: (``fair:new:<class>`` in Redis, :func:`~inferq.policy.fairness.lift_tenants`)
        self.newcomers: dict[str, dict[str, float]] = {}
        self.estimates: dict[tuple[str, str], float] = {}
        # scaler inputs and state
        self.scaler_state = ScalerState()
        # outputs
        self.assignments: list[AssignmentRecord] = []
        self.decision_log: list[DecisionRecord] = []
        self.scale_events: list[ScaleEvent] = []
        self.samples: list[Sample] = []
        self.fleet = Fleet(config.vram_mib, config.slots)
        # prefix caching (issue 22): the servers' LRUs and the dispatcher's index, kept
        # only when some request carries a chain (the snapshot has no index otherwise)
        self.prefixed = any(r.prefix for r in self.requests)
        self.caches = PrefixCaches()
        admitted = [r for r in self.requests if r.refused is None]
        self.initial = initial_fleet(policy, admitted, config)
        for model, n in sorted(self.initial.items()):
            spec = settings.model_by_name.get(model)
            if spec is None:
                known = ", ".join(sorted(settings.model_by_name))
                raise ConfigError(f"fleet: unknown model {model!r} (registry: {known})")
            for _ in range(n):
                self.caches.launched(self.fleet.launch(spec, 0.0, warm=True))
        self.tracker = LoadTracker(settings, self._managed(), config.slots, config.rate_window_s)
        # What the dispatcher sees of the scaler (as the daemon reads it from Redis).
        self.pools = frozenset(self.tracker.managed) if policy.scaler else frozenset()

    def _managed(self) -> list[str]:
        """The scaler's models: the configured pools, else the fleet's and the routed-to ones."""
        if self.settings.scaling.pools:
            return list(self.settings.scaling.pools)
        models = set(self.initial)
        for route in {r.route for r in self.requests if r.refused is None}:
            try:
                names = route_models(self.routing, route, False)
            except InvalidRequest:
                continue
            models.update(names[:1])
        return sorted(models)

    # --- the loop ------------------------------------------------------------------

    def run(self) -> None:
        reqs, outcomes = self.requests, self.outcomes
        n, i = len(reqs), 0
        self._push(self.scaling.interval_s, _SCALE)
        self._sample()
        while True:
            t = reqs[i].arrival_s if i < n else math.inf
            if self.events and self.events[0][0] < t:
                t = self.events[0][0]
            self._drop_stale_deadlines()
            if self.deadlines and self.deadlines[0][0] < t:
                t = self.deadlines[0][0]
            if t == math.inf:
                break
            self.now = t
            changed = False
            while i < n and reqs[i].arrival_s <= t:
                self._arrive(outcomes[i], i)
                i += 1
                changed = True
            scale_due = False
            while self.events and self.events[0][0] <= t:
                _, seq, kind, a, b = heapq.heappop(self.events)
                self.stats.events += 1
                if kind in (_COMPLETE, _TIMEOUT):
                    if self.end_event.get(b) == seq:  # else the run was preempted
                        self._complete(a, b, timed_out=kind == _TIMEOUT)
                        changed = True
                elif kind == _ABORTED:
                    self._aborted(a, b)
                    changed = True
                elif kind == _OVERDUE:
                    changed = True
                elif kind == _READY:
                    changed |= self.fleet.make_ready(a, t)
                elif kind == _WAKE:
                    self.wake_pending = False
                    changed = True
                else:
                    scale_due = True
            changed |= self._expire_due()
            if changed and (self._room() or (self.queued and self._overdue_waiting())):
                self._decide()
            if scale_due:
                self._scale_tick(work_left=i < n)
            if not self.wake_pending and self._room():
                self.wake_pending = True
                self._push(t + self.config.tick_s, _WAKE)

    def _push(self, at: float, kind: int, a: str = "", b: str = "") -> int:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, a, b))
        return self.seq

    # --- queues --------------------------------------------------------------------

    def _arrive(self, o: RequestOutcome, index: int) -> None:
        r = o.request
        if r.refused is not None:  # intake refused it: the client got an error, nothing queued
            o.status, o.reason = "refused", r.refused
            return
        o.deadline = r.arrival_s + self.timeout[r.priority]
        self.entries[r.id] = q = QueuedRequest(
            id=r.id,
            priority=r.priority,
            route=r.route,
            tenant=r.tenant,
            task_type=r.task_type,
            submitted_at=r.arrival_s,
            deadline=o.deadline,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens,
            prefix=r.prefix,
            block_tokens=r.block_tokens,
        )
        self._enqueue(q, index)
        self.tracker.arrived(self.now, r.route)
        bound = self.preempt_after.get(r.priority)
        if bound is not None:  # a decision when it becomes overdue, room or not
            self._push(overdue_at(r.arrival_s, bound), _OVERDUE)
        self.last_activity = self.now

    def _enqueue(self, q: QueuedRequest, index: int) -> None:
        """Queue ``q`` at its position by submit time (``(submitted_at, id)``: the store's
        score and member order), in its queue and its tenant's sub-queue."""
        key = (q.priority, q.route)
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = {}
            self.class_keys[q.priority] = sorted([*self.class_keys[q.priority], key])
        part = self.tenant_queues.setdefault(key, {}).setdefault(q.tenant, {})
        for held in (queue, part):
            last = next(reversed(held.values()), None)
            held[q.id] = q
            if last is not None and (last.submitted_at, last.id) > (q.submitted_at, q.id):
                ordered = sorted(held.values(), key=_age_order)  # a requeue: back in place
                held.clear()
                held.update((r.id, r) for r in ordered)
        self.queued += 1
        counts = self.tenant_counts[q.priority]
        counts[q.tenant] = counts.get(q.tenant, 0) + 1
        if counts[q.tenant] == 1:
            self.backlog_dirty.add(q.priority)
        heapq.heappush(self.deadlines, (q.deadline, index))
        heapq.heappush(self.needs, (q.prompt_tokens + q.max_tokens, index))

    def _overdue_waiting(self) -> bool:
        """True when some class's oldest queued request is past its preemption bound
        (a decision may reserve a worker and preempt although no slot is free)."""
        for cls, keys in self.class_keys.items():
            bound = self.preempt_after.get(cls)
            if bound is None:
                continue
            for key in keys:
                oldest = next(iter(self.queues[key].values()), None)
                if oldest is not None and overdue(
                    self.dispatch_policy.class_by_name[cls], self.now - oldest.submitted_at
                ):
                    return True
        return False

    def _room(self) -> bool:
        """True when a decision could place something: some ready worker has a free slot
        and KV-cache room for the smallest request in the queues (parked ones aside)."""
        heap, outcomes = self.needs, self.outcomes
        while heap:
            o = outcomes[heap[0][1]]
            r = o.request
            if o.status == "queued" and r.id not in self.parked.get((r.priority, r.route), ()):
                return self.fleet.has_room(heap[0][0])
            heapq.heappop(heap)
        return False

    def _park(self, o: RequestOutcome) -> None:
        """Take an unschedulable request out of its queue (and out of every snapshot)
        until :meth:`_unpark`; it stays queued: counted, expiring, its tenant backlogged."""
        r = o.request
        key = (r.priority, r.route)
        queue = self.queues[key]
        if r.id not in queue:
            return
        self.parked.setdefault(key, {})[r.id] = queue.pop(r.id)
        parts = self.tenant_queues[key]
        del parts[r.tenant][r.id]
        if not parts[r.tenant]:
            del parts[r.tenant]

    def _unpark(self) -> None:
        """A worker was launched: every parked request goes back to its place in its
        queue (submit order), and the next decision judges it against the new fleet."""
        for key, parked in self.parked.items():
            if not parked:
                continue
            queue = self.queues[key]
            parts = self.tenant_queues.setdefault(key, {})
            for q in parked.values():
                queue[q.id] = q
                parts.setdefault(q.tenant, {})[q.id] = q
                heapq.heappush(self.needs, (q.prompt_tokens + q.max_tokens, self.index_of[q.id]))
            self.queues[key] = _in_submit_order(queue)
            for tenant in {q.tenant for q in parked.values()}:
                parts[tenant] = _in_submit_order(parts[tenant])
            parked.clear()

    def _dequeue(self, o: RequestOutcome, *, dispatched: bool = False) -> None:
        """Take ``o`` out of its queue (``dispatched``: to a worker; else it expired)."""
        r = o.request
        key = (r.priority, r.route)
        parked = self.parked.get(key)
        if parked and r.id in parked:
            del parked[r.id]
        else:
            del self.queues[key][r.id]
            parts = self.tenant_queues[key]
            del parts[r.tenant][r.id]
            if not parts[r.tenant]:
                del parts[r.tenant]
        self.queued -= 1
        counts = self.tenant_counts[r.priority]
        counts[r.tenant] -= 1
        if not counts[r.tenant]:
            del counts[r.tenant]
            self.backlog_dirty.add(r.priority)
            waiting = self.newcomers.get(r.priority, {})
            if dispatched:  # served: the newcomers behind it stay (includes/counts.lua)
                waiting.pop(r.tenant, None)
            else:
                newcomer_left(
                    r.tenant,
                    waiting,
                    self.counters.setdefault(r.priority, {}),
                    counts,
                    self.dispatch_policy.tenant_weight,
                )

    def _drop_stale_deadlines(self) -> None:
        heap = self.deadlines
        while heap and self.outcomes[heap[0][1]].status != "queued":
            heapq.heappop(heap)

    def _expire_due(self) -> bool:
        heap, now = self.deadlines, self.now
        expired = False
        while heap and heap[0][0] <= now:
            _, index = heapq.heappop(heap)
            o = self.outcomes[index]
            if o.status != "queued":
                continue
            why = self._unservable(o)
            self._dequeue(o)
            waited = o.deadline - o.request.arrival_s
            cause = f": {why}" if why else " while queued"
            self._end(o, "expired", o.deadline, f"deadline passed{cause} (waited {waited:.2f} s)")
            expired = True
        return expired

    def _unservable(self, o: RequestOutcome) -> str | None:
        """Why nothing can serve a queued request now (as a dispatcher's fresh note on the
        real stack says), or None: checked only for one a decision found unschedulable."""
        if o.unschedulable is None:
            return None
        r = o.request
        key = (r.priority, r.route)
        queued = self.queues[key].get(r.id) or self.parked[key][r.id]
        views = [w.view() for w in self.fleet]
        return FleetCapacity(views, self.routing, self.pools).reason(queued)

    def _end(self, o: RequestOutcome, status: Status, at: float, reason: str | None) -> None:
        o.status = status
        o.finished_at = at
        o.reason = reason
        self.last_activity = max(self.last_activity, at)

    # --- dispatch ------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        head = self.config.queue_head
        queued: dict[str, list[QueuedRequest]] = {}
        free, whole, cutoffs = self._waiting_for_room()
        for cls, keys in self.class_keys.items():
            if len(keys) == 1 and len(self.tenant_queues.get(keys[0], ())) <= 1:
                heads = list(islice(self.queues[keys[0]].values(), head))
            else:
                heads = [r for k in keys for r in self._heads(k, head)]
                heads.sort(key=lambda r: (r.submitted_at, r.id))
            cut = cutoffs.get(cls, -math.inf)
            queued[cls] = [
                r
                for r in heads
                if (t := r.prompt_tokens + r.max_tokens) <= free
                or t > whole
                or r.submitted_at <= cut
            ]
        for cls in self.backlog_dirty:
            self.backlogged[cls] = frozenset(self.tenant_counts[cls])
        self.backlog_dirty.clear()
        return Snapshot(
            now=self.now,
            queued=queued,
            workers=[w.view() for w in self.fleet],
            fairness=FairnessState(self.credit, self.counters, self.active, self.newcomers),
            backlogged_tenants=self.backlogged,
            output_estimates=self.estimates,
            scaler_pools=self.pools,
            prefix_index=self.caches.index if self.prefixed else None,
        )

    def _waiting_for_room(self) -> tuple[float, float, dict[str, float]]:
        """What a decision need not see: a request of ``t`` tokens (prompt + max_tokens)
        with ``free < t <= whole`` fits no ready worker's free KV cache now (it could not be
        placed: ``OpenBatch.has_room``) but would fit an empty one, so it waits for room;
        unless submitted at or before its class's ``cutoff`` (past the class's preemption
        bound: a decision may reserve a worker for it). Returns ``(free, whole, cutoff)``.
        Such a request rejoins the snapshots as soon as room for it frees."""
        free, whole = 0.0, 0.0
        for w in self.fleet:
            per_token = w.spec.kv_bytes_per_token / MIB
            whole = max(whole, w.kv_cache_mib / per_token)
            if w.has_slot:
                free = max(free, (w.kv_cache_mib - w.reserved_mib) / per_token)
        cutoff = {
            name: self.now - c.may_preempt_after_s
            for name, c in self.dispatch_policy.class_by_name.items()
            if c.may_preempt_after_s is not None
        }
        return free, whole, cutoff

    def _heads(self, key: tuple[str, str], head: int) -> list[QueuedRequest]:
        """What the dispatcher reads of one queue (``store/snapshot.py``): its oldest
        ``head`` requests and the heads of the first ``max(SNAPSHOT_MIN_TENANTS, head)``
        tenants' sub-queues (oldest head first), ``max(1, head // tenants)`` each, so a
        tenant behind another's flood is seen at once."""
        out = {r.id: r for r in islice(self.queues[key].values(), head)}
        parts = self.tenant_queues.get(key, {})
        if len(parts) > 1:
            first = sorted(
                parts.items(), key=lambda kv: (next(iter(kv[1].values())).submitted_at, kv[0])
            )[: max(defaults.SNAPSHOT_MIN_TENANTS, head)]
            depth = max(1, head // len(first))
            for _, part in first:
                for r in islice(part.values(), depth):
                    out.setdefault(r.id, r)
        return list(out.values())

    def _decide(self) -> None:
        snapshot = self._snapshot()
        self.stats.snapshot_requests += sum(len(q) for q in snapshot.queued.values())
        t0 = time.perf_counter()
        decision = self.dispatch(snapshot)
        self.stats.decide_s += time.perf_counter() - t0
        self.stats.decisions += 1
        self._apply(decision)
        if decision.reservations:
            self._preempt(snapshot, decision)

    def _preempt(self, snapshot: Snapshot, decision: Decision) -> None:
        """The dispatcher's preemption step: read what the reserved workers hold (after
        this decision's batches, as ``Store.running_on`` does), let
        :func:`~inferq.policy.preemption.choose_victims` pick, and abort them; each is
        requeued ``abort_delay_s`` later (:meth:`_aborted`)."""
        running: dict[str, list[RunningRequest]] = {}
        for res in decision.reservations:
            worker = self.fleet.live.get(res.worker_id)
            if worker is None or worker.id in running:
                continue
            running[worker.id] = [
                self._running(worker.id, rid, mib) for rid, mib in worker.running.items()
            ]
        victims = choose_victims(
            decision.reservations, running, snapshot, self.dispatch_policy, decision.batches
        )
        for v in victims:
            self.aborting[v.request_id] = v
            self._push(self.now + self.config.abort_delay_s, _ABORTED, v.worker_id, v.request_id)

    def _running(self, worker_id: str, request_id: str, need_mib: float) -> RunningRequest:
        o = self.by_id[request_id]
        r = o.request
        return RunningRequest(
            id=r.id,
            worker_id=worker_id,
            priority=r.priority,
            tenant=r.tenant,
            task_type=r.task_type,
            attempt=o.runs,
            started_at=o.dispatched_at if o.dispatched_at is not None else self.now,
            need_mib=need_mib,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens,
            aborting=request_id in self.aborting,
            preemptions=o.preemptions,
        )

    def _aborted(self, worker_id: str, request_id: str) -> None:
        """A preemption's abort took effect: as ``requeue_preempted.lua``, the request
        frees its room, goes back to its queue at its original position with its
        deadline (or expires if that passed), spends no attempt, and its tenant is
        charged only for the tokens it used (:func:`preemption_refund`)."""
        victim = self.aborting.pop(request_id, None)
        o = self.by_id[request_id]
        if victim is None or o.status != "running" or o.worker != worker_id:
            return  # it ended before the abort reached it
        if o.runs != victim.attempt:
            return
        now = self.now
        r = o.request
        worker = self.fleet.live[worker_id]
        worker.release(request_id, now, served=False)
        del self.end_event[request_id]
        generated, processed = _progress(
            r.prompt_tokens, r.output_tokens, self.run_times.pop(request_id), now
        )
        counters = self.counters.get(r.priority)
        if counters is not None and r.tenant in counters:
            refund = preemption_refund(
                victim.charged, r.prompt_tokens, generated, self.dispatch_policy.vtc_output_weight
            )
            counters[r.tenant] = refunded_counter(counters[r.tenant], refund)
        o.preemptions += 1
        o.wasted_tokens += processed
        self.stats.preemptions += 1
        o.dispatched_at = o.first_token_at = None
        o.worker = o.model = None
        if o.deadline <= now:
            self._end(o, "expired", now, f"deadline passed while preempted (run {o.runs})")
        else:
            o.status = "queued"
            self._enqueue(self.entries[request_id], self.index_of[request_id])
            # back in its queue is no new arrival: no VTC lift (includes/counts.lua)
            if counters is not None and r.tenant in counters:
                self.active[r.priority] = self.active.get(r.priority, frozenset()) | {r.tenant}
        if worker.state is WorkerState.DRAINING and not worker.running:
            self._stop(worker_id)

    def _apply(self, decision: Decision) -> None:
        now = self.now
        for rid, reason in decision.expired:
            o = self.by_id[rid]
            if o.status == "queued":
                self._dequeue(o)
                self._end(o, "expired", now, reason)
        for rid, reason in decision.unschedulable:
            o = self.by_id[rid]
            if o.unschedulable is None:
                o.unschedulable = reason
            if o.status == "queued":
                self._park(o)
        dispatched = 0
        for batch in decision.batches:
            dispatched += self._start(
                batch.worker_id,
                [a.request_id for a in batch.items],
                [a.need_mib for a in batch.items],
                [a.cached_tokens for a in batch.items],
            )
        self._write_fairness(decision)
        if dispatched:
            counts = tuple(self._class_queued(c) for c in self.classes)
            self.decision_log.append(
                DecisionRecord(self.stats.decisions - 1, now, dispatched, counts)
            )
        if self.config.check:
            self._check_limits()

    def _start(
        self,
        worker_id: str,
        ids: Sequence[str],
        needs: Sequence[float],
        forecasts: Sequence[int],
    ) -> int:
        now = self.now
        worker = self.fleet.live[worker_id]
        if worker.state is not WorkerState.READY:
            raise AssertionError(f"decision assigned to {worker_id} in state {worker.state}")
        decision = self.stats.decisions - 1
        started: list[RequestOutcome] = []
        for rid, need, forecast in zip(ids, needs, forecasts, strict=True):
            o = self.by_id[rid]
            if o.status != "queued":
                raise AssertionError(f"decision assigned {rid} in state {o.status}")
            self._dequeue(o, dispatched=True)
            worker.admit(rid, need, now)
            o.forecast_tokens = forecast
            self.caches.placed(worker.id, o.request)
            o.status = "running"
            o.dispatched_at = now
            o.worker = worker.id
            o.model = worker.model
            self.assignments.append(
                AssignmentRecord(
                    len(self.assignments),
                    now,
                    decision,
                    rid,
                    o.request.priority,
                    worker.id,
                    worker.model,
                )
            )
            started.append(o)
        self.tracker.dispatched(now, worker.model, len(started))
        concurrency = worker.in_flight
        latency = self.config.latency
        decode = sum(self.by_id[rid].request.max_tokens for rid in worker.running)
        for o in started:
            r = o.request
            o.concurrency = concurrency
            o.runs += 1
            took = latency(worker.spec, r.prompt_tokens, r.output_tokens, concurrency)
            o.cached_tokens = self.caches.started(worker, r, decode)
            if o.cached_tokens:  # the server skips the cached part's prefill (sim server's rule)
                ttft = max(0.0, took.ttft_s - prefill_s(worker.spec, o.cached_tokens))
                took = ServiceTime(ttft_s=ttft, decode_s=took.decode_s)
            end = now + took.total_s
            self.run_times[r.id] = (now, took.ttft_s, took.total_s)
            if end > o.deadline:
                self.end_event[r.id] = self._push(o.deadline, _TIMEOUT, worker.id, r.id)
            else:
                o.first_token_at = now + took.ttft_s
                self.end_event[r.id] = self._push(end, _COMPLETE, worker.id, r.id)
        return len(started)

    def _complete(self, worker_id: str, request_id: str, *, timed_out: bool) -> None:
        now = self.now
        o = self.by_id[request_id]
        worker = self.fleet.live[worker_id]
        worker.release(request_id, now)
        del self.end_event[request_id]
        self.run_times.pop(request_id, None)
        if timed_out:
            self._end(o, "expired", now, "deadline passed while running")
        else:
            self._end(o, "succeeded", now, None)
            self._observe(worker.model, o, now)
            if o.request.prefix:
                self.caches.succeeded(
                    worker_id, o.forecast_tokens, o.cached_tokens, o.request.block_tokens
                )
        if worker.state is WorkerState.DRAINING and not worker.running:
            self._stop(worker_id)

    def _observe(self, model: str, o: RequestOutcome, now: float) -> None:
        """Fold a success into the output-token estimate and the scaler's service mean."""
        alpha = defaults.OUTPUT_ESTIMATE_ALPHA
        key = estimate_key(model, o.request.task_type)
        self.estimates[key] = update_moving_mean(
            self.estimates.get(key), o.request.output_tokens, alpha
        )
        started = o.dispatched_at if o.dispatched_at is not None else now
        r = o.request
        self.tracker.finished(
            now,
            model,
            now - started,
            r.prompt_tokens,
            r.output_tokens,
            o.concurrency or 1,
            r.priority,
        )

    def _write_fairness(self, d: Decision) -> None:
        """Carry the decision's fairness state forward exactly as ``Store.write_fairness``."""
        if d.class_credit:
            self.credit.update(d.class_credit)
        for cls, floors in d.tenant_counter_floor.items():
            if floors:
                self.counters.setdefault(cls, {}).update(floors)
        for cls, tags in d.newcomer_tags.items():
            self.newcomers.setdefault(cls, {}).update(tags)
        for cls, deltas in d.tenant_counter_delta.items():
            counters = self.counters.setdefault(cls, {})
            waiting = self.newcomers.get(cls, {})
            for tenant, delta in deltas.items():
                counters[tenant] = counters.get(tenant, 0.0) + delta
                waiting.pop(tenant, None)  # dispatched: no longer waiting for its first
        for cls, tenants in d.active_tenants.items():
            self.active[cls] = frozenset(tenants)

    def _check_limits(self) -> None:
        for w in self.fleet:
            problem = w.over_limits()
            if problem is not None:
                raise AssertionError(f"t={self.now:.3f}: {problem}")

    # --- scaling -------------------------------------------------------------------

    def _scale_tick(self, work_left: bool) -> None:
        running = any(w.running for w in self.fleet)
        if not (work_left or self.queued or running):
            return  # nothing left to serve: the run ends, so does the scaler
        scaler = self.policy.scaler
        if scaler is not None:
            since = {
                rid: at
                for w in self.fleet
                for rid in w.running
                if (at := self.by_id[rid].dispatched_at) is not None
            }
            loads = self.tracker.loads(self.now, self._depths(), self.fleet, self.estimates, since)
            self.stats.scale_calls += 1
            decisions, self.scaler_state = scaler(
                loads, self.scaler_state, self.scaling, self.settings.classes, self.now
            )
            for d in decisions:
                self._carry_out(d.model, d.action, d.current, d.desired, d.drain, d.reasons)
        self._sample()
        self._push(self.now + self.scaling.interval_s, _SCALE)

    def _depths(self) -> list[tuple[str, str, int, float | None]]:
        """``(class, route, queued, oldest wait)`` per non-empty queue (``Store.queue_depths``),
        parked requests included."""
        out: list[tuple[str, str, int, float | None]] = []
        for (cls, route), q in self.queues.items():
            parked = self.parked.get((cls, route), {})
            heads = [next(iter(d.values())).submitted_at for d in (q, parked) if d]
            if heads:
                out.append((cls, route, len(q) + len(parked), self.now - min(heads)))
        return out

    def _class_queued(self, cls: str) -> int:
        """Requests of ``cls`` queued, parked ones included."""
        return sum(len(self.queues[k]) + len(self.parked.get(k, ())) for k in self.class_keys[cls])

    def _carry_out(
        self,
        model: str,
        action: str,
        current: int,
        desired: int,
        drain: Sequence[str],
        reasons: Sequence[str],
    ) -> None:
        now = self.now
        if action == "up" and desired > current:
            spec = self.settings.model_by_name[model]
            launched = []
            for _ in range(desired - current):
                worker = self.fleet.launch(spec, now)
                self.caches.launched(worker)
                launched.append(worker.id)
                self._push(now + spec.cold_start_s, _READY, worker.id)
            self._unpark()
            self.scale_events.append(
                ScaleEvent(now, model, "up", current, desired, tuple(launched), tuple(reasons))
            )
        elif action == "down" and drain:
            drained = tuple(w for w in drain if self.fleet.drain(w, now))
            for w in drained:
                if w not in self.fleet.live:  # it was idle: stopped at once
                    self.caches.stopped(w)
            if drained:
                self.scale_events.append(
                    ScaleEvent(
                        now,
                        model,
                        "down",
                        current,
                        current - len(drained),
                        drained,
                        tuple(reasons),
                    )
                )

    def _stop(self, worker_id: str) -> None:
        """A draining worker became idle: it leaves the fleet, and its caches with it."""
        self.fleet.stop(worker_id, self.now)
        self.caches.stopped(worker_id)

    def _sample(self) -> None:
        counts = {s: 0 for s in WorkerState}
        running = 0
        for w in self.fleet:
            counts[w.state] += 1
            running += len(w.running)
        queued = tuple(self._class_queued(c) for c in self.classes)
        self.samples.append(
            Sample(
                self.now,
                counts[WorkerState.STARTING],
                counts[WorkerState.READY],
                counts[WorkerState.DRAINING],
                running,
                queued,
            )
        )

    # --- the end -------------------------------------------------------------------

    def result(self) -> SimResult:
        end = self.last_activity
        for w in self.fleet:
            w.advance(end)
        return SimResult(
            policy=self.policy.name,
            config=replace(self.config, fleet=dict(self.config.fleet)),
            classes=self.classes,
            initial_fleet=dict(self.initial),
            outcomes=self.outcomes,
            assignments=self.assignments,
            decisions=self.decision_log,
            scale_events=self.scale_events,
            samples=self.samples,
            workers=self.fleet.all_workers(),
            end_s=end,
            stats=self.stats,
        )


def overdue_at(arrival_s: float, bound_s: float) -> float:
    """The first time at which a request that arrived at ``arrival_s`` has waited
    ``bound_s``: ``arrival_s + bound_s``, moved up by the float ulps that make
    ``at - arrival_s >= bound_s`` hold (``3.7650851657331015 + 0.5`` minus the arrival is
    0.49999999999999956: the wake-up found the request not yet overdue and nothing woke
    the simulator again until the batch request holding the slot finished, 2 s later)."""
    at = arrival_s + bound_s
    while at - arrival_s < bound_s:
        at = math.nextafter(at, math.inf)
    return at


def _age_order(req: QueuedRequest) -> tuple[float, str]:
    return (req.submitted_at, req.id)


def _progress(
    prompt_tokens: int, output_tokens: int, run: tuple[float, float, float], now: float
) -> tuple[int, int]:
    """(output tokens generated, prompt + output tokens processed) by a run aborted at
    ``now``: the prefill takes the run's TTFT, then the output tokens come evenly over
    the decode time (the latency model's shape)."""
    start, ttft, total = run
    elapsed = now - start
    if elapsed < ttft:
        return 0, int(prompt_tokens * elapsed / ttft) if ttft > 0 else prompt_tokens
    decode = total - ttft
    if output_tokens <= 1 or decode <= 0:
        generated = output_tokens
    else:
        generated = min(output_tokens, 1 + int((elapsed - ttft) / decode * (output_tokens - 1)))
    return generated, prompt_tokens + generated


def _in_submit_order(held: dict[str, QueuedRequest]) -> dict[str, QueuedRequest]:
    """``held`` re-ordered by ``(submitted_at, id)``: the store's score and member order."""
    return {q.id: q for q in sorted(held.values(), key=_age_order)}


def _check_requests(requests: Sequence[SimRequest]) -> None:
    seen: set[str] = set()
    last = -math.inf
    for i, r in enumerate(requests):
        if r.arrival_s < last:
            raise ValueError(f"requests[{i}].arrival_s: {r.arrival_s} is before the previous one")
        if r.id in seen:
            raise ValueError(f"requests[{i}].id: {r.id!r} repeats")
        last = r.arrival_s
        seen.add(r.id)
