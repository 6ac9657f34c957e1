"""``inferq``: run the components, submit and inspect requests, watch the fleet.

Every command takes ``--redis-url`` (``INFERQ_REDIS_URL``), ``--namespace``
(``INFERQ_NAMESPACE``) and ``--config`` (``INFERQ_CONFIG``, a TOML file).
Listings print rich tables, or JSON with ``--json``. Errors print one line
and exit non-zero; never a traceback.

The daemons' modules (the dispatcher and worker import RQ, metrics imports
prometheus-client, the demo its plotting) are imported by the command that runs
them, not here: every other command starts without them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from inferq import defaults, envvars
from inferq.cli.common import (
    Context,
    LazyGroup,
    console,
    err_console,
    fail,
    gpu_indices,
    handle_errors,
    hint_if_empty,
    metrics_options,
    pairs,
    pass_ctx,
    progress,
    say_ready,
    show,
    start_metrics,
)
from inferq.errors import InferqError, redact_url
from inferq.extras import import_extra
from inferq.logs import setup_logging

if TYPE_CHECKING:
    from inferq.config import Settings
    from inferq.models import Result, StreamChunk
    from inferq.store import Store

#: Commands imported only when they run (their modules pull in heavy dependencies).
LAZY_COMMANDS = {
    "scaler": (
        "inferq.cli.scaler:scaler",
        "Run a scaler replica: launch workers on backlog, drain idle ones.",
    ),
    "keys": (
        "inferq.cli.keys:keys",
        "The gateway's API keys stored in Redis: add, list, revoke.",
    ),
    "usage": (
        "inferq.cli.usage:usage_cmd",
        "Tokens, GPU-seconds, outcomes and cost per tenant, key, class or model.",
    ),
    "simulate": (
        "inferq.cli.simulate:simulate",
        "Replay traces through the scheduling policies in virtual time and compare them.",
    ),
}


@click.group(
    cls=LazyGroup,
    lazy=LAZY_COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--redis-url",
    envvar="INFERQ_REDIS_URL",
    help="Redis URL (redis://, rediss://, unix://, redis+sentinel://).",
)
@click.option("--namespace", envvar="INFERQ_NAMESPACE", help="Key namespace of the deployment.")
@click.option(
    "--cell",
    envvar="INFERQ_CELL",
    help="Run against this cell's Redis (a name under [cells] in the settings).",
)
@click.option(
    "--config", "config_path", envvar="INFERQ_CONFIG", type=click.Path(), help="TOML settings file."
)
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option("--log-json", is_flag=True, help="Log one JSON object per line.")
@click.version_option(package_name="inferq")
@click.pass_context
def cli(
    ctx: click.Context,
    redis_url: str | None,
    namespace: str | None,
    cell: str | None,
    config_path: str | None,
    log_level: str,
    log_json: bool,
) -> None:
    """inferq: priority-, deadline- and GPU-aware scheduling of LLM inference on Redis."""
    for line in envvars.warnings(os.environ):
        click.echo(line, err=True)
    setup_logging(log_level, json_lines=log_json)
    overrides: dict[str, Any] = {}
    if redis_url:
        overrides["redis_url"] = redis_url
    if namespace:
        overrides["namespace"] = namespace
    target = None
    if ctx.invoked_subcommand in CONNECTION_ONLY_COMMANDS and config_path is None and cell is None:
        target = connection_target(overrides)
    if target is not None:
        ctx.obj = Context(load=lambda: load_settings(config_path, cell, overrides), target=target)
    else:
        ctx.obj = Context(load_settings(config_path, cell, overrides))


#: Commands that need only the Redis URL and the namespace (they read through
#: ``Context.glance``): without a settings file, a cell or another setting in the
#: environment, they start without loading the settings (issue 15: CLI start time).
CONNECTION_ONLY_COMMANDS = frozenset({"queues"})


def connection_target(overrides: dict[str, Any]) -> tuple[str, str] | None:
    """``(redis_url, namespace)`` the settings would hold, when they are all that the
    settings would differ from their defaults by; None when the settings must be loaded
    (see :func:`inferq.envvars.connection_only`). ``overrides`` come from the options."""
    env = envvars.connection_only(os.environ)
    if env is None:
        return None
    url = overrides.get("redis_url") or env[0] or defaults.REDIS_URL
    namespace = overrides.get("namespace") or env[1] or defaults.NAMESPACE
    return (url, namespace) if envvars.valid_namespace(namespace) else None


def load_settings(config_path: str | None, cell: str | None, overrides: dict[str, Any]) -> Settings:
    """The settings of the command line: file, environment, options, then ``--cell``.

    Exits with one error line when they are invalid or the cell is unknown.
    """
    from inferq.config import Settings

    try:
        settings = Settings.load(config_path, **overrides)
    except InferqError as exc:
        fail(str(exc))
    if cell is not None:
        if cell not in settings.cells:
            fail(f"--cell: {cell!r} is not a cell (configured: {sorted(settings.cells) or 'none'})")
        settings = settings.model_copy(update={"redis_url": settings.cells[cell].redis_url})
    return settings


def emit(data: Any, as_json: bool, render: Callable[[Any], Any]) -> None:
    """Print ``data`` as JSON (``--json``) or through a rich renderer."""
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str, sort_keys=True))
    else:
        show(render(data))


# --- requests -----------------------------------------------------------------------


@cli.command()
@click.argument("prompt", required=False)
@click.option("--model", help="Model name or size requirement (>=13b).")
@click.option("--priority", help="Priority class name or level (0 = highest).")
@click.option("--tenant", default="default", show_default=True)
@click.option("--task-type", help="Task type (the classifier picks class and route from it).")
@click.option("--max-tokens", type=int)
@click.option("--timeout", type=float, help="Seconds until the deadline.")
@click.option("--idempotency-key")
@click.option(
    "--chat",
    is_flag=True,
    help="Send PROMPT as a chat message (role user), through the model's chat template.",
)
@click.option("--wait", is_flag=True, help="Wait for the result and print it.")
@click.option(
    "--stream",
    is_flag=True,
    help="Print the output as it is generated, then the result (--json: one JSON line per chunk).",
)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def submit(
    obj: Context,
    prompt: str | None,
    model: str | None,
    priority: str | None,
    tenant: str,
    task_type: str | None,
    max_tokens: int | None,
    timeout: float | None,
    idempotency_key: str | None,
    chat: bool,
    wait: bool,
    stream: bool,
    as_json: bool,
) -> None:
    """Submit one request (PROMPT, or stdin when omitted).

    Says on stderr when no live worker and no scaler pool serves the request's model
    now: it waits in the queue until one does, or until its deadline.
    """
    from inferq.cli import views
    from inferq.client import Client

    if prompt is None:
        if sys.stdin.isatty():
            raise click.UsageError("give a PROMPT or pipe one on stdin")
        prompt = sys.stdin.read()
    fields: dict[str, Any] = {"tenant": tenant}
    for name, value in (
        ("model", model),
        ("priority", priority),
        ("task_type", task_type),
        ("max_tokens", max_tokens),
        ("timeout", timeout),
        ("idempotency_key", idempotency_key),
    ):
        if value is not None:
            fields[name] = value
    client = Client(settings=obj.settings, store=obj.store)
    if chat:
        handle = client.submit(
            messages=[{"role": "user", "content": prompt}], stream=stream, **fields
        )
    else:
        handle = client.submit(prompt, stream=stream, **fields)
    if task_type is not None:  # after the submit: a refused request gets its error alone
        note_if_unclassified(obj.settings, task_type)
    if not handle.duplicate:
        note_if_unserved(obj, client.cells.for_id(handle.id), handle.id)
    if stream:
        print_stream(handle.stream(), as_json)
        return
    if not wait:
        out = {"id": handle.id, "duplicate": handle.duplicate}
        emit(out, as_json, lambda d: f"{d['id']}" + (" (duplicate)" if d["duplicate"] else ""))
        return
    result = handle.result()
    emit(views.result_dict(result), as_json, views.result_panel)
    if not result.ok:
        sys.exit(1)


def note_if_unclassified(settings: Settings, task_type: str) -> None:
    """Say on stderr when the classifier does not know ``task_type``. Task types are
    free-form by design (an unknown one gets the default class and model,
    :func:`inferq.intake.classify`; output-token estimates are learned per task type),
    so a typo would otherwise pass unseen."""
    if task_type in settings.classifier:
        return
    known = ", ".join(sorted(settings.classifier)) or "none configured"
    err_console().print(
        f"note: task_type {task_type!r} is not one the classifier knows ({known}): the "
        f"request gets the default class {settings.default_priority!r} and model "
        f"{settings.default_model!r} unless --priority or --model say otherwise",
        highlight=False,
        soft_wrap=True,
    )


def note_if_unserved(obj: Context, store: Store, request_id: str) -> None:
    """Say on stderr when nothing serves the request's model now in its cell's ``store``
    (the gateway answers 503 then; a queue may rightly hold work before its workers
    start, so here it is a note, not an error)."""
    from inferq.routes import parse_route, served

    request = store.record(request_id).request
    cls = obj.settings.priority_class(request.priority)
    available = set(store.live_models()) | store.scaler_pools()
    route = parse_route(request.model)
    if served(route, obj.settings.models, available, degrade=cls.allow_degrade):
        return
    err_console().print(
        f"note: no live worker and no scaler pool serves model {request.model!r} in "
        f"namespace {obj.settings.namespace!r} now; {request_id} waits until one does, or "
        f"until its deadline in {request.deadline - request.submitted_at:.0f} s",
        highlight=False,
        soft_wrap=True,
    )


def print_stream(items: Iterable[StreamChunk | Result], as_json: bool) -> None:
    """Print chunks as they come (a reset starts a new line, saying why), then the result:
    its panel, or with ``as_json`` one JSON object per line (chunks, then the result).
    Exits 1 when the request did not succeed."""
    from inferq.cli import views
    from inferq.models import Result

    result: Result | None = None
    for item in items:
        if isinstance(item, Result):
            result = item
        elif as_json:
            click.echo(json.dumps(item.model_dump(mode="json"), sort_keys=True), nl=True)
        else:
            if item.reset:
                click.echo(f"\n[reset: attempt {item.attempt} restarts the text]", err=True)
            click.echo(item.delta, nl=False)
            sys.stdout.flush()
    if result is None:
        return
    data = views.result_dict(result)
    if as_json:
        click.echo(json.dumps(data, sort_keys=True))
    else:
        click.echo()
        # The output was just printed as it came: the panel gives the rest.
        show(views.result_panel({**data, "output": None}))
    if not result.ok:
        sys.exit(1)


@cli.command("request")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def request_cmd(obj: Context, request_id: str, as_json: bool) -> None:
    """Show one request: state, timings, result or error."""
    from inferq.cli import views

    record = obj.store.record(request_id)
    emit(views.record_dict(record), as_json, views.record_panel)


@cli.command()
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def cancel(obj: Context, request_id: str, as_json: bool) -> None:
    """Cancel a request (prints the state it is in after the call); a running one is
    aborted on its worker: ``running`` is printed, then the worker writes ``cancelled``."""
    from inferq.client import Client

    state = Client(settings=obj.settings, store=obj.store).cancel(request_id)
    emit({"id": request_id, "state": state.value}, as_json, lambda d: d["state"])


# --- fleet --------------------------------------------------------------------------


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def queues(obj: Context, as_json: bool) -> None:
    """Queue depth per route and class, oldest wait, submit and finish rates."""
    from inferq.cli import views

    rates = obj.glance.event_rates()
    rows = views.queue_rows(obj.glance)
    emit(rows, as_json, lambda rows: views.queue_view(rows, rates))
    if not rows:
        hint_if_empty(obj)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def workers(obj: Context, as_json: bool) -> None:
    """Live workers: model, state, slots, VRAM, heartbeat age."""
    from inferq.cli import views

    rows = views.worker_rows(obj.store)
    emit(rows, as_json, views.worker_table)
    if not rows:
        hint_if_empty(obj)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def info(obj: Context, as_json: bool) -> None:
    """The deployment: Redis memory, prefix-cache routing and its index, hit rate."""
    from inferq.cli import views

    emit(views.info_data(obj.store, obj.settings), as_json, views.info_table)


@cli.command()
@click.argument("worker_id")
@click.option("--wait", is_flag=True, help="Show its in-flight work going down until it leaves.")
@click.option("--timeout", default=600.0, show_default=True, help="Longest --wait, seconds.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def drain(obj: Context, worker_id: str, wait: bool, timeout: float, as_json: bool) -> None:
    """Ask WORKER to drain: finish what it runs, take nothing new, leave."""
    store = obj.store
    if not store.request_drain(worker_id):
        fail(f"no live worker {worker_id!r} (see `inferq workers`)")
    out: dict[str, Any] = {"worker": worker_id, "drain_requested": True}
    if wait:
        start = len(store.held_by(worker_id))
        deadline = time.monotonic() + timeout
        with progress(as_json) as bar:
            task = bar.add_task(f"draining {worker_id}", total=max(start, 1))
            while store.worker_registered(worker_id) and time.monotonic() < deadline:
                left = len(store.held_by(worker_id))
                bar.update(task, completed=max(0, max(start, 1) - left))
                time.sleep(0.5)
        out["left"] = not store.worker_registered(worker_id)
        if not out["left"]:
            emit(out, as_json, lambda d: f"{worker_id} still draining after {timeout:g} s")
            sys.exit(1)
    emit(
        out,
        as_json,
        lambda d: f"{worker_id} drained" if wait else f"drain requested for {worker_id}",
    )


@cli.command()
@click.option("--count", default=50, show_default=True, help="Events to show.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_ctx
@handle_errors
def events(obj: Context, count: int, follow: bool, as_json: bool) -> None:
    """The events stream: submit, dispatch, finish, retry, expire, worker and scale events."""
    from inferq.cli import views

    last = "-"
    batch = obj.store.recent_events(count)
    while True:
        for event in batch:
            click.echo(views.event_line(event, as_json))
            last = event.id
        if not follow:
            return
        time.sleep(0.5)
        batch = obj.store.events(count=1000, after=last)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def report(obj: Context, as_json: bool) -> None:
    """The run report: queue sizes, oldest waits, per-worker counts, recent events."""
    from inferq.cli import views

    emit(views.report_dict(obj.store), as_json, views.report_render)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def cells(obj: Context, as_json: bool) -> None:
    """Every cell: its Redis, routes and tenants, whether it answers, queued and live workers."""
    from inferq.cli import views

    emit(views.cells_list(obj.settings), as_json, views.cells_render)


@cli.command()
@click.option("--interval", default=1.0, show_default=True, help="Refresh period, seconds.")
@pass_ctx
@handle_errors
def top(obj: Context, interval: float) -> None:
    """A live view of queues, workers and recent events (Ctrl-C to quit).

    Without a terminal (a pipe, a file, a CI log) it prints the view once, as
    ``inferq report`` does: a live view redrawn in place means nothing there.
    """
    from rich.live import Live

    from inferq.cli import views

    if not console().is_terminal:
        show(views.report_render(views.report_dict(obj.store)))
        return
    with Live(views.report_render(views.report_dict(obj.store)), console=console()) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(views.report_render(views.report_dict(obj.store)))
        except KeyboardInterrupt:
            pass


@cli.group("dead-letter")
def dead_letter() -> None:
    """Requests that failed max_attempts times."""


@dead_letter.command("list")
@click.option("--limit", default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def dead_list(obj: Context, limit: int, as_json: bool) -> None:
    """List dead-lettered requests with their last error."""
    from inferq.cli import views

    records = [r for r in obj.store.records(obj.store.dead_letters(limit)) if r is not None]
    emit([views.record_dict(r) for r in records], as_json, views.dead_table)
    if not records:
        hint_if_empty(obj)


@dead_letter.command("requeue")
@click.argument("request_ids", nargs=-1)
@click.option("--all", "requeue_all", is_flag=True, help="Requeue every dead-lettered request.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def dead_requeue(
    obj: Context, request_ids: tuple[str, ...], requeue_all: bool, as_json: bool
) -> None:
    """Requeue dead-lettered requests with a fresh attempt budget and deadline.

    Exits 1 when an id given was not in the dead letter (the others are requeued).
    """
    if not request_ids and not requeue_all:
        raise click.UsageError("give request ids or --all")
    ids = list(request_ids) or obj.store.dead_letters(obj.store.dead_letter_count())
    done: list[str] = []
    missing: list[str] = []
    with progress(as_json or len(ids) < 100) as bar:
        for rid in bar.track(ids, description="requeueing"):
            (done if obj.store.requeue_dead(rid) else missing).append(rid)
    out = {"requeued": done, "not_in_dead_letter": missing}
    emit(out, as_json, lambda d: f"requeued {len(done)} of {len(ids)}")
    if missing:
        fail(f"not in the dead letter: {', '.join(missing)}")


@dead_letter.command("delete")
@click.argument("request_ids", nargs=-1)
@click.option("--all", "delete_all", is_flag=True, help="Delete every dead-lettered request.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def dead_delete(
    obj: Context, request_ids: tuple[str, ...], delete_all: bool, as_json: bool
) -> None:
    """Delete dead-lettered requests and their records (kept dead_letter_ttl_s otherwise).

    Exits 1 when an id given was not in the dead letter (the others are deleted).
    """
    if bool(request_ids) == delete_all:
        raise click.UsageError("give request ids or --all (not both)")
    ids = list(request_ids) or obj.store.dead_letters(obj.store.dead_letter_count())
    deleted = obj.store.delete_dead(ids)
    missing = [rid for rid in ids if rid not in set(deleted)]
    out = {"deleted": deleted, "not_in_dead_letter": missing}
    emit(out, as_json, lambda d: f"deleted {len(deleted)} of {len(ids)}")
    if missing:
        fail(f"not in the dead letter: {', '.join(missing)}")


@cli.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def purge(obj: Context, yes: bool, as_json: bool) -> None:
    """Delete every key of the namespace: queues, requests, results, workers, events,
    and RQ's keys of its workers (their queues, jobs and records)."""
    from inferq.delivery import purge_namespace_rq

    prefix = obj.store.keys.prefix
    url = redact_url(obj.settings.redis_url)
    if not yes:
        click.confirm(f"Delete every {prefix}* key on {url}?", abort=True)
    with progress(as_json) as bar:
        task = bar.add_task("purging", total=None)
        deleted = obj.store.purge(on_batch=lambda n: bar.advance(task, n))
        rq_deleted = purge_namespace_rq(obj.settings.redis_url, obj.store.keys)
    out = {"deleted": deleted, "rq_deleted": rq_deleted}
    emit(out, as_json, lambda d: f"deleted {deleted} keys and {rq_deleted} RQ keys")


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8300, show_default=True, help="TCP port (0: any free one).")
@pass_ctx
@handle_errors
def dashboard(obj: Context, host: str, port: int) -> None:
    """Serve a read-only live web page: queues, workers, SLA, events, the dead letter."""
    from inferq.extras import import_extra

    uvicorn = import_extra("uvicorn", "dashboard", "inferq dashboard")
    import_extra("starlette", "dashboard", "inferq dashboard")
    from inferq.dashboard.app import create_app

    serve_http(
        uvicorn, create_app(obj.store), host, port,
        lambda bound: say_ready("dashboard", obj.settings, None, f"http://{host}:{bound}/"),
    )  # fmt: skip


