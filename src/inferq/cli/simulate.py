"""``inferq simulate``: replay traces through the policies in virtual time and compare them.

Default workload: the bundled Azure conversation trace as ``realtime``, the
code trace as ``standard``, and a synthetic batch job (10% as many requests,
token counts drawn from both traces, arriving a quarter into the window) as
``batch``, all routed to the default model. Default fleet: ``defaults.SIM_FLEET``
on 80 GiB cards; every policy below is run unless ``--policy`` picks some, and when
the requests carry prefix chains (``--trace mooncake``) the two prefix-routing
baselines beside them (``least-loaded``, ``naive-affinity``:
:data:`~inferq.sim.policies.PREFIX_BASELINES`), with a prefix-cache table (hit rate,
the pooled-LRU reference, prompt tokens per worker).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from inferq import defaults
from inferq.cli.common import fail
from inferq.config import Settings
from inferq.errors import ConfigError, InferqError
from inferq.extras import import_extra
from inferq.sim.capacity import offered_rate, sustainable_rate
from inferq.sim.catalog import build_scenario, scenario_names
from inferq.sim.deployment import SimConfig
from inferq.sim.engine import simulate as run_simulation
from inferq.sim.fleet import parse_fleet
from inferq.sim.policies import ALL_POLICIES, POLICIES, PREFIX_BASELINES
from inferq.sim.report import markdown, plot, summarize, tables, write_json
from inferq.sim.result import SimResult
from inferq.sim.scenarios import ScenarioContext
from inferq.sim.workload import SimRequest, TraceSource, assemble, scale_requests

#: Wide enough for the tables when the output is a pipe or a file (rich assumes 80).
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _settings(config_path: str | None) -> Settings:
    """``--config``, else the ``inferq`` group's settings, else ``INFERQ_CONFIG``/defaults."""
    if config_path:
        return Settings.load(config_path)
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    settings = getattr(obj, "settings", None)
    if isinstance(settings, Settings):
        return settings
    return Settings.load(os.environ.get("INFERQ_CONFIG") or None)


@click.command("simulate")
@click.option(
    "--trace",
    "traces",
    multiple=True,
    metavar="NAME|PATH[=CLASS]",
    help="conv, code, mooncake or a trace file, optionally =class (repeatable). "
    "Default: conv=realtime, code=standard and a synthetic batch job.",
)
@click.option(
    "--scenario",
    metavar="NAME[:ARG...]",
    help="A named workload instead of the traces (it may bring its own fleet): "
    + ", ".join(scenario_names())
    + ".",
)
@click.option("--duration", type=float, help="Seconds of each trace to replay (from its start).")
@click.option("--rate-scale", type=float, default=1.0, show_default=True, help="Arrival rate x.")
@click.option(
    "--load",
    type=float,
    help="Scale arrivals so the offered load is this fraction of the initial fleet's "
    "sustainable throughput (replaces --rate-scale).",
)
@click.option(
    "--batch-requests",
    type=int,
    help="Size of the synthetic batch job (default: 10% of the trace rows with the default "
    "workload, none with --trace).",
)
@click.option("--tenants", type=int, default=defaults.TRACE_TENANTS, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(list(ALL_POLICIES)),
    help="Policy to run (repeatable; default all five, and the prefix-routing baselines "
    "when the requests carry prefix chains).",
)
@click.option(
    "--fleet",
    default=defaults.SIM_FLEET,
    show_default=True,
    help="Initial warm workers, model:count,... (static-fifo sizes its own for the peak).",
)
@click.option("--vram-mib", type=int, default=defaults.SIM_VRAM_MIB, show_default=True)
@click.option("--slots", type=int, default=defaults.SIM_WORKER_SLOTS, show_default=True)
@click.option(
    "--max-workers",
    type=int,
    default=defaults.SCALE_MAX_WORKERS,
    show_default=True,
    help="Scaler bound per model (unless the settings have [scaling.pools]).",
)
@click.option("--model", help="Route of trace rows that name no known model (default model).")
@click.option(
    "--json-out",
    "json_path",
    type=click.Path(dir_okay=False),
    help="Write the metrics as JSON here.",
)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG here.")
@click.option(
    "--markdown", "md_path", type=click.Path(dir_okay=False), help="Write the tables as markdown."
)
@click.option(
    "--config", "config_path", type=click.Path(), help="TOML settings (else INFERQ_CONFIG)."
)
@click.option("--check", is_flag=True, help="Assert slot and VRAM limits after every decision.")
def simulate_command(**opts: Any) -> None:
    """Replay traces through the scheduling policies in virtual time and compare them."""
    try:
        _run(opts)
    except (InferqError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))


