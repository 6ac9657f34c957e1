"""Fairness: how dispatch slots are shared between priority classes and between tenants.

Across classes: smooth weighted round-robin
    The SWRR of nginx's upstream balancer (``ngx_http_upstream_get_peer``). Every
    dispatch ("pick") adds each *round* class's weight to its credit, serves the
    class with the highest credit (the higher class on ties) and subtracts the
    sum of the round's weights from the winner. The round is the classes with
    dispatchable work and a weight above 0. Over any stretch where the same
    classes stay backlogged, class ``i`` gets ``w_i / sum(w)`` of the picks, spread
    evenly (5:1:1 gives ``a a b a c a a``) rather than in bursts. Credits live
    in Redis (``Decision.class_credit``), so any dispatcher replica continues
    the sequence.

    A class of weight 0 is outside the round: it is served only when no class of
    positive weight has dispatchable work, classes of weight 0 in priority
    order. That is strict priority.

Aging
    ``PriorityClass.aging_s`` bounds waiting: a class with a dispatchable request
    that has waited at least its ``aging_s`` is served before any round pick,
    the highest such class first; inside it VTC picks the tenant as in a round
    pick (aging protects classes from each other, it must not let one tenant's
    overdue flood pass another tenant of the same class: issue 12).
    Ranking by class (not by seconds overdue) matters under a flood: once a
    burst of batch work is all past batch's bound, a realtime request still
    waits no longer than realtime's own bound (1 s, half its SLA).
    Aging picks leave the credits alone, so they neither earn nor cost a class
    its round share; they do charge the tenant's counter.

The two classic policies are configurations of this one mechanism (the simulator's
baselines, :mod:`inferq.sim.baselines`):

- strict priority (Triton, vLLM's priority scheduling): weights (1, 0, 0, ...)
  and no aging -- :func:`~inferq.sim.baselines.strict_priority_classes`;
- the seed's "every 5 realtime dispatches serve one lower": weights
  (5, 1, 0, ...) with the classes' aging bounds kept, so the third class
  progresses through aging alone -- :func:`~inferq.sim.baselines.seed_ratio_classes`.

Within a class: Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024)
    Each tenant has a counter of the tokens it was served; a request costs
    ``prompt_tokens + vtc_output_weight * estimated output tokens`` (the paper's
    ``w_p * L_input + w_q * L_output`` with w_p = 1). The backlogged tenant with
    the lowest ``counter / weight`` (weight 1 unless configured) is served next;
    among equals the tenant whose oldest dispatchable request has waited longest
    (at the decision's start), then a stable hash of the name (CRC-32: the same in
    every dispatcher replica). Ties by name served ``aaa-*`` tenants first among
    equals, every time (issue 24). A tenant that becomes active (backlogged now, not at
    the previous decision) is lifted to ``max(own, weight * min(counter / weight))``
    over the tenants that were active before and are still backlogged, so idle
    time earns no credit.

    Counters of tenants that stay backlogged with dispatchable work and start within
    one request's cost of each other stay within it (the paper proves twice the largest
    cost for its server; the property tests check that bound).

    Newcomers as one group (issue 24): a *newcomer* is a tenant with no counter in the
    class (never seen, or folded after ``TENANT_IDLE_S`` idle). Lifted to the minimum,
    every one of a crowd of newcomers (200 one-request tenants) tied at the floor and
    went ahead of every established tenant: a returning tenant waited 59 s behind them
    in the simulator's ``tenant-crowd`` scenario (its SLA: 10 s). So a newcomer starts
    no lower than the *finish tag* of the newcomers still waiting for their first
    dispatch (weighted fair queueing's start = max(virtual time, previous finish)):
    each waiting newcomer's lifted virtual time plus its first request's charge at
    max_tokens (``prompt + output_weight x max_tokens``, at least what it will be
    charged) over its weight. A crowd then advances like one tenant sending requests of
    that size, at most that tenant's share, and an established tenant waits behind
    about one newcomer per turn; a newcomer arriving with no newcomer waiting is lifted
    exactly as before. The price: honest newcomers arriving together share one share. A
    newcomer that leaves before its first dispatch moves the ones behind it up
    (:func:`newcomer_left`), so queueing and cancelling costs the others nothing.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence

from inferq.config import PriorityClass

# --- across classes -----------------------------------------------------------


def swrr_winner(
    credit: Mapping[str, float], weights: Mapping[str, float], round_: Sequence[str]
) -> str | None:
    """The class SWRR would serve next among ``round_`` (in priority order), not charged.

    Returns:
        The class with the highest ``credit + weight`` (the earliest on ties),
        or None when the round is empty.
    """
    best: str | None = None
    best_value = 0.0
    for name in round_:
        value = credit.get(name, 0.0) + weights[name]
        if best is None or value > best_value:
            best, best_value = name, value
    return best


def swrr_charge(
    credit: MutableMapping[str, float],
    weights: Mapping[str, float],
    round_: Sequence[str],
    winner: str,
) -> None:
    """Apply one SWRR pick in place: every round class gains its weight, the winner pays the sum.

    Raises:
        ValueError: ``winner`` is not in ``round_``.
    """
    if winner not in round_:
        raise ValueError(f"winner {winner!r} is not in the round {list(round_)}")
    total = 0.0
    for name in round_:
        credit[name] = credit.get(name, 0.0) + weights[name]
        total += weights[name]
    credit[winner] -= total


def overdue_s(cls: PriorityClass, waited_s: float) -> float | None:
    """Seconds a request is past its class's aging bound (>= 0), or None when it is not.

    Args:
        cls: the request's class (``aging_s`` None = no bound).
        waited_s: seconds since the request was submitted.
    """
    if cls.aging_s is None or waited_s < cls.aging_s:
        return None
    return waited_s - cls.aging_s


# --- within a class -----------------------------------------------------------


def vtc_cost(prompt_tokens: int, output_tokens: float, output_weight: float) -> float:
    """A request's charge to its tenant's counter: ``prompt + output_weight * output`` tokens."""
    return prompt_tokens + output_weight * output_tokens


def lift_new_tenants(
    counters: Mapping[str, float],
    previously_active: Iterable[str],
    backlogged: Iterable[str],
    weight: Callable[[str], float],
) -> dict[str, float]:
    """Counters newly active tenants are lifted to (VTC's counter lift).

    Args:
        counters: tenant -> served-token counter (missing = 0).
        previously_active: tenants backlogged at the previous decision.
        backlogged: tenants backlogged now.
        weight: tenant -> fair-share weight (> 0).

    Returns:
        tenant -> new counter, only for tenants that became active and whose
        counter rises: ``weight(t) * min(counter(a) / weight(a))`` over the
        tenants ``a`` active before and still backlogged. Empty when no such
        tenant exists.
    """
    now = set(backlogged)
    before = set(previously_active)
    still = now & before
    if not still:
        return {}
    floor = min(counters.get(t, 0.0) / weight(t) for t in still)
    lifted: dict[str, float] = {}
    for tenant in sorted(now - before):
        value = floor * weight(tenant)
        if value > counters.get(tenant, 0.0):
            lifted[tenant] = value
    return lifted


def lift_tenants(
    counters: Mapping[str, float],
    previously_active: Iterable[str],
    backlogged: Iterable[str],
    weight: Callable[[str], float],
    waiting: Mapping[str, float],
    first: Mapping[str, tuple[float, float]],
) -> tuple[dict[str, float], dict[str, float]]:
    """VTC's lift (:func:`lift_new_tenants`) with newcomers as one group (module docstring).

    Args:
        counters / previously_active / backlogged / weight: as for
            :func:`lift_new_tenants`.
        waiting: newcomer -> finish tag (virtual time) of the newcomers still waiting for
            their first dispatch, from earlier decisions.
        first: tenant -> (submit time, epoch seconds; size, tokens: its VTC charge at
            max_tokens, :func:`vtc_cost`) of its oldest queued request; newcomers are
            stacked in that order (missing: last, size 0).

    Returns:
        ``(lifted, tags)``: tenant -> new counter (as :func:`lift_new_tenants`, only
        rises), and newcomer -> finish tag for the newcomers lifted now (the caller
        keeps them with ``waiting`` until each is charged or leaves the backlog).
    """
    lifted = lift_new_tenants(counters, previously_active, backlogged, weight)
    before = set(previously_active)
    fresh = [t for t in backlogged if t not in before and t not in counters and t not in waiting]
    if not fresh:
        return lifted, {}
    tail = max(waiting.values(), default=0.0)
    tags: dict[str, float] = {}
    for tenant in sorted(fresh, key=lambda t: (first.get(t, (math.inf, 0.0))[0], name_hash(t))):
        w = weight(tenant)
        start = max(lifted.get(tenant, 0.0) / w, tail)
        if start * w > counters.get(tenant, 0.0):
            lifted[tenant] = start * w
        tail = tags[tenant] = start + first.get(tenant, (0.0, 0.0))[1] / w
    return lifted, tags


def newcomer_left(
    tenant: str,
    waiting: MutableMapping[str, float],
    counters: MutableMapping[str, float],
    backlogged: Iterable[str],
    weight: Callable[[str], float],
) -> None:
    """A waiting newcomer left the backlog undispatched (cancelled, expired): the
    newcomers stacked behind it move up by its size, never below the lowest backlogged
    virtual time, as if it had never come -- a crowd that queues and cancels must not push
    an honest newcomer back for free (issue 24's attack: five cancelled one-off tenants
    put a newcomer behind an established tenant's 150 requests). In place.

    Args:
        tenant: the newcomer that left (nothing happens unless it is in ``waiting``).
        waiting: newcomer -> finish tag, virtual time (``FairnessState.newcomers``).
        counters: tenant -> counter (VTC), of the class.
        backlogged: the tenants backlogged now (``tenant`` not among them).
        weight: tenant -> fair-share weight (> 0).
    """
    tag = waiting.pop(tenant, None)
    if tag is None:
        return
    size = tag - counters.get(tenant, 0.0) / weight(tenant)
    if size <= 0:
        return
    floor = min((counters.get(t, 0.0) / weight(t) for t in backlogged), default=0.0)
    for other, other_tag in list(waiting.items()):
        if other_tag <= tag:
            continue
        w = weight(other)
        v = counters.get(other, 0.0) / w
        moved = v - max(v - size, floor)
        if moved > 0:
            counters[other] = (v - moved) * w
            waiting[other] = other_tag - moved


def name_hash(tenant: str) -> int:
    """A tenant's stable tie-break hash (CRC-32 of its name: the same in every process,
    unlike ``hash``, and not ordered like the name)."""
    return zlib.crc32(tenant.encode())


class VirtualTokenCounter:
    """VTC working state of one class during one decision: who is served next.

    Args:
        counters: tenant -> counter at the start (lifts already applied).
        tenants: the tenants that have queued requests to offer.
        weight: tenant -> fair-share weight (> 0).
        oldest: tenant -> submit time (epoch seconds) of its oldest dispatchable
            request at the decision's start: among tenants of equal ``counter /
            weight`` the smallest is served first (missing: after every known one),
            then the lowest :func:`name_hash`.
    """

    def __init__(
        self,
        counters: Mapping[str, float],
        tenants: Iterable[str],
        weight: Callable[[str], float],
        oldest: Mapping[str, float] | None = None,
    ) -> None:
        self.counters: dict[str, float] = dict(counters)
        self._weight = weight
        self._oldest = dict(oldest or {})
        self._live: set[str] = set(tenants)
        self._heap = [self._entry(t) for t in self._live]
        heapq.heapify(self._heap)

    def _entry(self, tenant: str) -> tuple[float, float, int, str]:
        oldest = self._oldest.get(tenant, float("inf"))
        return (self._key(tenant), oldest, name_hash(tenant), tenant)

    def _key(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0) / self._weight(tenant)

    def virtual_time(self, tenant: str) -> float:
        """``tenant``'s ``counter / weight`` now (0 for a tenant never charged)."""
        return self._key(tenant)

    def lowest(self) -> str | None:
        """The tenant with the lowest ``counter / weight`` still offering work (on ties
        the one waiting longest, then the lowest :func:`name_hash`)."""
        heap = self._heap
        while heap:
            key, _, _, tenant = heap[0]
            if tenant in self._live and key == self._key(tenant):
                return tenant
            heapq.heappop(heap)  # stale entry: charged since, or dropped
        return None

    def drop(self, tenant: str) -> None:
        """``tenant`` has nothing dispatchable left in this decision."""
        self._live.discard(tenant)

    def charge(self, tenant: str, cost: float) -> None:
        """Add ``cost`` tokens to ``tenant``'s counter."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        if tenant in self._live:
            heapq.heappush(self._heap, self._entry(tenant))
