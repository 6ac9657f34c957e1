"""The dispatch decision: which queued requests go to which workers now.

:func:`decide` is a pure, deterministic function of a
:class:`~inferq.policy.snapshot.Snapshot` and a :class:`DispatchPolicy`; the
dispatcher and the simulator both call it and carry out the
:class:`~inferq.policy.snapshot.Decision`. One decision, in order:

1. Expiry: a request whose deadline has passed is expired, never dispatched;
   in a class with ``refuse_late``, so is one that cannot finish by its deadline
   even on the fastest serving model at concurrency 1
   (:func:`inferq.latency.service_time` with the estimated output).
2. Unschedulable: a request no live worker could ever hold is reported with the
   reason (:func:`~inferq.policy.routing.unschedulable_reason`) and left queued.
3. Picks, one request at a time, while some worker has room:
   a. aging: the highest class with a dispatchable request past its aging bound
      is served (a lower-class flood cannot starve a higher class), its tenant
      chosen by VTC as in b (an overdue flood of one tenant does not undo
      fairness between the tenants of that class);
   b. otherwise the class chosen by smooth weighted round-robin over the
      classes with dispatchable work (weight-0 classes only when no weighted
      class has any), and in it the tenant with the lowest virtual token
      counter, and that tenant's oldest dispatchable request
      (:mod:`~inferq.policy.fairness`);
   the request goes to its preferred worker (:mod:`~inferq.policy.routing`),
   into that worker's batch (:mod:`~inferq.policy.batching`); a request its
   class's batching delay holds back is skipped.
   A request, tenant or class found with nothing dispatchable is skipped for
   the rest of the decision: capacity only shrinks while deciding.
Against priority inversion (:mod:`~inferq.policy.preemption`), inside step 3: a
class with a request overdue by its ``may_preempt_after_s`` is served before any
lower class a pick would choose (its tenants in counter order) until those requests
are placed or fit nowhere; one that fits nowhere reserves a worker, where no lower
class is placed; the reservations still waiting go out in ``Decision.reservations``
for the preemption step.

The caller applies the result: claims the batches, expires and reports, stores
``class_credit`` and ``active_tenants``, sets ``tenant_counter_floor`` then adds
``tenant_counter_delta``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from inferq import defaults
from inferq.config import PriorityClass
from inferq.latency import service_time
from inferq.policy.batching import OpenBatch, held_back
from inferq.policy.estimate import estimate_output_tokens
from inferq.policy.fairness import (
    VirtualTokenCounter,
    lift_tenants,
    swrr_charge,
    swrr_winner,
    vtc_cost,
)
from inferq.policy.fleet import FleetIndex
from inferq.policy.preemption import Urgency
from inferq.policy.prefix_index import PrefixIndex
from inferq.policy.routing import (
    Affinity,
    FleetCapacity,
    WorkerIndex,
    may_degrade,
    need_mib,
    route_models,
    serving_models,
)
from inferq.policy.snapshot import (
    Assignment,
    Decision,
    DispatchPolicy,
    QueuedRequest,
    Snapshot,
)


def decide(snapshot: Snapshot, policy: DispatchPolicy, fleet: FleetIndex | None = None) -> Decision:
    """What to dispatch, expire and report now (see the module docstring for the order).

    Args:
        snapshot: queues (oldest first per class), workers, fairness state and
            output estimates at ``snapshot.now``.
        policy: classes, registry and batching limits.
        fleet: ``snapshot.workers`` already indexed (the dispatcher keeps one between
            steps, :class:`~inferq.policy.fleet.FleetIndex`): it must hold exactly
            those views. None, or one made for another registry: indexed here. The
            decision is the same either way.

    Returns:
        The decision; deterministic for a given input (the order of
        ``snapshot.workers`` does not matter; worker ids must be unique).
    """
    return _Run(snapshot, policy, fleet).decide()


@dataclass(slots=True, eq=False)
class _Item:
    """A dispatchable-looking request during one decision."""

    req: QueuedRequest
    cls: PriorityClass
    models: tuple[str, ...]
    tokens: int
    waited_s: float
    pending: bool = True
    #: its prefix-cache affinity at its last placement (the forecast of its cached tokens)
    affinity: Affinity | None = None


class _Run:
    """The working state of one :func:`decide` call."""

    def __init__(
        self, snapshot: Snapshot, policy: DispatchPolicy, fleet: FleetIndex | None
    ) -> None:
        self.snapshot = snapshot
        self.policy = policy
        self.now = snapshot.now
        if fleet is None or not fleet.serves(policy):
            fleet = FleetIndex.build(snapshot.workers, policy)
        self.index = WorkerIndex(fleet.open_views(), policy, ranked=True)
        self.fleet = FleetCapacity(
            (), policy, snapshot.scaler_pools, largest_mib=fleet.largest_mib()
        )
        self.expired: list[tuple[str, str]] = []
        self.unschedulable: list[tuple[str, str]] = []
        stored = snapshot.fairness.class_credit
        self.credit = {c.name: float(stored.get(c.name, 0.0)) for c in policy.classes}
        self.weights = {c.name: c.weight for c in policy.classes}
        self.by_age: dict[str, list[_Item]] = {}
        self.age_pos: dict[str, int] = {}
        self.by_tenant: dict[str, dict[str, list[_Item]]] = {}
        self.tenant_pos: dict[str, dict[str, int]] = {}
        self.fillable: dict[str, dict[str, int]] = {}
        self.pending: dict[str, int] = {}
        self.vtc: dict[str, VirtualTokenCounter] = {}
        self.start_vt: dict[str, dict[str, float]] = {}
        self.delta: dict[str, dict[str, float]] = {}
        self.floor: dict[str, dict[str, float]] = {}
        self.active: dict[str, frozenset[str]] = {}
        self.newcomer_tags: dict[str, dict[str, float]] = {}
        self.order: list[OpenBatch] = []
        #: prefix chains placed in this decision, by worker (unbounded: one decision)
        self.placed = PrefixIndex()
        self.models: dict[tuple[str, bool], tuple[tuple[str, ...], int]] = {}
        self.exhausted: set[str] = set()
        self.aging = [c for c in policy.classes if c.aging_s is not None]
        for cls in policy.classes:
            self._load_class(cls)
        for name in sorted(set(snapshot.queued) - set(policy.class_by_name)):
            reason = f"priority class {name!r} is not configured"
            self.unschedulable.extend((r.id, reason) for r in snapshot.queued[name])
        skip = {rid for rid, _ in self.expired} | {rid for rid, _ in self.unschedulable}
        self.urgency = Urgency(snapshot, policy, skip, fleet)

    # --- loading -----------------------------------------------------------

    def _load_class(self, cls: PriorityClass) -> None:
        queue = sorted(self.snapshot.queued.get(cls.name, ()), key=attrgetter("submitted_at"))
        items = [it for it in (self._admit(cls, r) for r in queue) if it is not None]
        tenants: dict[str, list[_Item]] = {}
        fillable: dict[str, int] = {}
        for it in items:
            tenants.setdefault(it.req.tenant, []).append(it)
            for model in it.models:
                fillable[model] = fillable.get(model, 0) + 1
        self.by_age[cls.name] = items
        self.age_pos[cls.name] = 0
        self.by_tenant[cls.name] = tenants
        self.tenant_pos[cls.name] = {}
        self.fillable[cls.name] = fillable
        self.pending[cls.name] = len(items)
        self.delta[cls.name] = {}
        fairness = self.snapshot.fairness
        backlogged = self.snapshot.backlogged_tenants.get(cls.name, frozenset()) | {
            r.tenant for r in queue
        }
        counters = fairness.tenant_counter.get(cls.name, {})
        lifted, tags = lift_tenants(
            counters,
            fairness.active_tenants.get(cls.name, frozenset()),
            backlogged,
            self.policy.tenant_weight,
            fairness.newcomers.get(cls.name, {}),
            {
                t: (
                    its[0].req.submitted_at,
                    vtc_cost(
                        its[0].req.prompt_tokens,
                        its[0].req.max_tokens,
                        self.policy.vtc_output_weight,
                    ),
                )
                for t, its in tenants.items()
            },
        )
        if lifted:
            self.floor[cls.name] = lifted
        if tags:
            self.newcomer_tags[cls.name] = tags
        self.active[cls.name] = frozenset(backlogged)
        self.vtc[cls.name] = VirtualTokenCounter(
            {**counters, **lifted},
            tenants,
            self.policy.tenant_weight,
            {t: its[0].req.submitted_at for t, its in tenants.items() if its},
        )
        # the standing at the decision's start (the reservation rule compares tenants by it)
        self.start_vt[cls.name] = {t: self.vtc[cls.name].virtual_time(t) for t in backlogged}

    def _admit(self, cls: PriorityClass, req: QueuedRequest) -> _Item | None:
        waited = self.now - req.submitted_at
        if req.deadline <= self.now:
            self.expired.append((req.id, f"deadline passed while queued (waited {waited:.2f} s)"))
            return None
        reason = self.fleet.reason(req)
        if reason is not None:
            self.unschedulable.append((req.id, reason))
            return None
        models = self._serving(cls, req)
        if cls.refuse_late:
            late = self._late_reason(cls, req, models)
            if late is not None:
                self.expired.append((req.id, late))
                return None
        return _Item(req, cls, models, req.prompt_tokens + req.max_tokens, waited)

    def _serving(self, cls: PriorityClass, req: QueuedRequest) -> tuple[str, ...]:
        """:func:`~inferq.policy.routing.serving_models`, cached per (route, degrade)."""
        key = (req.route, may_degrade(cls, req, self.now))
        entry = self.models.get(key)
        if entry is None:
            models = route_models(self.policy, req.route, key[1])
            shortest = min((self.policy.model_by_name[m].max_context for m in models), default=0)
            entry = self.models[key] = (models, shortest)
        models, shortest = entry
        if req.prompt_tokens + req.max_tokens <= shortest:
            return models
        return serving_models(req, self.policy, self.now)

    def _late_reason(
        self, cls: PriorityClass, req: QueuedRequest, models: Sequence[str]
    ) -> str | None:
        """Why ``req`` cannot finish by its deadline even at best, or None when it may."""
        best: tuple[float, str] | None = None
        for name in models:
            spec = self.policy.model_by_name[name]
            output = estimate_output_tokens(
                req.max_tokens, self.snapshot.output_estimates, name, req.task_type
            )
            total = service_time(spec, req.prompt_tokens, math.ceil(output)).total_s
            if best is None or total < best[0]:
                best = (total, name)
        left = req.deadline - self.now
        if best is None or best[0] <= left:
            return None
        return (
            f"cannot finish by its deadline: needs at least {best[0]:.2f} s on {best[1]}, "
            f"{left:.2f} s left (class {cls.name} refuses late work)"
        )

    # --- picking -------------------------------------------------------------

    def decide(self) -> Decision:
        while self.index.open_count:
            pick = self._aged_pick() or self._fair_pick()
            if pick is None:
                break
            self._assign(*pick)
        return Decision(
            batches=tuple(b.to_batch() for b in self.order),
            expired=tuple(self.expired),
            unschedulable=tuple(self.unschedulable),
            class_credit=self.credit,
            tenant_counter_delta={c: d for c, d in self.delta.items() if d},
            tenant_counter_floor=self.floor,
            active_tenants=self.active,
            newcomer_tags=self.newcomer_tags,
            reservations=self.urgency.unplaced(),
        )

    def _place(self, item: _Item) -> OpenBatch | None:
        blocked = None
        group: object = None
        if self.urgency.active:
            held = self.urgency.blockers(item.req, self.start_vt.get(item.cls.name, {}))
            if held:
                blocked = lambda batch: batch.worker.id in held  # noqa: E731
                group = (item.cls.name, held)  # refusals hold for the same blockers only
        return self.index.place(
            item.models,
            item.tokens,
            item.req.excluded_worker,
            alone=item.req.alone,
            blocked=blocked,
            group=group,
            affinity=(lambda: self._affinity(item)) if item.req.prefix else None,
        )

    def _affinity(self, item: _Item) -> Affinity | None:
        """The request's cached prefix per worker (index and this decision's
        placements), or None when it has no chain, no worker holds a prefix of it,
        the rule is off or it is a suspect (it runs alone, where it fits)."""
        req = item.req
        rule = self.policy.affinity
        lookup = self.snapshot.prefix_index
        if not req.prefix or lookup is None or not rule.enabled or req.alone:
            return None
        limit = defaults.PREFIX_CANDIDATES
        blocks = dict(lookup.deepest(req.prefix, limit))
        for worker, held in self.placed.deepest(req.prefix, limit).items():
            blocks[worker] = max(held, blocks.get(worker, 0))
        if not blocks:
            return None
        size, prefix, placed = req.block_tokens, req.prefix, self.placed

        def tokens(n: int) -> int:
            return min(n * size, req.prompt_tokens)

        def cached_on(worker: str) -> int:
            return tokens(max(lookup.held(worker, prefix), placed.held(worker, prefix)))

        slack = 1.0 - item.waited_s / item.cls.sla_s
        cached = {w: tokens(n) for w, n in blocks.items()}
        item.affinity = Affinity(cached, req.prompt_tokens, rule, slack, cached_on)
        return item.affinity

    def _drop(self, item: _Item) -> None:
        item.pending = False
        self.urgency.dropped(item.req.id)
        self.pending[item.cls.name] -= 1
        fillable = self.fillable[item.cls.name]
        for model in item.models:
            fillable[model] -= 1

    def _aged_pick(self) -> tuple[_Item, OpenBatch] | None:
        """A pick of the highest class with a dispatchable request past its aging bound.

        Ranking overdue requests by class first (not by seconds overdue) keeps a
        flood of a lower class from starving a higher one: once every request of a
        batch burst is past batch's bound, realtime still waits at most its own
        aging bound (1 s by default, half its SLA) before it is served first.

        Aging chooses the class, not the request: inside the class the tenant with
        the lowest virtual token counter is served (VTC), so a tenant's flood past
        the bound does not push ahead of another tenant of the same class (issue 12).
        The oldest overdue request is served only when VTC finds nothing to place.
        """
        for cls in list(self.aging):
            urgent = self._urgent_before(cls.name)
            if urgent is not None:
                return urgent
            found = self._oldest_aged(cls)
            if found is not None:
                return self._tenant_pick(cls.name) or found
            self.aging.remove(cls)  # nothing aged left: capacity only shrinks
        return None

    def _oldest_aged(self, cls: PriorityClass) -> tuple[_Item, OpenBatch] | None:
        items, i = self.by_age[cls.name], self.age_pos[cls.name]
        bound = cls.aging_s if cls.aging_s is not None else math.inf
        found: tuple[_Item, OpenBatch] | None = None
        while i < len(items):
            item = items[i]
            if item.pending:
                if item.waited_s < bound:
                    break
                batch = self._place(item)
                if batch is not None:
                    found = (item, batch)
                    break
                self._drop(item)
            i += 1
        self.age_pos[cls.name] = i
        return found

    def _fair_pick(self) -> tuple[_Item, OpenBatch] | None:
        """SWRR over classes with work, weight-0 classes after; VTC within the class."""
        classes = [
            c.name
            for c in self.policy.classes
            if self.pending[c.name] and c.name not in self.exhausted
        ]
        round_ = [n for n in classes if self.weights[n] > 0]
        while round_:
            winner = swrr_winner(self.credit, self.weights, round_)
            assert winner is not None
            urgent = self._urgent_before(winner)
            if urgent is not None:
                return urgent
            found = self._tenant_pick(winner)
            if found is not None:
                swrr_charge(self.credit, self.weights, round_, winner)
                return found
            self.exhausted.add(winner)
            round_.remove(winner)
        for name in classes:
            if self.weights[name] > 0:
                continue
            urgent = self._urgent_before(name)
            if urgent is not None:
                return urgent
            found = self._tenant_pick(name)
            if found is not None:
                return found
            self.exhausted.add(name)
        return None

    def _urgent_before(self, name: str) -> tuple[_Item, OpenBatch] | None:
        """A pick of a class above ``name`` with an overdue request still waiting, if any
        (:mod:`~inferq.policy.preemption`, rule 2): it goes first, its tenants in counter
        order. Charges no round-robin credit (as aging does not)."""
        rank = self.urgency.rank[name]
        for urgent in self.urgency.classes_first():
            if self.urgency.rank[urgent] >= rank:
                break
            found = self._tenant_pick(urgent)
            if found is not None:
                return found
            self.urgency.exhausted(urgent)
        return None

    def _tenant_pick(self, name: str) -> tuple[_Item, OpenBatch] | None:
        vtc = self.vtc[name]
        while (tenant := vtc.lowest()) is not None:
            found = self._tenant_next(name, tenant)
            if found is not None:
                return found
            vtc.drop(tenant)
        return None

    def _tenant_next(self, name: str, tenant: str) -> tuple[_Item, OpenBatch] | None:
        items = self.by_tenant[name][tenant]
        positions = self.tenant_pos[name]
        i = positions.get(tenant, 0)
        found: tuple[_Item, OpenBatch] | None = None
        while i < len(items):
            item = items[i]
            if item.pending:
                batch = self._place(item)
                if batch is not None and not self._held(item, batch):
                    found = (item, batch)
                    break
                self._drop(item)
            i += 1
        positions[tenant] = i
        return found

    def _held(self, item: _Item, batch: OpenBatch) -> bool:
        fillable = self.fillable[item.cls.name].get(batch.spec.name, 0)
        target = batch.fill_target(self.policy.max_batch)
        return held_back(item.cls, item.waited_s, fillable, target)

    def _assign(self, item: _Item, batch: OpenBatch) -> None:
        req = item.req
        output = estimate_output_tokens(
            req.max_tokens, self.snapshot.output_estimates, batch.spec.name, req.task_type
        )
        cost = vtc_cost(req.prompt_tokens, output, self.policy.vtc_output_weight)
        assignment = Assignment(
            request_id=req.id,
            priority=item.cls.name,
            tenant=req.tenant,
            need_mib=need_mib(req, batch.spec),
            cost=cost,
            cached_tokens=item.affinity.tokens_on(batch.worker.id) if item.affinity else 0,
        )
        if not batch.items:
            self.order.append(batch)
        self.index.add(batch, assignment, item.tokens, alone=item.req.alone)
        if req.prefix:
            self.placed.set_capacity(batch.worker.id, float("inf"))
            self.placed.touch(batch.worker.id, req.block_tokens, req.prefix)
        self.urgency.placed(req.id)
        self.vtc[item.cls.name].charge(req.tenant, cost)
        delta = self.delta[item.cls.name]
        delta[req.tenant] = delta.get(req.tenant, 0.0) + cost
        self._drop(item)
