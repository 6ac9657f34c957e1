"""``inferq keys``: the gateway's API keys stored in Redis (add, list, revoke).

A stored key is kept as its SHA-256 digest only (``P apikeys``, see
:mod:`inferq.gateway.tenants`): ``add`` prints the new key once, and nothing can show
it again. ``list`` and ``revoke`` name a key by the first hex digits of its digest
(its id). Gateways started with ``--redis-keys`` accept the stored keys, and refuse a
revoked one within :data:`~inferq.gateway.tenants.KEY_CACHE_S`.
"""

from __future__ import annotations

import json
import time

import click
from rich.table import Column, Table

from inferq.cli.common import Context, console, fail, handle_errors, pass_ctx, show
from inferq.gateway.tenants import (
    KEY_ID_LEN,
    StoredKey,
    check_entry,
    digest,
    new_key,
    resolve_key_id,
)


@click.group()
def keys() -> None:
    """The gateway's API keys stored in Redis: add, list, revoke.

    Gateways started with `--redis-keys` accept them."""


@keys.command("add")
@click.option("--tenant", required=True, help="Tenant the key's requests are charged to.")
@click.option(
    "--class",
    "classes",
    multiple=True,
    metavar="CLASS",
    help="A priority class the key may use (repeat; omitted: every class).",
)
@click.option(
    "--default-class",
    help="Class of a request that names none (default: the only --class, else the classifier).",
)
@click.option("--requests-per-minute", "rpm", type=int, help="Rate limit (omitted: none).")
@click.option(
    "--tokens-per-minute",
    "tpm",
    type=int,
    help="Rate limit on prompt + max_tokens, counted at admission (omitted: none).",
)
@click.option("--note", default="", help="Free text: who holds the key, what for.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def add(
    obj: Context,
    tenant: str,
    classes: tuple[str, ...],
    default_class: str | None,
    rpm: int | None,
    tpm: int | None,
    note: str,
    as_json: bool,
) -> None:
    """Make a new API key, store its digest and entry, print the key (once)."""
    raw = {
        "tenant": tenant,
        "classes": list(classes),
        "default_class": default_class,
        "requests_per_minute": rpm,
        "tokens_per_minute": tpm,
    }
    entry = check_entry(raw, [c.name for c in obj.settings.classes], "inferq keys add")
    if len(note) > 200:
        fail(f"--note: at most 200 characters, got {len(note)}")
    key = new_key()
    key_digest = digest(key)
    stored = StoredKey(key=entry, created_s=round(time.time(), 3), note=note)
    if not obj.store.put_api_key(key_digest, stored.model_dump_json()):
        fail("a key with this digest is stored already (try again)")  # 2^-256: a broken RNG
    key_id = key_digest[:KEY_ID_LEN]
    if as_json:
        click.echo(json.dumps({"key": key, "id": key_id, "tenant": entry.tenant}, indent=2))
        return
    click.echo(key)
    click.echo(
        f"id {key_id}, tenant {entry.tenant}: the key is shown this once (only its "
        "SHA-256 digest is stored)",
        err=True,
    )


@keys.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def list_keys(obj: Context, as_json: bool) -> None:
    """The stored keys: id, tenant, classes, limits, when added (never the keys)."""
    rows = []
    for key_digest, raw in sorted(obj.store.api_keys().items()):
        stored = StoredKey.parse(raw)
        row: dict[str, object] = {"id": key_digest[:KEY_ID_LEN], "digest": key_digest}
        if stored is None:
            row["error"] = "invalid entry (the gateway refuses this key)"
        else:
            row.update(stored.key.model_dump())
            row["created_s"] = stored.created_s
            row["note"] = stored.note
        rows.append(row)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table("tenant", "classes", "default", "req/min", "tok/min", "added", "note")
    table.columns.insert(0, Column("id", no_wrap=True))
    for row in rows:
        if "error" in row:
            table.add_row(str(row["id"]), f"[red]{row['error']}[/red]", *[""] * 6)
            continue
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(str(row["created_s"]))))
        table.add_row(
            str(row["id"]),
            str(row["tenant"]),
            ", ".join(row["classes"]) or "all",  # type: ignore[arg-type]
            str(row["default_class"] or "-"),
            str(row["requests_per_minute"] or "-"),
            str(row["tokens_per_minute"] or "-"),
            created,
            str(row["note"]),
        )
    show(table)
    if not rows:
        console().print("no API keys stored (inferq keys add --tenant NAME)")


@keys.command("revoke")
@click.argument("key_ref", metavar="ID_OR_KEY")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def revoke(obj: Context, key_ref: str, as_json: bool) -> None:
    """Delete a stored key, named by its id (8+ hex digits of its digest), its
    ``sha256:<hex>`` digest, or the key itself."""
    key_digest = resolve_key_id(key_ref, list(obj.store.api_keys()))
    removed = obj.store.delete_api_key(key_digest)
    if as_json:
        click.echo(json.dumps({"id": key_digest[:KEY_ID_LEN], "revoked": removed}))
    elif removed:
        click.echo(f"revoked {key_digest[:KEY_ID_LEN]}")
    else:
        fail(f"{key_digest[:KEY_ID_LEN]} was revoked meanwhile")
