"""``inferq usage``: tokens, GPU-seconds, outcomes and cost per tenant, API key, class
or model, from the roll-ups every final result adds to (``lua/includes/meter.lua``).

The window is whole UTC hours: ``--since 24h`` starts at the hour 24 hours ago,
``--until`` (default now) ends with the hour it falls in. Cost is derived now, from
the settings' ``[prices.<model>]``: a changed price re-prices history. A roll-up
record that does not parse is skipped and reported (stderr, or ``corrupt`` in JSON).
"""

from __future__ import annotations

import json

import click
from rich.table import Column, Table

from inferq import usage
from inferq.cli.common import Context, err_console, fail, handle_errors, pass_ctx, show
from inferq.errors import InvalidUsageQuery


def usage_table(data: dict[str, object]) -> Table:
    by = str(data["by"])
    table = Table(
        Column(by, no_wrap=True),
        *(
            Column(h, justify="right")
            for h in ("requests", "ok", "failed", "expired", "cancelled", "prompt", "cached")
        ),
        Column("completion", justify="right"),
        Column("GPU-s", justify="right"),
        Column("cost $", justify="right"),
    )
    rows: list[dict[str, object]] = data["rows"]  # type: ignore[assignment]
    for row in [*rows, data["total"]]:
        assert isinstance(row, dict)
        name = "(none)" if row["name"] == "" else str(row["name"])
        cost = f"{row['cost_usd']:.4f}" + ("*" if row["unpriced_models"] else "")
        style = "bold" if row is data["total"] else None
        table.add_row(
            name,
            *(
                f"{row[c]:,}"
                for c in ("requests", *usage.COUNTERS[:-1])  # gpu_ms: shown as gpu_s
            ),
            f"{row['gpu_s']:,.1f}",
            cost,
            style=style,
        )
    return table


@click.command("usage")
@click.option(
    "--by",
    type=click.Choice(usage.DIMENSIONS),
    default="tenant",
    show_default=True,
    help="Sum by tenant, API key id (gateway), class or model.",
)
@click.option("--since", default="24h", show_default=True, help="Hours or days ago: 24h, 7d.")
@click.option("--until", default="now", show_default=True, help="Hours or days ago, or now.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def usage_cmd(obj: Context, by: str, since: str, until: str, as_json: bool) -> None:
    """Tokens, GPU-seconds, outcomes and cost per tenant, key, class or model.

    Cost is priced now from [prices.<model>] (a * marks rows with an unpriced model)."""
    try:
        data = obj.store.usage_report(by, since, until)
    except InvalidUsageQuery as exc:
        fail(f"--{exc.field}: {exc.reason}")
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    show(usage_table(data))
    corrupt: list[dict[str, str]] = data["corrupt"]  # type: ignore[assignment]
    if corrupt:
        err_console().print(
            f"skipped {len(corrupt)} usage record(s) that do not parse:", highlight=False
        )
        for c in corrupt[:20]:
            err_console().print(f"  {c['key']} {c['field']!r}: {c['reason']}", highlight=False)
    total: dict[str, object] = data["total"]  # type: ignore[assignment]
    if total["unpriced_models"]:
        models = ", ".join(total["unpriced_models"])  # type: ignore[arg-type]
        err_console().print(f"* no price for: {models} (counted as $0)", highlight=False)
