"""FleetIndex: an index kept worker by worker decides exactly as one built fresh (issue 17)."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given
from hypothesis import strategies as st

from inferq.policy.dispatch import decide
from inferq.policy.fleet import FleetIndex
from inferq.policy.preemption import choose_victims, reserve
from inferq.policy.snapshot import DispatchPolicy, Snapshot, WorkerView

from ..builders import SETTINGS, dispatch_policy, worker_view
from .test_policy_dispatch import NOW, PROPS, case_st, worker_st


def _lists(index: FleetIndex) -> tuple[object, ...]:
    return (
        index.views,
        list(index.open_views()),
        index.largest_mib(),
        index.by_free,
        index.by_rest,
        {m: n for m, n in index.free_slots_of.items() if n},
    )


@st.composite
def churned_st(draw: st.DrawFn) -> tuple[Snapshot, DispatchPolicy, FleetIndex]:
    """A random decision case and an index of its workers reached through earlier
    fleets: workers that left, views replaced, puts in any order."""
    snap, pol = draw(case_st())
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    ids = [w.id for w in snap.workers]
    earlier = [
        draw(worker_st(wid))
        for wid in draw(st.lists(st.sampled_from([*ids, "gone0", "gone1", "gone2"]), max_size=12))
    ]
    index = FleetIndex(pol)
    for view in earlier:
        index.put(view)
    final = list(snap.workers)
    rnd.shuffle(final)
    for view in final:
        if rnd.random() < 0.3:  # the same worker put twice (an unchanged beat)
            index.put(view)
        index.put(view)
    for wid in list(index.views):
        if wid not in ids:
            index.discard(wid)
    index.discard("never-held")
    return snap, pol, index


@PROPS
@given(churned_st())
def test_an_index_kept_incrementally_decides_as_a_fresh_one(
    case: tuple[Snapshot, DispatchPolicy, FleetIndex],
) -> None:
    snap, pol, index = case
    assert _lists(index) == _lists(FleetIndex.build(snap.workers, pol))
    fresh = decide(snap, pol)
    assert decide(snap, pol, index) == fresh
    urgent = [r for reqs in snap.queued.values() for r in reqs]
    assert reserve(urgent, snap.workers, pol, NOW, index) == reserve(urgent, snap.workers, pol, NOW)
    assert choose_victims(fresh.reservations, {}, snap, pol, fresh.batches, index) == (
        choose_victims(fresh.reservations, {}, snap, pol, fresh.batches)
    )


@PROPS
@given(case_st())
def test_an_index_of_another_registry_is_not_used(case: tuple[Snapshot, DispatchPolicy]) -> None:
    snap, pol = case
    other = dispatch_policy(models=SETTINGS.models[:1])
    assert decide(snap, pol, FleetIndex.build(snap.workers, other)) == decide(snap, pol)


def test_a_busy_fleet_touches_only_the_changed_workers() -> None:
    pol = dispatch_policy()
    fleet = [
        dataclasses.replace(worker_view(f"w{i:03d}", slots=4), reserved_slots=4) for i in range(200)
    ]
    index = FleetIndex.build(fleet, pol)
    assert list(index.open_views()) == []
    freed = dataclasses.replace(fleet[7], reserved_slots=1)
    index.put(freed)
    assert list(index.open_views()) == [freed]
    assert index.free_slots_of == {"llama-3.1-8b": 3}
    assert index.by_rest["llama-3.1-8b"][0][5] is freed
    index.discard("w007")
    assert list(index.open_views()) == [] and "w007" not in index.views
    assert len(index.by_free["llama-3.1-8b"]) == 199
    assert index.largest_mib() == {"llama-3.1-8b": fleet[0].kv_cache_mib}


def test_largest_kv_cache_follows_workers_leaving() -> None:
    pol = dispatch_policy()
    small, big = worker_view("a", kv=1_000.0), worker_view("b", kv=9_000.0)
    index = FleetIndex(pol, [small, big, dataclasses.replace(big, id="c")])
    assert index.largest_mib() == {"llama-3.1-8b": 9_000.0}
    index.discard("b")
    assert index.largest_mib() == {"llama-3.1-8b": 9_000.0}
    index.discard("c")
    assert index.largest_mib() == {"llama-3.1-8b": 1_000.0}
    index.put(WorkerView("a", "llama-2-13b", 13.0, False, 2, 500.0))
    assert index.largest_mib() == {"llama-2-13b": 500.0}
    assert index.free_slots_of.get("llama-2-13b", 0) == 0  # not ready: no free slot counts
