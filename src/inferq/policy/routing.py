"""Routing: which workers may take a request, which one should, and which never could.

A worker is eligible for a request (design brief, issue 3) when

- it is ``ready`` and runs a model of the registry;
- its model serves the request's route (:mod:`inferq.routes`): the exact model,
  any model of the required size, or a configured fallback -- fallbacks only
  when the request's class has ``allow_degrade`` and the request has waited at
  least ``degrade_after_s``;
- the model's context holds ``prompt + max_tokens`` (``ModelSpec.max_context``);
- it has a free slot and ``free_mib >= need_mib`` (reservations of assigned but
  unfinished work already subtracted);
- it is not running a suspect alone (``isolated``), and for a suspect (``alone``: a
  request caught in two worker crashes) it has nothing reserved at all: a
  suspect runs alone, so a poison request that crashes its worker again takes no
  other request with it (issue 13, fault 2).

Among eligible workers the preferred one is the first model in route order
(the exact model before its fallbacks; for a size requirement the smallest
adequate model, i.e. the cheapest), then the lowest utilisation as of the
snapshot, then the worker id. The worker of a request's last failed attempt
(``excluded_worker``) is taken only when no other is eligible.

:func:`choose_worker` states the rule over a list; :class:`WorkerIndex` is the
same rule for the dispatcher's hot loop, with workers bucketed by model and
sorted by utilisation, so a pick scans a few workers instead of the fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from inferq.config import ModelSpec, PriorityClass
from inferq.errors import InvalidRequest
from inferq.policy.affinity import AffinityRule, Candidate, choose
from inferq.policy.batching import OpenBatch
from inferq.policy.snapshot import Assignment, DispatchPolicy, QueuedRequest, WorkerView
from inferq.routes import candidates, parse_route

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Affinity:
    """A request's prefix-cache affinity during one placement.

    Attributes:
        cached: the candidates: worker id -> leading prompt tokens its cache holds
            (forecast), tokens; the workers holding the longest prefixes
            (``defaults.PREFIX_CANDIDATES`` of the index, as many of this decision's).
        prompt_tokens: the request's prompt tokens.
        rule: the affinity settings.
        slack: fraction of the request's class SLA left, 0..1.
        cached_on: worker id -> its cached prompt tokens, for any worker (the
            least-loaded pick need not be a candidate).
    """

    cached: Mapping[str, int]
    prompt_tokens: int
    rule: AffinityRule
    slack: float
    cached_on: Callable[[str], int]

    def tokens_on(self, worker_id: str) -> int:
        """Cached prompt tokens forecast on ``worker_id``."""
        got = self.cached.get(worker_id)
        return self.cached_on(worker_id) if got is None else got


def load_tokens(batch: OpenBatch) -> float:
    """Tokens (prompt + max_tokens) a worker holds plus what ``batch`` gave it so far:
    its reserved KV MiB and the batch's, over its model's KV bytes per token."""
    mib = batch.worker.reserved_mib + batch.mib
    return mib * MIB / batch.spec.kv_bytes_per_token


def kv_mib(tokens: int, spec: ModelSpec) -> float:
    """KV-cache VRAM ``tokens`` tokens fill on ``spec``: ``tokens x kv bytes per token``, MiB.

    ``ModelSpec.kv_bytes_per_token`` is 2 (K and V) x layers x KV heads x head dim x
    bytes per value (vLLM's block accounting, without its block rounding).
    """
    return tokens * spec.kv_bytes_per_token / MIB


def need_mib(request: QueuedRequest, spec: ModelSpec) -> float:
    """KV-cache VRAM a request may fill on ``spec``: ``(prompt + max_tokens) x kv bytes``, MiB."""
    return kv_mib(request.prompt_tokens + request.max_tokens, spec)


def may_degrade(cls: PriorityClass | None, request: QueuedRequest, now: float) -> bool:
    """True when fallback models may serve ``request``: the class allows it and it waited enough."""
    return (
        cls is not None and cls.allow_degrade and now - request.submitted_at >= cls.degrade_after_s
    )


def route_models(policy: DispatchPolicy, route: str, degrade: bool) -> tuple[str, ...]:
    """Registry models serving ``route``, most preferred first.

    A pure function of the registry, the route and ``degrade``, remembered per
    (registry, route, degrade) outside the policy, which stays immutable.

    Raises:
        InvalidRequest: (field ``model``) the route text does not parse.
    """
    found = _route_models(policy.models, route, degrade)
    if isinstance(found, InvalidRequest):
        raise found
    return found


@lru_cache(maxsize=4096)
def _route_models(
    models: tuple[ModelSpec, ...], route: str, degrade: bool
) -> tuple[str, ...] | InvalidRequest:
    """:func:`route_models`, memoised; a route that does not parse gives its error."""
    try:
        names = candidates(parse_route(route), models, degrade=degrade)
    except InvalidRequest as exc:
        return exc
    registry = {m.name for m in models}
    return tuple(n for n in names if n in registry)


def serving_models(request: QueuedRequest, policy: DispatchPolicy, now: float) -> tuple[str, ...]:
    """Models that may serve ``request`` now, in preference order.

    The route's models (fallbacks included when :func:`may_degrade`) whose
    context holds ``prompt + max_tokens``.

    Raises:
        InvalidRequest: (field ``model``) the route text does not parse.
    """
    cls = policy.class_by_name.get(request.priority)
    models = route_models(policy, request.route, may_degrade(cls, request, now))
    tokens = request.prompt_tokens + request.max_tokens
    by_name = policy.model_by_name
    return tuple(m for m in models if tokens <= by_name[m].max_context)


def eligible(
    worker: WorkerView, request: QueuedRequest, policy: DispatchPolicy, now: float
) -> bool:
    """True when ``worker`` may take ``request`` now (the rule in the module docstring)."""
    if not worker.ready or worker.isolated or worker.free_slots < 1:
        return False
    if request.alone and worker.reserved_slots > 0:
        return False
    spec = policy.model_by_name.get(worker.model)
    if spec is None:
        return False
    try:
        models = serving_models(request, policy, now)
    except InvalidRequest:
        return False
    return worker.model in models and need_mib(request, spec) <= worker.free_mib


def choose_worker(
    request: QueuedRequest,
    workers: Iterable[WorkerView],
    policy: DispatchPolicy,
    now: float,
) -> WorkerView | None:
    """The preferred eligible worker for ``request``, or None when none is eligible.

    Order: route preference of the model, then utilisation, then id; the
    ``excluded_worker`` only when it is the sole eligible worker. A linear scan;
    the dispatcher uses :class:`WorkerIndex`, which picks the same worker.
    """
    try:
        order = {m: i for i, m in enumerate(serving_models(request, policy, now))}
    except InvalidRequest:
        return None
    found = [w for w in workers if eligible(w, request, policy, now)]
    preferred = [w for w in found if w.id != request.excluded_worker] or found
    if not preferred:
        return None
    return min(preferred, key=lambda w: (order[w.model], w.utilisation, w.id))


class WorkerIndex:
    """Ready workers bucketed by model, each bucket sorted by (utilisation, id).

    Holds one :class:`OpenBatch` per ready registry worker with room; a batch
    leaves its bucket once closed (no slot, or ``max_batch`` items). Capacity
    only shrinks during a decision, so a request of ``t`` tokens that found no
    room for a set of models means no request of ``t`` or more tokens will:
    that is remembered, and such requests are refused without a scan.

    Args:
        workers: the snapshot's workers (any order).
        policy: the dispatch policy (registry, ``max_batch``, token budget).
        ranked: ``workers`` are already in (utilisation, id) order (a
            :class:`~inferq.policy.fleet.FleetIndex`'s open workers): not sorted again.
    """

    def __init__(
        self, workers: Iterable[WorkerView], policy: DispatchPolicy, *, ranked: bool = False
    ) -> None:
        self._max_batch = policy.max_batch
        self._budget = policy.batch_token_budget
        self._buckets: dict[str, list[OpenBatch]] = {}
        self._by_id: dict[str, OpenBatch] = {}
        if not ranked:
            workers = sorted(workers, key=lambda w: (w.utilisation, w.id))
        for w in workers:
            spec = policy.model_by_name.get(w.model)
            if spec is None or not w.ready or w.isolated or w.free_slots < 1:
                continue
            batch = OpenBatch(worker=w, spec=spec)
            if not batch.closed(self._max_batch):
                self._buckets.setdefault(w.model, []).append(batch)
                self._by_id[w.id] = batch
        self._open = sum(len(b) for b in self._buckets.values())
        self._refused: dict[tuple[object, ...], int] = {}

    @property
    def open_count(self) -> int:
        """Workers that can still take a request in this decision."""
        return self._open

    def place(
        self,
        models: Sequence[str],
        tokens: int,
        excluded: str | None = None,
        *,
        alone: bool = False,
        blocked: Callable[[OpenBatch], bool] | None = None,
        group: object = None,
        affinity: Callable[[], Affinity | None] | None = None,
    ) -> OpenBatch | None:
        """The preferred open batch for a request, or None when none has room.

        The preferred batch is the first with room in route order and (utilisation,
        id) order; with ``affinity``, the workers of the same model that hold a prefix
        of the request compete with it under :func:`~inferq.policy.affinity.choose`.

        Args:
            models: the request's serving models, in preference order.
            tokens: its prompt + max_tokens.
            excluded: a worker id to take only when no other has room.
            alone: a suspect: only an empty batch of a worker with nothing reserved
                (a refusal for that reason says nothing of other requests' room).
            blocked: batches this request may not join (the preemption rule's
                reservations and headroom); they count as having no room.
            group: what ``blocked`` depends on (the workers it blocks): refusals are
                remembered per (models, group).
            affinity: gives the request's cached prefix per worker and the rule (None:
                no affinity); called only once a worker with room is found, so a
                request that fits nowhere costs no index lookup.
        """
        key: tuple[object, ...] = (*models, group)
        if tokens >= self._refused.get(key, tokens + 1):
            return None
        fallback: OpenBatch | None = None
        for model in models:
            bucket = self._buckets.get(model)
            if not bucket:
                continue
            need = kv_mib(tokens, bucket[0].spec)
            for batch in bucket:
                if batch.has_room(tokens, need, self._max_batch, self._budget, alone=alone):
                    if blocked is not None and blocked(batch):
                        continue
                    if batch.worker.id != excluded:
                        aff = None if affinity is None else affinity()
                        if aff is None:
                            return batch
                        return self._affine(batch, tokens, need, excluded, blocked, aff)
                    fallback = batch
        if fallback is None and not alone:
            self._refused[key] = min(tokens, self._refused.get(key, tokens))
        return fallback

    def _affine(
        self,
        default: OpenBatch,
        tokens: int,
        need: float,
        excluded: str | None,
        blocked: Callable[[OpenBatch], bool] | None,
        affinity: Affinity,
    ) -> OpenBatch:
        """``default`` or a worker of its model holding a prefix of the request, by cost."""
        model = default.worker.model
        batches = [default]
        cached = []
        for worker_id, cached_tokens in affinity.cached.items():
            batch = self._by_id.get(worker_id)
            if (
                batch is None
                or batch is default
                or worker_id == excluded
                or batch.worker.model != model
                or not batch.has_room(tokens, need, self._max_batch, self._budget)
                or (blocked is not None and blocked(batch))
            ):
                continue
            cached.append(Candidate(len(batches), cached_tokens, load_tokens(batch)))
            batches.append(batch)
        if not cached:
            return default
        first = Candidate(0, affinity.tokens_on(default.worker.id), load_tokens(default))
        pick = choose(first, cached, affinity.prompt_tokens, affinity.rule, affinity.slack)
        return batches[pick.key]

    def add(
        self, batch: OpenBatch, assignment: Assignment, tokens: int, *, alone: bool = False
    ) -> None:
        """Append ``assignment`` to ``batch`` (``alone``: a suspect, which closes it); the
        batch leaves its bucket once closed."""
        batch.add(assignment, tokens)
        batch.alone = batch.alone or alone
        if batch.closed(self._max_batch):
            self._buckets[batch.worker.model].remove(batch)
            del self._by_id[batch.worker.id]
            self._open -= 1


class FleetCapacity:
    """What the live fleet could ever hold: the largest KV cache per model, MiB.

    Args:
        workers: live workers in any state (a starting worker will be ready).
        policy: the dispatch policy (registry, classes).
        pools: models a running scaler manages: a request that only they serve is
            not unschedulable (the scaler starts a worker; its KV cache is unknown
            until it beats, so no size check applies until then).
        largest_mib: model -> the largest KV cache of its live workers, MiB, already
            known (:meth:`~inferq.policy.fleet.FleetIndex.largest_mib`); ``workers``
            add to it.
    """

    def __init__(
        self,
        workers: Iterable[WorkerView],
        policy: DispatchPolicy,
        pools: frozenset[str] = frozenset(),
        *,
        largest_mib: dict[str, float] | None = None,
    ) -> None:
        self._policy = policy
        self._pools = pools
        self.largest_mib: dict[str, float] = dict(largest_mib or {})
        for w in workers:
            self.largest_mib[w.model] = max(self.largest_mib.get(w.model, 0.0), w.kv_cache_mib)
        self._live: dict[tuple[str, str], str | tuple[ModelSpec, ...]] = {}

    def reason(self, request: QueuedRequest) -> str | None:
        """Why no live worker could ever serve ``request``, or None when one could."""
        key = (request.priority, request.route)
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = self._live_models(request)
        if isinstance(live, str):
            return live
        if not live:  # served by a scaler pool only: waits for its cold start
            return None
        tokens = request.prompt_tokens + request.max_tokens
        for spec in live:
            if (
                tokens <= spec.max_context
                and need_mib(request, spec) <= self.largest_mib[spec.name]
            ):
                return None
        return self._too_big(request, live)

    def _live_models(self, request: QueuedRequest) -> str | tuple[ModelSpec, ...]:
        """The registry models with live workers that may ever serve the request, or why none."""
        policy = self._policy
        cls = policy.class_by_name.get(request.priority)
        if cls is None:
            return f"priority class {request.priority!r} is not configured"
        try:
            models = route_models(policy, request.route, cls.allow_degrade)
        except InvalidRequest as exc:
            return f"route {request.route!r} is invalid: {exc.reason}"
        if not models:
            return f"no model in the registry serves {request.route}"
        live = tuple(policy.model_by_name[m] for m in models if m in self.largest_mib)
        if live or any(m in self._pools for m in models):
            return live
        return f"no live worker or scaler pool serves {_route_words(request.route)}"

    def _too_big(self, request: QueuedRequest, live: Sequence[ModelSpec]) -> str:
        tokens = request.prompt_tokens + request.max_tokens
        in_context = [s for s in live if tokens <= s.max_context]
        if not in_context:
            widest = max(live, key=lambda s: s.max_context)
            return (
                f"needs {tokens} tokens (prompt + max_tokens), more than the "
                f"{widest.max_context}-token context of {widest.name}"
            )
        best = max(in_context, key=lambda s: self.largest_mib[s.name] - need_mib(request, s))
        return (
            f"needs {need_mib(request, best) / 1024:.1f} GiB KV cache, largest "
            f"{best.name} worker has {self.largest_mib[best.name] / 1024:.1f} GiB"
        )


def _route_words(route: str) -> str:
    """``model llama-2-13b`` for an exact route, ``a >=13b model`` for a size requirement."""
    return f"a {route} model" if route.startswith(">=") else f"model {route}"


def unschedulable_reason(
    request: QueuedRequest,
    workers: Sequence[WorkerView],
    policy: DispatchPolicy,
    pools: frozenset[str] = frozenset(),
) -> str | None:
    """Why no live worker could ever serve ``request``, or None when one could.

    Considers every live worker (any state) of every model serving the route,
    fallbacks included when the class allows degrading.

    Returns:
        e.g. ``"needs 21.3 GiB KV cache, largest llama-3.1-8b worker has 16.0 GiB"``;
        ``"no live worker or scaler pool serves model <route>"`` when neither the
        fleet nor a running scaler's pools serve the route (report it, do not fail
        the request: a worker may still join); None when only a pool serves it.
    """
    return FleetCapacity(workers, policy, pools).reason(request)
