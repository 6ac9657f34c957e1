"""Local platform: workers as subprocesses of the scaler on this host.

Each worker is ``<python> -m inferq --log-level L worker --model M --id ID
--backend B --slots S --heartbeat-interval H [--vram-mib N] [-o KEY=VALUE ...]``
in its own session (a Ctrl-C at the scaler's terminal does not reach it: only
the signals this platform sends do), with ``INFERQ_REDIS_URL``,
``INFERQ_NAMESPACE`` and, when given, ``INFERQ_CONFIG`` in its environment, and
its output appended to ``<log_dir>/<worker id>.log``.

- :meth:`LocalPlatform.list`: the children still running (exited ones are reaped
  and their exit codes kept in :attr:`LocalPlatform.exited`).
- :meth:`LocalPlatform.stop`: the scaler calls it after the worker drained and
  deregistered, so it waits for the process to exit on its own; only if it has
  not after ``stop_timeout_s`` *and* its heartbeat is gone from Redis, SIGTERM,
  then SIGKILL. A worker still registered is never signalled (the call raises).
- :meth:`LocalPlatform.close`: drain and stop everything this platform started:
  SIGTERM (the worker drains: finishes what runs, leaves, exits 0), then after
  ``drain_timeout_s`` a second SIGTERM (it hands its in-flight requests back to
  their queues), then SIGKILL. The demo uses it on shutdown.

The embedded demo and the tests run their fleet on it.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from inferq import defaults
from inferq.scaler.platforms.base import (
    WORKER_COMMAND,
    Platform,
    PlatformError,
    WorkerHandle,
    card_args,
    worker_command,
    worker_environment,
)

log = logging.getLogger(__name__)


class LocalPlatform(Platform):
    """Workers as local subprocesses.

    Args:
        redis_url: ``INFERQ_REDIS_URL`` of the workers.
        namespace: ``INFERQ_NAMESPACE`` of the workers.
        config_path: ``INFERQ_CONFIG`` of the workers (None: inherit the environment's).
        log_dir: directory of the per-worker log files (default: ``inferq-<namespace>-workers``
            in the system temp directory); created at the first launch.
        worker_server: the worker's model platform (``sim``, ``openai``, ...).
        slots: the worker's concurrent requests at most.
        vram_mib: the card's VRAM, MiB, when NVML is unavailable (the ``sim`` platform needs
            it): one figure for every model, or model -> MiB (a mixed fleet).
        worker_options: ``-o KEY=VALUE`` options of the worker platform (``time_scale=0.1``).
        heartbeat_interval_s: the workers' heartbeat period, s (match the settings').
        log_level: the workers' log level.
        extra_args: more arguments appended to the worker command.
        environment: more environment variables for the workers.
        registered: worker id -> True while its heartbeat exists in Redis
            (``Store.worker_registered``); None disables signalling in :meth:`stop`.
        python: the interpreter to run (default: this one).
        stop_timeout_s: seconds :meth:`stop` waits for an exit before each signal.
        drain_timeout_s: seconds :meth:`close` lets each worker drain.
    """

    name: ClassVar[str] = "local"

    def __init__(
        self,
        *,
        redis_url: str,
        namespace: str,
        config_path: str | None = None,
        log_dir: str | Path | None = None,
        worker_server: str = "sim",
        slots: int = defaults.SIM_WORKER_SLOTS,
        vram_mib: int | Mapping[str, int] | None = None,
        worker_options: Mapping[str, str] | None = None,
        heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S,
        log_level: str = "INFO",
        extra_args: Sequence[str] = (),
        environment: Mapping[str, str] | None = None,
        registered: Callable[[str], bool] | None = None,
        python: str = sys.executable,
        stop_timeout_s: float = defaults.LOCAL_STOP_TIMEOUT_S,
        drain_timeout_s: float = defaults.LOCAL_DRAIN_TIMEOUT_S,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        extra = dict(environment or {})
        if config_path is not None:
            extra["INFERQ_CONFIG"] = str(config_path)
        self.environment = {**os.environ, **worker_environment(redis_url, namespace, extra)}
        default_dir = Path(tempfile.gettempdir()) / f"inferq-{namespace}-workers"
        self.log_dir = Path(log_dir) if log_dir is not None else default_dir
        self.template = (python, "-m", "inferq", "--log-level", log_level, *WORKER_COMMAND[1:])
        args = ["--backend", worker_server, "--slots", str(slots)]
        args += ["--heartbeat-interval", repr(heartbeat_interval_s)]
        self.vram_mib = vram_mib
        for key, value in (worker_options or {}).items():
            args += ["-o", f"{key}={value}"]
        self.extra_args = (*args, *extra_args)
        self.registered = registered
        self.stop_timeout_s = stop_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.exited: dict[str, int] = {}
        self._procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}

    def command(self, model: str, worker_id: str) -> builtins.list[str]:
        """The argv that :meth:`launch` runs."""
        card = card_args(model, self.vram_mib)
        return worker_command(model, worker_id, self.template, (*card, *self.extra_args))

    def log_path(self, worker_id: str) -> Path:
        """Where the worker's output goes."""
        return self.log_dir / f"{worker_id}.log"

    def launch(self, model: str, worker_id: str) -> WorkerHandle:
        """Start one worker process (returns at once; it registers on its own).

        Raises:
            PlatformError: the id is taken by a running child, or the process
                could not be started (the message names the command's first part).
        """
        if worker_id in self._procs and self._procs[worker_id][1].poll() is None:
            raise PlatformError(f"local: worker {worker_id} is already running")
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with self.log_path(worker_id).open("ab") as out:
                proc = subprocess.Popen(
                    self.command(model, worker_id),
                    env=self.environment,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise PlatformError(
                f"local: cannot start worker {worker_id} ({self.template[0]}): {exc}"
            ) from exc
        self._procs[worker_id] = (model, proc)
        log.info("launched worker %s (%s), pid %d", worker_id, model, proc.pid)
        return WorkerHandle(worker_id=worker_id, model=model, platform_ref=str(proc.pid))

    def list(self, model: str | None = None) -> builtins.list[WorkerHandle]:
        """The children still running (of ``model`` only, when given)."""
        self._reap()
        return [
            WorkerHandle(wid, m, str(proc.pid))
            for wid, (m, proc) in sorted(self._procs.items())
            if model is None or m == model
        ]

    def stop(self, handle: WorkerHandle) -> None:
        """Wait for a drained worker to exit; signal it only once it is gone from Redis.

        Raises:
            PlatformError: it has not exited after ``stop_timeout_s`` and is
                still registered (or registration cannot be checked): it is left running.
        """
        entry = self._procs.get(handle.worker_id)
        if entry is None:
            return
        proc = entry[1]
        if self._wait(proc, self.stop_timeout_s):
            self._reap()
            return
        if self.registered is None or self.registered(handle.worker_id):
            raise PlatformError(
                f"local: worker {handle.worker_id} (pid {proc.pid}) has not exited "
                f"{self.stop_timeout_s:.0f} s after its drain and is still registered; "
                "not signalling a live worker"
            )
        self._terminate(handle.worker_id, proc)

    def close(self) -> None:
        """Drain and stop every worker this platform started (see the module docstring)."""
        running = [(wid, proc) for wid, (_, proc) in self._procs.items() if proc.poll() is None]
        for wid, proc in running:
            log.info("draining worker %s (pid %d)", wid, proc.pid)
            _signal(proc, signal.SIGTERM)
        for wid, proc in running:
            if self._wait(proc, self.drain_timeout_s):
                continue
            log.warning(
                "worker %s did not drain in %.0f s: handing back", wid, self.drain_timeout_s
            )
            self._terminate(wid, proc)
        self._reap()

    def _terminate(self, worker_id: str, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; waits for the exit."""
        log.warning("signalling worker %s (pid %d) to exit", worker_id, proc.pid)
        _signal(proc, signal.SIGTERM)
        if not self._wait(proc, self.stop_timeout_s):
            log.warning("killing worker %s (pid %d)", worker_id, proc.pid)
            _signal(proc, signal.SIGKILL)
            proc.wait()
        self._reap()

    def _reap(self) -> None:
        for wid, (_, proc) in builtins.list(self._procs.items()):
            code = proc.poll()
            if code is not None:
                del self._procs[wid]
                self.exited[wid] = code
                log.log(
                    logging.INFO if code == 0 else logging.WARNING,
                    "worker %s exited with code %d (log: %s)",
                    wid,
                    code,
                    self.log_path(wid),
                )

    @staticmethod
    def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
        proc.send_signal(signum)
