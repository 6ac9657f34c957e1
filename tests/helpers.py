"""Helpers of the tests that run against Redis: fake heartbeats, waiting, and how late the
host ran (:class:`LagProbe`, :func:`paused_within`) for tests that bound a reaction time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from inferq.models import Event, InferenceRequest, WorkerInfo
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


class LagProbe(threading.Thread):
    """How late this host wakes a sleeping thread: the stand-in for the daemons' own steps,
    which wait on the same CPUs (as ``inferq demo``'s keep-up timer).

    Every ``period_s`` it sleeps and records (epoch s, seconds it woke late).
    :meth:`max_lag` gives the worst lateness within a window, so a bound on a daemon's
    reaction time can be checked as "the bound plus what the host itself lost", and a
    starved CI host fails no test while a slow daemon on an idle one still does.
    """

    def __init__(self, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            before = time.monotonic()
            time.sleep(self.period_s)
            late = time.monotonic() - before - self.period_s
            self.samples.append((time.time(), max(0.0, late)))

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def max_lag(self, start: float, end: float) -> float:
        """The longest lateness of a wake-up between ``start`` and ``end`` (epoch s), s."""
        return max((late for at, late in self.samples if start <= at <= end), default=0.0)


class Progress:
    """Fails a long run that stopped moving, not one that is slow: a loaded CI host may
    take twice as long, and a bound on the whole run's wall time failed it (two CI runs at
    once on 2 cores). :meth:`check` raises when the count it is given has not grown for
    ``stall_s`` seconds.

    Args:
        stall_s: the longest a run may go without progress, seconds.
        what: what the count counts, for the error.
    """

    def __init__(self, stall_s: float, what: str) -> None:
        self.stall_s = stall_s
        self.what = what
        self._count = -1
        self._since = time.monotonic()

    def check(self, count: int, logs: Callable[[], str] = lambda: "") -> None:
        """Note ``count``; AssertionError (with ``logs()``) when it has not grown for
        ``stall_s`` seconds."""
        now = time.monotonic()
        if count > self._count:
            self._count, self._since = count, now
        elif now - self._since > self.stall_s:
            raise AssertionError(
                f"no progress for {now - self._since:.0f} s ({self.what}: {count}):\n{logs()}"
            )


def paused_within(start: float, end: float, pauses: Sequence[Event]) -> float:
    """How much of the interval ``start``..``end`` (epoch s) the ``reap_paused`` events
    cover, s: each covers its stall (``stalled_ms`` before it) and its grace
    (``grace_ms`` after it); the pauses of all dispatchers add up."""
    total = 0.0
    for p in pauses:
        since = p.at - int(p.fields["stalled_ms"]) / 1000
        until = p.at + int(p.fields["grace_ms"]) / 1000
        total += max(0.0, min(end, until) - max(start, since))
    return total
