"""Fleet sizing from a workload and the latency model: sustainable rate and peak fleet.

One request occupies a slot for its service time (:func:`inferq.latency.service_time`).
A worker with ``slots`` slots, all busy, serves its sequences at concurrency
``slots``, so by Little's law it completes ``slots / s`` requests per second,
where ``s`` is the mean service time at concurrency ``slots``. Since service
time is linear in the token counts, ``s`` is exactly the mean of the
per-request service times.

- :func:`sustainable_rate`: requests/s a fleet completes at full concurrency
  with the workload's mix of request sizes, ``sum_m n_m x slots / s_m``
  (requests go to their route's preferred model ``m``).
- :func:`peak_fleet`: what a peak-provisioned deployment (the ``static-fifo``
  baseline) runs: per model, enough workers for the busiest window of
  ``window_s`` seconds, ``ceil(max_window(sum of slot-seconds) / (window_s x slots))``,
  at least one.

Given the card (``vram_mib``), ``slots`` is the *effective* concurrency
(:func:`effective_slots`): the configured slots, or fewer when the workload's mean
sequence (``prompt + output / 2`` KV tokens) fills the model's KV cache first. The KV
cache, not a slot count, is what limits a worker (issue 16).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from inferq import defaults
from inferq.config import ModelSpec, Settings
from inferq.errors import InvalidRequest
from inferq.latency import resident_kv_tokens, service_time
from inferq.routes import check_known, parse_route
from inferq.sim.workload import SimRequest


def preferred_model(route: str, settings: Settings) -> str:
    """The route's preferred registry model (exact name, or the smallest adequate).

    Raises:
        InvalidRequest: the route does not parse or no model serves it.
    """
    return check_known(parse_route(route), settings.models)[0].name


def slot_seconds(request: SimRequest, spec: ModelSpec, slots: int) -> float:
    """Seconds ``request`` holds a slot of ``spec`` when ``slots`` sequences run."""
    return service_time(spec, request.prompt_tokens, request.output_tokens, slots).total_s


def effective_slots(
    requests: Sequence[SimRequest], spec: ModelSpec, slots: int, vram_mib: int | None
) -> int:
    """Sequences one worker of ``spec`` runs at once for these requests (>= 1).

    ``min(slots, kv_cache_tokens / mean(prompt + output / 2))``; ``slots`` when the
    card is unknown (``vram_mib`` None) or nothing is routed to ``spec``.
    """
    if vram_mib is None or not requests:
        return slots
    per_seq = sum(resident_kv_tokens(r.prompt_tokens, r.output_tokens, 1) for r in requests)
    per_seq = max(1.0, per_seq / len(requests))
    room = spec.kv_cache_mib(vram_mib) * 1024 * 1024 / spec.kv_bytes_per_token
    return max(1, min(slots, math.floor(room / per_seq)))


def sustainable_rate(
    requests: Sequence[SimRequest],
    settings: Settings,
    fleet: Mapping[str, int],
    slots: int = defaults.SIM_WORKER_SLOTS,
    vram_mib: int | None = None,
) -> float:
    """Requests/s ``fleet`` completes at full concurrency with this workload's sizes.

    Args:
        requests: the workload (its mix of token counts per model).
        settings: the registry.
        fleet: model -> workers.
        slots: slots per worker.
        vram_mib: the card, MiB (None: slots alone limit concurrency).

    Returns:
        The total arrival rate at which the first model saturates: each model
        ``m`` gets the share ``q_m`` of the requests and completes
        ``n_m x slots / s_m`` requests/s, so the rate is ``min_m n_m x slots / s_m / q_m``
        (``n x slots / s`` for one model). 0.0 when no request has a serving model
        or a loaded model has no worker.
    """
    routed = _routed(requests, settings)
    total = sum(len(v) for v in routed.values())
    best: float | None = None
    for name, mine in routed.items():
        spec = settings.model_by_name[name]
        c = effective_slots(mine, spec, slots, vram_mib)
        times = [slot_seconds(r, spec, c) for r in mine]
        workers = fleet.get(name, 0)
        capacity = workers * c / (sum(times) / len(times))
        share = len(times) / total
        rate = capacity / share
        best = rate if best is None else min(best, rate)
    return best or 0.0


def offered_rate(requests: Sequence[SimRequest]) -> float:
    """Mean arrival rate, requests/s: count over (last - first arrival); 0.0 if no span."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return len(requests) / span if span > 0 else 0.0


def _routed(requests: Sequence[SimRequest], settings: Settings) -> dict[str, list[SimRequest]]:
    """Model -> the requests its routes prefer it for (unservable ones left out), in order."""
    by_model: dict[str, list[SimRequest]] = {}
    for r in requests:
        try:
            name = preferred_model(r.route, settings)
        except InvalidRequest:
            continue
        by_model.setdefault(name, []).append(r)
    return by_model


def peak_fleet(
    requests: Sequence[SimRequest],
    settings: Settings,
    slots: int = defaults.SIM_WORKER_SLOTS,
    window_s: float = defaults.SIM_PEAK_WINDOW_S,
    vram_mib: int | None = None,
) -> dict[str, int]:
    """Workers per model that carry the busiest ``window_s`` of ``requests`` at full concurrency.

    Args:
        requests: sorted by arrival.
        settings: the registry.
        slots: slots per worker.
        window_s: the window, seconds (> 0).
        vram_mib: the card, MiB (None: slots alone limit concurrency).

    Returns:
        model -> ``max(1, ceil(peak slot-seconds / (window_s x slots)))`` for every
        model some request is routed to.

    Raises:
        ValueError: ``window_s`` is not positive.
    """
    if not window_s > 0:
        raise ValueError(f"window_s: must be > 0 seconds, got {window_s}")
    out: dict[str, int] = {}
    for name, mine in sorted(_routed(requests, settings).items()):
        spec = settings.model_by_name[name]
        c = effective_slots(mine, spec, slots, vram_mib)
        points = [(r.arrival_s, slot_seconds(r, spec, c)) for r in mine]
        out[name] = max(1, math.ceil(_peak_window(points, window_s) / (window_s * c) - 1e-9))
    return out


def _peak_window(points: Sequence[tuple[float, float]], window_s: float) -> float:
    """Largest sum of costs over arrivals within any ``[t, t + window_s)`` (two pointers)."""
    best = total = 0.0
    lo = 0
    for t, cost in points:
        total += cost
        while points[lo][0] <= t - window_s:
            total -= points[lo][1]
            lo += 1
        best = max(best, total)
    return best
