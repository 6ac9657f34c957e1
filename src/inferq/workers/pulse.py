"""The heartbeat process: a worker's liveness survives a stall of the worker's Python process.

A heartbeat thread inside the worker stops whenever the whole process stops: a long GC
pause, an in-process backend holding the GIL, a paused VM, SIGSTOP. Past the heartbeat
TTL (3 s) the dispatcher then reaps a worker that is alive, and every request it runs
is dispatched again (issue 13, fault 5: 4 requests ran 35 times and none succeeded).
So ``inferq worker`` beats from a small child process (``python -m
inferq.workers.pulse``, or forked from the worker before its threads start):

- the worker writes one JSON line on the child's stdin each heartbeat interval: its
  heartbeat hash and the (request id, attempt) pairs it runs (``{"fields": ...,
  "held": ...}``; ``"now": true`` asks for a beat at once);
- the child runs ``heartbeat.lua`` every interval with the latest line, and writes the
  reply as a JSON line on its stdout (joined, drain, Redis time, lost attempts, pending
  aborts), which
  the worker reads in a thread (:class:`HeartbeatProcess`);
- when the worker sends nothing for ``stall_s`` (default 30 s,
  :data:`~inferq.defaults.HEARTBEAT_STALL_S`), the child stops beating: a worker hung
  that long is let go, its heartbeat lapses and the reaper requeues its requests;
- it exits when its stdin closes: the worker exited or was killed (the kernel closes
  the pipe), so a crashed worker is reaped within one TTL as before.

This is the alternative to fencing chosen because it keeps the one rule the reaper and
the leases rely on (a silent worker is dead) and needs no change to how requests are
claimed; a worker that was reaped all the same (stalled past ``stall_s``, Redis
unreachable) learns it from its next beat, which lists the attempts that are no longer
its own, and stops them (:meth:`inferq.workers.runtime.Engine.forget_lost`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from inferq import defaults
from inferq.config import Settings
from inferq.logs import setup_logging
from inferq.store import CONNECTION_ERRORS, Beat, Store

log = logging.getLogger(__name__)


class HeartbeatProcess:
    """The worker's side of the heartbeat process: start it, feed it, read its replies.

    Args:
        settings: the deployment's settings (the child connects with them).
        worker_id: the worker's id.
        ttl_s: the heartbeat hash's TTL, seconds.
        interval_s: seconds between beats.
        on_beat: called (in a reader thread) with each :class:`~inferq.store.Beat`.
        stall_s: how long the child beats on without hearing from the worker, seconds.
    """

    def __init__(
        self,
        settings: Settings,
        worker_id: str,
        *,
        ttl_s: float,
        interval_s: float,
        on_beat: Callable[[Beat], None],
        stall_s: float = defaults.HEARTBEAT_STALL_S,
    ) -> None:
        self._on_beat = on_beat
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._child, self._stdin, self._stdout = _start_child()
        first = {
            "settings": settings.model_dump(mode="json"),
            "worker_id": worker_id,
            "ttl_s": ttl_s,
            "interval_s": interval_s,
            "stall_s": stall_s,
        }
        self._write(first)
        self._reader = threading.Thread(target=self._read, name="heartbeat-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def ready(self) -> bool:
        """True once the child has beaten (until then the worker beats itself too: the
        child may need a second or so to start, longer than a short heartbeat TTL)."""
        return self._ready.is_set()

    @property
    def alive(self) -> bool:
        """True while the child runs."""
        return self._child.poll() is None

    def send(
        self, fields: dict[str, str], held: Sequence[tuple[str, int]], *, now: bool = False
    ) -> bool:
        """Hand the child the latest heartbeat; ``now`` asks for a beat at once.

        Returns False when the child is gone (the caller then beats itself).
        """
        return self._write({"fields": fields, "held": [list(p) for p in held], "now": now})

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the child's stdin (it exits) and wait for it."""
        with self._lock:
            if not self._stdin.closed:
                with contextlib.suppress(OSError):
                    self._stdin.close()
        self._child.wait(timeout_s)

    def _write(self, message: dict[str, Any]) -> bool:
        line = json.dumps(message, separators=(",", ":")) + "\n"
        with self._lock:
            if self._stdin.closed or self._child.poll() is not None:
                return False
            try:
                self._stdin.write(line)
                self._stdin.flush()
            except (OSError, ValueError):
                return False
        return True

    def _read(self) -> None:
        for line in self._stdout:
            try:
                raw = json.loads(line)
                beat = Beat(
                    bool(raw["joined"]),
                    bool(raw["drain"]),
                    int(raw["now_ms"]),
                    [(str(rid), int(a)) for rid, a in raw["lost"]],
                    [
                        (str(rid), int(a), str(action), str(reason))
                        for rid, a, action, reason in raw.get("aborts", ())
                    ],
                )
            except (ValueError, KeyError, TypeError):
                log.warning("heartbeat process wrote an unreadable line: %.200r", line)
                continue
            self._ready.set()
            try:
                self._on_beat(beat)
            except Exception:  # the reader must outlive a bad reply
                log.exception("handling a heartbeat reply failed")