simulate = simulate_command


def _run(opts: dict[str, Any]) -> None:
    settings = _settings(opts["config_path"])
    if opts["plot_path"]:  # the plot comes last: fail before the runs
        import_extra("matplotlib", "demo", "inferq simulate --plot")
    if opts["slots"] < 1 or opts["max_workers"] < 1 or opts["vram_mib"] < 1:
        raise ValueError("--slots, --max-workers and --vram-mib must be >= 1")
    if opts["scenario"]:
        requests, fleet, meta = _scenario(opts, settings)
    else:
        fleet = parse_fleet(opts["fleet"], settings.model_by_name, opts["vram_mib"])
        requests, meta = _workload(opts, settings, fleet)
    config = SimConfig(
        settings=settings,
        fleet=fleet,
        vram_mib=opts["vram_mib"],
        slots=opts["slots"],
        max_workers=opts["max_workers"],
        check=opts["check"],
    )
    names = list(dict.fromkeys(opts["policies"])) or default_policies(requests)
    results: list[SimResult] = []
    reports: list[dict[str, Any]] = []
    for name in names:
        policy = ALL_POLICIES[name]
        result = run_simulation(requests, policy, config)
        results.append(result)
        reports.append(
            summarize(result, settings.classes, policy.summary, meta.get("watch_tenants", ()))
        )
        err_console.print(f"{name}: {result.stats.wall_s:.1f} s wall", highlight=False)
    _print(meta, reports)
    if opts["json_path"]:
        write_json(reports, opts["json_path"], meta)
    if opts["plot_path"]:
        plot(results, reports, opts["plot_path"])
    if opts["md_path"]:
        Path(opts["md_path"]).write_text(markdown(reports), encoding="utf-8")


def default_policies(requests: Sequence[SimRequest]) -> list[str]:
    """The five policies, and the prefix-routing baselines when some request carries a chain."""
    names = list(POLICIES)
    if any(r.prefix for r in requests):
        names += list(PREFIX_BASELINES)
    return names


def _scenario(
    opts: dict[str, Any], settings: Settings
) -> tuple[list[SimRequest], dict[str, int], dict[str, Any]]:
    """A ``--scenario`` workload: its requests, its fleet, and a description.

    The scenario's own fleet, slots, card and scaler bound replace the options'
    (which are left at their defaults for it); ``--load`` and ``--rate-scale``
    still scale its arrivals.

    Raises:
        ConfigError: unknown scenario or malformed arguments; ``--trace`` given too.
    """
    if opts["traces"]:
        raise ConfigError(
            "scenario: --scenario and --trace are exclusive (a scenario is a workload)"
        )
    context = ScenarioContext(
        settings=settings, seed=opts["seed"], duration_s=opts["duration"], tenants=opts["tenants"]
    )
    found, workload = build_scenario(opts["scenario"], context)
    for name in ("slots", "vram_mib", "max_workers"):
        value = getattr(workload, name)
        if value is not None:
            opts[name] = value
    fleet = (
        dict(workload.fleet)
        if workload.fleet is not None
        else parse_fleet(opts["fleet"], settings.model_by_name, opts["vram_mib"])
    )
    requests, meta = _scaled(opts, settings, fleet, list(workload.requests))
    meta.update(
        scenario=opts["scenario"],
        scenario_summary=found.summary,
        note=workload.note,
        watch_tenants=list(workload.watch_tenants),
    )
    return requests, fleet, meta


