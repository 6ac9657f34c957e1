"""``inferq demo``: the whole system on an embedded Redis, replaying the real Azure traces.

What runs (one process tree; everything is stopped on exit, Ctrl-C included):

- an embedded Redis (:mod:`inferq.embedded`);
- one dispatcher and one scaler (local platform) as subprocesses; the scaler's
  minimum pools start the initial mixed fleet of simulated workers (8B models on
  24 GiB cards, a 4-bit 70B model on an 80 GiB card) and adds or drains workers as
  the backlog moves;
- this process replays the workload at ``speedup`` x real time and samples the
  queues and the fleet twice a second.

Workload (the simulator's, :func:`inferq.sim.workload.build_requests`): the
conversation trace -> ``realtime`` on ``llama-3.1-8b``; the code trace ->
``standard`` on ``>=8b`` (served by the smallest adequate model that has room);
a synthetic bulk ``batch`` job -> ``llama-3.1-70b-awq``, drawn from the code trace's
token counts (``defaults.SIM_BATCH_SHARE`` of the requests, arriving
``defaults.SIM_BATCH_AT_FRACTION`` into the window, marked ``synthetic``).
Tenants follow the documented Zipf skew (:func:`inferq.traces.assign_tenants`).

Time is compressed: arrivals, the sim model server's latencies, class SLAs,
timeouts, batching delays, aging bounds and the scaler's idle time all shrink by
``speedup``; every time the report gives is converted back into trace seconds in one
place, :class:`TraceClock` (its origin: the replay's start, i.e. the window's ``--start``).

A compressed clock asks the machine for ``speedup`` x the punctuality: at 10x a 2 s
SLA is 0.2 s of wall time, and a loaded machine whose processes wake late misses it
whatever the scheduler decides. So the demo measures whether the machine kept up
(:func:`keep_up`): how late the replay submitted each request against the trace, how
late a separate timer process woke against its period (a stand-in for the daemons'
steps, which wait on the same CPUs), CPU steal and the load average; when the replay or
the timer fell behind by more than :data:`~inferq.reporting.KEEP_UP_SHARE` of the
tightest SLA at p99 (:func:`~inferq.reporting.fell_behind`) and a class missed its
SLA, the report says the machine was the bottleneck and which lower ``--speedup`` to
rerun at. The SLA table stays as measured.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from inferq import defaults
from inferq.client import Client
from inferq.config import Settings
from inferq.embedded import EmbeddedRedis
from inferq.errors import ConfigError
from inferq.extras import import_extra
from inferq.reporting import (
    KEEP_UP_MET,
    KEEP_UP_SHARE,
    Outcome,
    class_summary,
    fell_behind,
    lag_summary,
)
from inferq.sim.workload import SimRequest, build_requests
from inferq.store import Store, connect
from inferq.traces import load_trace, synthetic_batch, window

#: Default fleet: ``model:count@vram_mib`` (24 GiB L4/A10-class cards for 8B, an 80 GiB
#: H100 for 70B) and how far the scaler may grow each model.
DEMO_FLEET = "llama-3.1-8b:3@24576,llama-3.1-70b-awq:1@81920"
DEMO_MAX_EXTRA = 3
#: Concurrent requests per worker: vLLM serves dozens of sequences per card; 16 keeps
#: a 24 GiB card's KV cache (~54k tokens for Llama-3.1-8B) enough for the traces' prompts.
DEMO_SLOTS = 16
#: Routes of the demo's classes (see the module docstring).
DEMO_ROUTES = {"realtime": "llama-3.1-8b", "standard": ">=8b", "batch": "llama-3.1-70b-awq"}


@dataclass(frozen=True)
class FleetEntry:
    """``model:count@vram_mib`` of the demo's fleet."""

    model: str
    count: int
    vram_mib: int


