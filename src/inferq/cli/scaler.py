"""``inferq scaler``: run a scaler replica (any number may run; one acts at a time).

Options override the ``[scaling]`` table of the settings; pools given with
``--pool`` are added to (or replace) the configured ones, in the order given,
which is also their priority under ``--gpu-budget``.
"""

from __future__ import annotations

import contextlib
import re
import signal
from typing import Any

import click
from pydantic import ValidationError

from inferq import defaults
from inferq.cli.common import (
    Context,
    handle_errors,
    metrics_options,
    pairs,
    say_ready,
    start_metrics,
)
from inferq.config import ScalingPool, ScalingSettings
from inferq.policy.scaling import ScalingConfig
from inferq.scaler.daemon import Mode, Scaler, describe
from inferq.scaler.platforms import platform_class
from inferq.scaler.platforms.base import WORKER_ARGS
from inferq.store import Store

_POOL = re.compile(r"^(?P<model>[^=]+)=(?P<min>\d+):(?P<max>\d+)(?::(?P<gpus>\d+))?$")


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
    "platform",
    type=click.Choice(["local", "docker", "kubernetes"]),
    default="local",
    show_default=True,
    help="Where workers run: the platform.",
)
@click.option("--interval", type=float, help="Seconds between decisions [default: 5].")
@click.option("--dry-run", is_flag=True, help="Print decisions; start, drain and write nothing.")
@click.option(
    "--metrics-only",
    is_flag=True,
    help="Only publish desired counts (Redis scaler:desired, Prometheus) for KEDA or an HPA.",
)
@metrics_options
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
    "--unhealthy-replace-s", type=float, default=defaults.UNHEALTHY_REPLACE_S, show_default=True,
    help="Drain (and so replace) a launched worker unhealthy this long.",
)  # fmt: skip
@click.option(
    "--worker-backend", "worker_server", default="sim", show_default=True,
    help="local, docker: the workers' model server (their --backend).",
)  # fmt: skip
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
def scaler(obj: Context, /, **options: Any) -> None:
    """Run a scaler replica: launch workers on backlog, drain idle ones."""
    _run(obj, options)


@handle_errors
def _run(obj: Context, options: dict[str, Any]) -> None:
    if options["dry_run"] and options["metrics_only"]:
        raise click.UsageError("--dry-run and --metrics-only exclude each other")
    mode = Mode.DRY_RUN if options["dry_run"] else Mode.ACT
    if options["metrics_only"]:
        mode = Mode.METRICS
    scaling = scaling_settings(obj.settings.scaling, options)
    store = obj.store
    platform = None if mode is Mode.METRICS else _platform(obj, store, options)
    daemon = Scaler(
        store,
        config=ScalingConfig.from_settings(scaling),
        platform=platform,
        mode=mode,
        replica_id=options["replica_id"],
        default_slots=options["slots"],
        unhealthy_replace_s=options["unhealthy_replace_s"],
        on_decision=(lambda d: click.echo(describe(d))) if mode is Mode.DRY_RUN else None,
    )
    url = start_metrics(store, options["metrics_port"], options["metrics_host"])
    say_ready(
        "scaler", obj.settings, url, f"{mode.value}, {platform.name if platform else 'no platform'}"
    )
    try:
        if options["once"]:
            daemon.step()
            daemon.close()
            return
        signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
        with contextlib.suppress(KeyboardInterrupt):
            daemon.run()  # releases the lease on the way out
    finally:
        if platform is not None:
            platform.close()  # local: drains and stops the workers this replica started


def _platform(obj: Context, store: Store, options: dict[str, Any]) -> Any:
    """The chosen platform, built from the options (raises click.UsageError when one is missing)."""
    settings = obj.settings
    name = options["platform"]
    cls: Any = platform_class(name)
    root = click.get_current_context().find_root().params
    if name == "local":
        return cls(
            redis_url=settings.redis_url,
            namespace=settings.namespace,
            config_path=root.get("config_path"),
            log_dir=options["log_dir"],
            worker_server=options["worker_server"],
            slots=options["slots"],
            vram_mib=parse_vram(options["vram_mib"]),
            worker_options=pairs("--worker-option", options["worker_option"]),
            heartbeat_interval_s=settings.heartbeat_interval_s,
            registered=store.worker_registered,
        )
    if name == "docker":
        if not options["image"]:
            raise click.UsageError("--backend docker needs --docker-image")
        args = ["--backend", options["worker_server"], "--slots", str(options["slots"])]
        args += ["--heartbeat-interval", repr(settings.heartbeat_interval_s)]
        for key, value in pairs("--worker-option", options["worker_option"]).items():
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
