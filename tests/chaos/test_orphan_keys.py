"""Every key inferq (or RQ on its behalf) writes has an owner that removes it, or a TTL.

A workload, a SIGKILLed worker, the reaper, a dead-lettered request deleted, a clean
drain of the other worker: then the whole private Redis is walked and every key
without a TTL must be one of the deployment's long-lived keys (issue 12, fault 3).
"""

from __future__ import annotations

import signal

from .conftest import Deployment, wait_for

#: Keys that live as long as the deployment (bounded by configuration, not by traffic):
#: name after the ``inferq:<namespace>:`` prefix.
DEPLOYMENT_KEYS = {
    "queues",  # one member per (class, route) used
    "stats",  # one counter per outcome
    "counts",  # one field per class (tenant fields go at 0)
    "events",  # capped stream (MAXLEN)
    "prefixlog",  # capped stream (MAXLEN): the prefix-cache index's placements
    "fair:classes",  # one credit per class
    "wake",  # at most one token
    "wchanged",  # one member per worker live or removed within a minute (changed.lua)
    "usage:retention",  # one number: usage_retention_days (the dispatcher writes it)
}
#: Prefixes of keys bounded by an owner's folding (fairness.lua, estimates.lua).
FOLDED = ("fair:vtc:", "fair:seen:", "estimates")


def test_no_orphan_key_after_a_workload_a_killed_worker_and_cleanup(
    deployment: Deployment,
) -> None:
    d = deployment
    d.dispatcher()
    d.worker("victim", slots=4, time_scale=2.0)
    d.worker("survivor", slots=4, time_scale=0.05)
    handles = d.client.submit_many(
        {"prompt": f"p{i}", "tenant": f"t{i % 3}", "task_type": "chat", "max_tokens": 64}
        for i in range(24)
    )
    wait_for(lambda: d.store.held_by("victim"), timeout=30, what="victim holds work")
    d.kill("victim")
    ids = [h.id for h in handles]
    d.wait_final(ids)
    workers = d.store.keys.workers
    wait_for(lambda: d.store.redis.zscore(workers, "victim") is None, timeout=30, what="reaped")
    d.procs["survivor"].send_signal(signal.SIGTERM)
    assert d.procs["survivor"].wait(timeout=30) == 0
    wait_for(
        lambda: d.store.redis.zscore(workers, "survivor") is None, timeout=30, what="deregistered"
    )
    d.kill("dispatcher")

    r = d.store.redis
    prefix = d.store.keys.prefix
    orphans = []
    for key in r.scan_iter(count=1000):
        if r.ttl(key) >= 0:
            continue
        name = key[len(prefix) :] if key.startswith(prefix) else None
        if name is not None and (name in DEPLOYMENT_KEYS or name.startswith(FOLDED)):
            continue
        orphans.append((key, r.type(key)))
    assert orphans == [], orphans