class _Child:
    """A child process by pid: forked, or a :class:`subprocess.Popen`."""

    def __init__(self, pid: int, popen: subprocess.Popen[str] | None = None) -> None:
        self.pid = pid
        self._popen = popen
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self._code = -1
            else:
                if pid:
                    self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                if self._popen is not None:
                    self._popen.wait()
                else:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(self.pid, 0)
                    self._code = -signal.SIGKILL
                return
            time.sleep(0.02)


def _start_child() -> tuple[_Child, IO[str], IO[str]]:
    """Start the heartbeat child; returns it, its stdin and its stdout (text, line-buffered).

    Forked when this process has no other thread yet (``inferq worker`` starts it before
    any): the child then shares the imports already done and costs milliseconds. Else a
    fresh interpreter (``python -m inferq.workers.pulse``, ~0.5-1 s of CPU), since a fork
    beside running threads may inherit a lock one of them held.
    """
    if hasattr(os, "fork") and threading.active_count() == 1:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(to_child_w)
                os.close(from_child_r)
                _ignore_stop_signals()
                stdin = os.fdopen(to_child_r, "r")
                stdout = os.fdopen(from_child_w, "w", buffering=1)
                code = serve(stdin, stdout)
            except BaseException:
                log.exception("heartbeat process failed")
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(from_child_w)
        return (
            _Child(pid),
            os.fdopen(to_child_w, "w", buffering=1),
            os.fdopen(from_child_r, "r"),
        )
    popen = subprocess.Popen(
        [sys.executable, "-m", "inferq.workers.pulse"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert popen.stdin is not None and popen.stdout is not None
    return _Child(popen.pid, popen), popen.stdin, popen.stdout


def _ignore_stop_signals() -> None:
    # Ctrl-C or a SIGTERM sent to the worker's process group starts the worker's drain,
    # which must go on beating: the child ends only when the worker closes its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Latest:
    """The child's view: the last heartbeat the worker sent, and when it arrived."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.fields: dict[str, str] | None = None
        self.held: list[tuple[str, int]] = []
        self.received = 0.0  # monotonic
        self.urgent = False
        self.closed = False

    def follow(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                msg = json.loads(line)
                fields = {str(k): str(v) for k, v in msg["fields"].items()}
                held = [(str(rid), int(a)) for rid, a in msg["held"]]
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("heartbeat process: unreadable line from the worker: %.200r", line)
                continue
            with self.cond:
                self.fields, self.held = fields, held
                self.received = time.monotonic()
                self.urgent = self.urgent or bool(msg.get("now"))
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def serve(stdin: IO[str], stdout: IO[str]) -> int:
    """The child's loop (see the module docstring); returns its exit code."""
    try:
        first = json.loads(stdin.readline() or "null")
    except ValueError:
        first = None
    if not isinstance(first, dict):
        return 0  # the worker went away before saying anything
    settings = Settings.model_validate(first["settings"])
    worker_id = str(first["worker_id"])
    ttl_s, interval_s = float(first["ttl_s"]), float(first["interval_s"])
    stall_s = float(first["stall_s"])
    store = Store.from_settings(settings)
    latest = _Latest()
    threading.Thread(target=latest.follow, args=(stdin,), name="stdin", daemon=True).start()
    silent = False
    while True:
        with latest.cond:
            latest.cond.wait_for(lambda: latest.urgent or latest.closed, timeout=interval_s)
            if latest.closed:
                return 0
            latest.urgent = False
            fields, held, received = latest.fields, list(latest.held), latest.received
        if fields is None:
            continue
        quiet_s = time.monotonic() - received
        if quiet_s > stall_s:
            if not silent:
                log.warning(
                    "worker %s silent for %.0f s; no longer beating for it", worker_id, quiet_s
                )
            silent = True
            continue
        if silent:
            log.warning("worker %s speaks again; beating for it", worker_id)
            silent = False
        try:
            beat = store.heartbeat_fields(worker_id, fields, ttl_s, held)
        except CONNECTION_ERRORS as exc:
            log.warning("heartbeat failed: %s", exc)
            continue
        reply = {
            "joined": beat.joined,
            "drain": beat.drain,
            "now_ms": beat.now_ms,
            "lost": [list(p) for p in beat.lost],
            "aborts": [list(a) for a in beat.aborts],
        }
        try:
            stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
            stdout.flush()
        except (BrokenPipeError, OSError, ValueError):
            return 0  # the worker is gone


def main() -> int:
    """``python -m inferq.workers.pulse``: started by :class:`HeartbeatProcess` only."""
    setup_logging("WARNING")
    _ignore_stop_signals()
    return serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
