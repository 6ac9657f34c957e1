"""What the dispatch policy sees, how it is configured and what it decides: frozen dataclasses.

The dispatcher builds a :class:`Snapshot` from Redis, the simulator from its
virtual state; both hand it with a :class:`DispatchPolicy` to
:func:`inferq.policy.dispatch.decide` and carry out the :class:`Decision`. Times are
epoch (or virtual) seconds; VRAM is MiB. Every module of the policy reads these
types from here, so none of them needs another's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inferq import defaults
from inferq.config import ModelSpec, PriorityClass, Settings
from inferq.errors import ConfigError
from inferq.policy.affinity import AffinityRule


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
    #: a suspect (caught in two worker crashes): runs alone on an otherwise idle worker.
    alone: bool = False
    #: the chain of its prompt's block hashes (:mod:`inferq.prefix`), ``()`` for none.
    prefix: tuple[int, ...] = ()
    #: tokens per block of ``prefix``.
    block_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker as the policy sees it: heartbeat facts plus reserved capacity.

    ``reserved_*`` count assigned-but-unfinished work (kept exact in Redis by the
    assign and completion scripts), so capacity is never promised twice.
    ``measured_free_mib`` is the KV room the worker measured at its last beat (its
    model server's own KV figure, or NVML; None when it measured nothing): the free
    room the policy uses is the smaller of it and the booked room (issue 13).
    """

    id: str
    model: str
    params_b: float
    ready: bool
    slots: int
    kv_cache_mib: float
    reserved_slots: int = 0
    reserved_mib: float = 0.0
    #: it runs a suspect alone (see :attr:`QueuedRequest.alone`): it takes nothing else.
    isolated: bool = False
    measured_free_mib: float | None = None

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.reserved_slots)

    @property
    def free_mib(self) -> float:
        """KV room for new work, MiB: ``min(kv_cache_mib - reserved_mib, measured)``."""
        booked = self.kv_cache_mib - self.reserved_mib
        if self.measured_free_mib is not None:
            booked = min(booked, self.measured_free_mib)
        return max(0.0, booked)

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
        newcomers: class -> newcomer -> finish tag (virtual time) of the newcomers still
            waiting for their first dispatch (:func:`~inferq.policy.fairness.lift_tenants`;
            kept by the simulator; in Redis the queueing scripts keep their own,
            ``fair:new:<class>``, as they do the lift).
    """

    class_credit: Mapping[str, float] = field(default_factory=dict)
    tenant_counter: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    active_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    newcomers: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


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
        scaler_pools: models a running scaler manages (it starts workers of them on
            backlog): a request only they serve waits for a cold start instead of
            being reported unschedulable.
        prefix_index: which prompt blocks each worker's KV cache holds
            (:class:`~inferq.policy.prefix_index.PrefixIndex`, read only), or None:
            no prefix-cache affinity.
    """

    now: float
    queued: Mapping[str, Sequence[QueuedRequest]]
    workers: Sequence[WorkerView]
    fairness: FairnessState = field(default_factory=FairnessState)
    backlogged_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    output_estimates: Mapping[tuple[str, str], float] = field(default_factory=dict)
    scaler_pools: frozenset[str] = frozenset()
    prefix_index: PrefixLookup | None = None


