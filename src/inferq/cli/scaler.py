"""``inferq scaler``: run a scaler replica (any number may run; one acts at a time).

Options override the ``[scaling]`` table of the settings; pools given with
``--pool`` are added to (or replace) the configured ones, in the order given,
which is also their priority under ``--gpu-budget``.

This module does not import :mod:`inferq.cli.main` at import time (main
registers this command, so the import would be circular): the shared error
handler is looked up when the command runs.
"""

from __future__ import annotations

import contextlib
import re
import signal
from typing import Any, Protocol

import click
from pydantic import ValidationError

from inferq.config import ScalingPool, ScalingSettings, Settings
from inferq.store import Store

_POOL = re.compile(r"^(?P<model>[^=]+)=(?P<min>\d+):(?P<max>\d+)(?::(?P<gpus>\d+))?$")


class _Obj(Protocol):
    """What the CLI group puts in ``ctx.obj`` (``inferq.cli.main.Context``)."""

    settings: Settings

    @property
    def store(self) -> Store: ...


def parse_pool(text: str) -> tuple[str, ScalingPool]:
    """``MODEL=MIN:MAX[:GPUS]`` -> (model, pool).

    Raises:
        click.BadParameter: the text is not of that form or the bounds are inconsistent.
    """
    m = _POOL.match(text.strip())
    if m is None:
        raise click.BadParameter(f"{text!r} is not MODEL=MIN:MAX[:GPUS]", param_hint="--pool")
    values: dict[str, int] = {"min_workers": int(m["min"]), "max_workers": int(m["max"])}
    if m["gpus"] is not None:
        values["gpus_per_worker"] = int(m["gpus"])
    try:
        return m["model"].strip(), ScalingPool(**values)
    except ValidationError as exc:
        raise click.BadParameter(f"{text!r}: {_first(exc)}", param_hint="--pool") from None