def serve_http(uvicorn: Any, app: Any, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Bind and listen on ``host:port`` first (one error line when it cannot), then call
    ``ready`` with the port (the ready line comes once connections are accepted: they
    wait in the backlog until the server runs), then serve ``app``."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    server.config.load()
    quiet = logging.getLogger("uvicorn.error")  # it logs the bind error, then exits
    quiet.disabled = True
    try:
        sock = server.config.bind_socket()
    except SystemExit:
        fail(f"--port {port}: cannot listen on {host}:{port} (in use?)")
    finally:
        quiet.disabled = False
    sock.listen(config.backlog)  # connections wait in the backlog from the ready line on
    ready(sock.getsockname()[1])
    server.run(sockets=[sock])


# --- components -----------------------------------------------------------------------


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option(
    "--keys",
    "keys_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="INFERQ_GATEWAY_KEYS",
    help="API keys file (TOML or JSON): key -> tenant, classes, limits. "
    "Without one, and without --redis-keys, the gateway is open (every caller is the "
    "default tenant).",
)
@click.option(
    "--redis-keys",
    is_flag=True,
    envvar="INFERQ_GATEWAY_REDIS_KEYS",
    help="Also accept the API keys stored in Redis (inferq keys add/list/revoke).",
)
@click.option("--no-rate-limits", is_flag=True, help="Ignore the keys' per-minute limits.")
@click.option(
    "--admin-key",
    envvar="INFERQ_GATEWAY_ADMIN_KEY",
    help="Bearer key (or its sha256:<hex>) that opens GET /v1/usage; better given "
    "through INFERQ_GATEWAY_ADMIN_KEY than on the command line. None: /v1/usage is closed.",
)
@click.option(
    "--no-deployment-metrics",
    is_flag=True,
    help="Export only this replica's counters on /metrics; never take the metrics lease "
    "(whose holder, a gateway, dispatcher or scaler, exports the deployment-wide series).",
)
@pass_ctx
@handle_errors
def gateway(
    obj: Context,
    host: str,
    port: int,
    keys_path: Path | None,
    redis_keys: bool,
    no_rate_limits: bool,
    admin_key: str | None,
    no_deployment_metrics: bool,
) -> None:
    """Serve the OpenAI HTTP API (chat and completions, streaming) in front of the queue.

    Stateless: run one per core or host, behind any load balancer."""
    import_extra("starlette", "gateway", "inferq gateway")
    uvicorn = import_extra("uvicorn", "gateway", "inferq gateway")
    from inferq.gateway.admin import AdminKey
    from inferq.gateway.app import create_app
    from inferq.gateway.tenants import KEY_ID_LEN, KeyRing, check_budget_keys

    keyring = KeyRing.load(keys_path, [c.name for c in obj.settings.classes])
    if any(b.key is not None for b in obj.settings.budgets.values()):  # refused here: one line
        ids = keyring.ids()
        if redis_keys:
            ids |= {d[:KEY_ID_LEN] for d in obj.store.api_keys()}
        check_budget_keys(obj.settings.budgets, ids)
    if keyring.open and not redis_keys:
        click.echo(
            "warning: no --keys file and no --redis-keys: every caller is the default tenant",
            err=True,
        )
    app = create_app(
        obj.settings,
        keyring,
        rate_limits=not no_rate_limits,
        redis_keys=redis_keys,
        deployment_metrics=not no_deployment_metrics,
        admin_key=AdminKey(admin_key) if admin_key else None,
    )
    stored = ", and the keys stored in Redis" if redis_keys else ""
    keys = f"{len(keyring)} API keys in the file{stored}"
    serve_http(
        uvicorn, app, host, port,
        lambda bound: say_ready(
            "gateway", obj.settings, f"http://{host}:{bound}/metrics",
            f"http://{host}:{bound}/v1 ({keys})",
        ),
    )  # fmt: skip


@cli.command()
@click.option("--tick", default=0.1, show_default=True, help="Longest idle sleep, seconds.")
@metrics_options
@pass_ctx
@handle_errors
def dispatcher(obj: Context, tick: float, metrics_port: int | None, metrics_host: str) -> None:
    """Run a dispatcher replica (any number may run)."""
    from inferq.dispatcher.daemon import Dispatcher

    d = Dispatcher(obj.store, tick_s=tick)
    url = start_metrics(obj.store, metrics_port, metrics_host)
    say_ready("dispatcher", obj.settings, url)
    signal.signal(signal.SIGTERM, lambda *_: d.stop())
    try:
        d.run()
    except KeyboardInterrupt:
        d.stop()


@cli.command()
@click.option("--model", required=True, help="Registry name of the loaded model.")
@click.option(
    "--backend", "server", default="sim", show_default=True,
    help="Model server: sim, openai, or a plugin.",
)  # fmt: skip
@click.option(
    "--backend-option",
    "server_options",
    "-o",
    multiple=True,
    metavar="KEY=VALUE",
    help="Model server option (repeat).",
)
@click.option("--slots", default=8, show_default=True, help="Concurrent requests at most.")
@click.option("--vram-mib", type=int, help="Card VRAM, MiB (when NVML is unavailable).")
@click.option(
    "--gpu-index",
    default="",
    metavar="N[,N...]",
    help="CUDA device index, or a comma-separated list for a tensor-parallel model server "
    "(memory summed); under CUDA_VISIBLE_DEVICES, an index into that list.",
)
@click.option(
    "--id", "worker_id",
    help="Worker id (default host-pid); one live process per id: a restart takes it over.",
)  # fmt: skip
@click.option("--label", multiple=True, metavar="KEY=VALUE", help="Label (repeat).")
@click.option("--heartbeat-interval", default=1.0, show_default=True, help="Seconds.")
@click.option(
    "--heartbeat-thread",
    is_flag=True,
    help="Beat from a thread of the worker instead of a heartbeat process (a stall of the "
    "worker longer than the heartbeat TTL then gets it reaped).",
)
@click.option(
    "--stay-after-drain",
    is_flag=True,
    help="After a drain asked through Redis, leave the fleet, then wait for SIGTERM "
    "(Kubernetes restarts an exited container in place).",
)
@pass_ctx
@handle_errors
def worker(
    obj: Context,
    model: str,
    server: str,
    server_options: tuple[str, ...],
    slots: int,
    vram_mib: int | None,
    gpu_index: str,
    worker_id: str | None,
    label: tuple[str, ...],
    heartbeat_interval: float,
    heartbeat_thread: bool,
    stay_after_drain: bool,
) -> None:
    """Run a GPU worker beside one loaded model; SIGTERM drains it."""
    from inferq.workers.worker import WorkerOptions, run_worker

    opts = WorkerOptions(
        model=model,
        server=server,
        server_options=pairs("--backend-option", server_options),
        slots=slots,
        vram_mib=vram_mib,
        gpu_index=gpu_indices(gpu_index),
        worker_id=worker_id,
        labels=pairs("--label", label),
        heartbeat_interval_s=heartbeat_interval,
        stay_after_drain=stay_after_drain,
        heartbeat_process=not heartbeat_thread,
    )
    settings = obj.settings
    sys.exit(
        run_worker(settings, opts, on_ready=lambda wid: say_ready("worker", settings, None, wid))
    )


@cli.command()
@click.option("--speedup", default=10.0, show_default=True, help="Trace seconds per wall second.")
@click.option("--duration", default=600.0, show_default=True, help="Seconds of trace to replay.")
@click.option("--start", default=0.0, show_default=True, help="Trace second to start at.")
@click.option(
    "--trace", "traces", multiple=True, metavar="NAME|PATH",
    help="Realtime trace, then standard trace (default: conv, code).",
)  # fmt: skip
@click.option("--workers", "fleet", default=None, help="Initial fleet: model:count@vram_mib,...")
@click.option("--tenants", default=20, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", default=".", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--redis", "redis_kind", default="auto", show_default=True,
    type=click.Choice(["auto", "redis-server", "fakeredis"]),
)  # fmt: skip
@handle_errors
def demo(
    speedup: float,
    duration: float,
    start: float,
    traces: tuple[str, ...],
    fleet: str | None,
    tenants: int,
    seed: int,
    out_dir: str,
    redis_kind: str,
) -> None:
    """Run everything on an embedded Redis, replaying the real Azure LLM traces."""
    from inferq.demo import DEMO_FLEET, DemoOptions, run_demo

    opts = DemoOptions(
        speedup=speedup,
        duration_s=duration,
        start_s=start,
        traces=traces or ("conv", "code"),
        fleet=fleet or DEMO_FLEET,
        tenants=tenants,
        seed=seed,
        out_dir=Path(out_dir),
        redis=redis_kind,
    )
    try:
        run_demo(opts, console())
    except KeyboardInterrupt:
        err_console().print("interrupted: everything the demo started was stopped")
        sys.exit(130)


def main() -> None:
    """Console-script entry point: every error is one ``error: ...`` line on stderr.

    Click's own usage errors (exit code 2) print the command's usage line first, as
    click does, then the message with the same prefix as inferq's errors.
    """
    try:
        cli.main(prog_name="inferq", standalone_mode=False)
    except click.exceptions.Abort:
        fail("aborted", code=130)
    except click.UsageError as exc:
        if exc.ctx is not None:
            click.echo(exc.ctx.get_usage(), err=True)
        fail(exc.format_message(), code=exc.exit_code)
    except click.ClickException as exc:
        fail(exc.format_message(), code=exc.exit_code)
