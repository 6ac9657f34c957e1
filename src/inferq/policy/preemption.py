"""Against priority inversion: room held by lower classes never keeps a higher class past its SLA.

Issue 12's fault 1: a realtime request waited 11.9 s (SLA 2 s) behind four long batch
requests that held every slot, and a large request can wait forever while a stream of
small lower-class requests keeps taking the KV-cache room it needs. Any resource held
by lower-class work (slots, KV cache) is covered by three rules, each per class:

1. **Urgency.** A request is *overdue* once it has waited its class's
   ``may_preempt_after_s`` (realtime 0.5 s, standard 5 s; ``None``: never).
2. **Overdue classes first** (headroom, decided per pick): whenever a decision would
   serve a class (by aging or by round-robin), a higher class with an overdue request
   still waiting is served instead, its tenants still in virtual-token-counter order,
   until its overdue requests are placed or fit nowhere. Higher classes keep their
   precedence over it. Lower-class work then only takes room
   the overdue requests could not use. (The aging bound does the same at a longer
   bound for every class; this rule keeps tenant fairness inside the class.)
3. **Reservation with backfilling** (EASY backfilling, Lifka 1995 / Mu'alem & Feitelson
   2001): an overdue request that fits no worker reserves one, the worker of its route
   whose capacity could hold it and that is closest to fitting it (least missing KV
   room, then a free slot, then route preference and id). No request of a lower class
   is admitted onto a reserved worker until the reserved request has been placed, nor,
   while the reserved request lacks room there, a younger one of its own class whose
   tenant stands worse in VTC order (holding it against lower classes only let
   another tenant's stream of small requests of the same class keep a large one from
   ever fitting; a tenant VTC serves first is never held back, or one tenant's flood
   of large requests would make a new tenant wait behind all of it). EASY
   backfills jobs that finish before the reservation starts; inferq has no finish time
   it could promise (``max_tokens`` is a bound, the output estimate a mean), so on a
   reserved worker it backfills nothing of a lower class: the other workers take it.
   One reservation per worker, the highest class and the oldest request first.
4. **Preemption** (vLLM's recompute preemption): on a reserved worker that still lacks
   room, running requests of lower, ``preemptible`` classes are aborted and requeued at
   their original position (no attempt spent; :mod:`inferq.store`'s ``abort.lua``):
   the lowest class first, then the fewest preemptions so far, then the least progress
   (the latest start), and never more than the room the reserved request needs. A
   request already preempted ``max_preemptions`` times is no victim (least progress
   alone picks the request just dispatched again after its last preemption, so a
   light realtime stream aborted one batch request in every gap and it never
   finished). Requests already being aborted count as
   freed room, so a slow abort is never answered with a second victim. When even every
   preemptible request would not make room, none is preempted (a pointless abort only
   costs the victim).

Everything here is pure: a snapshot (and, for preemption, what runs on the reserved
workers) in, decisions out.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from inferq.config import PriorityClass
from inferq.errors import InvalidRequest
from inferq.policy.batching import OpenBatch
from inferq.policy.estimate import estimate_output_tokens
from inferq.policy.fairness import vtc_cost
from inferq.policy.fleet import FleetIndex
from inferq.policy.routing import need_mib, serving_models
from inferq.policy.snapshot import (
    Batch,
    DispatchPolicy,
    Preemption,
    QueuedRequest,
    Reservation,
    RunningRequest,
    Snapshot,
    WorkerView,
)

#: Overdue requests per class a decision considers at most (oldest first): they block
#: lower classes and reserve workers; a longer overdue backlog only means every worker
#: already serves or is reserved by that class.
MAX_URGENT_PER_CLASS = 64


def overdue(cls: PriorityClass, waited_s: float) -> bool:
    """True when a request of ``cls`` that waited ``waited_s`` seconds may preempt."""
    bound = cls.may_preempt_after_s
    return bound is not None and waited_s >= bound


@dataclass(slots=True)
class _Urgent:
    req: QueuedRequest
    rank: int
    tokens: int
    models: tuple[str, ...]
    pending: bool = True  # not placed yet
    placeable: bool = True  # not found to fit nowhere in this decision


class Urgency:
    """The overdue requests of one decision, the reservations, and which placements they block.

    Args:
        snapshot: the decision's snapshot.
        policy: the dispatch policy.
        skip: ids of queued requests the decision does not dispatch (expired,
            unschedulable); they neither block nor reserve.
        fleet: the snapshot's workers already indexed (None: indexed here when needed).
    """

    def __init__(
        self,
        snapshot: Snapshot,
        policy: DispatchPolicy,
        skip: set[str],
        fleet: FleetIndex | None = None,
    ) -> None:
        self.policy = policy
        self.rank = {c.name: i for i, c in enumerate(policy.classes)}
        self._by_model: dict[str, list[_Urgent]] = {}
        self._by_id: dict[str, _Urgent] = {}
        now = snapshot.now
        for cls in policy.classes:
            if cls.may_preempt_after_s is None:
                continue
            found = 0
            for req in sorted(snapshot.queued.get(cls.name, ()), key=_age_order):
                if found >= MAX_URGENT_PER_CLASS or not overdue(cls, now - req.submitted_at):
                    break
                if req.id in skip:
                    continue
                try:
                    models = serving_models(req, policy, now)
                except InvalidRequest:
                    continue
                entry = _Urgent(
                    req, self.rank[cls.name], req.prompt_tokens + req.max_tokens, models
                )
                self._by_id[req.id] = entry
                for m in models:
                    self._by_model.setdefault(m, []).append(entry)
                found += 1
        self.reservations = reserve(
            [e.req for e in self._by_id.values()], snapshot.workers, policy, now, fleet
        )
        self._reserved_by = {r.worker_id: r for r in self.reservations}
        # What blockers() compares, once per decision (it runs for every candidate
        # placement: ~700 times x up to 192 reservations in a busy 5,000-worker step):
        # per class rank, the reservations lacking room in age order; the workers
        # reserved by higher classes and the answers per (rank, older reservations,
        # tenant standing) are remembered until a reserved request is placed.
        self._lacking: dict[int, list[tuple[str, _Urgent]]] = {}
        self._lacking_age: dict[int, list[tuple[float, str]]] = {}
        lacking = sorted(
            (
                (_age_order(self._by_id[r.request_id].req), r)
                for r in self.reservations
                if r.missing_mib > 0 or r.missing_slots > 0
            ),
            key=lambda row: row[0],
        )
        for age, r in lacking:
            self._lacking.setdefault(r.rank, []).append((r.worker_id, self._by_id[r.request_id]))
            self._lacking_age.setdefault(r.rank, []).append(age)
        self._reserving = {r.request_id for r in self.reservations}
        self._higher: dict[int, frozenset[str]] = {}
        self._memo: dict[int, tuple[Mapping[str, float], dict[tuple[int, float], frozenset[str]]]]
        self._memo = {}
        self._first: list[str] | None = None

    @property
    def active(self) -> bool:
        """True when some worker is reserved (a placement may be blocked)."""
        return bool(self._reserved_by)

    def placed(self, request_id: str) -> None:
        """An overdue request was placed: it reserves no more."""
        entry = self._by_id.get(request_id)
        if entry is not None and entry.pending:
            entry.pending = False
            self._first = None
            if request_id in self._reserving:  # its worker blocks no more
                self._higher.clear()
                self._memo.clear()

    def dropped(self, request_id: str) -> None:
        """An overdue request fits nowhere for the rest of the decision (it keeps its
        reservation)."""
        entry = self._by_id.get(request_id)
        if entry is not None:
            entry.placeable = False
            self._first = None

    def classes_first(self) -> list[str]:
        """Classes with an overdue request that may still be placed, highest first (rule 2).

        The list is remembered until a request is placed or dropped; do not change it.
        """
        if self._first is None:
            ranked = sorted(
                {
                    (e.rank, e.req.priority)
                    for e in self._by_id.values()
                    if e.pending and e.placeable
                }
            )
            self._first = [name for _, name in ranked]
        return self._first

    def exhausted(self, priority: str) -> None:
        """Class ``priority`` has nothing placeable left in this decision."""
        for e in self._by_id.values():
            if e.req.priority == priority:
                e.placeable = False
        self._first = None

    def blocks(
        self, batch: OpenBatch, req: QueuedRequest, standing: Mapping[str, float] | None = None
    ) -> bool:
        """True when ``req`` must not go into ``batch``: the worker is reserved for an
        unplaced overdue request ``req`` may not go before (rule 3, :meth:`blockers`)."""
        return batch.worker.id in self.blockers(req, standing or {})

    def blockers(self, req: QueuedRequest, standing: Mapping[str, float]) -> frozenset[str]:
        """The reserved workers ``req`` may not be admitted to (rule 3).

        Those whose unplaced overdue request is of a higher class; or of ``req``'s own
        class while it lacks room there (at the snapshot), is older, and its tenant
        stands better in the class's VTC order (``standing``: tenant -> virtual time
        at the decision's start, missing = 0; a tie, as a newly active tenant's lift
        makes, is left to VTC; the mapping must not change during the decision, which
        remembers answers per mapping): EASY backfilling holds a reserved worker
        against later jobs, not only lower priorities, or another tenant's stream of
        small requests of the same class kept a large one from ever fitting; and only
        against tenants VTC would not serve first, or one tenant's flood of large
        requests would make a new tenant wait behind all of it.
        """
        rank = self.rank.get(req.priority, len(self.rank))
        higher = self._higher.get(rank)
        if higher is None:
            higher = self._higher[rank] = frozenset(
                r.worker_id
                for r in self.reservations
                if r.rank < rank and self._by_id[r.request_id].pending
            )
        # Own class: reservations lacking room, older than req (a request is never older
        # than itself, so its own reservation is never among them).
        older = bisect_left(self._lacking_age.get(rank, ()), _age_order(req))
        if not older:
            return higher
        mine = standing.get(req.tenant, 0.0)
        seen, answers = self._memo.get(rank, (None, None))
        if seen is not standing or answers is None:
            answers = {}
            self._memo[rank] = (standing, answers)
        found = answers.get((older, mine))
        if found is None:
            same = [
                wid
                for wid, entry in self._lacking[rank][:older]
                if entry.pending and standing.get(entry.req.tenant, 0.0) < mine
            ]
            found = answers[(older, mine)] = higher.union(same) if same else higher
        return found

    def unplaced(self) -> tuple[Reservation, ...]:
        """Reservations whose request is still waiting (the preemption step's input)."""
        return tuple(r for r in self.reservations if self._by_id[r.request_id].pending)


def _age_order(req: QueuedRequest) -> tuple[float, str]:
    return (req.submitted_at, req.id)


def reserve(
    urgent: Iterable[QueuedRequest],
    workers: Sequence[WorkerView],
    policy: DispatchPolicy,
    now: float,
    fleet: FleetIndex | None = None,
) -> tuple[Reservation, ...]:
    """One reserved worker per overdue request, highest class and oldest first (rule 3).

    A request reserves the ready worker of its route whose capacity could ever hold it
    and that lacks the least for it now: missing KV-cache MiB, then a missing slot,
    then the route's model preference, the utilisation and the id. A worker is
    reserved at most once; a request with no worker left reserves none.

    Args:
        urgent: overdue requests (any order).
        workers: the snapshot's workers.
        policy: the dispatch policy (classes in priority order, registry).
        now: the decision's time, seconds.
        fleet: ``workers`` already indexed (:class:`~inferq.policy.fleet.FleetIndex`,
            the same views); None indexes them here.

    Returns:
        The reservations, in the order they were made.
    """
    rank = {c.name: i for i, c in enumerate(policy.classes)}
    ordered = sorted(urgent, key=lambda r: (rank.get(r.priority, len(rank)), *_age_order(r)))
    out: list[Reservation] = []
    if not ordered:
        return ()
    # The key's worker parts come from the fleet index's two orders of the ready workers
    # per model (issue 17's busy fleet: kept between decisions, not rebuilt here).
    # The lowest key for a need: a worker with free_mib >= need (missing 0) first, the
    # lowest (slot, utilisation, id) among those; else the most free MiB, then (slot,
    # utilisation, id). So: the first row not taken in most-free order tells which case,
    # and in the first case the first fitting row in (slot, utilisation, id) order wins.
    index = fleet if fleet is not None and fleet.serves(policy) else None
    if index is None:
        index = FleetIndex.build(workers, policy)
    taken: set[str] = set()
    for req in ordered:
        try:
            models = serving_models(req, policy, now)
        except InvalidRequest:
            continue
        order = {m: i for i, m in enumerate(models)}
        best: tuple[tuple[float, int, int, float, str], WorkerView, float] | None = None
        for model, pref in order.items():
            cands = index.by_free.get(model)
            if not cands:
                continue
            need = need_mib(req, policy.model_by_name[model])
            top = next((r for r in cands if need <= r[4] and r[3] not in taken), None)
            if top is None:
                continue
            if -top[0] < need:
                missing = need - -top[0]
                key = (missing, top[1], pref, top[2], top[3])
                view = top[5]
            else:
                rest = next(
                    r
                    for r in index.by_rest[model]
                    if need <= r[3] and need <= r[4] and r[2] not in taken
                )
                key = (0.0, rest[0], pref, rest[1], rest[2])
                view = rest[5]
            if best is None or key < best[0]:
                best = (key, view, need)
        if best is None:
            continue
        (missing_mib, missing_slot, *_), w, need = best
        taken.add(w.id)
        out.append(
            Reservation(
                worker_id=w.id,
                request_id=req.id,
                priority=req.priority,
                rank=rank.get(req.priority, len(rank)),
                need_mib=need,
                missing_mib=missing_mib,
                missing_slots=missing_slot,
                waited_s=now - req.submitted_at,
            )
        )
    return tuple(out)


def choose_victims(
    reservations: Sequence[Reservation],
    running: Mapping[str, Sequence[RunningRequest]],
    snapshot: Snapshot,
    policy: DispatchPolicy,
    batches: Sequence[Batch] = (),
    fleet: FleetIndex | None = None,
) -> tuple[Preemption, ...]:
    """Running requests to preempt so each unplaced reservation fits on its worker (rule 4).

    Args:
        reservations: reservations still waiting after the decision
            (:attr:`~inferq.policy.snapshot.Decision.reservations`).
        running: worker id -> requests it holds (assigned or running), from Redis.
        snapshot: the decision's snapshot (workers' capacity and reservations).
        policy: the dispatch policy (classes: ``preemptible``; the counter's weights).
        batches: the decision's batches (room they took on a reserved worker counts as used).
        fleet: the snapshot's workers already indexed (the same views), or None.

    Returns:
        The preemptions, per reservation the lowest class first, then the fewest
        preemptions so far, then the latest start; none for a reservation that preempting
        every eligible request (those preempted fewer than ``policy.max_preemptions``
        times) would not satisfy.
    """
    workers = fleet.views if fleet is not None else {w.id: w for w in snapshot.workers}
    took: dict[str, tuple[int, float]] = {}
    for b in batches:
        slots, mib = took.get(b.worker_id, (0, 0.0))
        took[b.worker_id] = (slots + len(b.items), mib + sum(a.need_mib for a in b.items))
    rank = {c.name: i for i, c in enumerate(policy.classes)}
    out: list[Preemption] = []
    for res in reservations:
        w = workers.get(res.worker_id)
        if w is None:
            continue
        used_slots, used_mib = took.get(w.id, (0, 0.0))
        held = running.get(w.id, ())
        freeing = [r for r in held if r.aborting]
        free_slots = w.free_slots - used_slots + len(freeing)
        free_mib = w.free_mib - used_mib + sum(r.need_mib for r in freeing)
        short_slots = max(0, 1 - free_slots)
        short_mib = max(0.0, res.need_mib - free_mib)
        if short_slots == 0 and short_mib <= 0:
            continue  # room is on its way (or there): nothing to preempt
        eligible = [
            r
            for r in held
            if not r.aborting
            and rank.get(r.priority, -1) > res.rank
            and policy.class_by_name[r.priority].preemptible
            and r.preemptions < policy.max_preemptions
        ]
        eligible.sort(key=lambda r: (-rank[r.priority], r.preemptions, -r.started_at, r.id))
        chosen: list[RunningRequest] = []
        for r in eligible:
            if short_slots <= 0 and short_mib <= 0:
                break
            chosen.append(r)
            short_slots -= 1
            short_mib -= r.need_mib
        if short_slots > 0 or short_mib > 0:
            continue  # even all of them would not make room: preempt nobody
        reason = (
            f"preempted for {res.priority} request {res.request_id} "
            f"(waited {res.waited_s:.2f} s, needs {res.need_mib:.0f} MiB on {w.id})"
        )
        out.extend(
            Preemption(
                request_id=r.id,
                worker_id=w.id,
                attempt=r.attempt,
                priority=r.priority,
                tenant=r.tenant,
                charged=_charged(r, w, snapshot, policy),
                reason=reason,
            )
            for r in chosen
        )
    return tuple(out)


def _charged(r: RunningRequest, w: WorkerView, snapshot: Snapshot, policy: DispatchPolicy) -> float:
    """What the request's dispatch charged its tenant's counter (the same formula)."""
    output = estimate_output_tokens(r.max_tokens, snapshot.output_estimates, w.model, r.task_type)
    return vtc_cost(r.prompt_tokens, output, policy.vtc_output_weight)


def preemption_refund(
    charged: float,
    prompt_tokens: int,
    generated: int,
    output_weight: float,
    *,
    started: bool = True,
) -> float:
    """Tokens given back to a preempted request's tenant counter (never negative).

    A preempted request is charged only for what it used: once started, its prompt
    plus ``output_weight`` x the tokens it generated before the abort (the counter's
    own :func:`~inferq.policy.fairness.vtc_cost`); the rest of its dispatch charge
    ``charged`` is given back. One aborted before it started (assigned, not running)
    used nothing: the whole charge is given back. ``requeue_preempted.lua`` and
    ``abort.lua`` apply the same formula in Redis; the simulator calls this.

    Args:
        charged: what the dispatch charged (:attr:`Preemption.charged`), tokens.
        prompt_tokens: the request's prompt, tokens.
        generated: completion tokens generated before the abort.
        output_weight: the counter's weight of an output token.
        started: whether the model server had started it.
    """
    if not started:
        return max(0.0, charged)
    return max(0.0, charged - vtc_cost(prompt_tokens, generated, output_weight))


def refunded_counter(counter: float, refund: float) -> float:
    """A tenant counter after a preemption's refund: ``max(0, counter - refund)``."""
    return max(0.0, counter - refund) if refund > 0 else counter