def _first(exc: ValidationError) -> str:
    """The first error of a pydantic validation, naming its field: ``idle_s: ...``."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _pairs(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--worker-option")
        out[key] = value
    return out


def parse_vram(values: tuple[str, ...]) -> int | dict[str, int] | None:
    """``--vram-mib``: one ``MIB`` for every model, or ``MODEL=MIB`` pairs."""
    if not values:
        return None
    try:
        if len(values) == 1 and "=" not in values[0]:
            return int(values[0])
        return {model: int(mib) for model, _, mib in (v.partition("=") for v in values)}
    except ValueError:
        raise click.BadParameter(
            f"{', '.join(values)} is not MIB or MODEL=MIB", param_hint="--vram-mib"
        ) from None


def scaling_settings(base: ScalingSettings, options: dict[str, Any]) -> ScalingSettings:
    """``base`` with the command's overrides applied (``--pool``, times, budget).

    Raises:
        click.BadParameter: a ``--pool`` is malformed.
        click.UsageError: a value is out of range.
    """
    update: dict[str, Any] = {}
    for name in ("gpu_budget", "idle_s", "up_cooldown_s", "down_cooldown_s"):
        if options.get(name) is not None:
            update[name] = options[name]
    if options.get("interval") is not None:
        update["interval_s"] = options["interval"]
    if options.get("pool"):
        pools = dict(parse_pool(p) for p in options["pool"])
        update["pools"] = {**pools, **{m: p for m, p in base.pools.items() if m not in pools}}
    try:
        return ScalingSettings.model_validate({**base.model_dump(), **update})
    except ValidationError as exc:
        raise click.UsageError(f"scaling option {_first(exc)}") from None


@click.command("scaler")
@click.option(
    "--backend",
    type=click.Choice(["local", "docker", "kubernetes"]),
    default="local",
    show_default=True,
    help="Where workers run.",
)
@click.option("--interval", type=float, help="Seconds between decisions [default: 5].")
@click.option("--dry-run", is_flag=True, help="Print decisions; start, drain and write nothing.")
@click.option(
    "--metrics-only",
    is_flag=True,
    help="Only publish desired counts (Redis scaler:desired, Prometheus) for KEDA or an HPA.",
)
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")
@click.option("--once", is_flag=True, help="Make one decision and exit.")
@click.option(
    "--pool",
    multiple=True,
    metavar="MODEL=MIN:MAX[:GPUS]",
    help="A managed model's bounds (repeat; first = highest priority).",
)
@click.option("--gpu-budget", type=int, help="GPUs all pools share.")
@click.option("--idle-s", type=float, help="Idle seconds before a worker is drained [300].")
@click.option("--up-cooldown-s", type=float, help="Seconds between a scale action and an up [15].")
@click.option("--down-cooldown-s", type=float, help="Seconds between an action and a down [60].")
@click.option("--replica-id", help="This replica's lease id [host-pid-random].")
@click.option(
    "--worker-backend", default="sim", show_default=True, help="local, docker: model backend."
)
@click.option("--slots", type=int, default=8, show_default=True, help="local, docker: slots.")
@click.option(
    "--vram-mib",
    multiple=True,
    metavar="MIB|MODEL=MIB",
    help="local, docker: card VRAM, MiB (without NVML); MODEL=MIB per model (repeat).",
)
@click.option(
    "--worker-option",
    "-o",
    multiple=True,
    metavar="KEY=VALUE",
    help="local, docker: worker -o (repeat).",
)
@click.option("--log-dir", type=click.Path(file_okay=False), help="local: worker log directory.")
@click.option("--docker-image", "--image", "image", help="docker: the worker image.")
@click.option("--docker-url", help="docker: daemon URL [DOCKER_HOST].")
@click.option(
    "--docker-network",
    envvar="INFERQ_DOCKER_NETWORK",
    help="docker: network of the worker containers (compose: its network, where redis resolves).",
)
@click.option("--docker-gpus", type=int, default=0, show_default=True, help="docker: GPUs each.")
@click.option("--k8s-namespace", default="default", show_default=True, help="kubernetes.")
@click.option("--k8s-host", help="kubernetes: API server URL [in-cluster or kubeconfig].")
@click.pass_obj
def scaler(obj: _Obj, /, **options: Any) -> None:
    """Run a scaler replica: launch workers on backlog, drain idle ones."""
    from inferq.cli.main import handle_errors

    handle_errors(_run)(obj, options)


def _run(obj: _Obj, options: dict[str, Any]) -> None:
    from inferq.scaler.daemon import Mode, Scaler, describe, scaling_config

    if options["dry_run"] and options["metrics_only"]:
        raise click.UsageError("--dry-run and --metrics-only exclude each other")
    mode = Mode.DRY_RUN if options["dry_run"] else Mode.ACT
    if options["metrics_only"]:
        mode = Mode.METRICS
    scaling = scaling_settings(obj.settings.scaling, options)
    store = obj.store
    backend = None if mode is Mode.METRICS else _backend(obj, store, options)
    daemon = Scaler(
        store,
        config=scaling_config(scaling),
        backend=backend,
        mode=mode,
        replica_id=options["replica_id"],
        default_slots=options["slots"],
        on_decision=(lambda d: click.echo(describe(d))) if mode is Mode.DRY_RUN else None,
    )
    if options["metrics_port"] is not None:
        from inferq.metrics import serve_metrics

        serve_metrics(store, options["metrics_port"])
    try:
        if options["once"]:
            daemon.step()
            daemon.close()
            return
        signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
        with contextlib.suppress(KeyboardInterrupt):
            daemon.run()  # releases the lease on the way out
    finally:
        if backend is not None:
            backend.close()  # local: drains and stops the workers this replica started


def _backend(obj: _Obj, store: Store, options: dict[str, Any]) -> Any:
    """The chosen backend, built from the options (raises click.UsageError when one is missing)."""
    from inferq.scaler.backends import backend_class

    settings = obj.settings
    name = options["backend"]
    cls: Any = backend_class(name)
    root = click.get_current_context().find_root().params
    if name == "local":
        return cls(
            redis_url=settings.redis_url,
            namespace=settings.namespace,
            config_path=root.get("config_path"),
            log_dir=options["log_dir"],
            worker_backend=options["worker_backend"],
            slots=options["slots"],
            vram_mib=parse_vram(options["vram_mib"]),
            worker_options=_pairs(options["worker_option"]),
            heartbeat_interval_s=settings.heartbeat_interval_s,
            registered=store.worker_registered,
        )
    if name == "docker":
        if not options["image"]:
            raise click.UsageError("--backend docker needs --docker-image")
        from inferq.scaler.backends.base import WORKER_ARGS

        args = ["--backend", options["worker_backend"], "--slots", str(options["slots"])]
        args += ["--heartbeat-interval", repr(settings.heartbeat_interval_s)]
        for key, value in _pairs(options["worker_option"]).items():
            args += ["-o", f"{key}={value}"]
        return cls(
            image=options["image"],
            redis_url=settings.redis_url,
            namespace=settings.namespace,
            base_url=options["docker_url"],
            gpus_per_worker=options["docker_gpus"],
            network=options["docker_network"],
            command=("--log-level", str(root.get("log_level") or "WARNING"), *WORKER_ARGS),
            extra_args=args,
            vram_mib=parse_vram(options["vram_mib"]),
        )
    return cls(
        namespace=settings.namespace,
        k8s_namespace=options["k8s_namespace"],
        host=options["k8s_host"],
    )
