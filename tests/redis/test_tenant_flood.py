"""Tenant floods on the real stack (issue 12, fault 2): dispatcher + a sim worker process.

One worker with 4 slots; tenant ``bulk`` queues 300 standard requests; later tenant
``quiet`` submits 3. VTC's promise: a tenant that becomes active gets one of the first
two slots of its class that free up after it arrives, whatever the other tenant's
backlog, and whether that backlog is still young or already past the class's aging
bound (aging protects classes from each other, not one tenant from another). The
assertions count dispatches, never seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from inferq.client import Client
from inferq.config import Settings
from inferq.store import Store

from ..conftest import REDIS_URL
from ..helpers import wait_for
from .fleet import Fleet

MODEL = "llama-3.1-8b"


@pytest.fixture
def flood_settings(namespace: str) -> Settings:
    return Settings.load(
        redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.2, lease_s=2.0
    )


@pytest.fixture
def flood_fleet(flood_settings: Settings, redis_client) -> Iterator[Fleet]:  # type: ignore[no-untyped-def]
    f = Fleet(flood_settings, Store(redis_client, flood_settings))
    yield f
    f.close()


def dispatch_times(store: Store, ids: list[str]) -> dict[str, int]:
    """Request id -> dispatched_ms, for the ids dispatched so far."""
    pipe = store.redis.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(store.keys.req(rid), "dispatched_ms")
    return {rid: int(ms) for rid, ms in zip(ids, pipe.execute(), strict=True) if ms}


#: Backlogged tenants ahead of the new one: more than a snapshot reads from each end.
CROWD_TENANTS = 40


@pytest.mark.parametrize(
    "delay_s",
    [
        pytest.param(2.0, id="young-flood"),
        # standard's aging bound is 5 s: every bulk request is overdue when quiet arrives
        pytest.param(6.5, id="flood-past-aging-bound"),
    ],
)
def test_new_tenant_gets_one_of_the_first_two_slots(
    flood_fleet: Fleet, flood_settings: Settings, redis_client, delay_s: float
) -> None:  # type: ignore[no-untyped-def]
    store = flood_fleet.store
    client = Client(settings=flood_settings, connection=redis_client)
    flood_fleet.worker("w1", time_scale=0.2, slots=4)
    bulk = [
        h.id
        for h in client.submit_many(
            {"prompt": f"b{i}", "priority": "standard", "tenant": "bulk", "max_tokens": 640}
            for i in range(300)
        )
    ]
    time.sleep(delay_s)
    quiet = [
        h.id
        for h in client.submit_many(
            {"prompt": f"q{i}", "priority": "standard", "tenant": "quiet", "max_tokens": 64}
            for i in range(3)
        )
    ]
    arrived_ms = int(store.redis.hget(store.keys.req(quiet[0]), "submitted_ms"))
    wait_for(lambda: quiet[0] in dispatch_times(store, quiet), timeout=60, what="quiet served")
    first_ms = min(dispatch_times(store, quiet).values())
    bulk_at = dispatch_times(store, bulk)
    before = sorted(ms for ms in bulk_at.values() if arrived_ms < ms < first_ms)
    # A batch claimed just after quiet arrived may come from a snapshot read just before
    # (one dispatcher: at most one such batch, the first; its claims share one
    # dispatched_ms). Every later decision saw quiet: at most one bulk request first.
    later = [ms for ms in before if ms != before[0]] if before else []
    assert len(later) <= 1, (
        f"quiet's first request waited for {len(before)} bulk dispatches after it arrived"
    )
    # the flood was really in the way: part of it still queued when quiet was served
    # (counted at quiet's first dispatch; the bulk keeps draining while this test reads)
    served_first = [ms for ms in bulk_at.values() if ms <= first_ms]
    assert len(served_first) < len(bulk) - 20, len(served_first)
    if delay_s > 5.0:  # every bulk request was past standard's aging bound (5 s)
        last_bulk_ms = int(store.redis.hget(store.keys.req(bulk[-1]), "submitted_ms"))
        assert first_ms - last_bulk_ms > 5000


def test_new_tenant_behind_more_tenants_than_the_snapshot_reads(
    flood_fleet: Fleet, flood_settings: Settings, redis_client
) -> None:  # type: ignore[no-untyped-def]
    store = flood_fleet.store
    client = Client(settings=flood_settings, connection=redis_client)
    flood_fleet.worker("w1", time_scale=0.2, slots=4)
    crowd = [
        h.id
        for h in client.submit_many(
            {
                "prompt": f"c{t}-{i}",
                "priority": "standard",
                "tenant": f"crowd:{t}",
                "max_tokens": 64,
            }
            for t in range(CROWD_TENANTS)
            for i in range(4)
        )
    ]
    time.sleep(2.0)
    quiet = client.submit("q", priority="standard", tenant="quiet", max_tokens=64).id
    arrived_ms = int(store.redis.hget(store.keys.req(quiet), "submitted_ms"))
    wait_for(lambda: quiet in dispatch_times(store, [quiet]), timeout=120, what="quiet served")
    first_ms = dispatch_times(store, [quiet])[quiet]
    before = [ms for ms in dispatch_times(store, crowd).values() if arrived_ms < ms < first_ms]
    # VTC lifts quiet to the least counter of the backlogged tenants, where it ties with
    # the crowd's tenants not yet served this round (ties go to the oldest request): it
    # waits at most one dispatch per crowd tenant (40) plus a batch in flight (4), never
    # for their backlog (160; before the snapshot read the least-served tenants it waited
    # for 101, measured 18-19 with it on a loaded machine).
    # Newcomers advance as one group (issue 24): quiet, new too, starts behind the crowd's
    # tenants still waiting for their first dispatch when it came (each one turn more).
    times = dispatch_times(store, crowd)
    first: dict[str, int] = {}
    for rid, ms in times.items():
        tenant = store.redis.hget(store.keys.req(rid), "tenant") or ""
        first[tenant] = min(ms, first.get(tenant, ms))
    waiting = sum(1 for ms in first.values() if ms > arrived_ms)
    bound = CROWD_TENANTS + waiting + 4
    assert len(before) <= bound, f"quiet waited for {len(before)} crowd dispatches after it arrived"
