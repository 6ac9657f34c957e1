"""Metrics of a simulation run, and their table, JSON and PNG forms.

Definitions (per class, and over all requests):

- SLA attainment: the share of requests that *succeeded* with a time to first
  token (submit -> first token: queue wait + prefill) within the class SLA
  (:mod:`inferq.reporting`'s rule, shared with the demo); expired requests miss.
  Kept for comparison beside the length-aware targets of :mod:`inferq.sla`:
  TTFT attainment (``sla_s + prompt / reference_prefill_tps``), TPOT attainment
  (per output token after the first) and SLO attainment (both; DistServe).
- queue wait (submit -> dispatch), TTFT and end-to-end latency (submit ->
  result) percentiles p50/p95/p99, nearest rank, over the requests that
  reached that point (seconds).
- expired: requests whose deadline passed, queued or running; starved: the
  expired ones that were never dispatched (no GPU time at all).
- preemptions (per class: of its requests; under ``run``: all) and wasted tokens:
  running requests aborted and requeued for a higher class's reservation
  (:mod:`inferq.policy.preemption`), and the prompt and output tokens their
  aborted runs had processed (recomputed when they run again).
- refused: requests intake refused at arrival (prompt + ``max_tokens`` beyond
  every context of the route: :func:`inferq.routes.check_context`, the client's
  rule); they never enter a queue, so every other figure, SLA attainment
  included, is over the admitted requests only (as the real stack's metrics,
  which never see a refused submission).
- GPU-seconds: every worker's time from launch (cold start included) to
  stop, or to the end of the run; mean workers = GPU-seconds / run length.
- GPU utilisation: occupied slot-seconds over the slot-seconds paid for
  (``slots x GPU-seconds``); KV utilisation: KV-cache MiB-seconds reserved over the
  KV-cache MiB-seconds paid for (each worker's ``kv_cache_mib x GPU-seconds``), the
  measure of issue 16 (the KV cache, not the slots, limits a worker); busy fraction:
  time with at least one request running over GPU-seconds (what ``nvidia-smi`` shows).
- scale events: scale-up and scale-down actions (and the workers they
  launched or drained); direction reversals: per model, consecutive actions
  in opposite directions (flapping).
- prefix cache (requests with a prefix chain; issue 22): over the runs that started,
  hit tokens (leading prompt tokens the server's cache held, whose prefill was
  skipped), miss tokens (the rest of their prompts) and the hit rate = hit tokens /
  prompt tokens; the *pooled* hit rate of one LRU holding the whole warm fleet's KV
  capacity fed the same requests in arrival order
  (:func:`~inferq.sim.caches.pooled_cached_tokens`: the fleet behaving as one cache)
  and the ratio of the two; the index's forecast tokens and the servers' misses;
  imbalance = max / mean prompt tokens dispatched per worker (every worker of the run,
  idle ones at 0; 1 = perfectly even); the mean TTFT (seconds);
- fairness: Jain's index ``(sum x)^2 / (n sum x^2)`` over tenants of
  ``x_t`` = the share of tenant ``t``'s tokens (prompt + output) that were
  served within the SLA: 1 when every tenant gets the same quality of
  service whatever its volume, ``1/n`` when one tenant gets it all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from inferq.config import PriorityClass
from inferq.extras import import_extra
from inferq.reporting import Outcome, class_summary, jain_index, percentile, slo_attainment
from inferq.sim.caches import kv_tokens, missed, pooled_cached_tokens
from inferq.sim.result import RequestOutcome, SimResult
from inferq.sla import meets_flat_ttft

Report = dict[str, Any]


def _reporting_outcome(o: RequestOutcome) -> Outcome:
    r = o.request
    return Outcome(
        priority=r.priority,
        status=o.status,
        queue_wait_s=o.queue_wait_s,
        ttft_s=o.ttft_s,
        e2e_s=o.e2e_s,
        tenant=r.tenant,
        tokens=r.prompt_tokens + r.output_tokens,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
    )


def summarize(
    result: SimResult,
    classes: Sequence[PriorityClass],
    summary: str = "",
    watch_tenants: Sequence[str] = (),
) -> Report:
    """The run's metrics as a JSON-ready dict (definitions in the module docstring).

    Args:
        result: the run.
        classes: the priority classes (SLAs), highest first.
        summary: one line describing the policy.
        watch_tenants: tenants reported on their own (a scenario's verdict), under
            ``"tenants"``.

    Returns:
        ``{"policy", "summary", "requests", "duration_s", "classes": {class: {...}},
        "overall": {...}, "fleet": {...}, "scaling": {...}, "refused": {class: n},
        "fairness": {...},
        "tenants": {tenant: {...}}, "run": {...}}``; durations in seconds, shares in 0..1.
    """
    sla = {c.name: c.sla_s for c in classes}
    admitted = [o for o in result.outcomes if o.status != "refused"]
    refused: dict[str, int] = {}
    for o in result.outcomes:
        if o.status == "refused":
            refused[o.request.priority] = refused.get(o.request.priority, 0) + 1
    outcomes = [_reporting_outcome(o) for o in admitted]
    per_class = class_summary(outcomes, sla, classes=classes)
    for cls, stats in per_class.items():
        rows = [o for o in admitted if o.request.priority == cls]
        stats.update(_extras(rows, sla.get(cls)))
        stats["refused"] = refused.get(cls, 0)
    overall = _overall(admitted, sla)
    overall["refused"] = sum(refused.values())
    overall.update(_overall_slo(outcomes, classes))
    return {
        "policy": result.policy,
        "summary": summary,
        "requests": len(result.outcomes),
        "duration_s": result.end_s,
        "classes": per_class,
        "overall": overall,
        "fleet": _fleet(result),
        "scaling": _scaling(result),
        "refused": {c: refused[c] for c in sla if c in refused},
        "fairness": _fairness(admitted, sla),
        "prefix": prefix_summary(result),
        "tenants": {t: _tenant(result.outcomes, t, sla) for t in watch_tenants},
        "run": {
            "wall_s": result.stats.wall_s,
            "decisions": result.stats.decisions,
            "decide_s": result.stats.decide_s,
            "scale_calls": result.stats.scale_calls,
            "events": result.stats.events,
            "preemptions": result.stats.preemptions,
        },
    }


def _extras(rows: Sequence[RequestOutcome], sla_s: float | None) -> dict[str, Any]:
    """p95s, the class SLA, expiry split and unschedulable reports."""
    out: dict[str, Any] = {"sla_s": sla_s}
    for name in ("queue_wait", "ttft", "e2e"):
        values = [v for o in rows if (v := getattr(o, f"{name}_s")) is not None]
        out[f"{name}_p95_s"] = percentile(values, 95)
    out["starved"] = sum(1 for o in rows if o.status == "expired" and o.dispatched_at is None)
    out["unschedulable"] = sum(1 for o in rows if o.unschedulable is not None)
    out["preemptions"] = sum(o.preemptions for o in rows)
    out["wasted_tokens"] = sum(o.wasted_tokens for o in rows)
    return out


def _tenant(
    rows: Sequence[RequestOutcome], tenant: str, sla: Mapping[str, float]
) -> dict[str, Any]:
    """One watched tenant: its requests, how many succeeded and met their class's SLA,
    the queue wait of its first request (VTC's promise is about it: a newly active
    tenant is served among the next slots), and its longest queue wait and time to
    first token (seconds; None when none)."""
    mine = [o for o in rows if o.request.tenant == tenant]
    first = min(mine, key=lambda o: (o.request.arrival_s, o.request.id), default=None)
    waits = [v for o in mine if (v := o.queue_wait_s) is not None]
    ttfts = [v for o in mine if (v := o.ttft_s) is not None]
    return {
        "requests": len(mine),
        "refused": sum(1 for o in mine if o.status == "refused"),
        "succeeded": sum(1 for o in mine if o.status == "succeeded"),
        "sla_met": sum(1 for o in mine if _met(o, sla)),
        "queue_wait_first_s": first.queue_wait_s if first is not None else None,
        "queue_wait_max_s": max(waits, default=None),
        "ttft_max_s": max(ttfts, default=None),
    }


def _met(o: RequestOutcome, sla: Mapping[str, float]) -> bool:
    ttft = o.ttft_s
    return meets_flat_ttft(sla.get(o.request.priority, 0), o.status, ttft)


def _overall(rows: Sequence[RequestOutcome], sla: Mapping[str, float]) -> dict[str, Any]:
    n = len(rows)
    out: dict[str, Any] = {
        "requests": n,
        "succeeded": sum(1 for o in rows if o.status == "succeeded"),
        "expired": sum(1 for o in rows if o.status == "expired"),
        "starved": sum(1 for o in rows if o.status == "expired" and o.dispatched_at is None),
        "unfinished": sum(1 for o in rows if o.status in ("queued", "running")),
        "sla_attainment": sum(1 for o in rows if _met(o, sla)) / n if n else None,
    }
    for name in ("queue_wait", "ttft", "e2e"):
        values = [v for o in rows if (v := getattr(o, f"{name}_s")) is not None]
        for q in (50, 95, 99):
            out[f"{name}_p{q}_s"] = percentile(values, q)
    return out


def _overall_slo(outcomes: Sequence[Outcome], classes: Sequence[PriorityClass]) -> dict[str, Any]:
    """The :mod:`inferq.sla` attainments over every request (each held to its class)."""
    n = len(outcomes)
    if not n:
        return {"ttft_attainment": None, "tpot_attainment": None, "slo_attainment": None}
    sums = {"ttft_attainment": 0.0, "tpot_attainment": 0.0, "slo_attainment": 0.0}
    for cls in classes:
        rows = [o for o in outcomes if o.priority == cls.name]
        for k, v in slo_attainment(rows, cls).items():
            sums[k] += v * len(rows)
    return {k: v / n for k, v in sums.items()}


def _fleet(result: SimResult) -> dict[str, Any]:
    gpu_s = sum(result.gpu_seconds(w) for w in result.workers)
    slots = result.config.slots
    slot_s = sum(w.slot_s for w in result.workers)
    kv_s = sum(w.kv_mib_s for w in result.workers)
    kv_paid = sum(w.kv_cache_mib * result.gpu_seconds(w) for w in result.workers)
    busy_s = sum(w.busy_s for w in result.workers)
    live = [s.starting + s.ready + s.draining for s in result.samples]
    return {
        "initial": dict(result.initial_fleet),
        "workers_ever": len(result.workers),
        "peak_workers": max([*live, sum(result.initial_fleet.values())]),
        "mean_workers": gpu_s / result.end_s if result.end_s > 0 else None,
        "gpu_seconds": gpu_s,
        "gpu_utilisation": slot_s / (slots * gpu_s) if gpu_s > 0 else None,
        "kv_utilisation": kv_s / kv_paid if kv_paid > 0 else None,
        "gpu_busy_fraction": busy_s / gpu_s if gpu_s > 0 else None,
        "peak_slots_used": max((w.peak_slots for w in result.workers), default=0),
        "slots": slots,
        "peak_kv_cache_share": max(
            (w.peak_mib / w.kv_cache_mib for w in result.workers if w.kv_cache_mib > 0),
            default=0.0,
        ),
    }


def prefix_summary(result: SimResult) -> dict[str, Any] | None:
    """The prefix-cache figures of the module docstring, or None when no request that
    ran carried a chain."""
    ran = [o for o in result.outcomes if o.runs > 0]
    chained = [o for o in ran if o.request.prefix]
    if not chained:
        return None
    prompt = sum(o.request.prompt_tokens for o in chained)
    hits = sum(o.cached_tokens for o in chained)
    capacity = sum(kv_tokens(w) for w in result.workers if w.launched_at == 0)
    pooled = sum(pooled_cached_tokens([o.request for o in chained], capacity))
    per_worker = {w.id: 0 for w in result.workers}
    by_id = {o.request.id: o.request for o in ran}
    for a in result.assignments:
        per_worker[a.worker_id] = per_worker.get(a.worker_id, 0) + by_id[a.request_id].prompt_tokens
    loads = list(per_worker.values())
    mean = sum(loads) / len(loads) if loads else 0.0
    ttfts = [v for o in ran if (v := o.ttft_s) is not None]
    hit_rate = hits / prompt if prompt else None
    pooled_rate = pooled / prompt if prompt else None
    return {
        "requests": len(chained),
        "prompt_tokens": prompt,
        "hit_tokens": hits,
        "miss_tokens": prompt - hits,
        "hit_rate": hit_rate,
        "pooled_capacity_tokens": capacity,
        "pooled_hit_tokens": pooled,
        "pooled_hit_rate": pooled_rate,
        "pooled_ratio": hit_rate / pooled_rate if hit_rate is not None and pooled_rate else None,
        "forecast_tokens": sum(o.forecast_tokens for o in chained),
        "misses": sum(
            1 for o in chained if missed(o.forecast_tokens, o.cached_tokens, o.request.block_tokens)
        ),
        "prompt_tokens_per_worker": per_worker,
        "imbalance": max(loads) / mean if mean > 0 else None,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
    }


def _scaling(result: SimResult) -> dict[str, Any]:
    ups = [e for e in result.scale_events if e.action == "up"]
    downs = [e for e in result.scale_events if e.action == "down"]
    last: dict[str, str] = {}
    reversals = 0
    for e in result.scale_events:
        if e.model in last and last[e.model] != e.action:
            reversals += 1
        last[e.model] = e.action
    return {
        "scale_ups": len(ups),
        "scale_downs": len(downs),
        "workers_launched": sum(len(e.workers) for e in ups),
        "workers_drained": sum(len(e.workers) for e in downs),
        "reversals": reversals,
    }


def _fairness(rows: Sequence[RequestOutcome], sla: Mapping[str, float]) -> dict[str, Any]:
    def index(subset: Sequence[RequestOutcome]) -> float | None:
        total: dict[str, int] = {}
        good: dict[str, int] = {}
        for o in subset:
            tokens = o.request.prompt_tokens + o.request.output_tokens
            total[o.request.tenant] = total.get(o.request.tenant, 0) + tokens
            if _met(o, sla):
                good[o.request.tenant] = good.get(o.request.tenant, 0) + tokens
        return jain_index([good.get(t, 0) / n for t, n in sorted(total.items()) if n])

    by_class = {c: [o for o in rows if o.request.priority == c] for c in sla}
    return {
        "jain_tokens": index(rows),
        "jain_tokens_by_class": {c: index(v) for c, v in by_class.items() if v},
        "tenants": len({o.request.tenant for o in rows}),
    }


# --- output ----------------------------------------------------------------------------


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _sec(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _num(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


CLASS_COLUMNS = (
    "policy",
    "class",
    "requests",
    "SLA met",
    "TTFT met",
    "TPOT met",
    "SLO met",
    "wait p50/p95/p99 s",
    "TTFT p99 s",
    "e2e p50/p95/p99 s",
    "expired",
    "starved",
    "refused",
)
FLEET_COLUMNS = (
    "policy",
    "SLA met",
    "SLO met",
    "GPU-s",
    "mean/peak workers",
    "GPU util",
    "KV util",
    "busy",
    "scale up/down",
    "reversals",
    "preempted",
    "Jain",
    "wall s",
)


def class_rows(reports: Sequence[Report]) -> list[list[str]]:
    """One row per (policy, class): the cells of :data:`CLASS_COLUMNS`."""
    rows = []
    for rep in reports:
        for cls, s in rep["classes"].items():
            rows.append(
                [
                    rep["policy"],
                    cls,
                    str(s["requests"]),
                    _pct(s["sla_attainment"]),
                    _pct(s.get("ttft_attainment")),
                    _pct(s.get("tpot_attainment")),
                    _pct(s.get("slo_attainment")),
                    "/".join(_sec(s[f"queue_wait_{q}_s"]) for q in ("p50", "p95", "p99")),
                    _sec(s["ttft_p99_s"]),
                    "/".join(_sec(s[f"e2e_{q}_s"]) for q in ("p50", "p95", "p99")),
                    str(s["expired"]),
                    str(s["starved"]),
                    str(s.get("refused", 0)),
                ]
            )
    return rows


def fleet_rows(reports: Sequence[Report]) -> list[list[str]]:
    """One row per policy: the cells of :data:`FLEET_COLUMNS`."""
    rows = []
    for rep in reports:
        f, sc = rep["fleet"], rep["scaling"]
        rows.append(
            [
                rep["policy"],
                _pct(rep["overall"]["sla_attainment"]),
                _pct(rep["overall"].get("slo_attainment")),
                f"{f['gpu_seconds']:.0f}",
                f"{_num(f['mean_workers'], 1)}/{f['peak_workers']}",
                _pct(f["gpu_utilisation"]),
                _pct(f.get("kv_utilisation")),
                _pct(f["gpu_busy_fraction"]),
                f"{sc['scale_ups']}/{sc['scale_downs']}",
                str(sc["reversals"]),
                str(rep["run"].get("preemptions", 0)),
                _num(rep["fairness"]["jain_tokens"], 3),
                _num(rep["run"]["wall_s"], 1),
            ]
        )
    return rows


PREFIX_COLUMNS = (
    "policy",
    "prompt tokens",
    "hit rate",
    "pooled LRU",
    "hit/pooled",
    "forecast",
    "misses",
    "max/mean per worker",
    "mean TTFT s",
)


def prefix_rows(reports: Sequence[Report]) -> list[list[str]]:
    """One row per policy whose requests carried chains: the cells of :data:`PREFIX_COLUMNS`."""
    rows = []
    for rep in reports:
        p = rep.get("prefix")
        if not p:
            continue
        rows.append(
            [
                rep["policy"],
                f"{p['prompt_tokens']:,}",
                _pct(p["hit_rate"]),
                _pct(p["pooled_hit_rate"]),
                _num(p["pooled_ratio"]),
                f"{p['forecast_tokens']:,}",
                str(p["misses"]),
                _num(p["imbalance"]),
                _num(p["mean_ttft_s"], 3),
            ]
        )
    return rows


def tables(reports: Sequence[Report]) -> tuple[Table, ...]:
    """Rich tables: per class, fleet/scaling/fairness per policy, and the prefix cache
    per policy when the requests carried prefix chains."""
    per_class = Table(
        title="SLA and latency per class (SLA = flat TTFT; TTFT/TPOT/SLO = inferq.sla's targets)"
    )
    for col in CLASS_COLUMNS:
        per_class.add_column(col, justify="left" if col in ("policy", "class") else "right")
    for row in class_rows(reports):
        per_class.add_row(*row)
    fleet = Table(title="Fleet, scaling and tenant fairness")
    for col in FLEET_COLUMNS:
        fleet.add_column(col, justify="left" if col == "policy" else "right")
    for row in fleet_rows(reports):
        fleet.add_row(*row)
    rows = prefix_rows(reports)
    if not rows:
        return per_class, fleet
    prefix = Table(
        title="Prefix cache (hit rate = cached / prompt tokens; pooled = one LRU of the "
        "fleet's KV; max/mean = prompt tokens per worker)"
    )
    for col in PREFIX_COLUMNS:
        prefix.add_column(col, justify="left" if col == "policy" else "right")
    for row in rows:
        prefix.add_row(*row)
    return per_class, fleet, prefix


def markdown(reports: Sequence[Report]) -> str:
    """The tables of :func:`tables` as GitHub markdown."""

    def table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
        head = "| " + " | ".join(columns) + " |"
        rule = "|" + "|".join(" --- " if c in ("policy", "class") else " ---: " for c in columns)
        rule += "|"
        body = ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([head, rule, *body])

    text = (
        table(CLASS_COLUMNS, class_rows(reports))
        + "\n\n"
        + table(FLEET_COLUMNS, fleet_rows(reports))
        + "\n"
    )
    rows = prefix_rows(reports)
    if rows:
        text += "\n" + table(PREFIX_COLUMNS, rows) + "\n"
    return text


def write_json(reports: Sequence[Report], path: str | Path, meta: Mapping[str, Any]) -> None:
    """Write ``{"workload": meta, "policies": reports}`` as indented JSON."""
    data = {"workload": dict(meta), "policies": list(reports)}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def plot(results: Sequence[SimResult], reports: Sequence[Report], path: str | Path) -> None:
    """A PNG: SLA attainment and p99 TTFT per class, live workers and queued requests over time.

    Uses matplotlib's Agg backend (no display needed).

    Raises:
        MissingExtra: matplotlib is not installed (the ``demo`` extra).
    """
    import_extra("matplotlib", "demo", "the simulator's plot").use("Agg")
    plt: Any = import_extra("matplotlib.pyplot", "demo", "the simulator's plot")

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    classes = list(results[0].classes) if results else []
    width = 0.8 / max(1, len(reports))
    for i, rep in enumerate(reports):
        xs = [c + i * width for c in range(len(classes))]
        att = [100 * (rep["classes"].get(c, {}).get("sla_attainment") or 0) for c in classes]
        ttft = [rep["classes"].get(c, {}).get("ttft_p99_s") or 0 for c in classes]
        axes[0][0].bar(xs, att, width, label=rep["policy"])
        axes[0][1].bar(xs, ttft, width, label=rep["policy"])
    for ax, title in ((axes[0][0], "SLA attainment, %"), (axes[0][1], "p99 TTFT, s (log)")):
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(classes))], classes)
        ax.set_title(title)
    axes[0][1].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    for res in results:
        t = [s.at / 60 for s in res.samples]
        axes[1][0].step(
            t,
            [s.starting + s.ready + s.draining for s in res.samples],
            where="post",
            label=res.policy,
        )
        axes[1][1].plot(t, [sum(s.queued) for s in res.samples], label=res.policy, lw=1)
    axes[1][0].set_title("live workers (starting + ready + draining)")
    axes[1][1].set_title("queued requests")
    for ax in (axes[1][0], axes[1][1]):
        ax.set_xlabel("minutes")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
