"""Beyond one Redis: a Sentinel failover mid-run, and the Redis operations a request costs.

The failover test starts one primary, one replica and one sentinel (real redis-server
processes on free ports, in a temp dir), runs a client, an ``inferq dispatcher`` and an
``inferq worker`` against ``redis+sentinel://`` and, in the middle of a steady stream
of submissions, kills the primary with SIGKILL or asks the sentinel to fail over (the
old primary then lives on, demoted, answering writes with READONLY); the daemons must
follow the promoted replica. What the asynchronous replication lost (submissions acknowledged by
the old primary that never reached the replica) is measured and reported, not assumed.

The sizing test counts Redis commands per request through dispatcher and worker on a
server of its own (MONITOR tells commands sent by clients from those run inside Lua),
the figure behind docs/architecture.md's "Beyond one Redis" arithmetic.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.errors import InferqError, RequestNotFound
from inferq.models import FINAL_STATES, RequestState
from inferq.store import Store, connect

from ..fakes.servers import (
    Server,
    inferq_process,
    needs_redis_server,
    sim_worker,
    start_server,
    stop_process,
    wait_for,
    wait_ready,
)

pytestmark = needs_redis_server
SERVICE = "mymaster"


@dataclass
class Trio:
    primary: Server
    replica: Server
    sentinel: Server

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}"

    def primary_port(self) -> int:
        _, port = self.sentinel.client().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Trio]:
    primary = start_server(tmp_path, "primary")
    replica = start_server(tmp_path, "replica", [f"replicaof 127.0.0.1 {primary.port}"])
    sentinel = start_server(
        tmp_path,
        "sentinel",
        [
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1",
            f"sentinel down-after-milliseconds {SERVICE} 1000",
            f"sentinel failover-timeout {SERVICE} 5000",
            f"sentinel parallel-syncs {SERVICE} 1",
        ],
        sentinel=True,
    )
    servers = Trio(primary, replica, sentinel)
    try:
        wait_for(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            what="replication link",
        )
        wait_for(
            lambda: bool(sentinel.client().sentinel_slaves(SERVICE)),
            what="the sentinel to see the replica",
        )
        yield servers
    finally:
        for server in (sentinel, replica, primary):
            server.kill()


@dataclass
class Submitter:
    """Submits one request every ``period_s`` from a thread, recording what was acknowledged."""

    client: Client
    period_s: float = 0.05
    acked: list[tuple[str, float]] = field(default_factory=list)  # (id, monotonic time)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self.stop.wait(self.period_s):
            try:
                handle = self.client.submit(f"request {i}", max_tokens=8, tenant=f"t{i % 3}")
                self.acked.append((handle.id, time.monotonic()))
            except (InferqError, redis.RedisError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            i += 1


def final_states(client: Client, ids: list[str]) -> dict[str, str | None]:
    """State of each id; None when the new primary has no such request."""
    out: dict[str, str | None] = {}
    for rid in ids:
        try:
            out[rid] = client.status(rid).state.value
        except RequestNotFound:
            out[rid] = None
    return out


@pytest.mark.parametrize("how", ["sigkill", "sentinel failover"])
def test_daemons_follow_the_new_primary_after_a_failover(
    how: str, trio: Trio, record_property: Callable[[str, object], None]
) -> None:
    """Loss is measured, not forbidden: it must fall inside the window the failover opens.

    SIGKILL: what the primary acknowledged but had not yet shipped to the replica.
    SENTINEL FAILOVER: also what the old primary accepts between the replica's promotion
    and the sentinel's announcement of it (a forced failover does not pause writes); the
    old primary discards it when it resyncs from the new one. Without inferq's failover
    watch its clients would go on writing there until the sentinel demotes it (~10 s).
    """
    namespace = f"t{uuid.uuid4().hex[:8]}"
    settings = Settings.load(redis_url=trio.url, namespace=namespace, heartbeat_interval_s=0.5)
    env_args = ("--heartbeat-interval", "0.5")
    worker = sim_worker(trio.url, namespace, "w1", *env_args, "-o", "time_scale=0.02")
    dispatcher = inferq_process(trio.url, namespace, "dispatcher", "--tick", "0.05")
    client = Client(settings=settings)
    submitter = Submitter(client)
    thread = threading.Thread(target=submitter.run, daemon=True)
    outputs: list[str] = []
    try:
        wait_ready(client.store.redis, namespace, "w1", worker)
        thread.start()
        wait_for(lambda: len(submitter.acked) >= 40, what="40 submissions before the failover")
        old_port = trio.primary.port
        started = time.monotonic()
        if how == "sigkill":
            trio.primary.kill()
        else:
            trio.sentinel.client().execute_command("SENTINEL", "FAILOVER", SERVICE)
        wait_for(lambda: trio.primary_port() != old_port, timeout=30, what="a promotion")
        promoted = time.monotonic()
        if how != "sigkill":  # the old primary refuses writes only once it is a replica
            wait_for(
                lambda: trio.primary.client().info("replication")["role"] == "slave",
                timeout=30,
                what="the old primary's demotion",
            )
        settled = time.monotonic()
        wait_for(
            lambda: sum(t > settled for _, t in submitter.acked) >= 40,
            timeout=30,
            what="40 submissions on the new primary",
        )
        submitter.stop.set()
        thread.join(timeout=30)
        ids = [rid for rid, _ in submitter.acked]
        wait_for(
            lambda: all(s is None or s in FINAL_STATES for s in final_states(client, ids).values()),
            timeout=30,
            what="every surviving request to finish",
        )
        states = final_states(client, ids)
        assert worker.poll() is None and dispatcher.poll() is None  # both rode it out
    finally:
        submitter.stop.set()
        outputs = [stop_process(worker), stop_process(dispatcher)]
        client.close()
    acked_at = dict(submitter.acked)
    lost = [rid for rid, s in states.items() if s is None]
    after = [rid for rid, t in submitter.acked if t > settled]
    counts = collections.Counter(states.values())
    window = [acked_at[rid] - started for rid in lost]
    for name, value in (
        ("promoted_after_s", round(promoted - started, 2)),
        ("writable_old_primary_s", round(settled - promoted, 2)),
        ("acknowledged", len(ids)),
        ("lost", len(lost)),
        ("submit_errors", len(submitter.errors)),
    ):
        record_property(name, value)
    print(
        f"\n{how}: promoted after {promoted - started:.1f} s, old primary writable "
        f"{settled - promoted:.1f} s more; {len(ids)} acknowledged, {len(lost)} lost "
        f"(acknowledged {min(window, default=0):+.2f}..{max(window, default=0):+.2f} s "
        f"from the failover), {len(submitter.errors)} submit errors, {dict(counts)}"
    )
    # The daemons followed the new primary: everything submitted there ran to success.
    assert all(states[rid] == RequestState.SUCCEEDED.value for rid in after), outputs
    # Every request the new primary knows has exactly one final result; what is lost was
    # acknowledged inside the failover's window (replication lag before it, the old
    # primary's writable time after it), never earlier.
    assert set(counts) <= {RequestState.SUCCEEDED.value, None}, (counts, outputs)
    # inferq's pools leave the old primary as soon as a sentinel announces the switch
    # (connection.watch_failovers), not when the sentinels get round to demoting it.
    assert all(-1.0 < w <= promoted - started + 1.0 for w in window), window
    assert "Traceback" not in outputs[1], outputs[1]
    assert (worker.returncode, dispatcher.returncode) == (0, 0), outputs  # clean drain and stop


# --- sizing: Redis commands per request ------------------------------------------------


@dataclass
class Monitor:
    """Counts commands through MONITOR: sent by clients, or run inside a Lua script."""

    server: Server
    top: collections.Counter[str] = field(default_factory=collections.Counter)
    lua: collections.Counter[str] = field(default_factory=collections.Counter)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            with self.server.client().monitor() as monitor:
                for cmd in monitor.listen():
                    name = str(cmd["command"]).split(" ", 1)[0].upper()
                    (self.lua if cmd.get("client_type") == "lua" else self.top)[name] += 1
                    if self._stop.is_set():
                        return
        except redis.ConnectionError:
            return  # the server was stopped

    def snapshot(self) -> tuple[int, int]:
        return sum(self.top.values()), sum(self.lua.values())


def test_redis_commands_per_request(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    server = start_server(tmp_path, "sizing")
    url = f"redis://127.0.0.1:{server.port}/0"
    namespace = "sizing"
    settings = Settings.load(redis_url=url, namespace=namespace)  # 1 s heartbeats
    monitor = Monitor(server)
    threading.Thread(target=monitor.run, daemon=True).start()
    worker = sim_worker(url, namespace, "w1", "--slots", "32", "--heartbeat-interval", "1")
    dispatcher = Dispatcher(Store(connect(url), settings))
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    n = 200
    figures: dict[str, Any] = {}
    try:
        wait_ready(server.client(), namespace, "w1", worker)
        thread.start()
        time.sleep(1.0)
        idle_s, (t0, l0) = 3.0, monitor.snapshot()
        time.sleep(idle_s)
        t1, l1 = monitor.snapshot()
        figures["idle_per_s"] = ((t1 - t0) / idle_s, (l1 - l0) / idle_s)
        with Client(settings=settings) as client:
            for mode in ("one by one", "submit_many"):
                start, (a_top, a_lua) = time.monotonic(), monitor.snapshot()
                before = monitor.top.copy()
                if mode == "one by one":
                    handles = [client.submit(f"hello {i}", max_tokens=16) for i in range(n)]
                else:
                    handles = client.submit_many({"prompt": f"hi {i}"} for i in range(n))
                results = [h.result(timeout=60) for h in handles]
                elapsed = time.monotonic() - start
                b_top, b_lua = monitor.snapshot()
                assert all(r.status == "succeeded" for r in results)
                idle_top, idle_lua = figures["idle_per_s"]
                figures[mode] = (
                    (b_top - a_top - idle_top * elapsed) / n,
                    (b_lua - a_lua - idle_lua * elapsed) / n,
                )
                top = (monitor.top - before).most_common(8)
                print(f"\n{mode}: {elapsed:.1f} s; client commands {top}")
    finally:
        dispatcher.stop()
        thread.join(timeout=5)
        stop_process(worker)
        monitor._stop.set()
        server.kill()
    for name, (top, lua) in figures.items():
        unit = "per second, idle" if name == "idle_per_s" else "per request"
        print(f"\n{name}: {top:.1f} client commands + {lua:.1f} inside scripts {unit}")
        record_property(f"redis_commands_{name.replace(' ', '_')}", (round(top, 1), round(lua, 1)))
    # Regression guard on the documented arithmetic (docs/architecture.md, "Beyond one Redis"):
    # measured 12-24 client commands and ~45 inside scripts per request; the client share
    # grows with the backlog each dispatcher step re-reads, hence the margin.
    for mode in ("one by one", "submit_many"):
        client_commands, in_scripts = figures[mode]
        assert 0 < client_commands < 50 and 0 < in_scripts < 80, figures
