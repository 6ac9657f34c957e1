"""Any tick and any blocking wait works with any socket timeout a URL carries
(issue 13, fault 6).

Before: ``inferq dispatcher --tick 8`` blocked in 8 s BLPOPs on redis-py's 5 s socket
timeout, so every idle wait ended in a TimeoutError and the error backoff: a 4-token
request on an idle fleet took 41.8 s and a killed worker's request was still running
after 75 s. Now blocking commands block at most half the socket timeout and loop
(``store.connection.block_limit_s``), and expiry and recovery run at least every
``RECOVERY_EVERY_MAX_S`` (0.5 s) whatever the tick.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferq import defaults
from inferq.errors import ResultTimeout

from ..helpers import paused_within
from .conftest import HEARTBEAT_S, LEASE_S, Deployment, RedisServer, wait_for

#: A killed worker's requests are back in their queue within this long of the kill, s:
#: the reaper's 3 heartbeats, one recovery pass, and a loaded CI host's slack; plus what
#: the host itself lost meanwhile (``Deployment.probe``) and the dispatcher's recorded reap
#: pauses (as in test_kill).
REQUEUE_BOUND_S = 3 * HEARTBEAT_S + defaults.RECOVERY_EVERY_MAX_S + LEASE_S


@pytest.fixture(
    params=["", "?socket_timeout=0.5", "?socket_timeout=0.1"],
    ids=["default-socket", "socket-0.5s", "socket-0.1s"],
)
def deployment(
    request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Deployment]:
    d = Deployment(redis_server.url + request.param, tmp_path / "logs")
    yield d
    d.close()


def test_tick_8_serves_promptly_and_recovers_a_killed_worker_in_time(d8: Deployment) -> None:
    d = d8
    d.worker("w1", time_scale=0.2)
    started = time.monotonic()
    result = d.client.submit("hi", priority="realtime", max_tokens=4, timeout=30).result(timeout=30)
    served_s = time.monotonic() - started
    assert result.status == "succeeded", (result.error, d.logs())
    assert served_s < 3.0, f"a 4-token request on an idle fleet took {served_s:.1f} s"
    # A long request on w1; kill w1 while it runs: back in its queue in time. Long = ~19 s
    # of decode at time_scale 0.2 (20,000 tokens of llama-3.1-8b): it must outlast the
    # wait below and a loaded host's lag before the kill (4,000 tokens, 3.7 s, finished
    # first on a busy CI host, and the requeue waited for a request that had succeeded).
    handle = d.client.submit("long", priority="standard", max_tokens=20_000, timeout=60)
    wait_for(
        lambda: (r := d.store.record(handle.id)) is not None and r.state.value == "running",
        20,
        "the long request running",
        d.logs,
    )
    # A client's wait longer than the socket timeout ends on its own timeout, not redis-py's
    # (a request no worker serves: it stays queued, whatever the machine's speed).
    unserved = d.client.submit("wait", model="llama-2-13b", max_tokens=4, timeout=60)
    began = time.monotonic()
    with pytest.raises(ResultTimeout):
        d.client.result(unserved.id, timeout=2.0)
    assert 2.0 <= time.monotonic() - began < 10.0
    assert d.store.record(handle.id).state.value == "running", "finished before the kill"
    killed_at = d.store.now()
    d.kill("w1")
    wait_for(
        lambda: d.store.record(handle.id).state.value == "queued",
        15,
        "the killed worker's request requeued",
        d.logs,
    )
    events = d.events()
    lost = [e for e in events if e.type == "worker_lost" and e.fields.get("worker") == "w1"]
    assert lost, d.logs()
    requeue_s = lost[0].at - killed_at
    lag_s = d.probe.max_lag(killed_at, lost[0].at)
    paused_s = paused_within(killed_at, lost[0].at, [e for e in events if e.type == "reap_paused"])
    assert requeue_s < REQUEUE_BOUND_S + lag_s + paused_s, (
        f"requeued {requeue_s:.2f} s after the kill "
        f"(host lag {lag_s:.2f} s, paused {paused_s:.2f} s)"
    )
    assert "redis unavailable" not in d.log("dispatcher"), d.log("dispatcher")


@pytest.fixture
def d8(deployment: Deployment) -> Deployment:
    deployment.dispatcher(tick_s=8.0)
    deployment.wait_dispatching()
    return deployment
