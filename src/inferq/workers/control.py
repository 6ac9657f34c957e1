"""The worker's control channel: commands the dispatcher (or a cancel) sends a running worker.

A thread blocks on ``ctl:<worker>`` (:meth:`inferq.store.Store.take_control`, at most
``defaults.CONTROL_BLOCK_S`` per read, so stopping it never waits longer) and hands
each command to the engine: today the one command is *abort a running request*
(:meth:`inferq.workers.runtime.Engine.abort`), with the action ``requeue`` (a
preemption), ``cancel`` or ``expire``. Commands are written by ``abort.lua``, which
fences them by attempt, so a command for an attempt this worker no longer runs is a
no-op. A Redis outage or a bad command is logged; the thread never dies of either.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from inferq import defaults
from inferq.store import CONNECTION_ERRORS, Abort, Store

log = logging.getLogger(__name__)


class ControlReader:
    """Reads one worker's control channel in a daemon thread.

    Args:
        store: the deployment's store.
        worker_id: whose channel (``ctl:<worker_id>``).
        on_abort: called with each abort command, in the reader's thread.
        block_s: longest block of one read, seconds.
    """

    def __init__(
        self,
        store: Store,
        worker_id: str,
        on_abort: Callable[[Abort], object],
        *,
        block_s: float = defaults.CONTROL_BLOCK_S,
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.on_abort = on_abort
        self.block_s = block_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control", daemon=True)

    def start(self) -> None:
        """Start reading."""
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop after the current read (at most ``block_s``) and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.block_s + 1 if timeout_s is None else timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                commands = self.store.take_control(self.worker_id, self.block_s)
            except CONNECTION_ERRORS as exc:
                log.warning("control channel unreadable (%s); retrying", exc)
                self._stop.wait(self.block_s)
                continue
            except Exception:  # a broken reply must not stop the channel
                log.exception("control channel read failed")
                self._stop.wait(self.block_s)
                continue
            for command in commands:
                try:
                    self.on_abort(command)
                except Exception:
                    log.exception("abort of %s failed", command.request_id)
