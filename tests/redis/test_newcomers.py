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
