"""What the dashboard shows, read from the store (plain JSON-able data)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from inferq import usage
from inferq.config import PriorityClass
from inferq.models import Event
from inferq.sla import FINAL_EVENTS, event_meets_slo
from inferq.store import Store

#: SLA attainment window, seconds.
SLA_WINDOW_S = 300.0
#: A worker whose last heartbeat is older than this many intervals is shown as late.
LATE_BEATS = 3
#: Rows of each usage table (by cost, then requests); the rest are summed in one row.
USAGE_ROWS = 20


def sla_attainment(events: Iterable[Event], classes: Mapping[str, PriorityClass]) -> dict[str, Any]:
    """Per class: final results, how many met the class's SLO, and the share.

    A result meets it when it finished (``finish``) within the length-aware TTFT target
    and the TPOT target of its class (:func:`inferq.sla.event_meets_slo`, the rule the
    simulator and the metrics use); failed and expired requests miss it. Classes with no
    result have share None.

    Returns:
        class -> ``{"finished": n, "met": m, "attainment": m / n or None}``.
    """
    out: dict[str, dict[str, Any]] = {c: {"finished": 0, "met": 0} for c in classes}
    for e in events:
        cls = e.fields.get("class")
        if e.type not in FINAL_EVENTS or not cls:
            continue
        row = out.setdefault(cls, {"finished": 0, "met": 0})
        row["finished"] += 1
        try:
            met = event_meets_slo(classes.get(cls), e.type, e.fields)
        except ValueError:
            continue
        if met:
            row["met"] += 1
    for row in out.values():
        row["attainment"] = row["met"] / row["finished"] if row["finished"] else None
    return out


def usage_today(store: Store, now_ms: int, rows: int = USAGE_ROWS) -> dict[str, Any]:
    """Today's usage (UTC, from midnight to the current hour included), by tenant and by
    model, priced now: :func:`inferq.usage.report` over one read of the day's roll-up,
    so its figures are ``inferq usage --since <hours since midnight>h``'s.

    Returns:
        ``{"since_ms", "until_ms", "tenant": report, "model": report, "corrupt": n}``; each
        report's ``rows`` are the ``rows`` largest by cost, then requests, and one row
        ``"(N more)"`` summing the rest; its ``total`` is the whole day's.
    """
    start = now_ms // usage.DAY_MS * usage.DAY_MS
    end = now_ms // usage.HOUR_MS * usage.HOUR_MS + usage.HOUR_MS
    records, corrupt = store.usage_records(start, end)
    out: dict[str, Any] = {"since_ms": start, "until_ms": end, "corrupt": len(corrupt)}
    for by in ("tenant", "model"):
        data = usage.report(records, [], by, store.settings.prices, start, end)
        rows_of: list[dict[str, Any]] = data["rows"]  # type: ignore[assignment]
        ranked = sorted(rows_of, key=lambda r: (-r["cost_usd"], -r["requests"], r["name"]))
        if len(ranked) > rows:
            rest = ranked[rows:]
            more: dict[str, Any] = {
                k: sum(r[k] for r in rest)
                for k in ("requests", *usage.COUNTERS, "gpu_s", "cost_usd")
            }
            more["name"] = f"({len(rest)} more)"
            more["unpriced_models"] = sorted({m for r in rest for m in r["unpriced_models"]})
            ranked = [*ranked[:rows], more]
        data["rows"] = ranked
        out[by] = data
    return out


def dashboard_state(store: Store, window_s: float = SLA_WINDOW_S) -> dict[str, Any]:
    """Everything the page shows, from one pass over the store.

    Returns:
        ``{"now", "namespace", "queues", "workers", "sla", "sla_window_s", "events",
        "dead_letter": {"count", "requests"}, "counters", "usage"}`` (``usage``:
        :func:`usage_today`); times in epoch seconds, waits and ages in seconds, memory
        in MiB, cost in US $.
    """
    settings = store.settings
    now = store.now()
    queues = [
        {"class": cls, "route": route, "queued": n, "oldest_wait_s": wait}
        for cls, route, n, wait in store.queue_depths()
    ]
    infos, bad = store.workers()
    loads = store.worker_loads([w.id for w in infos])
    late_s = LATE_BEATS * settings.heartbeat_interval_s
    workers: list[dict[str, Any]] = []
    for w in infos:
        slots_used, kv_used = loads.get(w.id, (0, 0.0))
        age = max(0.0, now - w.last_heartbeat)
        workers.append(
            {
                "id": w.id,
                "model": w.model,
                "state": w.state.value,
                "slots_used": max(slots_used, w.in_flight),
                "slots": w.slots,
                "kv_used_mib": round(kv_used, 1),
                "kv_cache_mib": w.kv_cache_mib,
                "kv_measured_free_mib": None
                if w.kv_measured_free_mib is None
                else round(w.kv_measured_free_mib, 1),
                "heartbeat_age_s": round(age, 2),
                "health": "ok" if age <= late_s else "late",
                # the model server's own count of reused prompt tokens (issue 22)
                "prefix_hit_rate": w.prefix_hit_rate,
            }
        )
    workers += [{"id": key, "state": "corrupt", "health": reason} for key, reason in bad]
    start_ms = round((now - window_s) * 1000)
    window = store.events(count=50_000, after=f"{start_ms}-0")
    sla = sla_attainment(window, {c.name: c for c in settings.classes})
    dead_ids = store.dead_letters(50)
    dead = []
    for rec in store.records(dead_ids):
        if rec is None:
            continue
        error = (rec.result.error if rec.result else None) or rec.reason or ""
        dead.append(
            {
                "id": rec.request.id,
                "priority": rec.request.priority,
                "tenant": rec.request.tenant,
                "attempts": rec.attempt,
                "error": error,
            }
        )
    return {
        "now": now,
        "namespace": settings.namespace,
        "queues": queues,
        "workers": workers,
        "sla": sla,
        "sla_window_s": window_s,
        "events": [
            {"id": e.id, "type": e.type, "at": e.at, "fields": e.typed_fields()}
            for e in reversed(store.recent_events(20))
        ],
        "dead_letter": {"count": store.dead_letter_count(), "requests": dead},
        "counters": store.stats(),
        "usage": usage_today(store, round(now * 1000)),
    }