def parse_fleet_cards(text: str, settings: Settings) -> list[FleetEntry]:
    """Parse the demo's ``--workers``: ``model:count@vram_mib,...``, each worker with its card,
    e.g. ``"llama-3.1-8b:3@24576,llama-3.1-70b-awq:1@81920"`` (the simulator's ``--fleet`` is
    plain ``model:count``, :func:`inferq.sim.fleet.parse_fleet`).

    Raises:
        ConfigError: a part is malformed, names an unknown model, or the card is too small.
    """
    out: list[FleetEntry] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        head, _, vram = part.partition("@")
        model, _, count = head.partition(":")
        try:
            entry = FleetEntry(model, int(count or 1), int(vram or defaults.SIM_VRAM_MIB))
        except ValueError:
            raise ConfigError(f"workers: {part!r} is not model:count@vram_mib") from None
        spec = settings.model_by_name.get(model)
        if spec is None:
            raise ConfigError(f"workers: unknown model {model!r}")
        if entry.count < 0:
            raise ConfigError(f"workers: {part!r} has a negative count")
        spec.kv_cache_mib(entry.vram_mib)  # raises when the weights do not fit
        out.append(entry)
    if not out:
        raise ConfigError("workers: the fleet is empty")
    return out


@dataclass
class DemoOptions:
    """Options of ``inferq demo`` (durations in trace seconds)."""

    speedup: float = 10.0
    duration_s: float = 600.0
    start_s: float = 0.0
    traces: tuple[str, ...] = ("conv", "code")
    fleet: str = DEMO_FLEET
    tenants: int = defaults.TRACE_TENANTS
    seed: int = 0
    out_dir: Path = field(default_factory=Path.cwd)
    redis: str = "auto"
    drain_wait_s: float = 120.0
    #: Test hook, wall seconds slept after each submission: stands in for a machine too
    #: loaded to replay on time (``tests/redis/test_demo.py``); 0 in normal runs.
    replay_delay_s: float = 0.0


def build_workload(opts: DemoOptions, settings: Settings) -> list[SimRequest]:
    """The demo's requests, sorted by arrival (trace seconds from 0)."""
    classes = ("realtime", "standard")
    tagged: list[tuple[str | None, Any]] = []
    rows_by_trace = {}
    for cls, name in zip(classes, opts.traces, strict=False):
        rows = window(load_trace(name), opts.start_s, opts.duration_s)
        rows_by_trace[cls] = rows
        route = DEMO_ROUTES[cls]
        tagged += [(cls, dataclasses.replace(r, model=route)) for r in rows]
    pool = rows_by_trace.get("standard") or rows_by_trace.get("realtime") or []
    n_batch = round(len(tagged) * defaults.SIM_BATCH_SHARE)
    if pool and n_batch:
        at = opts.duration_s * defaults.SIM_BATCH_AT_FRACTION
        bulk = synthetic_batch(pool, n_batch, at, opts.seed)
        tagged += [("batch", dataclasses.replace(r, model=DEMO_ROUTES["batch"])) for r in bulk]
    return build_requests(tagged, settings, tenants=opts.tenants, seed=opts.seed)


def compressed(settings: Settings, speedup: float) -> Settings:
    """The same deployment on a clock ``speedup`` x faster.

    Every duration shrinks by ``speedup`` — class SLAs, timeouts, batching delays,
    aging bounds; model cold starts; the scaler's idle time, cooldowns, interval,
    backlog-drain target and trend constants — and every model's latency profile runs
    ``speedup`` x faster, so the sim model server, the dispatcher and the scaler all live on
    one consistent compressed clock.
    """
    models = [
        m.model_copy(
            update={
                "cold_start_s": m.cold_start_s / speedup,
                "latency": m.latency.scaled(speedup),
            }
        )
        for m in settings.models
    ]
    sc = settings.scaling
    durations: tuple[str, ...] = ("idle_s", "up_cooldown_s", "down_cooldown_s", "interval_s")
    durations += ("backlog_drain_s", "trend_level_s", "trend_slope_s", "service_smoothing_s")
    durations += ("down_window_s",)
    scaling = sc.model_copy(update={name: getattr(sc, name) / speedup for name in durations})
    classes = [
        c.model_copy(
            update={
                "sla_s": c.sla_s / speedup,
                "timeout_s": c.timeout_s / speedup,
                "batch_delay_s": c.batch_delay_s / speedup,
                "aging_s": None if c.aging_s is None else c.aging_s / speedup,
                "degrade_after_s": c.degrade_after_s / speedup,
            }
        )
        for c in settings.classes
    ]
    return settings.model_copy(update={"classes": classes, "models": models, "scaling": scaling})


