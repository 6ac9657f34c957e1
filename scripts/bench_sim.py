"""Simulator wall time for the full Azure conversation trace, per policy (issue 7).

Replays the bundled conversation trace (19,366 requests over ~58 min) as
``realtime`` on the simulator's default fleet (``defaults.SIM_FLEET``, scaling
up to ``--max-workers``), once per policy, and reports the wall time, the
number of dispatch decisions and the share of the time spent inside the
policy's decision function (``decide`` or FIFO). Goal: <= 10 s for ``inferq``
on a 2-core machine. ``--mix`` also runs the default ``inferq simulate``
workload (both traces and a synthetic batch job), where a standing backlog
makes every decision read full queue heads. No Redis is needed::

    python scripts/bench_sim.py --json sim.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from inferq.config import Settings
from inferq.sim.engine import SimConfig, simulate
from inferq.sim.policies import POLICIES
from inferq.sim.workload import SimRequest, TraceSource, assemble

#: The issue's budget for one hour of the conversation trace under ``inferq``, seconds.
BUDGET_S = 10.0

console = Console(width=None if sys.stdout.isatty() else 160)


def workloads(
    settings: Settings, mix: bool, duration_s: float | None = None
) -> dict[str, list[SimRequest]]:
    """``conv``: the conversation trace as realtime; ``mix``: the default simulate workload."""
    out = {"conv": assemble([TraceSource.parse("conv")], settings, duration_s=duration_s)}
    if mix:
        sources = [TraceSource.parse("conv"), TraceSource.parse("code")]
        out["mix"] = assemble(sources, settings, duration_s=duration_s, batch_requests=None)
    return out


def run(
    name: str, requests: list[SimRequest], policy: str, config: SimConfig, full: bool = True
) -> dict[str, Any]:
    """One simulation; its cost figures under self-explaining keys."""
    result = simulate(requests, POLICIES[policy], config)
    stats = result.stats
    return {
        "workload": name,
        "policy": policy,
        "requests": len(requests),
        "simulated_s": result.end_s,
        "wall_s": stats.wall_s,
        "decisions": stats.decisions,
        "decide_s": stats.decide_s,
        "decide_share": stats.decide_s / stats.wall_s if stats.wall_s else None,
        "decide_ms_mean": 1000 * stats.decide_s / stats.decisions if stats.decisions else None,
        "events": stats.events,
        "simulated_per_wall_s": result.end_s / stats.wall_s if stats.wall_s else None,
        "within_budget": stats.wall_s <= BUDGET_S if name == "conv" and full else None,
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
    for col in ("workload", "policy", "requests", "wall s", "decisions", "in decide", "ms/decide"):
        table.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for r in rows:
        table.add_row(
            r["workload"],
            r["policy"],
            f"{r['requests']:,}",
            f"{r['wall_s']:.2f}",
            f"{r['decisions']:,}",
            f"{100 * (r['decide_share'] or 0):.0f}%",
            f"{r['decide_ms_mean'] or 0:.3f}",
        )
    console.print(table)
    inferq = [r for r in rows if r["workload"] == "conv" and r["policy"] == "inferq"]
    if inferq and full:
        ok = "within" if inferq[0]["within_budget"] else "OVER"
        console.print(
            f"inferq on conv: {inferq[0]['wall_s']:.2f} s, {ok} the {BUDGET_S:g} s budget"
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
            "budget_s_conv_inferq": BUDGET_S,
            "results": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
