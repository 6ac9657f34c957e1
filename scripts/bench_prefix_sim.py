"""Prefix-cache-aware routing on the simulator: inferq against least-loaded and naive affinity.

Replays the bundled Mooncake trace (``load_trace("mooncake")``: 3,993 requests, mean
prompt 15k tokens, block ids per 512 tokens) as ``realtime`` on fixed fleets of
``llama-3.1-8b`` workers (4, 8 and 16 by default; no scaler, so only routing differs),
its arrivals scaled so the offered load is ``--load`` of the fleet's sustainable
throughput (``inferq simulate --load``'s rule, computed with full prefills: the cache
only adds headroom). Per fleet and policy (``inferq``; ``least-loaded``: no affinity;
``naive-affinity``: the longest cached prefix wins, load ignored) it prints the prefix
hit rate (cached / prompt tokens), the hit rate of one pooled LRU holding the whole
fleet's KV capacity fed the same requests in arrival order, their ratio, max/mean
prompt tokens per worker, the mean TTFT and its ratio to least-loaded's, and realtime
SLA attainment. Issue 22's goals, checked per fleet for ``inferq``: hit rate within
10% of pooled (ratio >= 0.9), max/mean <= 1.25, mean TTFT >= 15% below least-loaded,
realtime SLA attainment not below least-loaded's.

``--system-prompt`` adds a variant where every request first shares one 512-token block
(a system prompt): the case where "longest cached prefix wins" is the trap. No Redis;
about a minute on 2 cores::

    python scripts/bench_prefix_sim.py --json prefix.json
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
from inferq.sim.capacity import offered_rate, sustainable_rate
from inferq.sim.engine import SimConfig, simulate
from inferq.sim.policies import ALL_POLICIES
from inferq.sim.report import summarize
from inferq.sim.workload import SimRequest, TraceSource, assemble, scale_requests
from inferq.traces import MOONCAKE_BLOCK_TOKENS

MODEL = "llama-3.1-8b"
POLICY_NAMES = ("inferq", "least-loaded", "naive-affinity")
#: Issue 22's goals: hit rate / pooled, max / mean prompt tokens per worker, TTFT cut.
GOAL_POOLED_RATIO = 0.9
GOAL_IMBALANCE = 1.25
GOAL_TTFT_CUT = 0.15
#: The shared first block of ``--system-prompt`` (any hash outside the trace's chains).
SYSTEM_BLOCK = 0x5157_5354_454D

console = Console(width=None if sys.stdout.isatty() else 160)


def with_system_prompt(requests: list[SimRequest]) -> list[SimRequest]:
    """Every request behind one shared 512-token block: its chain gets that block first
    (two requests still share blocks ``0..i+1`` exactly when they shared ``0..i``)."""
    return [
        replace(
            r,
            prompt_tokens=r.prompt_tokens + MOONCAKE_BLOCK_TOKENS,
            prefix=(SYSTEM_BLOCK, *r.prefix),
            block_tokens=MOONCAKE_BLOCK_TOKENS,
        )
        for r in requests
    ]


def run_fleet(
    base: list[SimRequest], settings: Settings, workers: int, load: float
) -> dict[str, Any]:
    """One fleet: the three policies on the trace scaled to ``load``; their figures."""
    fleet = {MODEL: workers}
    sustainable = sustainable_rate(base, settings, fleet, SimConfig().slots, SimConfig().vram_mib)
    scale = load * sustainable / offered_rate(base)
    requests = scale_requests(base, scale)
    config = SimConfig(settings=settings, fleet=fleet)
    rows: dict[str, dict[str, Any]] = {}
    for name in POLICY_NAMES:
        policy = replace(ALL_POLICIES[name], scaler=None)
        t0 = time.process_time()
        result = simulate(requests, policy, config)
        report = summarize(result, settings.classes, policy.summary)
        prefix = report["prefix"]
        rows[name] = {
            "hit_rate": prefix["hit_rate"],
            "pooled_hit_rate": prefix["pooled_hit_rate"],
            "pooled_ratio": prefix["pooled_ratio"],
            "imbalance": prefix["imbalance"],
            "mean_ttft_s": prefix["mean_ttft_s"],
            "realtime_sla": report["classes"]["realtime"]["sla_attainment"],
            "misses": prefix["misses"],
            "cpu_s": time.process_time() - t0,
        }
    base_ttft = rows["least-loaded"]["mean_ttft_s"]
    for row in rows.values():
        row["ttft_vs_least_loaded"] = row["mean_ttft_s"] / base_ttft if base_ttft else None
    ours, ll = rows["inferq"], rows["least-loaded"]
    goals = {
        "pooled_ratio": ours["pooled_ratio"] >= GOAL_POOLED_RATIO,
        "imbalance": ours["imbalance"] <= GOAL_IMBALANCE,
        "ttft_cut": ours["ttft_vs_least_loaded"] <= 1 - GOAL_TTFT_CUT,
        "realtime_sla": ours["realtime_sla"] >= ll["realtime_sla"],
    }
    return {
        "workers": workers,
        "rate_per_s": offered_rate(requests),
        "rate_scale": scale,
        "policies": rows,
        "goals": goals,
    }


def table(title: str, fleets: list[dict[str, Any]]) -> Table:
    t = Table(title=title)
    columns = (
        "workers",
        "policy",
        "hit rate",
        "pooled LRU",
        "hit/pooled",
        "max/mean",
        "mean TTFT s",
        "vs least-loaded",
        "realtime SLA",
        "cpu s",
    )
    for col in columns:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for f in fleets:
        for name, r in f["policies"].items():
            t.add_row(
                str(f["workers"]),
                name,
                f"{r['hit_rate']:.1%}",
                f"{r['pooled_hit_rate']:.1%}",
                f"{r['pooled_ratio']:.2f}",
                f"{r['imbalance']:.2f}",
                f"{r['mean_ttft_s']:.3f}",
                f"{r['ttft_vs_least_loaded']:.2f}",
                f"{r['realtime_sla']:.1%}",
                f"{r['cpu_s']:.1f}",
            )
    return t


def verdict(fleets: list[dict[str, Any]]) -> str:
    parts = []
    for f in fleets:
        missed = [k for k, ok in f["goals"].items() if not ok]
        said = "all met" if not missed else "missed " + ", ".join(missed)
        parts.append(f"{f['workers']} workers: {said}")
    return "goals (inferq): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fleets", default="4,8,16", help="Worker counts, comma-separated.")
    parser.add_argument(
        "--load", type=float, default=0.8, help="Offered load, fraction of sustainable."
    )
    parser.add_argument("--system-prompt", action="store_true", help="Add the shared-block case.")
    parser.add_argument("--json", type=Path, help="Write the figures here.")
    args = parser.parse_args(argv)
    settings = Settings()
    base = assemble([TraceSource.parse("mooncake")], settings, batch_requests=0)
    sizes = [int(x) for x in args.fleets.split(",") if x.strip()]
    cases = {"mooncake": base}
    if args.system_prompt:
        cases["mooncake + shared system block"] = with_system_prompt(base)
    out: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "load": args.load,
        "cases": {},
    }
    for case, requests in cases.items():
        fleets = [run_fleet(requests, settings, n, args.load) for n in sizes]
        out["cases"][case] = fleets
        console.print(table(f"{case}: {MODEL} fleets at {args.load:.0%} offered load", fleets))
        console.print(verdict(fleets), highlight=False)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
