"""Prefix-cache affinity (inferq.policy.affinity) and its place in decide()."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferq.errors import ConfigError
from inferq.policy.affinity import AffinityRule, Candidate, choose, overloaded
from inferq.policy.dispatch import decide
from inferq.policy.prefix_index import PrefixIndex
from tests.builders import assigned, dispatch_policy, queued_request, snapshot, worker_view

RULE = AffinityRule()
MIB = 1024 * 1024
KV_BYTES = 131_072  # llama-3.1-8b: 1 token = 0.125 MiB


def test_a_cached_worker_wins_when_the_prefill_saved_outweighs_its_load() -> None:
    saved, weight = 3000, RULE.load_weight
    idle = Candidate(0, 0, 0.0)
    cached = Candidate(1, saved, saved / 2 / weight)  # its load weighs half the hit
    assert choose(idle, [cached], 4000, RULE, slack=1.0) is cached
    # the same hit on a worker whose load weighs twice what the hit saves: the idle worker
    assert choose(idle, [Candidate(1, saved, 2 * saved / weight)], 4000, RULE, slack=1.0) is idle


def test_little_sla_slack_weighs_load_more() -> None:
    saved, weight = 3000, RULE.load_weight
    idle = Candidate(0, 0, 0.0)
    cached = Candidate(1, saved, saved / 2 / weight)
    # no slack: the load weighs urgent_load_factor (4) times more, twice the hit
    assert choose(idle, [cached], 4000, RULE, slack=0.0) is idle


def test_balance_mode_passes_over_an_overloaded_cached_worker() -> None:
    rule = AffinityRule(load_weight=0.0)  # only the cache counts ...
    idle = Candidate(0, 0, 0.0)
    busy = Candidate(1, 30_000, rule.balance_abs_tokens + 1)
    assert choose(idle, [busy], 30_000, rule, slack=1.0) is idle  # ... but balance holds


def test_the_rule_s_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"prefix\.balance_rel must be >= 1, got 0\.5"):
        AffinityRule(balance_rel=0.5)
    with pytest.raises(ConfigError, match=r"prefix\.load_weight must be >= 0"):
        AffinityRule(load_weight=-1)


candidates = st.lists(
    st.tuples(st.integers(0, 50_000), st.floats(0, 100_000, allow_nan=False)),
    min_size=1,
    max_size=8,
)


@given(
    st.floats(0, 100_000, allow_nan=False),
    candidates,
    st.integers(1, 50_000),
    st.floats(0, 1),
    st.floats(0, 3),
)
def test_choose_never_takes_an_overloaded_worker_and_takes_the_least_cost(
    default_load: float, rest: list[tuple[int, float]], prompt: int, slack: float, weight: float
) -> None:
    rule = AffinityRule(load_weight=weight)
    default = Candidate(0, 0, default_load)
    cached = [Candidate(i + 1, c, load) for i, (c, load) in enumerate(rest)]
    pick = choose(default, cached, prompt, rule, slack)
    least = min(c.load_tokens for c in [default, *cached])
    assert pick is default or not overloaded(pick.load_tokens, least, rule)
    assert pick.cached_tokens <= max(c.cached_tokens for c in [default, *cached])


def _fleet(n: int, *, used: dict[str, float] | None = None) -> list:
    used = used or {}
    return [
        worker_view(f"w{i}", slots=64, kv=65_536, used_mib=used.get(f"w{i}", 0.0)) for i in range(n)
    ]


def _index(fleet: list, held: dict[str, tuple[int, ...]]) -> PrefixIndex:
    index = PrefixIndex()
    for w in fleet:
        index.set_capacity(w.id, w.kv_cache_mib * MIB / KV_BYTES)
    for worker, chain in held.items():
        index.touch(worker, 64, chain)
    return index


def test_a_request_goes_where_its_prefix_is_cached() -> None:
    fleet = _fleet(4)
    chain = tuple(range(1, 41))  # 40 blocks x 64 = 2,560 tokens
    index = _index(fleet, {"w2": chain})
    req = queued_request("r", "standard", prompt=2600, prefix=chain, waited=1.0)
    snap = snapshot([req], fleet, now=0.0, prefix_index=index)
    decision = decide(snap, dispatch_policy())
    assert assigned(decision) == {"r": "w2"}
    assert decision.batches[0].items[0].cached_tokens == 2560
    off = dispatch_policy(affinity=AffinityRule(enabled=False))
    assert assigned(decide(snap, off)) == {"r": "w0"}


def test_requests_sharing_one_system_block_do_not_pile_onto_one_worker() -> None:
    """Mooncake's trap: every request shares its first block; the fleet must not collapse."""
    fleet = _fleet(4)
    system = (7,)
    index = _index(fleet, {"w0": system})
    reqs = [
        queued_request(
            f"r{i:02d}", "standard", prompt=4000, max_tokens=500, prefix=(7, 100 + i), waited=1.0
        )
        for i in range(32)
    ]
    snap = snapshot(reqs, fleet, now=0.0, prefix_index=index)
    got = assigned(decide(snap, dispatch_policy()))
    # one shared 64-token block never outweighs the load: routed as without the cache
    assert got == assigned(decide(snap, dispatch_policy(affinity=AffinityRule(enabled=False))))
    assert len(set(got.values())) > 1


