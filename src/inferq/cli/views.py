"""What the CLI shows: data gathered from the store, rendered as rich tables or JSON.

rich, the settings, the models and the store are imported where a function uses them,
not here: ``inferq queues --json`` renders nothing and reads through
:class:`~inferq.store.glance.Glance`, so it starts without them (issue 15).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from inferq.errors import InferqError, redact_url

if TYPE_CHECKING:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    from inferq.config import Settings
    from inferq.models import Event, RequestRecord, Result
    from inferq.store import Glance, Store


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _id_column(table: Table, name: str, values: list[str]) -> None:
    """A column that is never truncated or wrapped (ids are pasted into other commands);
    rich narrows the other columns instead."""
    width = max([len(name), *(len(v) for v in values)])
    table.add_column(name, no_wrap=True, min_width=width, overflow="ignore")


def queue_rows(store: Glance) -> list[dict[str, Any]]:
    """One row per (class, route) queue: depth and oldest wait (s)."""
    return [
        {"class": cls, "route": route, "queued": depth, "oldest_wait_s": oldest}
        for cls, route, depth, oldest in store.queue_depths()
    ]


def queue_table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(title="queues")
    _id_column(table, "class", [r["class"] for r in rows])
    _id_column(table, "route", [r["route"] for r in rows])
    for col in ("queued", "oldest wait"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["class"], r["route"], str(r["queued"]), _s(r["oldest_wait_s"]))
    return table


def queue_view(rows: list[dict[str, Any]], rates: dict[str, float]) -> Group:
    """The queues table, then the event rates on a line of their own below it (as the
    table's caption they were folded to the table's width, mid-phrase)."""
    from rich.console import Group
    from rich.text import Text

    shown = [f"{k} {v:.1f}" for k, v in sorted(rates.items()) if k in _RATE_EVENTS]
    footer = Text("per second (last 60 s): " + ", ".join(shown), style="italic")
    return Group(queue_table(rows), footer)


#: The events whose rates the queues view shows.
_RATE_EVENTS = frozenset({"submit", "dispatch", "finish", "fail", "expire", "retry"})


def worker_rows(store: Store) -> list[dict[str, Any]]:
    """One row per live worker (heartbeat facts plus reserved slots)."""
    infos, bad = store.workers()
    now = store.now()
    reserved = store.worker_reservations([w.id for w in infos])
    rows: list[dict[str, Any]] = [
        {
            "id": w.id,
            "model": w.model,
            "state": w.state.value,
            "slots_used": reserved[w.id],
            "slots": w.slots,
            "in_flight": w.in_flight,
            "vram_free_mib": w.vram_free_mib,
            "vram_total_mib": w.vram_total_mib,
            "vram_measured_free_mib": w.vram_measured_free_mib,
            "vram_measured_used_mib": w.vram_measured_used_mib,
            "kv_cache_mib": w.kv_cache_mib,
            "kv_measured_free_mib": w.kv_measured_free_mib,
            **{f"server_{name}": value for name, value in w.server},
            "heartbeat_age_s": round(max(0.0, now - w.last_heartbeat), 2),
            "host": w.host,
            "prompt_tokens_total": w.prompt_tokens_total,
            "cached_tokens_total": w.cached_tokens_total,
            "forecast_tokens_total": w.forecast_tokens_total,
            "prefix_hit_rate": w.prefix_hit_rate,
        }
        for w in infos
    ]
    rows += [{"id": key, "state": "corrupt", "error": reason} for key, reason in bad]
    return rows


def worker_table(rows: list[dict[str, Any]], counts: bool = False) -> Table:
    """Workers as a table; ``counts`` adds the report's finished/failed columns."""
    from rich.table import Table

    table = Table(title="workers")
    extra = ("finished", "failed") if counts else ()
    _id_column(table, "id", [r["id"] for r in rows])
    _id_column(table, "model", [r.get("model", "-") for r in rows])
    columns = ("state", "slots", "VRAM free/total MiB", "KV measured MiB", "prefix hits")
    for col in (*columns, "heartbeat", *extra):
        table.add_column(col)
    for r in rows:
        tail = [str(r.get(c, 0)) for c in extra]
        if r["state"] == "corrupt":
            table.add_row(r["id"], "-", "[red]corrupt[/red]", "-", r["error"], "-", "-", "-", *tail)
            continue
        hits = r.get("prefix_hit_rate")
        table.add_row(
            r["id"],
            r["model"],
            r["state"],
            f"{r['slots_used']}/{r['slots']}",
            f"{r['vram_free_mib']}/{r['vram_total_mib']}",
            "-" if r.get("kv_measured_free_mib") is None else f"{r['kv_measured_free_mib']:.0f}",
            "-" if hits is None else f"{hits:.0%}",
            f"{r['heartbeat_age_s']:.1f}s ago",
            *tail,
        )
    return table


