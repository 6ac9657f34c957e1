"""A live worker is not declared dead when its Python process stalls (issue 13, fault 5).

Repro of the issue: one sim worker, 4 requests with ``max_tokens=800, timeout=60``;
once they run, ``kill -STOP`` the worker for 4.5 s (longer than the heartbeat TTL of
3 s), then ``kill -CONT``. Before the heartbeat process
the worker was reaped, its requests ran again and again (35 dispatches, 0 succeeded).
Now the heartbeat process beats on for the stopped worker: every request succeeds on
its first attempt, and with a second worker present nothing runs twice either.

A worker stalled past the heartbeat process's patience is reaped all the same; then its
next beat lists the attempts that are no longer its own and it stops them
(``test_a_reaped_worker_stops_the_attempts_it_lost``).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferq import defaults
from inferq.models import WorkerState

from .conftest import Deployment, RedisServer, wait_for

STALL_S = 4.5
#: Sim time scale: 800 tokens take ~10 s on the 8B model's latency model.
TIME_SCALE = 0.5


@pytest.fixture
def deployment(redis_server: RedisServer, tmp_path: Path) -> Iterator[Deployment]:
    """The issue's timings, the defaults: a beat a second, a 3 s TTL, 5 s leases (the
    chaos suite's 0.2 s beats would also measure how a loaded CI host schedules a child
    process, not what a stall does)."""
    d = Deployment(
        redis_server.url,
        tmp_path / "logs",
        heartbeat_s=defaults.HEARTBEAT_INTERVAL_S,
        lease_s=defaults.LEASE_S,
    )
    yield d
    d.close()


def _four_running(d: Deployment) -> list[str]:
    """Submit the issue's 4 long requests and wait until they all run on w1."""
    items = [
        {"prompt": f"long answer {i}", "priority": "standard", "max_tokens": 800, "timeout": 60}
        for i in range(4)
    ]
    ids = [h.id for h in d.client.submit_many(items)]
    wait_for(
        lambda: all(r is not None and r.state.value == "running" for r in d.store.records(ids)),
        30,
        "4 requests running on w1",
        lambda: d.diagnose(ids),
    )
    return ids


def _stall_past_the_ttl(d: Deployment, pid: int) -> None:
    """SIGSTOP the worker process ``pid`` for STALL_S (past the 3 s TTL), then SIGCONT;
    while stopped, its heartbeat process keeps it ready in the fleet."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
        assert d.worker_state("w1") == WorkerState.READY.value, d.logs()
    finally:
        os.kill(pid, signal.SIGCONT)


def _dispatches(d: Deployment, ids: list[str]) -> Counter[str]:
    wanted = set(ids)
    return Counter(
        rid
        for e in d.events()
        if e.type == "dispatch"
        for rid in e.fields.get("ids", "").split(",")
        if rid in wanted
    )


@pytest.mark.parametrize("second_worker", [False, True], ids=["alone", "beside-another"])
def test_sigstop_longer_than_the_ttl_keeps_the_worker(
    deployment: Deployment, second_worker: bool
) -> None:
    d = deployment
    d.dispatcher()
    d.worker("w1", slots=8, time_scale=TIME_SCALE)
    ids = _four_running(d)
    if second_worker:
        d.worker("w2", slots=8, time_scale=TIME_SCALE)
    time.sleep(1.0)
    _stall_past_the_ttl(d, d.procs["w1"].pid)
    d.wait_final(ids, timeout=60)
    audit = d.audit(ids)
    audit.check_exactly_once(ids)
    retries = [e.fields for e in audit.events if e.type == "retry"]
    assert audit.attempts == Counter({1: 4}), (audit.attempts, retries[:6])
    dispatches = _dispatches(d, ids)
    assert all(dispatches[rid] == 1 for rid in ids), dispatches
    assert audit.stats.get("stale_results", 0) == 0, audit.stats
    assert "declared dead" not in d.log("w1"), d.log("w1")


def test_a_reaped_worker_stops_the_attempts_it_lost(deployment: Deployment) -> None:
    """A worker whose heartbeat process is stopped with it is reaped; after SIGCONT its
    next beat tells it which attempts are no longer its own, it stops them and runs the
    re-dispatched attempts: each request ends succeeded, on its second attempt at most,
    with no attempt of it left behind as a "never arrived" orphan."""
    d = deployment
    d.dispatcher()
    d.worker("w1", slots=8, time_scale=TIME_SCALE)
    ids = _four_running(d)
    pgid = os.getpgid(d.procs["w1"].pid)  # the worker and its heartbeat process
    os.killpg(pgid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: any(
                e.type == "worker_lost" and e.fields.get("worker") == "w1" for e in d.events()
            ),
            20,
            "w1 reaped",
            d.logs,
        )
        # Back in their queue, and dispatched again to w1 once it beats (the only worker).
    finally:
        os.killpg(pgid, signal.SIGCONT)
    d.wait_final(ids, timeout=60)
    audit = d.audit(ids)
    audit.check_exactly_once(ids)
    assert set(audit.attempts) <= {2}, audit.attempts
    log = d.log("w1", tail=20_000)
    assert "declared dead" in log, log
    assert "never reached the worker" not in log, log


def _children(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    return children


def test_a_killed_heartbeat_process_is_replaced(deployment: Deployment) -> None:
    """``kill -9`` the heartbeat process alone (an OOM kill, an operator's mistake): the
    worker fell back to beating from a thread of its own and never started another, so a
    stall of the worker's process later got it reaped and its requests run again (issue 13
    attack). A new heartbeat process is started; the stall then costs nothing."""
    d = deployment
    d.dispatcher()
    d.worker("w1", slots=8, time_scale=TIME_SCALE)
    pid = d.procs["w1"].pid
    [pulse] = _children(pid)
    os.kill(pulse, signal.SIGKILL)
    wait_for(
        lambda: [c for c in _children(pid) if c != pulse] != [],
        20,
        "a new heartbeat process",
        lambda: d.log("w1"),
    )
    ids = _four_running(d)
    time.sleep(1.0)
    _stall_past_the_ttl(d, pid)
    d.wait_final(ids, timeout=60)
    audit = d.audit(ids)
    audit.check_exactly_once(ids)
    assert audit.attempts == Counter({1: 4}), audit.attempts
    assert "declared dead" not in d.log("w1"), d.log("w1")