def test_follow_up_requests_in_one_decision_follow_the_first() -> None:
    """Two turns of one conversation in the same decision land together."""
    fleet = _fleet(3)
    chain = tuple(range(1, 31))
    reqs = [
        queued_request("a", "standard", prompt=2000, prefix=chain[:20], tenant="t1", waited=1.1),
        queued_request("b", "standard", prompt=2000, prefix=chain, tenant="t2", waited=1.0),
    ]
    index = _index(fleet, {})
    got = assigned(decide(snapshot(reqs, fleet, now=0.0, prefix_index=index), dispatch_policy()))
    assert got["a"] == got["b"]


@st.composite
def fleets_and_queues(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    n = draw(st.integers(1, 6))
    used = {f"w{i}": draw(st.sampled_from([0.0, 256.0, 4096.0])) for i in range(n)}
    reqs = []
    for i in range(draw(st.integers(1, 30))):
        reqs.append(
            queued_request(
                f"r{i:03d}",
                draw(st.sampled_from(["realtime", "standard", "batch"])),
                tenant=draw(st.sampled_from(["a", "b", "c"])),
                prompt=draw(st.integers(1, 6000)),
                max_tokens=draw(st.integers(1, 2000)),
                waited=draw(st.floats(0, 5)),
                prefix=(1000 + i, 2000 + i),  # unique: nothing shared
            )
        )
    return _fleet(n, used=used), reqs


@settings(max_examples=60, deadline=None)
@given(fleets_and_queues())
def test_with_no_shared_prefix_routing_is_today_s(case: tuple[list, list]) -> None:
    fleet, reqs = case
    index = _index(fleet, {"w0": (1, 2, 3)})  # a cache that matches nobody
    policy = dispatch_policy()
    with_index = decide(snapshot(reqs, fleet, now=10.0, prefix_index=index), policy)
    without = decide(snapshot(reqs, fleet, now=10.0), policy)
    plain = [replace(r, prefix=(), block_tokens=0) for r in reqs]
    assert with_index == without == decide(snapshot(plain, fleet, now=10.0), policy)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(4, 60), st.integers(64, 8000))
def test_a_shared_prefix_never_sends_everything_to_one_worker_while_others_idle(
    n: int, count: int, prompt: int
) -> None:
    """All requests share a long prefix cached on the last worker only (today's pick is
    the first): once its load passes the balance margins, the others take the rest."""
    fleet = _fleet(n)
    chain = tuple(range(1, 1 + min(prompt // 64, 120)))
    cached = fleet[-1].id
    index = _index(fleet, {cached: chain})
    reqs = [
        queued_request(
            f"r{i:03d}", "standard", prompt=prompt, max_tokens=512, prefix=chain, waited=1.0
        )
        for i in range(count)
    ]
    decision = decide(snapshot(reqs, fleet, now=0.0, prefix_index=index), dispatch_policy())
    per_worker = Counter(assigned(decision).values())
    tokens = prompt + 512
    if sum(per_worker.values()) * tokens > RULE.balance_abs_tokens + 2 * tokens:
        assert len(per_worker) > 1
    # the cached worker was only chosen within the balance margins of today's pick (w0)
    least = per_worker.get("w0", 0) * tokens
    bound = max(least + RULE.balance_abs_tokens, RULE.balance_rel * least) + tokens
    assert per_worker[cached] * tokens <= bound