class PrefixLookup(Protocol):
    """What a decision reads of the prefix index (:class:`.prefix_index.PrefixIndex`)."""

    def deepest(self, hashes: Sequence[int], limit: int) -> Mapping[str, int]:
        """At most ``limit`` workers holding the longest prefixes of ``hashes`` (none for
        a block more than ``limit`` workers hold): worker id -> leading blocks held."""
        ...

    def held(self, worker: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that ``worker`` holds."""
        ...


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request a worker holds (assigned or running), as the preemption rule sees it.

    Attributes:
        started_at: when it started (or was assigned, if not started), epoch seconds.
        need_mib: the KV-cache MiB reserved for it on the worker.
        aborting: an abort of this attempt was already sent (its room is on its way).
        preemptions: times the request was preempted before (``max_preemptions``
            bounds it: a request preempted that often is no longer a victim).
    """

    id: str
    worker_id: str
    priority: str
    tenant: str
    task_type: str | None
    attempt: int
    started_at: float
    need_mib: float
    prompt_tokens: int
    max_tokens: int
    aborting: bool = False
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    """A worker held for an overdue request that fits nowhere yet (no lower class admitted).

    Attributes:
        rank: the request's class position (0 = highest).
        need_mib: its KV-cache need on the reserved worker's model, MiB.
        missing_mib / missing_slots: what the worker lacked for it at the snapshot.
        waited_s: how long it had waited, seconds.
    """

    worker_id: str
    request_id: str
    priority: str
    rank: int
    need_mib: float
    missing_mib: float
    missing_slots: int
    waited_s: float


@dataclass(frozen=True, slots=True)
class Preemption:
    """A running request to abort and requeue for a reservation.

    Attributes:
        charged: tokens its dispatch charged its tenant's counter (the part it did
            not use is given back).
        reason: why, naming the request it makes room for.
    """

    request_id: str
    worker_id: str
    attempt: int
    priority: str
    tenant: str
    charged: float
    reason: str


@dataclass(frozen=True, slots=True)
class Assignment:
    """One request placed in a batch.

    Attributes:
        request_id / priority / tenant: the request.
        need_mib: KV-cache VRAM reserved for it, MiB ((prompt + max_tokens) x KV bytes/token).
        cost: tokens charged to its tenant's virtual counter.
        cached_tokens: leading prompt tokens the prefix index forecast cached on the
            worker (0: none, or no chain).
    """

    request_id: str
    priority: str
    tenant: str
    need_mib: float
    cost: float
    cached_tokens: int = 0


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
        newcomer_tags: class -> newcomer -> finish tag of the newcomers lifted now (add
            to ``FairnessState.newcomers``; drop a newcomer once charged or no longer
            backlogged).
        reservations: workers held for overdue requests still waiting after this
            decision (:mod:`~inferq.policy.preemption`): the caller reads what runs
            there and calls :func:`~inferq.policy.preemption.choose_victims`.
    """

    batches: tuple[Batch, ...] = ()
    expired: tuple[tuple[str, str], ...] = ()
    unschedulable: tuple[tuple[str, str], ...] = ()
    class_credit: Mapping[str, float] = field(default_factory=dict)
    tenant_counter_delta: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    tenant_counter_floor: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    active_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    newcomer_tags: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    reservations: tuple[Reservation, ...] = ()


@dataclass(frozen=True)
class DispatchPolicy:
    """Everything :func:`~inferq.policy.dispatch.decide` needs besides the snapshot.

    Immutable: a decision reads it, never writes it (the lookups by name are built
    once, when it is made).

    Attributes:
        classes: priority classes, highest first (weights, aging, delays...).
        models: the model registry (routes, KV bytes per token, latency profile).
        max_batch: requests per batch at most.
        batch_token_budget: ``prompt + max_tokens`` summed over a batch, tokens.
        vtc_output_weight: weight of an output token in a tenant's counter
            (VTC's w_q; an input token weighs 1).
        tenant_weights: tenant -> fair-share weight (> 0; missing = 1).
        max_preemptions: preemptions of one request at most; a request preempted this
            often is never chosen as a victim again (:mod:`inferq.policy.preemption`).
        chars_per_token: the fast prompt-token estimate's characters per token.
        affinity: the prefix-cache affinity rule (:mod:`inferq.policy.affinity`).
        class_by_name: classes by name, in priority order (derived).
        model_by_name: registry models by name (derived).

    Raises:
        ConfigError: a value is out of range or names repeat; the message
            names the field and the limit.
    """

    classes: tuple[PriorityClass, ...]
    models: tuple[ModelSpec, ...]
    max_batch: int = defaults.MAX_BATCH
    batch_token_budget: int = defaults.BATCH_TOKEN_BUDGET
    vtc_output_weight: float = defaults.VTC_OUTPUT_WEIGHT
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)
    max_preemptions: int = defaults.MAX_PREEMPTIONS
    chars_per_token: float = defaults.CHARS_PER_TOKEN
    affinity: AffinityRule = field(default_factory=AffinityRule)
    class_by_name: Mapping[str, PriorityClass] = field(init=False, repr=False, compare=False)
    model_by_name: Mapping[str, ModelSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "tenant_weights", dict(self.tenant_weights))
        _check_unique("classes", [c.name for c in self.classes])
        _check_unique("models", [m.name for m in self.models])
        _check_min("max_batch", self.max_batch, 1)
        _check_min("batch_token_budget", self.batch_token_budget, 1)
        _check_min("vtc_output_weight", self.vtc_output_weight, 0)
        _check_min("max_preemptions", self.max_preemptions, 0)
        if self.chars_per_token <= 0:
            raise ConfigError(f"policy.chars_per_token must be > 0, got {self.chars_per_token}")
        for tenant, weight in self.tenant_weights.items():
            if not weight > 0:
                raise ConfigError(f"policy.tenant_weights[{tenant!r}] must be > 0, got {weight}")
        object.__setattr__(self, "class_by_name", {c.name: c for c in self.classes})
        object.__setattr__(self, "model_by_name", {m.name: m for m in self.models})

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> DispatchPolicy:
        """The policy of ``settings`` (classes, registry, chars per token), with overrides.

        Raises:
            ConfigError: an override names no field, or a value is out of range.
        """
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"policy has no field {unknown[0]!r} (fields: {sorted(names)})")
        values: dict[str, Any] = {
            "classes": tuple(settings.classes),
            "models": tuple(settings.models),
            "chars_per_token": settings.chars_per_token,
            "affinity": AffinityRule(
                enabled=settings.prefix.enabled,
                load_weight=settings.prefix.load_weight,
                balance_abs_tokens=settings.prefix.balance_abs_tokens,
                balance_rel=settings.prefix.balance_rel,
                urgent_load_factor=settings.prefix.urgent_load_factor,
            ),
        }
        values.update(overrides)
        return cls(**values)

    def tenant_weight(self, tenant: str) -> float:
        """A tenant's fair-share weight (1 unless configured)."""
        return self.tenant_weights.get(tenant, 1.0)


def _check_unique(what: str, names: Sequence[str]) -> None:
    if not names:
        raise ConfigError(f"policy.{what} must not be empty")
    if len(set(names)) != len(names):
        raise ConfigError(f"policy.{what} names must be unique, got {list(names)}")


def _check_min(what: str, value: float, least: float) -> None:
    if value < least:
        raise ConfigError(f"policy.{what} must be >= {least}, got {value}")
