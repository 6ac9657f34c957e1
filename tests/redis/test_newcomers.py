"""Newcomers as one group in the queueing scripts' VTC lift (issue 24, includes/counts.lua).

A tenant with no virtual time in a class starts no lower than the finish tag of the
newcomers still waiting for their first dispatch, so a crowd of one-off tenants is
stacked like one tenant's requests; an established tenant returning to the backlog is
lifted to the floor, not behind the crowd. The simulator runs the same rule
(``inferq.policy.fairness.lift_tenants``; tests/unit/test_sim_scenarios.py).
"""

from __future__ import annotations

import pytest

from inferq import defaults
from inferq.config import Settings
from inferq.policy.fairness import vtc_cost
from inferq.policy.snapshot import Decision
from inferq.store import Store

from ..builders import inference_request
from ..helpers import ready_worker

CLS = "standard"


def submit(store: Store, settings: Settings, tenant: str) -> str:
    request = inference_request(settings, tenant=tenant, priority=CLS)
    store.submit(request)
    return request.id


def charge(store: Store, tenant: str, tokens: float) -> None:
    """What a dispatch of ``tenant`` writes (fairness.lua): its charge, in tokens."""
    store.write_fairness(Decision(tenant_counter_delta={CLS: {tenant: tokens}}), [CLS])


def test_a_crowd_of_newcomers_is_stacked_and_a_returning_tenant_is_not(
    store: Store, settings: Settings
) -> None:
    k = store.keys
    vtc, new = k.fair_vtc(CLS), k.fair_new(CLS)
    sample = inference_request(settings, priority=CLS)  # every request here is this size
    size = vtc_cost(sample.prompt_tokens, sample.max_tokens, defaults.VTC_OUTPUT_WEIGHT)
    charge(store, "bulk", 1000.0)  # two established tenants, served before
    charge(store, "quiet", 10.0)
    submit(store, settings, "bulk")
    crowd = {t: submit(store, settings, t) for t in ("c1", "c2", "c3")}
    submit(store, settings, "quiet")  # returns after the crowd came
    score = {t: store.redis.zscore(vtc, t) for t in ("bulk", "quiet", "c1", "c2", "c3")}
    # the crowd advances like one tenant: c1 at bulk's floor, each next one after it
    assert score["c1"] == pytest.approx(1000.0)
    assert score["c2"] == pytest.approx(1000.0 + size)
    assert score["c3"] == pytest.approx(1000.0 + 2 * size)
    assert score["quiet"] == pytest.approx(1000.0)  # lifted to the floor, not stacked
    tags = dict(store.redis.zrange(new, 0, -1, withscores=True))
    assert tags == {"c1": 1000.0 + size, "c2": 1000.0 + 2 * size, "c3": 1000.0 + 3 * size}
    charge(store, "c1", size)  # dispatched: no longer waiting for its first
    store.cancel(crowd["c3"])  # left the backlog
    assert store.redis.zrange(new, 0, -1) == ["c2"]
    submit(store, settings, "c4")  # a newcomer after c2, the last still waiting
    assert store.redis.zscore(vtc, "c4") == pytest.approx(1000.0 + 2 * size)
    charge(store, "c2", size)
    charge(store, "c4", size)
    assert store.redis.zcard(new) == 0
    submit(store, settings, "c5")  # nobody waiting: lifted to the floor, as before
    assert store.redis.zscore(vtc, "c5") == pytest.approx(1000.0)


def test_newcomers_that_leave_undispatched_do_not_push_the_next_one_back(
    store: Store, settings: Settings
) -> None:
    """The attack on the group: one-off tenants queue big requests ahead of an honest
    newcomer, then cancel them before any is dispatched. The newcomer's start moves up by
    each one that leaves (not below the floor); a newcomer that is dispatched leaves the
    ones behind it where they are."""
    vtc, new = store.keys.fair_vtc(CLS), store.keys.fair_new(CLS)
    charge(store, "bulk", 1000.0)
    submit(store, settings, "bulk")
    phantoms = []
    for t in ("p1", "p2", "p3"):
        request = inference_request(settings, tenant=t, priority=CLS, max_tokens=4000)
        store.submit(request)
        phantoms.append(request.id)
    honest = submit(store, settings, "honest")
    assert store.redis.zscore(vtc, "honest") > 1000.0 + 3 * 8000  # behind the three
    for rid in phantoms:
        store.cancel(rid)
    assert store.redis.zscore(vtc, "honest") == pytest.approx(1000.0)  # at the floor again
    assert list(dict(store.redis.zrange(new, 0, -1, withscores=True))) == ["honest"]
    # dispatched, not cancelled: the newcomer behind keeps its place
    submit(store, settings, "behind")
    start = store.redis.zscore(vtc, "behind")
    assert start > 1000.0
    ready_worker(store, "w1")
    queue = store.keys.tenant_queue(CLS, settings.default_model, "honest")
    assert store.assign("w1", "b1", [(honest, queue, 1.0)])
    assert store.redis.zscore(vtc, "behind") == pytest.approx(start)
    assert store.redis.zrange(new, 0, -1) == ["behind"]
