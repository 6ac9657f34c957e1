"""Helpers of the tests that run against Redis: fake heartbeats, waiting (plain functions)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from inferq.models import InferenceRequest, WorkerInfo
from inferq.store import Store
from inferq.store.keys import count_field_queue

from .builders import worker_info


def ready_worker(store: Store, worker_id: str = "w1", **kw: object) -> WorkerInfo:
    """Register a ready worker with one heartbeat (TTL 30 s)."""
    info = worker_info(worker_id, **kw)  # type: ignore[arg-type]
    store.heartbeat(info, ttl_s=30)
    return info


class KeepAlive:
    """Heartbeat some fake workers from a thread while a test runs (a context manager).

    Entering beats once before it returns: a worker whose last beat is older than the
    heartbeat TTL (a slow set-up on a loaded host) would be reaped by a dispatcher that
    starts at once."""

    def __init__(self, store: Store, infos: list[WorkerInfo], interval_s: float = 0.5) -> None:
        self.store, self.infos, self.interval_s = store, infos, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _beat(self) -> None:
        for info in self.infos:
            self.store.heartbeat(info, ttl_s=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def __enter__(self) -> KeepAlive:
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def queue_key(store: Store, req: InferenceRequest) -> str:
    return store.keys.tenant_queue(req.priority, req.route, req.tenant)


def plant_queued(
    store: Store, cls: str, route: str, tenant: str, rid: str, score_ms: float
) -> None:
    """Put ``rid`` in queue (cls, route) by hand, as ``includes/queue.lua`` would: its
    tenant's sub-queue, the tenant index, the queue's depth counter and the queue names."""
    k = store.keys
    if store.redis.zadd(k.tenant_queue(cls, route, tenant), {rid: score_ms}):
        store.redis.hincrby(k.counts, count_field_queue(cls, route), 1)
    store.redis.zadd(k.tenant_index(cls, route), {tenant: score_ms}, lt=True)
    store.redis.sadd(k.queues, f"{cls}|{route}")


def queued_ids(store: Store, cls: str, route: str) -> list[str]:
    """The ids of queue (cls, route), oldest first (merged from its tenants' sub-queues);
    asserts the depth counter and the tenant index agree with them."""
    k = store.keys
    tenants = store.redis.zrange(k.tenant_index(cls, route), 0, -1, withscores=True)
    rows: list[tuple[float, str]] = []
    for tenant, head in tenants:
        part = store.redis.zrange(k.tenant_queue(cls, route, tenant), 0, -1, withscores=True)
        assert part and part[0][1] == head, (tenant, head, part[:1])
        rows += [(score, rid) for rid, score in part]
    depth = int(store.redis.hget(k.counts, count_field_queue(cls, route)) or 0)
    assert depth == len(rows), (depth, len(rows))
    return [rid for _, rid in sorted(rows)]


def wait_for(predicate: Callable[[], bool], timeout: float = 20, what: str = "condition") -> None:
    """Poll ``predicate`` every 50 ms; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
