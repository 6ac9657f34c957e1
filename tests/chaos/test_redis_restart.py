"""Restart Redis in the middle of a run: every daemon reconnects, nothing acknowledged is lost.

The server is the test's own (``appendonly yes``, ``appendfsync everysec``).
A graceful restart (``SHUTDOWN``, which fsyncs the append-only file) must lose
nothing: every submission whose call returned is present afterwards and
finishes. After a SIGKILL of Redis, up to about one second of acknowledged
writes may be lost (the fsync window); the slow test measures and reports it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import redis

from inferq.client import Client
from inferq.config import Settings
from inferq.errors import InferqError
from inferq.models import RequestState
from inferq.store import Store
from inferq.workers.worker import WorkerOptions, build_engine

from ..conftest import REDIS_URL
from .conftest import (
    MODEL,
    VRAM_MIB,
    Deployment,
    RedisServer,
    wait_for,
)


class TrickleSubmitter(threading.Thread):
    """Submits chunks of ``chunk`` requests every ``pause_s`` until stopped.

    ``acked`` holds the ids whose submit call returned; calls that raised (Redis
    down, reply lost) are counted in ``refused`` and not retried: a caller that saw
    an error does not count on the request.
    """

    def __init__(self, d: Deployment, chunk: int = 10, pause_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.d, self.chunk, self.pause_s = d, chunk, pause_s
        self.acked: list[str] = []
        self.acked_at: list[float] = []
        self.refused = 0
        self.done = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.done.is_set():
            items = [
                {"prompt": f"p{n + i}", "priority": "standard", "max_tokens": 16}
                for i in range(self.chunk)
            ]
            n += self.chunk
            try:
                handles = self.d.client.submit_many(items)
            except (redis.RedisError, InferqError):
                self.refused += 1
            else:
                self.acked += [h.id for h in handles]
                self.acked_at += [time.monotonic()] * len(handles)
            time.sleep(self.pause_s)


@dataclass
class RestartFigures:
    """What a restart run measured (seconds, counts)."""

    graceful: bool
    acked: int = 0
    refused_calls: int = 0
    outage_s: float = 0.0
    lost: list[str] = field(default_factory=list)
    lost_acked_within_s: float = 0.0
    rerun: int = 0
    workers_lost: int = 0
    reap_pauses: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0

    def summary(self) -> dict[str, object]:
        return {
            "restart": "SHUTDOWN (fsync)" if self.graceful else "SIGKILL",
            "acknowledged": self.acked,
            "refused_calls": self.refused_calls,
            "outage_s": round(self.outage_s, 2),
            "acknowledged_lost": len(self.lost),
            "lost_acknowledged_in_last_s": round(self.lost_acked_within_s, 2),
            "requests_run_again": self.rerun,
            "workers_reaped": self.workers_lost,
            "reap_pauses": self.reap_pauses,
            "retries_by_reason": dict(self.retries),
            "wall_s": round(self.wall_s, 1),
        }


def start_fleet(d: Deployment) -> None:
    """A dispatcher, and a scaler that keeps two local sim workers."""
    d.dispatcher()
    d.spawn(
        "scaler",
        "scaler",
        "--backend",
        "local",
        "--pool",
        f"{MODEL}=2:2",
        "--interval",
        "0.3",
        "--slots",
        "8",
        "--vram-mib",
        str(VRAM_MIB),
        "-o",
        "time_scale=0.25",
        "--log-dir",
        str(d.log_dir),
    )
    wait_for(lambda: len(ready_workers(d)) == 2, 60, "the scaler's two workers")


def ready_workers(d: Deployment) -> set[str]:
    return {w.id for w in d.store.workers()[0] if w.state.value == "ready"}


def run_restart(
    d: Deployment,
    server: RedisServer,
    *,
    graceful: bool,
    before_s: float,
    down_s: float,
    min_acked: int = 0,
) -> RestartFigures:
    """Submit for ``before_s``, stop Redis for ``down_s``, start it again, submit as long
    again and on until ``min_acked`` submissions were acknowledged in all (a loaded host
    submits less in the same time); wait for every acknowledged request that survived to
    finish."""
    figures = RestartFigures(graceful=graceful)
    started = time.monotonic()
    start_fleet(d)
    workers = ready_workers(d)
    submitter = TrickleSubmitter(d)
    submitter.start()
    time.sleep(before_s)
    stopped_at = time.monotonic()
    if graceful:
        server.shutdown()
    else:
        server.kill()
    time.sleep(down_s)
    server.start()
    figures.outage_s = time.monotonic() - stopped_at
    time.sleep(before_s)
    wait_for(
        lambda: len(submitter.acked) >= min_acked,
        120,
        f"{min_acked} submissions acknowledged",
        d.logs,
    )
    submitter.done.set()
    submitter.join()
    figures.acked, figures.refused_calls = len(submitter.acked), submitter.refused
    for name in ("dispatcher", "scaler"):
        assert d.alive(name), f"{name} exited:\n{d.log(name)}"
    records = dict(zip(submitter.acked, d.store.records(submitter.acked), strict=True))
    figures.lost = [rid for rid, rec in records.items() if rec is None]
    if figures.lost:
        acked_at = dict(zip(submitter.acked, submitter.acked_at, strict=True))
        figures.lost_acked_within_s = stopped_at - min(acked_at[rid] for rid in figures.lost)
    present = [rid for rid in submitter.acked if records[rid] is not None]
    d.wait_final(present)
    assert ready_workers(d) >= workers, "a worker did not come back after the restart"
    audit = d.audit(present)
    audit.check_exactly_once(present)
    figures.rerun = sum(n for a, n in audit.attempts.items() if a > 1)
    figures.workers_lost = len(audit.of_type("worker_lost"))
    figures.reap_pauses = len(audit.of_type("reap_paused"))
    figures.retries = Counter(e.fields["error"][:40] for e in audit.of_type("retry"))
    figures.wall_s = time.monotonic() - started
    return figures


def test_graceful_redis_restart_loses_no_acknowledged_submission(
    deployment: Deployment, redis_server: RedisServer
) -> None:
    figures = run_restart(
        deployment, redis_server, graceful=True, before_s=3.0, down_s=6.0, min_acked=500
    )
    print(figures.summary())
    assert not figures.lost, f"acknowledged and lost: {figures.lost[:5]}"
    assert figures.acked >= 500
    # The dispatcher paused reaping while live workers reconnected, and said so.
    assert figures.reap_pauses >= 1


@pytest.mark.slow
def test_redis_sigkill_loses_at_most_the_fsync_window(
    deployment: Deployment, redis_server: RedisServer
) -> None:
    figures = run_restart(deployment, redis_server, graceful=False, before_s=5.0, down_s=1.5)
    print(figures.summary())
    # appendfsync everysec: what was acknowledged in the last ~second may be gone.
    assert figures.lost_acked_within_s <= 2.0


def test_a_batch_whose_records_read_failed_is_handed_back(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Redis went away between start.lua and the read of the records (seen after a SIGKILL
    restart: 'Redis is loading the dataset'): the batch job fails, and the requests, marked
    running, must not stay held by the worker forever. The hand-back comes a lease after
    the start: 2 s, so that a loaded host cannot hand it back before the test has read it
    running (at 0.5 s, a stall of the test's thread could)."""
    settings = Settings.load(
        redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.2, lease_s=2.0
    )
    store = Store(redis_client, settings)
    opts = WorkerOptions(
        model=MODEL,
        vram_mib=VRAM_MIB,
        worker_id="w1",
        heartbeat_interval_s=0.2,
        server_options={"time_scale": "0"},
    )
    engine = build_engine(settings, opts, store=Store(redis_client, settings))
    engine.start()
    try:
        client = Client(settings=settings, connection=redis_client)
        handle = client.submit("x", priority="realtime", max_tokens=4)
        qkey = store.keys.tenant_queue("realtime", MODEL, "default")
        claimed = store.assign("w1", "b1", [(handle.id, qkey, 1.0)])

        real_start = engine.store.start

        def loading(worker_id: str, pairs: list[tuple[str, int]]) -> None:
            # start.lua ran; the read of the records (its pipeline's tail, or the second
            # call after a NOSCRIPT) failed
            real_start(worker_id, pairs)
            raise redis.BusyLoadingError("Redis is loading the dataset in memory")

        engine.store.start_and_read = loading  # type: ignore[method-assign,assignment]
        with pytest.raises(redis.BusyLoadingError):
            engine.accept("b1", claimed)
        assert store.record(handle.id).state is RequestState.RUNNING
        wait_for(lambda: store.record(handle.id).state is RequestState.QUEUED, 10, "the hand-back")
    finally:
        engine.store = store
        engine.stop()
