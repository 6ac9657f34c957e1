"""Is the worker's model server healthy? Probes after a failure; ``unhealthy`` until it passes.

After any retryable failure (:mod:`inferq.workers.failures`: infrastructure, server,
truncated) the worker probes its model server (:meth:`ModelServer.probe`: for the
``openai`` backend its health endpoint, then a 1-token request). A failed probe turns a
``ready`` worker ``unhealthy`` in its next heartbeat (published at once): ``assign.lua``
and routing give work only to ``ready`` workers, so the dispatcher sends it nothing and
the scaler counts it as no capacity. It keeps probing every ``HEALTH_PROBE_INTERVAL_S``
(or the server's ``Retry-After``, when longer, up to ``RETRY_AFTER_CAP_S``) and returns
to ``ready`` by itself when a probe passes. Each transition is logged once at WARNING;
nothing is logged per probe.

A server that refuses every request (the same 400 for a run of requests from several
tenants, :mod:`inferq.workers.rejections`) is taken out by :meth:`HealthMonitor.broken`:
``unhealthy`` at once, with the refusal as its ``health_reason``, and its probes are
strict (:meth:`ModelServer.probe`: the 1-token request must be served, not refused)
until one passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from inferq import defaults
from inferq.models import WorkerState
from inferq.workers import failures
from inferq.workers.servers import ModelServer, ServerError

log = logging.getLogger(__name__)


class HealthMonitor:
    """Probes a model server from the engine's event loop and flips ready <-> unhealthy.

    Args:
        server: the model server to probe.
        worker_id: for the log lines.
        get_state / set_state: read and publish the worker's state (``set_state`` also
            writes the heartbeat; it may block briefly on Redis).
        interval_s: pause between two probes while unhealthy, seconds.
    """

    def __init__(
        self,
        server: ModelServer,
        *,
        worker_id: str,
        get_state: Callable[[], WorkerState],
        set_state: Callable[[WorkerState], None],
        interval_s: float = defaults.HEALTH_PROBE_INTERVAL_S,
    ) -> None:
        self.server = server
        self.worker_id = worker_id
        self._get_state = get_state
        self._set_state = set_state
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._judged: asyncio.Event | None = None  # set once the probe loop's first verdict is out
        self.transitions = 0
        #: why the server is held unhealthy (the last failed probe, or the refusal), or ""
        self.reason = ""
        #: True while the server is held broken for refusing every request: its probes
        #: are strict and a refusal on it is not the caller's (the worker requeues it)
        self.refusing = False

    @property
    def probing(self) -> bool:
        """True while a probe loop runs."""
        return self._task is not None and not self._task.done()

    def suspect(self, down: ServerError | None = None) -> None:
        """A request failed in a way the server may be to blame for: start probing
        (once; a probe loop already running covers it). ``down``: the failure already
        found the server not answering at all (:attr:`ServerError.server_down`), so the
        worker turns ``unhealthy`` before its first probe. Call from the event loop."""
        if not self.probing:
            self._judged = judged = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._probe_until_healthy(down, judged)
            )

    def broken(self, refusal: ServerError, reason: str) -> None:
        """The server refuses every request (``refusal``, the last of the run): turn
        ``unhealthy`` now, with ``reason``, and probe strictly until it serves a probe
        request. Call from the event loop."""
        self.refusing = True
        self.reason = reason
        if self.probing:  # a loop already running probes strictly from its next round
            return
        self._judged = judged = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._probe_until_healthy(refusal, judged)
        )

    async def judged(self, timeout_s: float = defaults.HEALTH_VERDICT_WAIT_S) -> None:
        """Wait (at most ``timeout_s``) until the running probe loop's first verdict is
        published: ``unhealthy`` in the heartbeat, or the server found healthy.

        A failed request waits for it before it goes back to its queue: requeueing frees
        its slot, and while the worker still says ``ready`` the dispatcher refilled the
        slot on the failing server (a 500-ing server got 5-8 requests for 4 slots, issue
        13 attack). Returns at once when no probe loop runs or its verdict is out."""
        judged = self._judged
        if judged is None or judged.is_set() or not self.probing:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(judged.wait(), timeout_s)

    async def _probe_until_healthy(
        self, down: ServerError | None = None, judged: asyncio.Event | None = None
    ) -> None:
        try:
            await self._probe_loop(down, judged or asyncio.Event())
        finally:
            if judged is not None:
                judged.set()

    async def _probe_loop(self, down: ServerError | None, judged: asyncio.Event) -> None:
        while True:
            error: ServerError | None = down
            down = None
            if error is None:
                try:
                    error = await self.server.probe(strict=self.refusing)
                except Exception as exc:  # a probe that raises says the server is not healthy
                    error = ServerError(f"probe raised {exc!r}", retryable=True)
            state = self._get_state()
            if error is None:
                self.refusing = False
                self.reason = ""
                if state is WorkerState.UNHEALTHY:
                    self.transitions += 1
                    log.warning("worker %s: model server healthy again; ready", self.worker_id)
                    await asyncio.to_thread(self._set_state, WorkerState.READY)
                return
            if not self.refusing:
                self.reason = str(error)[:500]
            if state is WorkerState.READY:
                self.transitions += 1
                log.warning(
                    "worker %s: model server unhealthy (%s); taking no work until it recovers",
                    self.worker_id,
                    self.reason,
                )
                await asyncio.to_thread(self._set_state, WorkerState.UNHEALTHY)
            elif state is not WorkerState.UNHEALTHY:
                return  # draining or starting: the drain or the load decides
            judged.set()
            wait_s = failures.honoured_retry_after_s(error.retry_after_s or 0.0)
            await asyncio.sleep(max(self.interval_s, wait_s))

    async def close(self) -> None:
        """Stop probing (at shutdown)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
