"""What the dispatch policy sees and what it decides: plain frozen dataclasses.

The dispatcher builds a :class:`Snapshot` from Redis, the simulator from its
virtual state; both hand it to :func:`inferq.policy.dispatch.decide` and carry
out the :class:`Decision`. Times are epoch (or virtual) seconds; VRAM is MiB.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A queued request as the policy sees it (no payload)."""

    id: str
    priority: str
    route: str
    tenant: str
    task_type: str | None
    submitted_at: float
    deadline: float
    prompt_tokens: int
    max_tokens: int
    attempts: int = 0
    #: the worker whose attempt failed last; avoided when another can serve.
    excluded_worker: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker as the policy sees it: heartbeat facts plus reserved capacity.

    ``reserved_*`` count assigned-but-unfinished work (kept exact in Redis by the
    assign and completion scripts), so capacity is never promised twice.
    """

    id: str
    model: str
    params_b: float
    ready: bool
    slots: int
    kv_cache_mib: float
    reserved_slots: int = 0
    reserved_mib: float = 0.0

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.reserved_slots)

    @property
    def free_mib(self) -> float:
        return max(0.0, self.kv_cache_mib - self.reserved_mib)

    @property
    def utilisation(self) -> float:
        """Fraction of slots reserved, 0..1."""
        return min(1.0, self.reserved_slots / self.slots) if self.slots else 1.0


@dataclass(frozen=True, slots=True)
class FairnessState:
    """Fairness state carried between decisions (lives in Redis).

    Attributes:
        class_credit: class -> smooth weighted round-robin credit.
        tenant_counter: class -> tenant -> virtual token counter (VTC).
        active_tenants: class -> tenants that were backlogged at the last decision.
    """

    class_credit: Mapping[str, float] = field(default_factory=dict)
    tenant_counter: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    active_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one decision needs.

    Attributes:
        now: the current time, seconds.
        queued: class -> queued requests of that class, oldest first (all routes).
        backlogged_tenants: class -> tenants with at least one queued request
            (exact, from the queue counters; may include tenants beyond ``queued``).
        workers: live workers (any state; only ``ready`` ones are eligible).
        fairness: carried fairness state.
        output_estimates: (model, task_type) -> moving mean of generated tokens.
    """

    now: float
    queued: Mapping[str, Sequence[QueuedRequest]]
    workers: Sequence[WorkerView]
    fairness: FairnessState = field(default_factory=FairnessState)
    backlogged_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    output_estimates: Mapping[tuple[str, str], float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Assignment:
    """One request placed in a batch.

    Attributes:
        request_id / priority / tenant: the request.
        need_mib: KV-cache VRAM reserved for it, MiB ((prompt + max_tokens) x KV bytes/token).
        cost: tokens charged to its tenant's virtual counter.
    """

    request_id: str
    priority: str
    tenant: str
    need_mib: float
    cost: float


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests for one worker, in dispatch order."""

    worker_id: str
    model: str
    items: tuple[Assignment, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now.

    Attributes:
        batches: batches to claim and hand to workers, in dispatch order.
        expired: (request id, reason) to expire now (deadline passed, or cannot
            finish in time when the class refuses late work).
        unschedulable: (request id, reason) no live worker could ever serve
            (reported; the request stays queued until its deadline).
        class_credit: the new smooth-WRR credits (replace the stored ones).
        tenant_counter_delta: class -> tenant -> tokens charged this decision (add).
        tenant_counter_floor: class -> tenant -> counter a newly active tenant is
            lifted to (set, before adding the delta).
        active_tenants: class -> tenants backlogged now (replace the stored sets).
    """

    batches: tuple[Batch, ...] = ()
    expired: tuple[tuple[str, str], ...] = ()
    unschedulable: tuple[tuple[str, str], ...] = ()
    class_credit: Mapping[str, float] = field(default_factory=dict)
    tenant_counter_delta: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    tenant_counter_floor: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    active_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)


def eligible_models_note(workers: Sequence[WorkerView]) -> str:
    """Short description of a fleet for error reasons, e.g. ``"2 x llama-3.1-8b"``."""
    counts: dict[str, int] = {}
    for w in workers:
        counts[w.model] = counts.get(w.model, 0) + 1
    return ", ".join(f"{n} x {m}" for m, n in sorted(counts.items())) or "no workers"
