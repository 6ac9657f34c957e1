"""Every hostile mix of ``inferq simulate --scenario`` under the five policies (issue 12).

Runs each adversarial scenario (:func:`inferq.sim.catalog.adversarial_names`:
priority-inversion, kv-hog, tenant-flood, tenant-flood-aged, tenant-crowd) on
the deployment it names (one worker of the default model on a 24 GiB card;
``static-fifo`` provisions for the trace's peak as always) under every policy of
:data:`inferq.sim.policies.POLICIES`, and prints one table:

- the top class (realtime): TTFT p99 over its requests, one never served counting
  as never (``never``), and SLA attainment;
- the watched tenants (the scenario's verdict: ``interactive`` and ``analyst``
  in the inversion mixes, ``quiet`` in the floods): the first one's first and
  longest queue wait, and how many of their requests met their class's SLA;
- what the others paid (every request not of a watched tenant: the lower-class
  hog in the inversion mixes, the flood in the tenant mixes): their p99 queue
  wait, the change of their p99 and mean end-to-end time against the same
  policy with preemption off (:func:`~inferq.sim.policies.without_preemption`;
  0 for the policies that never preempt), the preemptions and the tokens the
  preempted runs had processed and lost. A policy that preempts (``inferq``) gets
  a second row with preemption off, the baseline of its Δ columns.

Deterministic: the scenarios' token counts are fixed and ``--seed`` is handed to
them; no Redis is needed::

    python scripts/eval_adversarial.py [--seed 0] [--json adversarial.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from inferq.config import Settings
from inferq.reporting import percentile
from inferq.sim.catalog import adversarial_names, build_scenario
from inferq.sim.engine import simulate
from inferq.sim.policies import POLICIES, SimPolicy, preempts, without_preemption
from inferq.sim.report import summarize
from inferq.sim.result import RequestOutcome, SimResult
from inferq.sim.scenarios import ScenarioContext, ScenarioWorkload

console = Console(width=None if sys.stdout.isatty() else 200)


def _others(result: SimResult, watched: Sequence[str]) -> list[RequestOutcome]:
    return [o for o in result.outcomes if o.request.tenant not in watched]


def _e2e(rows: Sequence[RequestOutcome]) -> tuple[float | None, float | None]:
    """(p99, mean) end-to-end seconds of the rows that finished."""
    values = [v for o in rows if (v := o.e2e_s) is not None and o.status == "succeeded"]
    return percentile(values, 99), (sum(values) / len(values) if values else None)


def evaluate(
    scenario: str,
    workload: ScenarioWorkload,
    policy: SimPolicy,
    settings: Settings,
    abort_delay_s: float = 0.0,
) -> list[dict[str, Any]]:
    """One scenario under one policy: its row and, when the policy preempts, the row of
    the same policy with preemption off (the baseline of the Δ columns)."""
    config = replace(workload.sim_config(settings, check=True), abort_delay_s=abort_delay_s)
    requests = list(workload.requests)
    result = simulate(requests, policy, config)
    if not preempts(policy, settings):
        return [_row(scenario, workload, policy, result, result, settings)]
    plain_policy = without_preemption(policy)
    plain = simulate(requests, plain_policy, config)
    return [
        _row(scenario, workload, policy, result, plain, settings),
        _row(scenario, workload, plain_policy, plain, plain, settings),
    ]


def _row(
    scenario: str,
    workload: ScenarioWorkload,
    policy: SimPolicy,
    result: SimResult,
    plain: SimResult,
    settings: Settings,
) -> dict[str, Any]:
    """The figures of one run; ``plain`` is the run without preemption (the Δ baseline)."""
    watched = workload.watch_tenants
    report = summarize(result, settings.classes, policy.summary, watched)
    top = settings.classes[0].name
    tops = [o for o in result.outcomes if o.request.priority == top]
    ttfts = [o.ttft_s if o.ttft_s is not None else math.inf for o in tops]
    others = _others(result, watched)
    p99, mean = _e2e(others)
    plain_p99, plain_mean = _e2e(_others(plain, watched))
    first = report["tenants"][watched[0]] if watched else {}
    return {
        "scenario": scenario,
        "policy": policy.name,
        "requests": len(result.outcomes),
        "realtime": {
            "requests": len(tops),
            "ttft_p99_s": percentile(ttfts, 99),
            "sla_attainment": report["classes"].get(top, {}).get("sla_attainment"),
        },
        "watched": {
            "tenant": watched[0] if watched else None,
            "queue_wait_first_s": first.get("queue_wait_first_s"),
            "queue_wait_max_s": first.get("queue_wait_max_s"),
            "sla_met": sum(t["sla_met"] for t in report["tenants"].values()),
            "requests": sum(t["requests"] for t in report["tenants"].values()),
            "tenants": report["tenants"],
        },
        "others": {
            "requests": len(others),
            "queue_wait_p99_s": percentile(
                [v for o in others if (v := o.queue_wait_s) is not None], 99
            ),
            "e2e_p99_s": p99,
            "e2e_mean_s": mean,
            "e2e_p99_delta_s": None if p99 is None or plain_p99 is None else p99 - plain_p99,
            "e2e_mean_delta_s": None if mean is None or plain_mean is None else mean - plain_mean,
            "expired": sum(1 for o in others if o.status == "expired"),
        },
        "preemptions": result.stats.preemptions,
        "wasted_tokens": sum(o.wasted_tokens for o in result.outcomes),
    }


def _s(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "never"
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(rows: Sequence[dict[str, Any]]) -> Table:
    """The one table (seconds; shares in percent)."""
    t = Table(title="Adversarial workloads (issue 12), simulated", title_justify="left")
    columns = [
        "scenario",
        "policy",
        "realtime TTFT p99 s",
        "realtime SLA",
        "watched",
        "first wait s",
        "max wait s",
        "watched SLA met",
        "others' wait p99 s",
        "others' e2e p99 Δ s",
        "others' e2e mean Δ s",
        "preemptions",
        "wasted tokens",
    ]
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i < 2 or name == "watched" else "right", no_wrap=i < 2)
    for r in rows:
        rt, w, o = r["realtime"], r["watched"], r["others"]
        t.add_row(
            r["scenario"],
            r["policy"],
            _s(rt["ttft_p99_s"]),
            _pct(rt["sla_attainment"]),
            w["tenant"] or "-",
            _s(w["queue_wait_first_s"]),
            _s(w["queue_wait_max_s"]),
            f"{w['sla_met']}/{w['requests']}",
            _s(o["queue_wait_p99_s"]),
            _s(o["e2e_p99_delta_s"]),
            _s(o["e2e_mean_delta_s"]),
            str(r["preemptions"]),
            f"{r['wasted_tokens']:,}",
        )
    return t


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table as Markdown, for docs/evaluation.md."""
    head = (
        "| scenario | policy | realtime TTFT p99 s | realtime SLA | watched: first / max wait s "
        "| watched SLA met | others' wait p99 s | others' e2e p99 / mean Δ s "
        "| preemptions | wasted tokens |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        rt, w, o = r["realtime"], r["watched"], r["others"]
        lines.append(
            f"| {r['scenario']} | {r['policy']} | {_s(rt['ttft_p99_s'])} "
            f"| {_pct(rt['sla_attainment'])} "
            f"| {w['tenant'] or '-'}: {_s(w['queue_wait_first_s'])} / {_s(w['queue_wait_max_s'])} "
            f"| {w['sla_met']}/{w['requests']} | {_s(o['queue_wait_p99_s'])} "
            f"| {_s(o['e2e_p99_delta_s'])} / {_s(o['e2e_mean_delta_s'])} "
            f"| {r['preemptions']} | {r['wasted_tokens']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=0, help="handed to every scenario builder")
    p.add_argument(
        "--scenario",
        action="append",
        choices=adversarial_names(),
        help="only these scenarios (repeatable; default: all)",
    )
    p.add_argument("--policy", action="append", choices=list(POLICIES), help="only these policies")
    p.add_argument(
        "--abort-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds from a preemption's abort to the freed room (the real worker reads "
        "its control channel within defaults.CONTROL_BLOCK_S = 0.5 s)",
    )
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the figures here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    args = p.parse_args(argv)
    settings = Settings.load(None)
    context = ScenarioContext(settings=settings, seed=args.seed)
    rows = []
    for name in args.scenario or adversarial_names():
        _, workload = build_scenario(name, context)
        for policy in args.policy or list(POLICIES):
            rows.extend(evaluate(name, workload, POLICIES[policy], settings, args.abort_delay))
    console.print(table(rows))
    console.print(
        "others = requests not of a watched tenant (the lower-class hog, or the flood); "
        "Δ = against the same policy with preemption off",
        highlight=False,
    )
    if args.markdown:
        console.print(markdown(rows), highlight=False, markup=False)
    if args.json:
        doc = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "python": platform.python_version(),
            "seed": args.seed,
            "abort_delay_s": args.abort_delay,
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n")
        console.print(f"figures written to {args.json}", highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
