"""What one worker can carry at its SLA: the capacity model the scaler sizes the fleet with.

Pure (no clock, no Redis). The scaler daemon (:func:`inferq.policy.scaling_inputs.build_loads`)
and the simulator (:class:`inferq.sim.loads.LoadTracker`) both call :func:`worker_capacity`
and hand its ``rate`` to :func:`inferq.policy.scaling.decide_scale` as
``ModelLoad.capacity_rate``, so the two size a fleet the same way.

For the mean request of the last window (``prompt`` and ``output`` tokens), each running
sequence holds ``prompt + output / 2`` KV tokens on average over its decode
(:func:`inferq.latency.resident_kv_tokens`: what a decode step reads), but the
dispatcher admits it only where ``prompt + max_tokens`` fit
(:func:`inferq.policy.routing.need_mib`, reserved for its whole run), so its
``reserved = prompt + output`` tokens (``max_tokens`` is at least the output; the
window knows only the output) are what fills a worker. A worker may run ``c`` of them
where all three limits hold:

- KV cache: ``c x reserved <= occupancy x kv_cache_tokens`` (the dispatcher places no
  request past its free KV cache; ``occupancy`` leaves headroom for the spread of
  request sizes). Sizing on the resident half-output instead over-counted a worker by
  8% on the conversation trace (1,155 + 211 tokens) and more where outputs are long:
  the fleet it chose queued at the crest of a wave;
- TPOT: the decode step at ``c`` stays within the strictest class's per-token target
  (:mod:`inferq.sla`): ``step_s(c, c x per_seq) <= tpot`` solved for ``c`` in the
  roofline form of :mod:`inferq.latency`;
- slots: ``c <= slots`` (the model server's own cap on sequences).

Its rate is Little's law over the latency model at that concurrency, the simulator's
own: ``rate = c / service_time(prompt, output, c).total_s`` requests/s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from inferq.config import ModelSpec, PriorityClass
from inferq.latency import resident_kv_tokens, service_time, weight_bytes

Limit = Literal["kv_cache", "tpot", "slots"]

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    """One worker's carrying capacity at the target occupancy.

    Attributes:
        concurrency: sequences it runs at once (>= 1, may be fractional).
        kv_tokens: KV tokens resident at that concurrency (what a decode step reads).
        kv_share: KV tokens reserved at that concurrency over the whole KV cache (0..1).
        rate: requests/s it completes (Little's law).
        limited_by: which limit set ``concurrency``.
    """

    concurrency: float
    kv_tokens: float
    kv_share: float
    rate: float
    limited_by: Limit


def strictest_tpot(classes: Iterable[PriorityClass]) -> float | None:
    """The smallest per-output-token target among ``classes`` (None when none has one)."""
    targets = [c.tpot_s for c in classes if c.tpot_s is not None]
    return min(targets) if targets else None


def tpot_concurrency(spec: ModelSpec, per_seq_tokens: float, tpot_s: float) -> float:
    """Largest batch whose decode step stays within ``tpot_s`` (inf if always; 0 if never).

    ``step = overhead + seq_step c + (weights + c per_seq kv_bytes) / bw <= tpot``, so
    ``c <= (tpot - overhead - weights / bw) / (seq_step + per_seq kv_bytes / bw)``.
    """
    p = spec.latency
    bw = p.mem_bw_gbs * 1e9
    room = tpot_s - p.step_overhead_ms / 1000.0 - weight_bytes(spec) / bw
    per = p.seq_step_ms / 1000.0 + max(0.0, per_seq_tokens) * spec.kv_bytes_per_token / bw
    if room <= 0:
        return 0.0
    return math.inf if per <= 0 else room / per


def worker_capacity(
    spec: ModelSpec,
    kv_cache_mib: float,
    slots: int,
    prompt_tokens: float,
    output_tokens: float,
    tpot_s: float | None,
    occupancy: float,
) -> WorkerCapacity:
    """What one worker of ``spec`` carries for this request mix (see the module docstring).

    Args:
        spec: the model and its latency profile.
        kv_cache_mib: the worker's KV-cache room, MiB (0: unknown, the KV limit is skipped).
        slots: the most sequences it runs at once (>= 1).
        prompt_tokens / output_tokens: the mean request of the window (>= 0).
        tpot_s: the strictest per-output-token target among its classes (None: none).
        occupancy: share of the KV cache to fill at most (0 < x <= 1).

    Raises:
        ValueError: ``slots < 1`` or ``occupancy`` outside (0, 1].
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not 0 < occupancy <= 1:
        raise ValueError(f"occupancy must be in (0, 1], got {occupancy}")
    per_seq = max(1.0, resident_kv_tokens(round(prompt_tokens), round(output_tokens), 1))
    reserved = max(1.0, prompt_tokens + output_tokens)
    kv_room = kv_cache_mib * _MIB / spec.kv_bytes_per_token
    limits: list[tuple[float, Limit]] = [(float(slots), "slots")]
    if kv_room > 0:
        limits.append((occupancy * kv_room / reserved, "kv_cache"))
    if tpot_s is not None:
        limits.append((tpot_concurrency(spec, per_seq, tpot_s), "tpot"))
    c, limit = min(limits, key=lambda x: x[0])
    c = max(1.0, c)
    total = service_time(
        spec, round(prompt_tokens), round(output_tokens), max(1, math.floor(c)), c * per_seq
    ).total_s
    return WorkerCapacity(
        concurrency=c,
        kv_tokens=c * per_seq,
        kv_share=c * reserved / kv_room if kv_room > 0 else 0.0,
        rate=c / total if total > 0 else math.inf,
        limited_by=limit,
    )


def censoring_factor(measured_service_s: float, in_service_s: float, margin: float) -> float:
    """How much to trust a capacity sized on finished requests, given those still running.

    A window's finishes are a right-censored sample: a request that has not finished is
    missing from it, and the longer a request, the likelier it is missing. Where the
    fleet has served for less than its long requests take (a cold start, the first
    minutes of a run) the finishes are the short requests only, so the measured service
    time, and the capacity sized on it (:func:`worker_capacity`: ``c / service time``),
    are too small and too large by up to 4x (issue 16's sinusoid, first crest).
    ``in_service_s`` is the mean time in service with the running requests counted
    (:func:`mean_in_service_s`).

    Returns ``measured_service_s / in_service_s`` (with ``1 + margin`` of slack for the
    noise of a 10 s window), capped at 1: it only ever lowers a capacity.

    Args:
        measured_service_s: mean dispatch -> finish of the window's finishes, s (> 0).
        in_service_s: mean seconds in service, running requests included (>= 0).
        margin: relative slack before the correction applies (>= 0).

    Returns:
        A factor in (0, 1] to multiply the finishes' capacity rate by.
    """
    if in_service_s <= 0 or measured_service_s <= 0:
        return 1.0
    return min(1.0, (1.0 + margin) * measured_service_s / in_service_s)


def mean_in_service_s(
    running: float, entry_rate: float, time_on_test_s: float | None = None
) -> float:
    """Mean seconds a request spends in service, counting the ones still running: the
    smaller of two estimates, each biased high where the other is not.

    - Little's law, ``running / entry_rate`` (``L = lambda W``, Little 1961), with the rate
      the running requests entered service at (``inferq.policy.scaling_inputs.entry_rate``).
      It never exceeds the truth on a fleet's start (it estimates ``E[min(S, elapsed)]``),
      but after a burst, while its longest requests run on and nothing new enters, they
      read as the mean.
    - Time on test over the window (``time_on_test_s``: service-seconds served in the
      window, finished and running, over the finishes; the estimator of right-censored
      durations). After a burst it is right (hundreds of finishes outweigh a few long
      runs); on a fleet's start, with few finishes, it runs far past the truth.

    Issue 24, item 5: ``inferq demo``'s 70B pool read its batch burst's last 16 running
    requests as 1.4 s each against a 0.08 s mean, cut its capacity 14x and launched two
    workers for a burst the ready one had drained.

    Returns:
        Seconds, >= 0 (0: nothing running or entering; no correction).
    """
    if running <= 0:
        return 0.0
    if entry_rate <= 0:  # all of them entered before the window: the time on test alone
        return time_on_test_s or 0.0
    little = running / entry_rate
    return little if time_on_test_s is None else min(little, time_on_test_s)


def time_on_test_s(
    finishes: Iterable[tuple[float, float]],
    running_since: Iterable[float],
    start: float,
    now: float,
    running_before: float = 0,
) -> float | None:
    """Service-seconds served in the window ``[start, now]`` over the requests that
    finished in it (the total-time-on-test estimate of the mean service time).

    Args:
        finishes: ``(finished at, service seconds)`` of the window's finishes.
        running_since: when each request still running entered service (epoch s; one
            from before the window counts from ``start``).
        start, now: the window, epoch seconds.
        running_before: more requests running since before the window (a count, not
            listed: each counts the whole window).

    Returns:
        Seconds, or None when nothing finished in the window.
    """
    served, n = 0.0, 0
    for at, took in finishes:
        served += max(0.0, min(took, at - start))
        n += 1
    if n == 0:
        return None
    served += sum(max(0.0, now - max(since, start)) for since in running_since)
    served += max(0.0, running_before) * max(0.0, now - start)
    return served / n
