"""The five policies the simulator compares (issue 7), each named in its output.

=================  ==========================================  =====================
name               dispatch                                     scaling
=================  ==========================================  =====================
static-fifo        FIFO: oldest first, any class, round-robin   none: a fleet sized
                   over eligible workers (:class:`FifoDispatch`) for the trace's peak
strict-priority    ``decide`` with ``strict_priority_classes``  ``decide_scale``
                   (weights 1, 0, 0; no aging)
seed               ``decide`` with ``seed_ratio_classes(5)``;   ``seed_scale``
                   routing's least-utilised eligible worker
keda-zcard         FIFO (:class:`FifoDispatch`)                 ``keda_zcard_scale``
inferq             ``decide`` with the configured classes       ``decide_scale``
=================  ==========================================  =====================

Beside ``inferq`` on traces whose requests carry prefix chains
(:data:`PREFIX_BASELINES`; issue 22), two routings of the same ``decide``, classes
and scaler, differing only in the prefix-cache affinity rule
(:mod:`inferq.policy.affinity`):

=================  ===================================================================
least-loaded       no affinity: the least-utilised worker with room (routing before it)
naive-affinity     the longest cached prefix wins, load ignored (slots and KV room aside)
=================  ===================================================================

Every rule is the production one: :func:`inferq.policy.dispatch.decide`, the
class transforms of :mod:`inferq.policy.fairness` and the scalers of
:mod:`inferq.policy.scaling` are called, never copied. FIFO is the one
dispatch rule of its own (no scheduler exists in those baselines); it uses
:mod:`inferq.policy.routing` for eligibility. ``strict-priority`` keeps
inferq's scaler so that only the ordering differs from ``inferq``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from inferq.config import PriorityClass, Settings
from inferq.errors import InvalidRequest
from inferq.policy.affinity import AffinityRule
from inferq.policy.dispatch import decide
from inferq.policy.routing import FleetCapacity, need_mib, serving_models
from inferq.policy.scaling import (
    ModelLoad,
    ScaleDecision,
    ScalerState,
    ScalingConfig,
    decide_scale,
)
from inferq.policy.snapshot import (
    Assignment,
    Batch,
    Decision,
    DispatchPolicy,
    QueuedRequest,
    Snapshot,
)
from inferq.sim.baselines import (
    keda_zcard_scale,
    naive_affinity,
    no_affinity,
    seed_ratio_classes,
    seed_scale,
    strict_priority_classes,
)

#: ``(snapshot) -> decision``: what the simulator calls where the dispatcher calls ``decide``.
DispatchFn = Callable[[Snapshot], Decision]
#: The signature shared by ``decide_scale``, ``seed_scale`` and ``keda_zcard_scale``.
ScaleFn = Callable[
    [Sequence[ModelLoad], ScalerState, ScalingConfig, Sequence[PriorityClass], float],
    tuple[list[ScaleDecision], ScalerState],
]
ClassTransform = Callable[[Sequence[PriorityClass]], tuple[PriorityClass, ...]]
AffinityTransform = Callable[[AffinityRule], AffinityRule]

#: The seed text's fairness ratio: every five realtime dispatches serve one lower.
SEED_RATIO = 5


@dataclass(frozen=True)
class SimPolicy:
    """A named policy: how requests are ordered and placed, and how the fleet scales.

    Attributes:
        name: shown in every output.
        summary: one line for tables and the JSON.
        ordering: ``"decide"`` (the production dispatch policy) or ``"fifo"``.
        classes: turns the configured classes into the policy's (weights, aging).
        scaler: the scaling function, or None for a static fleet.
        peak_fleet: the fleet is sized for the trace's peak instead of ``--fleet``.
        affinity: turns the configured prefix-cache affinity rule into the policy's
            (None: the configured one).
    """

    name: str
    summary: str
    ordering: Literal["decide", "fifo"]
    classes: ClassTransform
    scaler: ScaleFn | None
    peak_fleet: bool = False
    affinity: AffinityTransform | None = None

    def dispatch_policy(self, settings: Settings) -> DispatchPolicy:
        """The dispatch policy over ``settings``' registry and this policy's classes (the
        preemption rule reads its classes' ``may_preempt_after_s`` and ``preemptible``)."""
        policy = DispatchPolicy.from_settings(settings, classes=self.classes(settings.classes))
        if self.affinity is None:
            return policy
        return replace(policy, affinity=self.affinity(policy.affinity))

    def dispatcher(self, settings: Settings) -> DispatchFn:
        """A fresh dispatch function over ``settings``' classes and registry (stateful for FIFO)."""
        policy = self.dispatch_policy(settings)
        if self.ordering == "fifo":
            return FifoDispatch(policy)

        def run(snapshot: Snapshot) -> Decision:
            return decide(snapshot, policy)

        return run


def _same(classes: Sequence[PriorityClass]) -> tuple[PriorityClass, ...]:
    return tuple(classes)


def _seed(classes: Sequence[PriorityClass]) -> tuple[PriorityClass, ...]:
    return seed_ratio_classes(classes, SEED_RATIO)


POLICIES: Mapping[str, SimPolicy] = {
    p.name: p
    for p in (
        SimPolicy(
            "static-fifo",
            "no scheduler: FIFO, round-robin, fleet sized for the trace's peak minute",
            "fifo",
            _same,
            None,
            peak_fleet=True,
        ),
        SimPolicy(
            "strict-priority",
            "strict priority, no aging (Triton/vLLM order); inferq's scaler",
            "decide",
            strict_priority_classes,
            decide_scale,
        ),
        SimPolicy(
            "seed",
            "ratio 5 realtime:1 lower, least-utilised worker; >20 pending & full -> +1, 300 s idle",
            "decide",
            _seed,
            seed_scale,
            affinity=no_affinity,
        ),
        SimPolicy(
            "keda-zcard",
            "FIFO dispatch; ceil(queued / 5) workers, polled every 30 s, 300 s cooldown",
            "fifo",
            _same,
            keda_zcard_scale,
        ),
        SimPolicy(
            "inferq",
            "weighted fair classes + aging + VTC tenants + batching; trend/backlog/SLA scaler",
            "decide",
            _same,
            decide_scale,
        ),
    )
}


#: The routings compared with ``inferq`` when the requests carry prefix chains.
PREFIX_BASELINES: Mapping[str, SimPolicy] = {
    p.name: p
    for p in (
        replace(
            POLICIES["inferq"],
            name="least-loaded",
            summary="inferq without prefix affinity: least-utilised worker with room",
            affinity=no_affinity,
        ),
        replace(
            POLICIES["inferq"],
            name="naive-affinity",
            summary="inferq with 'longest cached prefix wins', load ignored",
            affinity=naive_affinity,
        ),
    )
}
#: Every named policy (``inferq simulate --policy``).
ALL_POLICIES: Mapping[str, SimPolicy] = {**POLICIES, **PREFIX_BASELINES}


def without_preemption(policy: SimPolicy) -> SimPolicy:
    """``policy`` with the rule against priority inversion off: every class's
    ``may_preempt_after_s`` cleared (no overdue class first, no reservation, no
    preemption; :mod:`inferq.policy.preemption`). The baseline that measures what the
    rule costs the lower classes; the same policy for those that never preempt."""
    classes = policy.classes

    def transform(cs: Sequence[PriorityClass]) -> tuple[PriorityClass, ...]:
        return tuple(c.model_copy(update={"may_preempt_after_s": None}) for c in classes(cs))

    return replace(policy, name=f"{policy.name} (no preemption)", classes=transform)


def preempts(policy: SimPolicy, settings: Settings) -> bool:
    """True when ``policy`` may preempt: it dispatches with ``decide`` and some class of
    its has a ``may_preempt_after_s``."""
    return policy.ordering == "decide" and any(
        c.may_preempt_after_s is not None for c in policy.classes(settings.classes)
    )


class FifoDispatch:
    """FIFO dispatch: oldest first over every class, each to the next eligible worker in turn.

    One call is one decision over the snapshot: requests in ``(submitted_at, id)``
    order; a request past its deadline is expired; one no live worker could ever
    hold is reported unschedulable and skipped
    (:class:`~inferq.policy.routing.FleetCapacity`); otherwise it goes to the
    first worker, in id order starting after the worker served last (round-robin,
    kept between calls), that is ready, runs one of the request's serving models
    (:func:`~inferq.policy.routing.serving_models`) and has a free slot and the
    request's KV-cache need (:func:`~inferq.policy.routing.need_mib`). When no
    worker has room for the oldest request, dispatch stops there (head-of-line
    blocking: a FIFO queue has no other order). Fairness state is left alone.

    Args:
        policy: the registry and classes (for routes, degrading and context limits).
    """

    def __init__(self, policy: DispatchPolicy) -> None:
        self.policy = policy
        self.last_worker: str | None = None

    def __call__(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now
        queue = sorted(
            (r for reqs in snapshot.queued.values() for r in reqs),
            key=lambda r: (r.submitted_at, r.id),
        )
        ring = sorted((w for w in snapshot.workers if w.ready), key=lambda w: w.id)
        free = {w.id: [w.free_slots, w.free_mib] for w in ring}
        models = {w.id: w.model for w in ring}
        capacity = FleetCapacity(snapshot.workers, self.policy, snapshot.scaler_pools)
        expired: list[tuple[str, str]] = []
        unschedulable: list[tuple[str, str]] = []
        batches: dict[str, list[Assignment]] = {}
        for req in queue:
            if req.deadline <= now:
                waited = now - req.submitted_at
                expired.append((req.id, f"deadline passed while queued (waited {waited:.2f} s)"))
                continue
            reason = capacity.reason(req)
            if reason is not None:
                unschedulable.append((req.id, reason))
                continue
            placed = self._place(req, free, models, now)
            if placed is None:
                break
            wid, need = placed
            batches.setdefault(wid, []).append(
                Assignment(req.id, req.priority, req.tenant, need, 0.0)
            )
        return Decision(
            batches=tuple(Batch(w, models[w], tuple(items)) for w, items in batches.items()),
            expired=tuple(expired),
            unschedulable=tuple(unschedulable),
        )

    def _place(
        self,
        req: QueuedRequest,
        free: dict[str, list[float]],
        models: Mapping[str, str],
        now: float,
    ) -> tuple[str, float] | None:
        """The next worker in turn with room for ``req`` (reserving it), or None."""
        try:
            serving = serving_models(req, self.policy, now)
        except InvalidRequest:
            return None
        ids = list(models)
        if not ids:
            return None
        start = 0
        if self.last_worker is not None:
            start = next((i for i, w in enumerate(ids) if w > self.last_worker), 0)
        for k in range(len(ids)):
            wid = ids[(start + k) % len(ids)]
            if models[wid] not in serving:
                continue
            need = need_mib(req, self.policy.model_by_name[models[wid]])
            room = free[wid]
            if room[0] >= 1 and need <= room[1]:
                room[0] -= 1
                room[1] -= need
                self.last_worker = wid
                return wid, need
        return None
