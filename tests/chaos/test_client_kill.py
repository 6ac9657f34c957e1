"""Drop every client connection (``CLIENT KILL TYPE normal``) in a loop under load.

Every component (dispatcher, scaler, workers, the submitting client) must
reconnect on its own, and every acknowledged request must finish exactly once.
A reply lost with its connection makes redis-py send the call again: scripts
are fenced, so a repeated ``complete`` is counted in ``stats.stale_results`` and a
repeated claim or start leaves requests the worker hands back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from .conftest import Deployment, RedisServer, wait_for
from .test_redis_restart import TrickleSubmitter, ready_workers, start_fleet


class Killer(threading.Thread):
    """``CLIENT KILL TYPE normal`` every ``every_s`` until stopped; counts what it killed."""

    def __init__(self, server: RedisServer, every_s: float) -> None:
        super().__init__(daemon=True)
        self.admin = server.client()
        self.every_s = every_s
        self.rounds = 0
        self.killed = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            self.killed += int(self.admin.client_kill_filter(_type="normal"))
            self.rounds += 1


@dataclass
class KillClientsFigures:
    """What a connection-killing run did (seconds, counts)."""

    acked: int = 0
    refused_calls: int = 0
    kill_rounds: int = 0
    connections_killed: int = 0
    stale_results: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    attempts: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def summary(self) -> dict[str, object]:
        return {
            "acknowledged": self.acked,
            "refused_calls": self.refused_calls,
            "kill_rounds": self.kill_rounds,
            "connections_killed": self.connections_killed,
            "stale_results": self.stale_results,
            "retries_by_reason": dict(self.retries),
            "attempts": dict(sorted(self.attempts.items())),
            "wall_s": round(self.wall_s, 1),
        }


def run_client_kills(
    d: Deployment,
    server: RedisServer,
    *,
    duration_s: float,
    every_s: float,
    min_acked: int = 0,
    min_rounds: int = 0,
) -> KillClientsFigures:
    """Submit while killing every connection every ``every_s`` for ``duration_s`` and on
    until ``min_acked`` submissions were acknowledged and ``min_rounds`` kill rounds ran (a
    loaded host does less in the same time); wait for every acknowledged request, check
    exactly-once and that every daemon is still there."""
    figures = KillClientsFigures()
    started = time.monotonic()
    start_fleet(d)
    workers = ready_workers(d)
    submitter = TrickleSubmitter(d)
    killer = Killer(server, every_s)
    submitter.start()
    killer.start()
    time.sleep(duration_s)
    wait_for(
        lambda: len(submitter.acked) >= min_acked and killer.rounds >= min_rounds,
        120,
        f"{min_acked} submissions acknowledged and {min_rounds} kill rounds",
        d.logs,
    )
    killer.done.set()
    submitter.done.set()
    killer.join()
    submitter.join()
    ids = submitter.acked
    d.wait_final(ids)
    for name in ("dispatcher", "scaler"):
        assert d.alive(name), f"{name} exited:\n{d.log(name)}"
    assert ready_workers(d) >= workers, "a worker did not reconnect:\n" + d.logs()
    audit = d.audit(ids)
    audit.check_exactly_once(ids)
    figures.acked, figures.refused_calls = len(ids), submitter.refused
    figures.kill_rounds, figures.connections_killed = killer.rounds, killer.killed
    figures.stale_results = audit.stats.get("stale_results", 0)
    figures.retries = Counter(e.fields["error"][:40] for e in audit.of_type("retry"))
    figures.attempts = dict(audit.attempts)
    figures.wall_s = time.monotonic() - started
    return figures


def test_dropped_connections_under_load(deployment: Deployment, redis_server: RedisServer) -> None:
    figures = run_client_kills(
        deployment, redis_server, duration_s=8.0, every_s=0.25, min_acked=500, min_rounds=20
    )
    print(figures.summary())
    assert figures.acked >= 500
    assert figures.kill_rounds >= 20 and figures.connections_killed >= 5 * figures.kill_rounds


@pytest.mark.slow
def test_dropped_connections_long_run(deployment: Deployment, redis_server: RedisServer) -> None:
    figures = run_client_kills(deployment, redis_server, duration_s=60.0, every_s=0.2)
    print(figures.summary())
    assert figures.acked >= 5000