def _rate(part: int, whole: int) -> float | None:
    """``part / whole``, None when ``whole`` is 0."""
    return part / whole if whole else None


def info_data(store: Store, settings: Settings) -> dict[str, Any]:
    """What ``inferq info`` shows: the deployment's Redis, its prefix-cache routing
    settings and the prefix log (the shared index's Redis memory), and the fleet's
    prefix hit rate (prompt tokens the model servers reported reusing)."""
    infos, _ = store.workers()
    prompt = sum(w.prompt_tokens_total for w in infos)
    cached = sum(w.cached_tokens_capped for w in infos)
    forecast = sum(w.forecast_tokens_total for w in infos)
    log = store.prefix_log_info()
    p = settings.prefix
    memory = store.memory()
    return {
        "namespace": settings.namespace,
        "redis_used_memory_bytes": memory.used_bytes,
        "redis_maxmemory_bytes": memory.max_bytes,
        "redis_maxmemory_policy": memory.policy,
        "warnings": [w for w in (memory.eviction_warning,) if w],
        "workers": len(infos),
        "prefix_routing": {
            "enabled": p.enabled,
            "block_tokens": p.block_tokens,
            "load_weight": p.load_weight,
            "balance_abs_tokens": p.balance_abs_tokens,
            "balance_rel": p.balance_rel,
        },
        "prefix_log": log,
        "prefix_log_bytes_per_worker": round(log["bytes"] / len(infos)) if infos else None,
        "prefix_tokens": {
            "prompt": prompt,
            "cached_by_servers": cached,
            "forecast_by_index": forecast,
            "hit_rate": _rate(cached, prompt),
        },
    }


