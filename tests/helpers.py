"""Helpers of the tests that run against Redis: fake heartbeats, waiting (plain functions)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from inferq.models import InferenceRequest, WorkerInfo
from inferq.store import Store

from .builders import worker_info


def ready_worker(store: Store, worker_id: str = "w1", **kw: object) -> WorkerInfo:
    """Register a ready worker with one heartbeat (TTL 30 s)."""
    info = worker_info(worker_id, **kw)  # type: ignore[arg-type]
    store.heartbeat(info, ttl_s=30)
    return info


class KeepAlive:
    """Heartbeat some fake workers from a thread while a test runs (a context manager)."""

    def __init__(self, store: Store, infos: list[WorkerInfo], interval_s: float = 0.5) -> None:
        self.store, self.infos, self.interval_s = store, infos, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for info in self.infos:
                self.store.heartbeat(info, ttl_s=30)

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def queue_key(store: Store, req: InferenceRequest) -> str:
    return store.keys.queue(req.priority, req.route)


def wait_for(predicate: Callable[[], bool], timeout: float = 20, what: str = "condition") -> None:
    """Poll ``predicate`` every 50 ms; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
