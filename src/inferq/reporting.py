"""Run reports: per-class SLA attainment and latency percentiles, shared by the demo and tools.

Pure functions over per-request outcomes (no I/O). SLA attainment is the share
of a class's requests that *succeeded* with a time to first token within the
class SLA; expired, failed and cancelled requests count as missed. Given the
classes, the length-aware targets of :mod:`inferq.sla` are reported too: TTFT
attainment (``sla_s + prompt / reference_prefill_tps``), TPOT attainment and SLO
attainment (both, DistServe's definition).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from inferq import sla as slas
from inferq.config import PriorityClass


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request as a report sees it (seconds; None = not reached)."""

    priority: str
    status: str
    queue_wait_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    tenant: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def class_summary(
    outcomes: Iterable[Outcome],
    sla_s: Mapping[str, float],
    scale: float = 1.0,
    classes: Sequence[PriorityClass] = (),
) -> dict[str, dict[str, float | int | None]]:
    """Per class: counts by status, SLA attainment and p50/p99 waits and latencies.

    Args:
        outcomes: finished requests.
        sla_s: class -> TTFT SLA, seconds (in the same time base as the outcomes x ``scale``).
        scale: multiplies every duration (the demo passes its speedup to report in
            trace time).
        classes: the priority classes; those listed also get "ttft_attainment",
            "tpot_attainment" and "slo_attainment" (:mod:`inferq.sla`, 0..1).

    Returns:
        class -> {"requests", "succeeded", "expired", "failed", "cancelled",
        "sla_attainment" (0..1), "queue_wait_p50_s", "queue_wait_p99_s", "ttft_p50_s",
        "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"}, in ``sla_s`` order.
    """
    by_class: dict[str, list[Outcome]] = {c: [] for c in sla_s}
    by_name = {c.name: c for c in classes}
    for o in outcomes:
        by_class.setdefault(o.priority, []).append(o)
    out: dict[str, dict[str, float | int | None]] = {}
    for cls, rows in by_class.items():
        if not rows:
            continue
        sla = sla_s.get(cls, math.inf)
        met = sum(
            1
            for o in rows
            if slas.meets_flat_ttft(sla, o.status, None if o.ttft_s is None else o.ttft_s * scale)
        )
        stats: dict[str, float | int | None] = {"requests": len(rows)}
        for status in ("succeeded", "expired", "failed", "cancelled"):
            stats[status] = sum(1 for o in rows if o.status == status)
        stats["sla_attainment"] = met / len(rows)
        if cls in by_name:
            stats.update(slo_attainment(rows, by_name[cls], scale))
        for name in ("queue_wait", "ttft", "e2e"):
            values = [v * scale for o in rows if (v := getattr(o, f"{name}_s")) is not None]
            stats[f"{name}_p50_s"] = percentile(values, 50)
            stats[f"{name}_p99_s"] = percentile(values, 99)
        out[cls] = stats
    return out


def slo_attainment(
    rows: Sequence[Outcome], cls: PriorityClass, scale: float = 1.0
) -> dict[str, float]:
    """Shares (0..1) of ``rows`` that succeeded within the length-aware TTFT target, within
    the TPOT target, and within both (:mod:`inferq.sla`); durations x ``scale``."""
    n = len(rows) or 1
    ttft = tpot = both = 0
    for o in rows:
        if o.status != "succeeded":
            continue
        t = None if o.ttft_s is None else o.ttft_s * scale
        e = None if o.e2e_s is None else o.e2e_s * scale
        ok_ttft = slas.meets_ttft(cls, o.prompt_tokens, t)
        ok_tpot = slas.meets_tpot(cls, t, e, o.output_tokens)
        ttft += ok_ttft
        tpot += ok_tpot
        both += ok_ttft and ok_tpot
    return {"ttft_attainment": ttft / n, "tpot_attainment": tpot / n, "slo_attainment": both / n}


def jain_index(shares: Iterable[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 = equal, 1/n = one takes all."""
    values = list(shares)
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


#: A run is machine-bound when something that should run on a schedule ran later than this
#: share of the tightest class SLA, at p99: at 10% of a 2 s SLA the replay or the daemons
#: already eat a tenth of every request's budget before the scheduler sees it.
KEEP_UP_SHARE = 0.1
#: ... and it says so only when a class met its SLA for less than this share of its
#: requests: a lag that cost no SLA is a figure in the report, not a warning.
KEEP_UP_MET = 0.99


def lag_summary(late_s: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """p50, p99 and max of how late something ran against its schedule.

    Args:
        late_s: lateness of each event, seconds (>= 0; early events count as 0).
        scale: multiplies every figure (the demo passes its speedup: trace seconds).

    Returns:
        {"n", "p50_s", "p99_s", "max_s"}; the figures are None when ``late_s`` is empty.
    """
    values = [max(0.0, v) * scale for v in late_s]
    return {
        "n": len(values),
        "p50_s": percentile(values, 50),
        "p99_s": percentile(values, 99),
        "max_s": max(values) if values else None,
    }


def fell_behind(
    lag_p99_s: Mapping[str, float | None], sla_s: Mapping[str, float], share: float = KEEP_UP_SHARE
) -> dict[str, float]:
    """The lags that were a significant share of the tightest SLA: the machine, not the
    scheduler, was the bottleneck of the run that measured them.

    Args:
        lag_p99_s: what ran on a schedule (the replay, a timer) -> its p99 lateness,
            seconds (None: not measured).
        sla_s: class -> TTFT SLA, seconds, on the same clock as the lags.
        share: the rule's threshold, a share of the tightest SLA (:data:`KEEP_UP_SHARE`).

    Returns:
        name -> p99 lateness for each lag above ``share`` x the tightest SLA, in
        ``lag_p99_s`` order; empty when the machine kept up (or there is no SLA).
    """
    if not sla_s:
        return {}
    limit = share * min(sla_s.values())
    return {name: v for name, v in lag_p99_s.items() if v is not None and v > limit}