def child_env(settings: Settings) -> dict[str, str]:
    """Environment that gives a subprocess exactly these settings."""
    env = dict(os.environ)
    env.pop("INFERQ_CONFIG", None)
    env["INFERQ_REDIS_URL"] = settings.redis_url
    env["INFERQ_NAMESPACE"] = settings.namespace
    env["INFERQ_CLASSES"] = json.dumps([c.model_dump() for c in settings.classes])
    env["INFERQ_MODELS"] = json.dumps([m.model_dump() for m in settings.models])
    env["INFERQ_SCALING"] = settings.scaling.model_dump_json()
    return env


#: A number with its unit in a scaler reason: seconds ("0.1 s") or a rate ("2.00 req/s").
_TIMED = re.compile(r"(\d+(?:\.\d+)?) (s|req/s)\b")


@dataclass(frozen=True)
class TraceClock:
    """The demo's one conversion from its compressed (wall) clock into trace time.

    Args:
        speedup: trace seconds per wall second.
        t0_redis: Redis epoch seconds when the replay started: trace time 0, the trace
            window's ``--start``.
    """

    speedup: float
    t0_redis: float = 0.0

    def trace_s(self, wall_s: float) -> float:
        """A wall duration in trace seconds."""
        return wall_s * self.speedup

    def at_s(self, redis_s: float) -> float | None:
        """Trace seconds since the replay started of a Redis epoch time; None before it
        (the initial fleet's start, which the trace window does not contain)."""
        if redis_s < self.t0_redis:
            return None
        return round(self.trace_s(redis_s - self.t0_redis), 1)

    def reason(self, text: str) -> str:
        """A scaler reason (written on the compressed clock) in trace units: every
        ``N s`` times ``speedup``, every ``N req/s`` divided by it, at the same decimals."""

        def convert(m: re.Match[str]) -> str:
            number, unit = m.group(1), m.group(2)
            decimals = len(number.partition(".")[2])
            value = float(number) * (self.speedup if unit == "s" else 1 / self.speedup)
            return f"{value:.{decimals}f} {unit}"

        return _TIMED.sub(convert, text)


#: The timer process: sleeps ``period`` seconds and prints how late it woke, for ever.
_TIMER = (
    "import sys, time\n"
    "p = float(sys.argv[1])\n"
    "while True:\n"
    "    t = time.monotonic(); time.sleep(p)\n"
    "    print(f'{time.monotonic() - t - p:.6f}', flush=True)\n"
)