def _workload(
    opts: dict[str, Any], settings: Settings, fleet: dict[str, int]
) -> tuple[list[SimRequest], dict[str, Any]]:
    """The requests to replay, and a description of them for the outputs."""
    given = [TraceSource.parse(t) for t in opts["traces"]]
    sources = given or [TraceSource.parse("conv"), TraceSource.parse("code")]
    batch = opts["batch_requests"]
    if batch is None and given:
        batch = 0
    requests = assemble(
        sources,
        settings,
        duration_s=opts["duration"],
        batch_requests=batch,
        tenants=opts["tenants"],
        seed=opts["seed"],
        model=opts["model"],
    )
    if not requests:
        raise ValueError("the workload is empty (check --trace and --duration)")
    requests, meta = _scaled(opts, settings, fleet, requests)
    meta["traces"] = [f"{s.name}={s.priority or 'own'}" for s in sources]
    return requests, meta


def _scaled(
    opts: dict[str, Any], settings: Settings, fleet: dict[str, int], requests: list[SimRequest]
) -> tuple[list[SimRequest], dict[str, Any]]:
    """``requests`` scaled by ``--rate-scale`` or ``--load``, and the run's description."""
    scale = opts["rate_scale"]
    sustainable = sustainable_rate(requests, settings, fleet, opts["slots"], opts["vram_mib"])
    offered = offered_rate(requests)
    if opts["load"] is not None:
        if not opts["load"] > 0 or offered <= 0 or sustainable <= 0:
            raise ValueError(f"--load {opts['load']}: needs a positive load, trace span and fleet")
        scale = opts["load"] * sustainable / offered
    if scale != 1.0:
        requests = scale_requests(requests, scale)
    meta = {
        "requests": len(requests),
        "by_class": _count_by(requests, "priority"),
        "synthetic": sum(1 for r in requests if r.source == "synthetic"),
        "span_s": requests[-1].arrival_s - requests[0].arrival_s,
        "rate_scale": scale,
        "offered_rate_per_s": offered * scale,
        "fleet": fleet,
        "fleet_sustainable_rate_per_s": sustainable,
        "offered_load": offered * scale / sustainable if sustainable > 0 else None,
        "vram_mib": opts["vram_mib"],
        "slots": opts["slots"],
        "max_workers": opts["max_workers"],
        "tenants": opts["tenants"],
        "seed": opts["seed"],
    }
    return requests, meta


def _count_by(requests: Sequence[SimRequest], attr: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        key = getattr(r, attr)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _print(meta: dict[str, Any], reports: Sequence[dict[str, Any]]) -> None:
    load = meta["offered_load"]
    if meta.get("scenario"):
        console.print(f"scenario {meta['scenario']}: {meta['note']}", highlight=False)
    console.print(
        f"workload: {meta['requests']} requests {meta['by_class']} over {meta['span_s']:.0f} s, "
        f"rate x{meta['rate_scale']:.3g} = {meta['offered_rate_per_s']:.2f} req/s; fleet "
        f"{meta['fleet']} sustains {meta['fleet_sustainable_rate_per_s']:.2f} req/s"
        + (f" (offered load {load:.0%})" if load is not None else ""),
        highlight=False,
    )
    for table in tables(reports):
        console.print(table)
    watched = meta.get("watch_tenants") or []
    if watched:
        console.print(_tenant_table(reports, watched))


def _tenant_table(reports: Sequence[dict[str, Any]], tenants: Sequence[str]) -> Table:
    """The watched tenants of a scenario, one row per policy and tenant (seconds)."""
    table = Table(title="Watched tenants")
    columns = ("policy", "tenant", "requests", "succeeded", "SLA met", "first wait", "max wait")
    for col in (*columns, "max TTFT"):
        table.add_column(col, justify="left" if col in ("policy", "tenant") else "right")
    for report in reports:
        for tenant in tenants:
            t = report["tenants"][tenant]
            table.add_row(
                report["policy"],
                tenant,
                str(t["requests"]),
                str(t["succeeded"]),
                str(t["sla_met"]),
                _seconds(t.get("queue_wait_first_s")),
                _seconds(t["queue_wait_max_s"]),
                _seconds(t["ttft_max_s"]),
            )
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
