"""Worker subprocesses (``inferq worker``) and a dispatcher thread on the real Redis.

The tests that run real worker processes share this: each worker's log goes to a file
(a pipe nobody reads would fill at 64 KiB of request logs and block the worker), and
everything is killed at the end. The ``fleet`` and ``client`` fixtures are in
``tests/redis/conftest.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from typing import IO

from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.models import WorkerState
from inferq.store import Store

from ..conftest import REDIS_URL
from ..helpers import wait_for


class Fleet:
    """Starts worker subprocesses and a dispatcher thread; kills everything at the end.

    Args:
        settings: the test's settings (namespace, heartbeat interval, lease).
        store: a store on the test's Redis (the dispatcher gets its own).
    """

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self.dispatcher = Dispatcher(Store(store.redis, settings), tick_s=0.05)
        self._thread = threading.Thread(target=self.dispatcher.run, daemon=True)
        self._thread.start()

    def worker(
        self,
        wid: str,
        *,
        time_scale: float | None = 1.0,
        slots: int = 4,
        extra: tuple[str, ...] = (),
        ready_timeout_s: float = 60,
    ) -> subprocess.Popen[bytes]:
        """Start ``inferq worker`` for llama-3.1-8b on a 24,576 MiB card (the sim backend
        unless ``extra`` names another; ``time_scale`` None leaves the option out) and
        wait until its heartbeat says ready (at most ``ready_timeout_s``: in two CI runs at
        once on 2 cores a 20 s wait timed out, log unseen; the worker's log on a timeout)."""
        env = {
            **os.environ,
            "INFERQ_REDIS_URL": REDIS_URL,
            "INFERQ_NAMESPACE": self.settings.namespace,
        }
        cmd = [sys.executable, "-m", "inferq", "--log-level", "INFO", "worker"]
        cmd += ["--model", "llama-3.1-8b", "--vram-mib", "24576", "--id", wid]
        cmd += ["--slots", str(slots), "--heartbeat-interval", "0.2"]
        if time_scale is not None:
            cmd += ["-o", f"time_scale={time_scale}"]
        log = self._logs[wid] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        proc = subprocess.Popen([*cmd, *extra], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[wid] = proc
        try:
            wait_for(
                lambda: self.state(wid) == WorkerState.READY.value,
                what=f"{wid} ready",
                timeout=ready_timeout_s,
            )
        except AssertionError as exc:
            state = self.state(wid)
            raise AssertionError(f"{exc} (state {state}):\n{self.output(wid)[-3000:]}") from None
        return proc

    def state(self, wid: str) -> str | None:
        """The state in the worker's heartbeat hash (None once it is gone)."""
        value: str | None = self.store.redis.hget(self.store.keys.worker(wid), "state")
        return value

    def output(self, wid: str | None = None) -> str:
        """One worker's log so far, or every worker's."""
        logs = [self._logs[wid]] if wid is not None else list(self._logs.values())
        out = []
        for log in logs:
            log.seek(0)
            out.append(log.read().decode(errors="replace"))
        return "\n".join(out)

    def close(self) -> None:
        """Stop the dispatcher, kill every worker still running (idempotent)."""
        self.dispatcher.stop()
        self._thread.join(timeout=5)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)

    def discard(self) -> None:
        """:meth:`close`, then the log files."""
        self.close()
        for log in self._logs.values():
            log.close()