def info_table(data: dict[str, Any]) -> Table:
    """``inferq info`` as a two-column table."""
    from rich.table import Table

    table = Table(title=f"inferq {data['namespace']}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    p, log, t = data["prefix_routing"], data["prefix_log"], data["prefix_tokens"]
    rate = t["hit_rate"]
    rows = [
        ("Redis used memory", f"{data['redis_used_memory_bytes'] / 2**20:.1f} MiB"),
        ("Redis eviction", _eviction(data)),
        ("workers", str(data["workers"])),
        ("prefix routing", "on" if p["enabled"] else "off"),
        (
            "prefix block / balance",
            f"{p['block_tokens']} tokens / "
            f"+{p['balance_abs_tokens']:.0f} tokens and x{p['balance_rel']}",
        ),
        ("prefix index (log)", f"{log['entries']} entries, {log['bytes'] / 2**20:.2f} MiB"),
        (
            "prefix hit rate",
            "-"
            if rate is None
            else f"{rate:.1%} ({t['cached_by_servers']} of {t['prompt']} prompt tokens)",
        ),
        ("index forecast", f"{t['forecast_by_index']} prompt tokens"),
    ]
    rows += [("warning", f"[bold red]{w}[/]") for w in data["warnings"]]
    for what, value in rows:
        table.add_row(what, value)
    return table


def _eviction(data: dict[str, Any]) -> str:
    """The maxmemory policy and limit, as ``inferq info`` shows them."""
    limit = data["redis_maxmemory_bytes"]
    policy = data["redis_maxmemory_policy"] or "unknown"
    return f"{policy}, " + (f"limit {limit / 2**20:.0f} MiB" if limit else "no limit")


def record_dict(record: RequestRecord) -> dict[str, Any]:
    """A request record as plain JSON-able data (the prompt is left out)."""
    req, t = record.request, record.timings
    out: dict[str, Any] = {
        "id": req.id,
        "state": record.state.value,
        "model": req.model,
        "priority": req.priority,
        "tenant": req.tenant,
        "task_type": req.task_type,
        "max_tokens": req.max_tokens,
        "prompt_tokens_estimate": req.prompt_tokens,
        "attempt": record.attempt,
        "worker": record.worker,
        "submitted_at": t.submitted_at,
        "deadline": req.deadline,
        "queue_wait_s": t.queue_wait_s,
        "ttft_s": t.ttft_s,
        "e2e_s": t.e2e_s,
        "reason": record.reason,
    }
    if record.result is not None:
        out["result"] = {
            "status": record.result.status,
            "output": record.result.output,
            "prompt_tokens": record.result.prompt_tokens,
            "completion_tokens": record.result.completion_tokens,
            "cached_tokens": record.result.cached_tokens,
            "error": record.result.error,
        }
    return out


def record_panel(data: dict[str, Any]) -> Panel:
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    for key in ("state", "model", "priority", "tenant", "attempt", "worker"):
        value = data.get(key)
        if value is not None:
            table.add_row(key, str(value))
    _timing_rows(table, data)
    if data.get("reason") is not None:
        table.add_row("reason", str(data["reason"]))
    result = data.get("result")
    if result:
        tokens = (_n(result.get("prompt_tokens")), _n(result.get("completion_tokens")))
        cached = result.get("cached_tokens") or 0
        reused = f" ({cached} from the server's prefix cache)" if cached else ""
        table.add_row("tokens", f"{tokens[0]} in{reused}, {tokens[1]} out")
        if result.get("error"):
            table.add_row("error", result["error"])
        if result.get("output"):
            table.add_row("output", result["output"][:2000])
    return Panel(table, title=f"request {data['id']}")


def result_dict(result: Result) -> dict[str, Any]:
    """A result as JSON fields, with its queue wait, TTFT and end-to-end time (seconds)."""
    t = result.timings
    return result.model_dump(mode="json") | {
        "queue_wait_s": t.queue_wait_s, "ttft_s": t.ttft_s, "e2e_s": t.e2e_s
    }  # fmt: skip


#: The timings a request's panel shows, JSON key -> label (both panels: one wording).
_TIMINGS = (("queue_wait_s", "queue wait"), ("ttft_s", "TTFT"), ("e2e_s", "e2e"))


def _timing_rows(table: Table, data: dict[str, Any]) -> None:
    """The known timings of ``data`` (seconds) as labelled rows of a panel's grid."""
    for key, label in _TIMINGS:
        if data.get(key) is not None:
            table.add_row(label, _s(data[key]))


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def result_panel(data: dict[str, Any]) -> Panel:
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_row("status", data["status"])
    _timing_rows(table, data)
    if data.get("error"):
        table.add_row("error", data["error"])
    if data.get("output") is not None:
        table.add_row("output", data["output"])
    return Panel(table, title=f"request {data['request_id']}")


def dead_table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(title="dead letter")
    _id_column(table, "id", [r["id"] for r in rows])
    for col in ("priority", "tenant", "attempts", "last error"):
        table.add_column(col)
    for r in rows:
        error = (r.get("result") or {}).get("error") or r.get("reason") or ""
        table.add_row(r["id"], r["priority"], r["tenant"], str(r["attempt"]), error)
    return table


#: :func:`event_dict`'s own keys (a report row shows the type, then the event's fields).
_EVENT_HEAD = frozenset({"event_id", "type", "at", "at_epoch_s", "ids"})


def iso_utc(epoch_s: float) -> str:
    """Epoch seconds as ISO 8601 UTC with milliseconds: ``2026-12-01T04:30:00.123Z``."""
    stamp = datetime.fromtimestamp(epoch_s, tz=UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def event_dict(event: Event) -> dict[str, Any]:
    """An event as JSON data: ``event_id`` (the stream entry), ``type``, ``at`` in ISO
    8601 UTC and ``at_epoch_s`` in epoch seconds, then its fields, numbers as numbers
    (``id`` is always the request's, when the event concerns one)."""
    return {
        "event_id": event.id,
        "type": event.type,
        "at": iso_utc(event.at),
        "at_epoch_s": event.at,
        **event.typed_fields(),
    }


def event_line(event: Event, as_json: bool) -> str:
    if as_json:
        return json.dumps(event_dict(event))
    stamp = time.strftime("%H:%M:%S", time.gmtime(event.at)) + f".{int(event.at * 1000) % 1000:03d}"
    fields = " ".join(f"{k}={v}" for k, v in event.fields.items() if k != "ids")
    return f"{stamp} {event.type:<15} {fields}"


def report_dict(store: Store) -> dict[str, Any]:
    """The run report: queues, workers with their counts, lifetime counters, recent events."""
    workers = worker_rows(store)
    finished: dict[str, int] = {}
    failed: dict[str, int] = {}
    for e in store.recent_events(5000):
        wid = e.fields.get("worker")
        if wid and e.type == "finish":
            finished[wid] = finished.get(wid, 0) + 1
        elif wid and e.type in ("fail", "retry"):
            failed[wid] = failed.get(wid, 0) + 1
    for row in workers:
        row["finished"] = finished.get(row["id"], 0)
        row["failed"] = failed.get(row["id"], 0)
    queues = queue_rows(store)
    waits = [q["oldest_wait_s"] for q in queues if q["oldest_wait_s"] is not None]
    return {
        "queued": sum(q["queued"] for q in queues),
        "oldest_wait_s": max(waits) if waits else None,
        "queues": queues,
        "workers": workers,
        "counters": store.stats(),
        "rates_per_s": store.event_rates(),
        "dead_letter": store.dead_letter_count(),
        "quarantined": store.quarantined(),
        "recent_events": [event_dict(e) for e in store.recent_events(15)],
    }


def report_render(data: dict[str, Any]) -> Group:
    from rich.console import Group
    from rich.table import Table

    head = Table.grid(padding=(0, 3))
    counters = data["counters"]
    head.add_row(
        f"queued [bold]{data['queued']}[/bold]",
        f"oldest wait {_s(data['oldest_wait_s'])}",
        f"dead letter {data['dead_letter']}",
        f"quarantined {len(data['quarantined'])}",
        " ".join(f"{k} {v}" for k, v in sorted(counters.items())),
    )
    workers = worker_table(data["workers"], counts=True)
    events = Table(title="recent events")
    events.add_column("event")
    for e in data["recent_events"]:
        shown = {k: v for k, v in e.items() if k not in _EVENT_HEAD}
        events.add_row(f"{e['type']} " + " ".join(f"{k}={v}" for k, v in shown.items()))
    return Group(head, queue_view(data["queues"], data["rates_per_s"]), workers, events)


def cells_list(settings: Settings) -> list[dict[str, Any]]:
    """One row per configured cell: Redis (redacted), routes, tenants, and what it holds now.

    A cell that does not answer gets ``reachable: False`` and the error; the others are
    still read (one cell's outage does not hide the rest).
    """
    from inferq.store import REDIS_ERRORS, Store, connect, describe_error

    rows: list[dict[str, Any]] = []
    for name, spec in settings.cells.items():
        row: dict[str, Any] = {
            "cell": name,
            "redis": redact_url(spec.redis_url),
            "routes": list(spec.routes),
            "tenants": list(spec.tenants),
        }
        try:
            store = Store(
                connect(spec.redis_url), settings.model_copy(update={"redis_url": spec.redis_url})
            )
        except InferqError as exc:
            rows.append({**row, "reachable": False, "error": str(exc)})
            continue
        try:
            counts = store.queued_counts()
            infos, _ = store.workers()
            states: dict[str, int] = {}
            for w in infos:
                states[w.state.value] = states.get(w.state.value, 0) + 1
            row |= {
                "reachable": True,
                "queued": sum(v for k, v in counts.items() if k.startswith("c:")),
                "workers": states,
            }
        except REDIS_ERRORS as exc:
            row |= {"reachable": False, "error": describe_error(spec.redis_url, exc)}
        finally:
            store.close()
        rows.append(row)
    return rows


def cells_render(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(title="cells")
    for col in ("cell", "redis", "routes", "tenants", "queued", "workers"):
        table.add_column(col, justify="right" if col == "queued" else "left", overflow="fold")
    for r in rows:
        workers = (
            ", ".join(f"{n} {s}" for s, n in sorted(r["workers"].items())) or "none"
            if r["reachable"]
            else f"[red]unreachable[/red]: {r['error']}"
        )
        table.add_row(
            r["cell"],
            r["redis"],
            ", ".join(r["routes"]),
            ", ".join(r["tenants"]) or "all",
            str(r["queued"]) if r["reachable"] else "-",
            workers,
        )
    if not rows:
        table.caption = "no cells configured: one Redis (--redis-url); see docs/scaling.md"
    return table
