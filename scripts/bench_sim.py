"""Simulator wall time for an hour of trace, per policy and workload (issues 7 and 16).

Replays the bundled conversation trace (19,366 requests over ~58 min) as
``realtime`` on the simulator's default fleet (``defaults.SIM_FLEET``, scaling
up to ``--max-workers``), once per policy, and reports the wall and CPU time,
the number of dispatch decisions and the share of the time spent inside the
policy's decision function (``decide`` or FIFO). ``--mix`` adds two workloads
where requests wait long: ``unservable`` (the same trace plus one request in
50 for a route no model serves, ``>=400b``: each waits its whole 120 s timeout)
and ``mix`` (the default ``inferq simulate`` workload: both traces and a bulk
batch job that waits behind them). Goal (issue 16): every row <= 10 s per hour
of trace on a 2-core machine, whatever waits; the verdict line names the slowest
row. On a shared machine the CPU seconds are the steadier figure. No Redis::

    python scripts/bench_sim.py --mix --json sim.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from inferq.config import Settings
from inferq.sim.engine import SimConfig, simulate
from inferq.sim.policies import POLICIES
from inferq.sim.workload import SimRequest, TraceSource, assemble

#: The issues' budget for one hour of trace (any workload, any policy), seconds.
BUDGET_S = 10.0

#: One request in this many gets an unservable twin in the ``unservable`` workload.
UNSERVABLE_EVERY = 50
#: A route no registry model serves (each such request waits its class's timeout).
UNSERVABLE_ROUTE = ">=400b"

console = Console(width=None if sys.stdout.isatty() else 160)


def workloads(
    settings: Settings, mix: bool, duration_s: float | None = None
) -> dict[str, list[SimRequest]]:
    """``conv``: the conversation trace as realtime; with ``mix``, ``unservable`` (``conv``
    plus a twin of every ``UNSERVABLE_EVERY``-th request routed to ``UNSERVABLE_ROUTE``)
    and ``mix`` (the default simulate workload)."""
    conv = assemble([TraceSource.parse("conv")], settings, duration_s=duration_s)
    out = {"conv": conv}
    if mix:
        twins: list[SimRequest] = []
        for i, r in enumerate(conv):
            twins.append(r)
            if i % UNSERVABLE_EVERY == 0:
                twins.append(replace(r, id=f"{r.id}u", route=UNSERVABLE_ROUTE))
        out["unservable"] = twins
        sources = [TraceSource.parse("conv"), TraceSource.parse("code")]
        out["mix"] = assemble(sources, settings, duration_s=duration_s, batch_requests=None)
    return out


def run(
    name: str, requests: list[SimRequest], policy: str, config: SimConfig, full: bool = True
) -> dict[str, Any]:
    """One simulation; its cost figures under self-explaining keys."""
    cpu0 = time.process_time()
    result = simulate(requests, POLICIES[policy], config)
    cpu_s = time.process_time() - cpu0
    stats = result.stats
    # per hour of trace (the run's span, a little past the last arrival)
    hours = max(result.end_s, 1.0) / 3600.0
    return {
        "workload": name,
        "policy": policy,
        "requests": len(requests),
        "simulated_s": result.end_s,
        "wall_s": stats.wall_s,
        "cpu_s": cpu_s,
        "wall_s_per_hour": stats.wall_s / hours,
        "cpu_s_per_hour": cpu_s / hours,
        "decisions": stats.decisions,
        "decide_s": stats.decide_s,
        "decide_share": stats.decide_s / stats.wall_s if stats.wall_s else None,
        "decide_ms_mean": 1000 * stats.decide_s / stats.decisions if stats.decisions else None,
        "events": stats.events,
        "simulated_per_wall_s": result.end_s / stats.wall_s if stats.wall_s else None,
        "within_budget": stats.wall_s / hours <= BUDGET_S if full else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the figures here")
    p.add_argument("--policy", action="append", choices=list(POLICIES), help="(repeatable)")
    p.add_argument("--mix", action="store_true", help="also run the default simulate workload")
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument(
        "--duration", type=float, help="seconds of each trace (default: all; a quick smoke run)"
    )
    args = p.parse_args(argv)
    settings = Settings()
    config = SimConfig(settings=settings, max_workers=args.max_workers)
    rows = []
    full = args.duration is None
    for name, requests in workloads(settings, args.mix, args.duration).items():
        for policy in args.policy or list(POLICIES):
            rows.append(run(name, requests, policy, config, full))
    table = Table(title="Simulator wall time (virtual hour of trace)", title_justify="left")
    cols = ("workload", "policy", "requests", "wall s", "wall s/h", "CPU s/h", "decisions")
    for col in (*cols, "in decide", "ms/decide"):
        table.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for r in rows:
        table.add_row(
            r["workload"],
            r["policy"],
            f"{r['requests']:,}",
            f"{r['wall_s']:.2f}",
            f"{r['wall_s_per_hour']:.2f}",
            f"{r['cpu_s_per_hour']:.2f}",
            f"{r['decisions']:,}",
            f"{100 * (r['decide_share'] or 0):.0f}%",
            f"{r['decide_ms_mean'] or 0:.3f}",
        )
    console.print(table)
    if rows and full:
        slowest = max(rows, key=lambda r: r["wall_s_per_hour"])
        cpu = max(rows, key=lambda r: r["cpu_s_per_hour"])
        verdict = "met" if slowest["wall_s_per_hour"] <= BUDGET_S else "missed"
        console.print(
            f"goal {verdict} (<= {BUDGET_S:g} s per hour of trace on every row): slowest "
            f"{slowest['workload']}/{slowest['policy']} {slowest['wall_s_per_hour']:.2f} s wall "
            f"per hour; most CPU {cpu['workload']}/{cpu['policy']} "
            f"{cpu['cpu_s_per_hour']:.2f} s per hour"
        )
    if args.json:
        doc = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "budget_s_per_hour": BUDGET_S,
            "results": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
