"""The dashboard's web app: the page, its live fragment, the JSON state, the static files."""

from __future__ import annotations

import time
from html import escape
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from inferq.dashboard.state import dashboard_state
from inferq.store import Store

#: Page refresh period, milliseconds.
REFRESH_MS = 2000

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>inferq · {namespace}</title>
<link rel="stylesheet" href="static/uPlot.min.css">
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.2em; color: #222; }}
h1 {{ font-size: 1.3em; margin: 0 0 .4em; }} h2 {{ font-size: 1.05em; margin: 1.2em 0 .3em; }}
table {{ border-collapse: collapse; }} td, th {{ padding: .2em .7em; text-align: left; }}
th {{ border-bottom: 1px solid #999; }} tr:nth-child(even) td {{ background: #f4f4f4; }}
.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.late, .corrupt, .missed {{ color: #b00; font-weight: bold; }} .ok {{ color: #070; }}
.id {{ font-family: ui-monospace, monospace; white-space: nowrap; }}
#charts {{ display: flex; gap: 2em; flex-wrap: wrap; }} .muted {{ color: #777; }}
</style></head>
<body>
<h1>inferq <span class="muted">namespace {namespace}</span></h1>
<div id="charts"><div id="queue-chart"></div><div id="sla-chart"></div></div>
<div id="live" data-updated="server">{fragment}</div>
<script src="static/uPlot.iife.min.js"></script>
<script>
const hist = {{t: [], queued: [], sla: {{}}}};
let qPlot = null, sPlot = null;
function opts(title, series) {{
  return {{title, width: 520, height: 200, scales: {{x: {{time: true}}}},
           series: [{{}}, ...series.map((s, i) => ({{label: s,
             stroke: ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"][i % 5]}}))]}};
}}
function draw(state) {{
  hist.t.push(state.now); if (hist.t.length > 300) hist.t.shift();
  const queued = state.queues.reduce((a, q) => a + q.queued, 0);
  hist.queued.push(queued); if (hist.queued.length > 300) hist.queued.shift();
  const classes = Object.keys(state.sla);
  for (const c of classes) {{
    const a = state.sla[c].attainment;
    (hist.sla[c] = hist.sla[c] || []).push(a === null ? null : 100 * a);
    if (hist.sla[c].length > hist.t.length) hist.sla[c].shift();
    while (hist.sla[c].length < hist.t.length) hist.sla[c].unshift(null);
  }}
  if (!qPlot) qPlot = new uPlot(opts("queued requests", ["queued"]),
                                [hist.t, hist.queued], document.getElementById("queue-chart"));
  else qPlot.setData([hist.t, hist.queued]);
  const sData = [hist.t, ...classes.map(c => hist.sla[c])];
  if (!sPlot) sPlot = new uPlot(opts("SLA attainment %", classes), sData,
                                document.getElementById("sla-chart"));
  else sPlot.setData(sData);
}}
async function refresh() {{
  try {{
    const [frag, state] = await Promise.all([
      fetch("fragment").then(r => r.text()), fetch("api/state").then(r => r.json())]);
    const live = document.getElementById("live");
    live.innerHTML = frag; live.dataset.updated = new Date().toISOString();
    draw(state);
  }} catch (e) {{ document.getElementById("live").dataset.error = String(e); }}
}}
refresh(); setInterval(refresh, {refresh_ms});
</script></body></html>
"""


def _pct(value: float | None) -> str:
    """A fraction as a whole percentage, ``-`` for none."""
    return "-" if value is None else f"{value:.0%}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _table(caption: str, head: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f"<h2>{escape(caption)}</h2><p class='muted'>{escape(empty)}</p>"
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(cells) + "</tr>" for cells in rows)
    return f"<h2>{escape(caption)}</h2><table><tr>{th}</tr>{body}</table>"


def _td(value: Any, cls: str = "") -> str:
    attr = f" class='{cls}'" if cls else ""
    return f"<td{attr}>{escape(str(value))}</td>"


def render_fragment(state: dict[str, Any]) -> str:
    """The live part of the page (tables) as HTML; every value is escaped."""
    parts: list[str] = []
    queues = [
        [
            _td(q["route"]),
            _td(q["class"]),
            _td(q["queued"], "num"),
            _td(_s(q["oldest_wait_s"]), "num"),
        ]
        for q in state["queues"]
    ]
    parts.append(_table("Queues", ["route", "class", "queued", "oldest wait"], queues, "no queue"))
    workers = []
    for w in state["workers"]:
        if w["state"] == "corrupt":
            workers.append(
                [_td(w["id"], "id"), _td("-"), _td("corrupt", "corrupt")]
                + [_td("-")] * 4
                + [_td(w["health"], "corrupt")]
            )
            continue
        workers.append(
            [
                _td(w["id"], "id"),
                _td(w["model"]),
                _td(w["state"]),
                _td(f"{w['slots_used']}/{w['slots']}", "num"),
                _td(_kv(w), "num"),
                _td(_pct(w.get("prefix_hit_rate")), "num"),
                _td(_s(w["heartbeat_age_s"]), "num"),
                _td(w["health"], w["health"]),
            ]
        )
    parts.append(
        _table(
            "Workers",
            ["worker", "model", "state", "slots", "KV cache", "prefix hits", "heartbeat", "health"],
            workers,
            "no live worker",
        )
    )
    minutes = state["sla_window_s"] / 60
    sla = []
    for cls, row in state["sla"].items():
        share = row["attainment"]
        text = "-" if share is None else f"{100 * share:.1f} %"
        mark = "" if share is None else ("ok" if share >= 0.99 else "missed")
        sla.append([_td(cls), _td(row["finished"], "num"), _td(row["met"], "num"), _td(text, mark)])
    parts.append(
        _table(
            f"SLA attainment, last {minutes:g} min",
            ["class", "results", "met SLA", "attainment"],
            sla,
            "no class",
        )
    )
    events = [
        [
            _td(time.strftime("%H:%M:%S", time.gmtime(e["at"])), "num"),
            _td(e["type"]),
            _td(" ".join(f"{k}={v}" for k, v in e["fields"].items() if k not in _LONG)),
        ]
        for e in state["events"]
    ]
    parts.append(_table("Recent events (UTC)", ["time", "event", "fields"], events, "no event"))
    if state.get("usage"):  # a state without it (an older page's): no usage tables
        parts.extend(_usage_tables(state["usage"]))
    dead = state["dead_letter"]
    rows = [
        [
            _td(d["id"], "id"),
            _td(d["priority"]),
            _td(d["tenant"]),
            _td(d["attempts"], "num"),
            _td(d["error"]),
        ]
        for d in dead["requests"]
    ]
    parts.append(
        _table(
            f"Dead letter ({dead['count']})",
            ["request", "class", "tenant", "attempts", "last error"],
            rows,
            "empty",
        )
    )
    return "\n".join(parts)


def create_app(store: Store) -> Starlette:
    """The dashboard of ``store``'s deployment (GET only; it writes nothing).

    Routes: ``/`` the page, ``/fragment`` its live tables, ``/api/state`` the JSON
    (:func:`~inferq.dashboard.state.dashboard_state`), ``/static`` uPlot.
    """

    async def state() -> dict[str, Any]:
        return await run_in_threadpool(dashboard_state, store)

    async def page(request: Request) -> Response:
        data = await state()
        html = _PAGE.format(
            namespace=escape(data["namespace"]),
            fragment=render_fragment(data),
            refresh_ms=REFRESH_MS,
        )
        return HTMLResponse(html)

    async def fragment(request: Request) -> Response:
        return HTMLResponse(render_fragment(await state()))

    async def api_state(request: Request) -> Response:
        return JSONResponse(await state())

    static = StaticFiles(directory=str(resources.files("inferq.dashboard") / "static"))
    return Starlette(
        routes=[
            Route("/", page),
            Route("/fragment", fragment),
            Route("/api/state", api_state),
            Mount("/static", app=static, name="static"),
        ]
    )


#: Event fields left out of the events table (long; the JSON state has them).
_LONG = ("ids", "usage")
_USAGE_HEAD = ["requests", "failed+expired", "prompt", "cached", "completion", "GPU-s", "cost $"]


def _usage_tables(today: dict[str, Any]) -> list[str]:
    """Today's usage by tenant and by model (:func:`~inferq.dashboard.state.usage_today`)."""
    hours = (today["until_ms"] - today["since_ms"]) // 3_600_000
    out = []
    for by in ("tenant", "model"):
        report = today[by]
        rows = []
        for r in [*report["rows"], {**report["total"], "name": "total"}]:
            unpriced = "*" if r["unpriced_models"] else ""
            rows.append(
                [
                    _td("(none)" if r["name"] == "" else r["name"]),
                    _td(f"{r['requests']:,}", "num"),
                    _td(f"{r['failed'] + r['expired']:,}", "num"),
                    _td(f"{r['prompt_tokens']:,}", "num"),
                    _td(f"{r['cached_tokens']:,}", "num"),
                    _td(f"{r['completion_tokens']:,}", "num"),
                    _td(f"{r['gpu_s']:,.1f}", "num"),
                    _td(f"{r['cost_usd']:,.4f}{unpriced}", "num"),
                ]
            )
        if not report["rows"]:
            rows = []
        out.append(
            _table(
                f"Usage today by {by} (UTC, {hours} h; * an unpriced model counts $0)",
                [by, *_USAGE_HEAD],
                rows,
                "nothing metered today",
            )
        )
    if today["corrupt"]:
        out.append(
            f"<p class='corrupt'>{today['corrupt']} usage record(s) do not parse "
            "(skipped; inferq usage names them)</p>"
        )
    return out


def _kv(worker: dict[str, Any]) -> str:
    """A worker's KV cell: reserved / booked MiB, and the free room it measured, if any."""
    text = f"{worker['kv_used_mib']:.0f}/{worker['kv_cache_mib']} MiB"
    measured = worker.get("kv_measured_free_mib")
    return text if measured is None else f"{text}, {measured:.0f} free measured"
