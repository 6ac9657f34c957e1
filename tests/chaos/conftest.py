"""Chaos fixtures: a private redis-server, every daemon as a real subprocess, and the audit.

Each chaos test runs on a ``redis-server`` of its own (free port, temporary
directory, ``appendonly yes``, ``appendfsync everysec``): it may restart it,
kill it or kill every client connection without touching anyone else's Redis.
Daemons are the real CLI (``python -m inferq dispatcher|worker|scaler``) with
fast timings: heartbeat every 0.2 s (a silent worker is reaped after 0.6 s),
1 s leases, and a generous ``max_attempts`` so repeated kills of the same
request's workers end in a result, not in the dead letter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from inferq.client import Client
from inferq.config import Settings
from inferq.embedded import free_port
from inferq.models import Event, WorkerState
from inferq.store import Store, connect

from ..helpers import LagProbe

#: Worker heartbeat period, s: the reaper declares a worker dead after 3 of them.
HEARTBEAT_S = 0.2
#: Lease of an assigned/running request, s (the worker's beats extend it).
LEASE_S = 1.0
#: Attempts before the dead letter: high, since a request may meet several killed workers.
MAX_ATTEMPTS = 20
MODEL = "llama-3.1-8b"
VRAM_MIB = 24_576
#: Event types that end a request; each id must have exactly one.
FINAL_EVENTS = frozenset({"finish", "fail", "expire", "cancel"})
REDIS_SERVER = shutil.which("redis-server")

needs_redis_server = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not on PATH")


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, why: Callable[[], str] | None = None
) -> None:
    """Poll ``predicate`` every 50 ms; AssertionError naming ``what`` after ``timeout`` s
    (followed by ``why()``, a diagnosis, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    detail = f"\n{why()}" if why is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


class RedisServer:
    """A ``redis-server`` the test owns: its port, its directory, AOF with fsync every second.

    Args:
        directory: data directory (the AOF lives here across restarts).
    """

    def __init__(self, directory: Path) -> None:
        assert REDIS_SERVER is not None
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart) on the same port and directory; returns once it answers PING."""
        assert REDIS_SERVER is not None
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.starts += 1
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            wait_for(lambda: _answers(probe), 20, f"redis-server on port {self.port}")
        finally:
            probe.close()

    def client(self) -> redis.Redis:
        """A plain connection (no retries): for the test's own admin commands."""
        return redis.Redis(port=self.port, decode_responses=True, retry=Retry(NoBackoff(), 0))

    def shutdown(self) -> None:
        """Graceful stop: ``SHUTDOWN`` fsyncs the AOF, then the process exits."""
        with self.client() as admin, contextlib.suppress(redis.ConnectionError):
            admin.shutdown()  # the server closes the connection as it exits
        self._reap()

    def kill(self) -> None:
        """SIGKILL: whatever the AOF had not fsynced yet (up to ~1 s of writes) is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=20)
            self.proc = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not on PATH")
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


class Deployment:
    """One namespace on one Redis: daemons as subprocesses, a client, the event audit.

    Args:
        url: the Redis URL.
        log_dir: where each process's output goes (``<name>.log``).
        heartbeat_s / lease_s: the deployment's timings (default: the fast ones above).
    """

    def __init__(
        self, url: str, log_dir: Path, *, heartbeat_s: float = HEARTBEAT_S, lease_s: float = LEASE_S
    ) -> None:
        self.url = url
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.settings = Settings.load(
            redis_url=url,
            namespace=f"c{uuid.uuid4().hex[:10]}",
            heartbeat_interval_s=heartbeat_s,
            lease_s=lease_s,
            max_attempts=MAX_ATTEMPTS,
        )
        self.store = Store(connect(url), self.settings)
        self.client = Client(settings=self.settings, connection=self.store.redis)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        #: how late this host wakes a thread, for the reaction-time bounds; stopped by
        #: :meth:`close`, so a failed test leaves no thread behind
        self.probe = LagProbe()
        self.probe.start()

    # --- processes -------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment every daemon gets: URL, namespace and the fast timings."""
        s = self.settings
        return {
            **os.environ,
            "INFERQ_REDIS_URL": s.redis_url,
            "INFERQ_NAMESPACE": s.namespace,
            "INFERQ_HEARTBEAT_INTERVAL_S": repr(s.heartbeat_interval_s),
            "INFERQ_LEASE_S": repr(s.lease_s),
            "INFERQ_MAX_ATTEMPTS": str(s.max_attempts),
        }

    def spawn(
        self, name: str, *args: str, module: Sequence[str] = ("inferq",)
    ) -> subprocess.Popen[bytes]:
        """Run ``python -m inferq --log-level info ARGS`` as ``name`` (output in its log);
        ``module`` replaces ``inferq`` (with its own arguments) when given, run from the
        repository root (e.g. ``tests.fakes.skewed_clock 15``)."""
        with (self.log_dir / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", *module, "--log-level", "info", *args],
                cwd=Path(__file__).resolve().parents[2],
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def dispatcher(self, name: str = "dispatcher", tick_s: float = 0.05) -> None:
        self.spawn(name, "dispatcher", "--tick", repr(tick_s))

    def worker(
        self,
        wid: str,
        *,
        slots: int = 8,
        time_scale: float = 0.5,
        ready: bool = True,
        module: Sequence[str] = ("inferq",),
    ) -> None:
        """Start a sim worker; with ``ready``, return once its heartbeat says ``ready``."""
        self.spawn(
            wid,
            "worker",
            "--model",
            MODEL,
            "--vram-mib",
            str(VRAM_MIB),
            "--id",
            wid,
            "--slots",
            str(slots),
            "--heartbeat-interval",
            repr(self.settings.heartbeat_interval_s),
            "-o",
            f"time_scale={time_scale}",
            module=module,
        )
        if ready:
            self.wait_ready([wid])

    def wait_ready(self, wids: list[str], timeout: float = 30) -> None:
        def all_ready() -> bool:
            for wid in wids:
                proc = self.procs[wid]
                assert proc.poll() is None, f"{wid} exited {proc.returncode}:\n{self.log(wid)}"
                if self.worker_state(wid) != WorkerState.READY.value:
                    return False
            return True

        wait_for(all_ready, timeout, f"workers {wids} ready")

    def wait_dispatching(self, timeout: float = 30) -> None:
        """Wait until a dispatcher has beaten (``dispatcher:beat``): it has connected and
        taken its first step, which a loaded host may delay by seconds."""
        wait_for(
            lambda: bool(self.store.redis.exists(self.store.keys.dispatcher_beat)),
            timeout,
            "a dispatcher running",
            self.logs,
        )

    def worker_state(self, wid: str) -> str | None:
        state: str | None = self.store.redis.hget(self.store.keys.worker(wid), "state")
        return state

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` and wait for it."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=20)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def logs(self, tail: int = 1500) -> str:
        """The end of every process log (for assertion messages)."""
        return "\n".join(
            f"--- {p.stem} ---\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def close(self) -> None:
        """SIGTERM everything (daemons exit, the scaler drains its workers), then SIGKILL."""
        self.probe.stop()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        self.client.close()

    # --- the audit --------------------------------------------------------------------

    def wait_final(self, ids: list[str], timeout: float = 90) -> None:
        """Wait until every id's record is final (AssertionError with a diagnosis)."""
        wait_for(
            lambda: all(r is not None and r.state.final for r in self.store.records(ids)),
            timeout,
            f"{len(ids)} requests to finish",
            lambda: self.diagnose(ids),
        )

    def diagnose(self, ids: list[str]) -> str:
        """Where the unfinished requests are, the live workers, and the logs' ends."""
        open_ = [(rid, r) for rid, r in zip(ids, self.store.records(ids), strict=True)]
        open_ = [(rid, r) for rid, r in open_ if r is None or not r.state.final]
        states = Counter("missing" if r is None else r.state.value for _, r in open_)
        sample = [
            (rid, None if r is None else (r.state.value, r.worker, r.attempt))
            for rid, r in open_[:5]
        ]
        workers = [(w.id, w.state.value, w.in_flight) for w in self.store.workers()[0]]
        return f"unfinished {dict(states)} e.g. {sample}\nworkers {workers}\n{self.logs()}"

    def events(self) -> list[Event]:
        """Every event of the stream, oldest first (read in pages)."""
        out: list[Event] = []
        after = "-"
        while True:
            page = self.store.events(count=10_000, after=after)
            out += page
            if len(page) < 10_000:
                return out
            after = page[-1].id

    def audit(self, ids: list[str]) -> Audit:
        """Final events per submitted id, and every record's state now."""
        events = self.events()
        finals: Counter[str] = Counter(
            e.fields.get("id", "") for e in events if e.type in FINAL_EVENTS
        )
        states: Counter[str] = Counter()
        attempts: Counter[int] = Counter()
        missing: list[str] = []
        for rid, record in zip(ids, self.store.records(ids), strict=True):
            if record is None:
                missing.append(rid)
                continue
            states[record.state.value] += 1
            attempts[record.attempt] += 1
        return Audit(events, finals, states, attempts, missing, self.store.stats())


@dataclass
class Audit:
    """What the stream and the records say about a run.

    Attributes:
        events: the whole events stream.
        finals: request id -> final events (finish/fail/expire/cancel) seen for it.
        states: record state -> requests in it.
        attempts: attempt number -> requests that ended on it.
        missing: submitted ids with no record at all (lost).
        stats: the ``stats`` counters.
    """

    events: list[Event]
    finals: Counter[str]
    states: Counter[str]
    attempts: Counter[int]
    missing: list[str]
    stats: dict[str, int]

    def of_type(self, etype: str) -> list[Event]:
        return [e for e in self.events if e.type == etype]

    def check_exactly_once(self, ids: list[str]) -> None:
        """Every id has a record, exactly one final event, and succeeded."""
        assert not self.missing, f"{len(self.missing)} requests lost, e.g. {self.missing[:5]}"
        twice = {rid: n for rid, n in self.finals.items() if n > 1}
        assert not twice, f"duplicate final results: {list(twice.items())[:5]}"
        never = [rid for rid in ids if self.finals[rid] == 0]
        assert not never, f"{len(never)} requests without a final event, e.g. {never[:5]}"
        assert self.states == Counter({"succeeded": len(ids)}), self.states


@pytest.fixture
def deployment(redis_server: RedisServer, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(redis_server.url, tmp_path / "logs")
    yield d
    d.close()


# --- a zygote: many short-lived workers without paying Python's start-up each time -------


def zygote_main() -> None:
    """Fork sim workers on request from one process that imported inferq once.

    Each stdin line ``<worker id> <slots> <time_scale> <log path>`` forks a worker
    running :func:`inferq.workers.worker.run_worker` (what ``inferq worker`` runs) in
    its own session, with the environment's settings; its output goes to the log.
    Prints ``spawned <id> <pid>`` and, once it exits, ``exit <id> <code>``. A fork
    costs milliseconds where a fresh interpreter costs ~0.5 s of CPU, which is what
    makes hundreds of drains fit in a CI run on two cores.
    """
    import select

    from inferq.workers.worker import WorkerOptions, run_worker

    settings = Settings.load()
    children: dict[int, str] = {}
    pending = b""  # read with os.read: a buffered readline would hide lines from select
    stdin_open = True
    while stdin_open or children:
        if stdin_open and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 65536)
            stdin_open = bool(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                wid, slots, time_scale, log = line.decode().split()
                opts = WorkerOptions(
                    model=MODEL,
                    slots=int(slots),
                    vram_mib=VRAM_MIB,
                    worker_id=wid,
                    heartbeat_interval_s=settings.heartbeat_interval_s,
                    server_options={"time_scale": time_scale},
                )
                pid = os.fork()
                if pid == 0:
                    _zygote_child(settings, opts, log, run_worker)
                children[pid] = wid
                print(f"spawned {wid} {pid}", flush=True)
        elif not stdin_open:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            print(f"exit {children.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)


def _zygote_child(settings: Settings, opts: object, log: str, run: Callable[..., int]) -> None:
    """The forked worker: own session, output to ``log``, exits with run_worker's code."""
    import logging
    import traceback

    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    code = 1
    try:
        code = run(settings, opts)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Zygote:
    """The test's side of :func:`zygote_main`: spawn workers, learn their exit codes.

    Args:
        d: the deployment (its environment and log directory).
    """

    def __init__(self, d: Deployment) -> None:
        self.d = d
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.chaos.conftest import zygote_main; zygote_main()"],
            cwd=root,
            env=d.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.spawned = 0
        self.pids: dict[str, int] = {}
        self.exits: dict[str, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, wid, number = line.split()
            if kind == "spawned":
                self.pids[wid] = int(number)
            else:
                self.exits[wid] = int(number)

    def spawn(self, wid: str, *, slots: int, time_scale: float) -> None:
        assert self.proc.stdin is not None
        log = self.d.log_dir / f"{wid}.log"
        self.proc.stdin.write(f"{wid} {slots} {time_scale} {log}\n")
        self.proc.stdin.flush()
        self.spawned += 1

    def close(self) -> None:
        """Stop spawning, SIGKILL the workers still running, then let the zygote go."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        with contextlib.suppress(AssertionError):
            wait_for(lambda: len(self.pids) == self.spawned, 10, "the last spawns")
        for wid, pid in self.pids.items():
            if wid not in self.exits:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def zygote(deployment: Deployment) -> Iterator[Zygote]:
    z = Zygote(deployment)
    yield z
    z.close()