class TimerProbe:
    """A separate process that wakes every ``period_s`` and reports how late it woke.

    It waits on the same CPUs as the dispatcher, the scaler and the workers, without
    sharing the demo's interpreter lock, so its lateness is how late a daemon's step
    runs against its interval on this machine (wall seconds).
    """

    def __init__(self, period_s: float = 0.02) -> None:
        self.late_s: list[float] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TIMER, str(period_s)], stdout=subprocess.PIPE, text=True
        )
        self.reader = threading.Thread(target=self._read, name="demo-timer", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.late_s.append(float(line))
            except ValueError:
                continue

    def stop(self) -> list[float]:
        """End the process; returns the lateness of each wake-up, wall seconds."""
        self.proc.terminate()
        self.proc.wait(5)
        self.reader.join(5)
        return list(self.late_s)


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def keep_up(
    clock: TraceClock,
    sla_s: dict[str, float],
    replay_late_s: Sequence[float],
    timer_late_s: Sequence[float],
    cpu: tuple[tuple[int, int] | None, tuple[int, int] | None],
    attainment: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """Whether the machine kept up with the compressed clock: the report's ``keep_up``.

    The verdict blames the machine only when it lagged *and* a class missed its SLA
    (attainment below :data:`KEEP_UP_MET`): a lag that cost nothing is reported as a
    figure, not as a warning (the replay submits a batch job in one call, so its p99
    lag passes the threshold on runs that meet every SLA).

    Args:
        clock: the demo's clock.
        sla_s: class -> SLA, trace seconds.
        replay_late_s / timer_late_s: how late each submission / timer wake-up ran,
            wall seconds.
        cpu: :func:`cpu_times` at the replay's start and end.
        attainment: class -> SLA attainment (0..1, None: no request); None: unknown,
            the lag alone decides.

    Returns:
        {"replay_lag" / "timer_lag": {"wall": ..., "trace": ...} (:func:`lag_summary`),
        "threshold_s" (trace), "cpu_steal_share", "load_avg_1m", "machine_bound",
        "behind" (name -> p99 trace seconds), "rerun_speedup" (half the speedup: the
        lags are wall-clock figures, so halving the speedup halves them in trace
        seconds), "verdict" (None when it kept up)}.
    """
    lags = {"replay_lag": replay_late_s, "timer_lag": timer_late_s}
    out: dict[str, Any] = {
        name: {"wall": lag_summary(v), "trace": lag_summary(v, clock.speedup)}
        for name, v in lags.items()
    }
    (start, end) = cpu
    steal = None
    if start is not None and end is not None and end[1] > start[1]:
        steal = (end[0] - start[0]) / (end[1] - start[1])
    out["cpu_steal_share"] = steal
    out["load_avg_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out["threshold_s"] = KEEP_UP_SHARE * min(sla_s.values()) if sla_s else None
    p99 = {name: out[name]["trace"]["p99_s"] for name in lags}
    behind = fell_behind(p99, sla_s)
    missed = [c for c, a in (attainment or {}).items() if a is not None and a < KEEP_UP_MET]
    if attainment is not None and not missed:
        behind = {}
    out["machine_bound"] = bool(behind)
    out["behind"] = behind
    out["rerun_speedup"] = None
    out["verdict"] = None
    if behind:
        rerun = max(1, math.floor(clock.speedup / 2))
        out["rerun_speedup"] = rerun
        out["verdict"] = verdict(behind, sla_s, clock.speedup, rerun)
    return out


def verdict(behind: dict[str, float], sla_s: dict[str, float], speedup: float, rerun: int) -> str:
    """The report's plain sentence for a machine that did not keep up (trace seconds)."""
    tightest = min(sla_s, key=lambda c: sla_s[c])
    what = {"replay_lag": "the replay submitted requests", "timer_lag": "a timer process woke"}
    parts = [
        f"{what.get(n, n)} {v:.2f} s late at p99 ({v / speedup * 1000:.0f} ms of wall time)"
        for n, v in behind.items()
    ]
    return (
        f"The machine, not the scheduler, was the bottleneck: at {speedup:g}x "
        f"{' and '.join(parts)}, more than {KEEP_UP_SHARE:.0%} of the {tightest} SLA "
        f"({sla_s[tightest]:g} s). The SLA figures above measure this machine's lag as much "
        f"as the scheduling; rerun at a lower speedup: inferq demo --speedup {rerun} "
        f"(halve it again while this warning stays)"
    )


class Processes:
    """Subprocesses of the demo, stopped in reverse order on :meth:`stop`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: Sequence[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the child's exit
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferq", *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append((name, proc))

    def check(self) -> None:
        """Raise when a component died (its log says why)."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise ConfigError(
                    f"{name} exited with code {proc.returncode}; see {self.log_dir / name}.log"
                )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each (the scaler drains its workers), then kill what is left."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class LiveSample:
    """One sample of the system, wall seconds since the replay started.

    ``workers``, ``starting``, ``draining`` and ``unhealthy``: model -> live workers whose
    heartbeat says that state. They are kept apart (issue 24: one "starting/draining"
    line made two 70B workers coming up one after the other, a starting worker turning
    ready, read as a worker flipping between ready and draining; the workers' logs showed
    no drain then).
    """

    t: float
    queued: dict[str, int]
    workers: dict[str, int]
    starting: dict[str, int]
    utilisation: float
    gpus_busy: float
    draining: dict[str, int] = field(default_factory=dict)
    unhealthy: dict[str, int] = field(default_factory=dict)
    #: ready workers with nothing in flight (the fleet's idle capacity at this sample)
    idle: int = 0


class Sampler(threading.Thread):
    """Samples queues and fleet four times a second into :attr:`samples`."""

    def __init__(self, store: Store, t0: float, period_s: float = 0.25) -> None:
        super().__init__(name="demo-sampler", daemon=True)
        self.store, self.t0, self.period_s = store, t0, period_s
        self.samples: list[LiveSample] = []
        self.stop_event = threading.Event()

    def sample(self) -> LiveSample:
        queued: dict[str, int] = {}
        for cls, _, n, _ in self.store.queue_depths():
            queued[cls] = queued.get(cls, 0) + n
        infos, _ = self.store.workers()
        ready: dict[str, int] = {}
        starting: dict[str, int] = {}
        draining: dict[str, int] = {}
        unhealthy: dict[str, int] = {}
        by_state = {"ready": ready, "starting": starting, "draining": draining}
        slots = used = busy = idle = 0
        for w in infos:
            target = by_state.get(w.state.value, unhealthy)
            target[w.model] = target.get(w.model, 0) + 1
            idle += target is ready and w.in_flight == 0
            slots += w.slots
            used += min(w.slots, w.in_flight)
            busy += w.in_flight > 0
        return LiveSample(
            time.monotonic() - self.t0,
            queued,
            ready,
            starting,
            used / slots if slots else 0.0,
            busy / len(infos) if infos else 0.0,
            draining,
            unhealthy,
            idle,
        )

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            try:
                self.samples.append(self.sample())
            except Exception:  # a missed sample is not worth stopping the demo
                continue


def run_demo(opts: DemoOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the demo end to end; returns the report (also written as JSON and PNG).

    Raises:
        ConfigError: bad options, or a component died.
        MissingExtra: matplotlib (or fakeredis, when it must stand in for redis-server)
            is not installed: checked before anything starts.
    """
    console = console or Console()
    import_extra("matplotlib", "demo", "inferq demo")  # the plot comes last: fail first
    base = Settings.load()
    if opts.speedup <= 0:
        raise ConfigError("speedup: must be > 0")
    if opts.duration_s <= 0:
        raise ConfigError("duration: must be > 0 seconds of trace")
    fleet = parse_fleet_cards(opts.fleet, base)
    workload = build_workload(opts, base)
    if not workload:
        raise ConfigError("the chosen trace window holds no requests")
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="inferq-demo-"))
    console.print(
        f"[bold]inferq demo[/bold]: {len(workload)} requests from "
        f"{opts.duration_s:g} s of the Azure traces, at {opts.speedup:g}x "
        f"(~{opts.duration_s / opts.speedup:.0f} s); logs in {log_dir}"
    )
    with EmbeddedRedis(opts.redis) as server:
        settings = compressed(base, opts.speedup).model_copy(
            update={"redis_url": server.url, "namespace": "demo"}
        )
        procs = Processes(log_dir)
        try:
            return _run(opts, settings, fleet, workload, procs, console, server.kind)
        finally:
            with console.status("stopping the dispatcher, the scaler and its workers"):
                procs.stop()


def _run(
    opts: DemoOptions,
    settings: Settings,
    fleet: list[FleetEntry],
    workload: list[SimRequest],
    procs: Processes,
    console: Console,
    redis_kind: str,
) -> dict[str, Any]:
    store = Store(connect(settings.redis_url), settings)
    client = Client(settings=settings, store=store)
    env = child_env(settings)
    procs.start("dispatcher", ["--log-level", "INFO", "dispatcher"], env)
    args = scaler_args(opts, fleet, procs.log_dir)
    procs.start("scaler", ["--log-level", "INFO", "scaler", *args], env)
    initial = sum(f.count for f in fleet)
    with console.status(f"starting {initial} workers on {redis_kind}"):
        deadline = time.monotonic() + 60
        while len([w for w in store.workers()[0] if w.state.value == "ready"]) < initial:
            procs.check()
            if time.monotonic() > deadline:
                raise ConfigError("the initial fleet did not become ready within 60 s")
            time.sleep(0.2)

    timer = TimerProbe()
    cpu_start = cpu_times()
    t0 = time.monotonic()
    clock = TraceClock(opts.speedup, store.now())
    sampler = Sampler(store, t0)
    sampler.start()
    try:
        ids, late = _replay(opts, client, workload, procs, sampler, console, t0)
        _wait_final(opts, store, ids, procs, console)
    finally:
        timer_late = timer.stop()
    sampler.stop_event.set()
    wall = time.monotonic() - t0
    report = _report(opts, settings, store, workload, ids, sampler.samples, wall, clock)
    met = {c: v.get("sla_attainment") for c, v in report["classes"].items()}
    cpu = (cpu_start, cpu_times())
    report["keep_up"] = keep_up(clock, report["sla_s"], late, timer_late, cpu, met)
    report["redis"] = redis_kind
    _print_report(report, console)
    _write(report, sampler.samples, clock, opts, console)
    return report


def scaler_args(opts: DemoOptions, fleet: list[FleetEntry], log_dir: Path) -> list[str]:
    """Arguments of the demo's ``inferq scaler`` (local platform, compressed times)."""
    args = [
        "--backend", "local",
        "--slots", str(DEMO_SLOTS),
        "--worker-option", "cold_start=true",
        "--log-dir", str(log_dir / "workers"),
    ]  # fmt: skip
    for f in fleet:
        args += ["--pool", f"{f.model}={f.count}:{f.count + DEMO_MAX_EXTRA}"]
        args += ["--vram-mib", f"{f.model}={f.vram_mib}"]
    return args


def _prompt(rid: str, tokens: int) -> str:
    """A prompt the fast estimate counts as ``tokens`` tokens ("tok " is 4 characters,
    one token at 4 characters per token) that starts with the request's own id (8
    characters, two tokens' worth): the Azure traces say nothing of shared prefixes, so
    no two prompts may share one, or prefix-cache routing would see a common prefix as
    long as the shorter prompt."""
    return rid + "tok " * max(1, tokens - len(rid) // 4)


def _replay(
    opts: DemoOptions,
    client: Client,
    workload: list[SimRequest],
    procs: Processes,
    sampler: Sampler,
    console: Console,
    t0: float,
) -> tuple[list[str], list[float]]:
    """Submit the workload on its compressed schedule. Returns the ids and how late the
    replay picked each request up against its schedule, wall seconds: a late wake-up, or
    a slow submission before it, delays it; a bulk that arrives at one instant (the
    synthetic batch) is not late for its own submission's length."""
    ids: list[str] = []
    late: list[float] = []
    progress = Progress(
        TextColumn("replaying"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console,
    )  # fmt: skip
    task = progress.add_task("replay", total=len(workload))
    i = 0
    with Live(Group(progress, _live_table(None)), console=console, refresh_per_second=4) as live:
        while i < len(workload):
            picked = time.monotonic() - t0
            now = picked * opts.speedup
            due = []
            while i < len(workload) and workload[i].arrival_s <= now:
                if workload[i].refused is None:  # intake would refuse it (the sim's rule)
                    due.append(workload[i])
                i += 1
            if due:
                handles = client.submit_many(
                    {
                        "prompt": _prompt(r.id, r.prompt_tokens),
                        "model": r.route,
                        "priority": r.priority,
                        "tenant": r.tenant,
                        "max_tokens": r.max_tokens,
                        "params": {"sim_output_tokens": r.output_tokens},
                    }
                    for r in due
                )
                ids += [h.id for h in handles]
                late += [picked - r.arrival_s / opts.speedup for r in due]
                if opts.replay_delay_s:  # the test hook: a slow submission
                    time.sleep(opts.replay_delay_s)
                progress.update(task, completed=i)
            procs.check()
            live.update(
                Group(progress, _live_table(sampler.samples[-1] if sampler.samples else None))
            )
            if i < len(workload):
                wait = (workload[i].arrival_s / opts.speedup) - (time.monotonic() - t0)
                time.sleep(min(max(wait, 0.0), 0.25))
    return ids, late


def _live_table(sample: LiveSample | None) -> Table:
    table = Table.grid(padding=(0, 3))
    if sample is None:
        table.add_row("waiting for the first sample")
        return table
    queued = " ".join(f"{c} {n}" for c, n in sorted(sample.queued.items())) or "none"
    workers = " ".join(f"{m} {n}" for m, n in sorted(sample.workers.items()))
    starting = " ".join(f"{m} {n}" for m, n in sorted(sample.starting.items()))
    table.add_row("queued", queued)
    table.add_row("workers ready", workers + (f"  (starting: {starting})" if starting else ""))
    table.add_row("slots busy", f"{sample.utilisation:.0%}")
    return table


def _wait_final(
    opts: DemoOptions, store: Store, ids: list[str], procs: Processes, console: Console
) -> None:
    deadline = time.monotonic() + opts.drain_wait_s
    with console.status("waiting for the last requests") as status:
        while time.monotonic() < deadline:
            procs.check()
            records = store.records(ids[-2000:])
            open_ = [r for r in records if r is not None and not r.state.final]
            status.update(f"waiting for the last requests ({len(open_)} in flight)")
            if not open_ and all(r is not None and r.state.final for r in store.records(ids)):
                return
            time.sleep(0.5)


def _report(
    opts: DemoOptions,
    settings: Settings,
    store: Store,
    workload: list[SimRequest],
    ids: list[str],
    samples: list[LiveSample],
    wall_s: float,
    clock: TraceClock,
) -> dict[str, Any]:
    outcomes: list[Outcome] = []
    unfinished = 0
    for start in range(0, len(ids), 1000):
        for rec in store.records(ids[start : start + 1000]):
            if rec is None or not rec.state.final:
                unfinished += 1
                continue
            t = rec.timings
            outcomes.append(
                Outcome(
                    priority=rec.request.priority,
                    status=rec.state.value,
                    queue_wait_s=t.queue_wait_s,
                    ttft_s=t.ttft_s,
                    e2e_s=t.e2e_s,
                    tenant=rec.request.tenant,
                )
            )
    sla = {c.name: clock.trace_s(c.sla_s) for c in settings.classes}
    scale_events, before = [], 0
    for e in store.events(count=100_000):
        if e.type not in ("scale_up", "scale_down"):
            continue
        at = clock.at_s(e.at)
        if at is None:  # the initial fleet, started before the replay
            before += 1
            continue
        fields = dict(e.fields)
        if "reason" in fields:
            fields["reason"] = clock.reason(str(fields["reason"]))
        scale_events.append({"type": e.type, "at_s": at, **fields})
    stats = store.stats()
    output: dict[str, list[int]] = {}
    for r in workload:
        output.setdefault(r.priority, []).append(r.output_tokens)
    util = [s.utilisation for s in samples]
    gpus = [s.gpus_busy for s in samples]
    return {
        "trace_window_s": opts.duration_s,
        "speedup": opts.speedup,
        "wall_s": round(wall_s, 1),
        "requests": len(workload),
        "submitted": len(ids),
        "refused": sum(1 for r in workload if r.refused is not None),
        "unfinished": unfinished,
        "lost": sum(1 for r in workload if r.refused is None) - len(ids),
        "time_origin": "at_s and every duration: trace seconds, at_s since the replay "
        "started (the window's --start); wall_s: wall-clock seconds",
        "classes": class_summary(outcomes, sla, scale=clock.speedup),
        "sla_s": sla,
        # e2e grows with the tokens generated: the conversation trace's answers are
        # longer than the code trace's, so realtime's e2e is longer than standard's
        # while its TTFT (what the SLA bounds) is shorter (issue 24)
        "output_tokens_mean": {c: sum(v) / len(v) for c, v in output.items() if v},
        "slot_utilisation_mean": sum(util) / len(util) if util else None,
        "gpus_busy_mean": sum(gpus) / len(gpus) if gpus else None,
        "idle_worker_s": idle_worker_s(samples, clock),
        "scale_events": len(scale_events),
        "scale_events_detail": scale_events,
        "scale_events_before_replay": before,
        "retries": stats.get("retried", 0),
        "expired": stats.get("expired", 0),
        "failed": stats.get("failed", 0),
        "dead_letter": len(store.dead_letters(100_000)),
    }


def _print_report(report: dict[str, Any], console: Console) -> None:
    console.print()
    table = Table(
        title=f"{report['requests']} requests, {report['trace_window_s']:g} s of trace in "
        f"{report['wall_s']:g} s (durations in trace seconds)",
        caption="SLA = time to first token; met = share of the class that succeeded within it",
    )
    for col in ("class", "n", "SLA", "met", "wait50", "wait99", "e2e50", "e2e99", "exp", "fail"):
        table.add_column(col, justify="left" if col == "class" else "right")

    def s(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"

    for cls, st in report["classes"].items():
        table.add_row(
            cls, str(st["requests"]), s(report["sla_s"][cls]), f"{st['sla_attainment']:.0%}",
            s(st["queue_wait_p50_s"]), s(st["queue_wait_p99_s"]), s(st["e2e_p50_s"]),
            s(st["e2e_p99_s"]), str(st["expired"]), str(st["failed"]),
        )  # fmt: skip
    console.print(table)
    tokens = report.get("output_tokens_mean") or {}
    if tokens:
        console.print(
            "mean output tokens: "
            + ", ".join(f"{c} {n:.0f}" for c, n in sorted(tokens.items()))
            + " (e2e includes generating them: a class with longer answers has a longer"
            " e2e at the same TTFT, which is no scheduling fault)"
        )
    util, gpus = report["slot_utilisation_mean"], report["gpus_busy_mean"]
    console.print(
        f"GPUs busy {gpus:.0%} (>= 1 request running), slots busy {util:.0%}"
        if util is not None and gpus is not None
        else "no utilisation samples",
        f"| idle ready workers {report['idle_worker_s']:.0f} worker-s "
        f"| scale events {report['scale_events']} | retries {report['retries']} "
        f"| expired {report['expired']} | failed {report['failed']} "
        f"| unfinished {report['unfinished']} | lost {report['lost']}",
    )
    _print_keep_up(report["keep_up"], console)


def _print_keep_up(k: dict[str, Any], console: Console) -> None:
    """Whether the machine kept up: the lags (trace seconds) and, if not, the verdict."""
    replay, timer = k["replay_lag"]["trace"], k["timer_lag"]["trace"]

    def p99(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    steal = k["cpu_steal_share"]
    load = k["load_avg_1m"]
    console.print(
        f"lag p99 (trace): replay {p99(replay['p99_s'])}, timer {p99(timer['p99_s'])} "
        f"(threshold {p99(k['threshold_s'])})"
        + ("" if steal is None else f" | CPU steal {steal:.0%}")
        + ("" if load is None else f" | load {load:.1f}")
    )
    if k["verdict"]:
        console.print(f"[bold red]{k['verdict']}[/bold red]")


def _write(
    report: dict[str, Any],
    samples: list[LiveSample],
    clock: TraceClock,
    opts: DemoOptions,
    console: Console,
) -> None:
    json_path = opts.out_dir / "inferq-demo-report.json"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    png = opts.out_dir / "inferq-demo.png"
    plot(samples, clock, png)
    console.print(f"report: {json_path}  plot: {png}")


def idle_worker_s(samples: Sequence[LiveSample], clock: TraceClock) -> float:
    """Worker-seconds (trace) ready workers spent with nothing in flight: each sample's
    idle count held until the next sample (the step the chart draws). The figure a
    scale-up that came too late costs (issue 24: workers launched for a burst that was
    gone when they came up)."""
    return sum(a.idle * clock.trace_s(b.t - a.t) for a, b in itertools.pairwise(samples))


def plot(samples: list[LiveSample], clock: TraceClock, path: Path) -> None:
    """Queue depth per class, workers per model and slot utilisation over trace time.

    Raises:
        MissingExtra: matplotlib is not installed (the ``demo`` extra).
    """
    import_extra("matplotlib", "demo", "inferq demo").use("Agg")
    plt: Any = import_extra("matplotlib.pyplot", "demo", "inferq demo")

    t = [clock.trace_s(s.t) for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    classes = sorted({c for s in samples for c in s.queued})
    for cls in classes:
        axes[0].plot(t, [s.queued.get(cls, 0) for s in samples], label=cls)
    axes[0].set_ylabel("queued requests")
    axes[0].legend(loc="upper right")
    models = sorted(
        {m for s in samples for m in (*s.workers, *s.starting, *s.draining, *s.unhealthy)}
    )
    for model in models:
        axes[1].step(
            t, [s.workers.get(model, 0) for s in samples], where="post", label=f"{model} ready"
        )
        for state, style in (("starting", ":"), ("draining", "--"), ("unhealthy", "-.")):
            counts = [getattr(s, state).get(model, 0) for s in samples]
            if any(counts):  # a state no worker of the model was in draws no line
                axes[1].step(t, counts, where="post", linestyle=style,
                             label=f"{model} {state}")  # fmt: skip
    axes[1].set_ylabel("workers")
    axes[1].legend(loc="upper right", fontsize="small")
    axes[2].plot(t, [100 * s.gpus_busy for s in samples], label="GPUs busy (>= 1 request)")
    axes[2].plot(t, [100 * s.utilisation for s in samples], label="slots busy")
    axes[2].set_ylabel("utilisation %")
    axes[2].legend(loc="lower right", fontsize="small")
    axes[2].set_ylim(0, 100)
    axes[2].set_xlabel("trace time (s)")
    fig.suptitle("inferq demo: Azure LLM traces (2023)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
