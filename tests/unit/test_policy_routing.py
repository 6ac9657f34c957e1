"""Routing policy: eligibility, worker preference, the worker index, unschedulable reasons."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferq.config import Settings
from inferq.policy.routing import (
    WorkerIndex,
    choose_worker,
    eligible,
    need_mib,
    serving_models,
    unschedulable_reason,
)
from inferq.policy.snapshot import Assignment, DispatchPolicy, QueuedRequest, WorkerView

from ..builders import PARAMS_B, queued_request, worker_view

SETTINGS = Settings()
POLICY = DispatchPolicy.from_settings(SETTINGS)
SPECS = POLICY.model_by_name
NOW = 5_000.0


req = partial(
    queued_request, "r", priority="standard", tenant="t", now=NOW, deadline=NOW + 60,
    prompt=1000, max_tokens=1000,
)  # fmt: skip
wk = partial(worker_view, slots=4, kv=8192)


def test_need_mib_is_tokens_times_kv_bytes() -> None:
    # 2000 tokens x 131072 bytes = 250 MiB on the 8b model
    assert need_mib(req(), SPECS["llama-3.1-8b"]) == 250.0
    assert need_mib(req(prompt=0, max_tokens=1), SPECS["llama-2-13b"]) == 819_200 / 2**20


def test_eligible_needs_ready_slot_vram_and_route() -> None:
    r = req()
    assert eligible(wk(), r, POLICY, NOW)
    assert not eligible(wk(ready=False), r, POLICY, NOW)
    assert not eligible(wk(used_slots=4), r, POLICY, NOW)
    assert eligible(wk(kv=250.0), r, POLICY, NOW)
    assert not eligible(wk(kv=1000.0, used_mib=750.1), r, POLICY, NOW)
    assert not eligible(wk(model="llama-2-13b"), r, POLICY, NOW)
    assert not eligible(wk(model="not-in-registry"), req(route="not-in-registry"), POLICY, NOW)
    assert not eligible(wk(), req(route="!!bad route"), POLICY, NOW)


def test_routing_takes_the_smaller_of_the_measured_and_the_booked_room() -> None:
    r = req()  # needs 250 MiB on the 8b model
    # The H200: the bookkeeping says plenty, another process holds the memory.
    assert not eligible(wk(kv=114_073, measured=200.0), r, POLICY, NOW)
    assert eligible(wk(kv=114_073, measured=250.0), r, POLICY, NOW)
    # A measurement above the booked room changes nothing: reservations still count.
    assert not eligible(wk(kv=1000.0, used_mib=750.1, measured=10_000.0), r, POLICY, NOW)
    assert eligible(wk(kv=1000.0, used_mib=750.0, measured=None), r, POLICY, NOW)


@settings(max_examples=200, deadline=None)
@given(
    kv=st.floats(0, 1e6),
    used=st.floats(0, 1e6),
    measured=st.one_of(st.none(), st.floats(0, 1e6)),
)
def test_free_room_is_never_more_than_either_figure(
    kv: float, used: float, measured: float | None
) -> None:
    w = wk(kv=kv, used_mib=used, measured=measured)
    assert 0.0 <= w.free_mib <= max(0.0, kv - used)
    if measured is not None:
        assert w.free_mib <= measured
        assert w.free_mib == max(0.0, min(kv - used, measured))
    else:
        assert w.free_mib == max(0.0, kv - used)


@settings(max_examples=200, deadline=None)
@given(measured=st.floats(0, 2000), prompt=st.integers(0, 4000), out=st.integers(1, 4000))
def test_the_index_places_only_what_the_measured_room_holds(
    measured: float, prompt: int, out: int
) -> None:
    r = req(prompt=prompt, max_tokens=out)
    w = wk(kv=1e6, measured=measured)
    tokens = prompt + out
    batch = WorkerIndex([w], POLICY).place(serving_models(r, POLICY, NOW), tokens)
    fits = need_mib(r, SPECS["llama-3.1-8b"]) <= measured
    assert (batch is not None) == fits == eligible(w, r, POLICY, NOW)


def test_size_route_is_served_by_any_adequate_model() -> None:
    r = req(route=">=13b", prompt=100, max_tokens=100)
    assert eligible(wk(model="llama-2-13b", kv=4096), r, POLICY, NOW)
    assert eligible(wk(model="llama-3.1-70b-awq"), r, POLICY, NOW)
    assert not eligible(wk(model="llama-3.1-8b"), r, POLICY, NOW)


def test_context_longer_than_the_model_is_ineligible() -> None:
    # llama-2-13b has a 4096-token context
    r = req(route="llama-2-13b", prompt=3000, max_tokens=1200)
    assert not eligible(wk(model="llama-2-13b", kv=1e6), r, POLICY, NOW)
    assert serving_models(r, POLICY, NOW) == ()


def test_fallback_only_when_class_degrades_and_waited_enough() -> None:
    fallback = wk(model="llama-3.1-8b")
    # realtime allows degrading after 1 s; standard never does
    assert not eligible(
        fallback, req(route="llama-3.1-70b-awq", priority="realtime", waited=0.5), POLICY, NOW
    )
    assert eligible(
        fallback, req(route="llama-3.1-70b-awq", priority="realtime", waited=1.0), POLICY, NOW
    )
    assert not eligible(
        fallback, req(route="llama-3.1-70b-awq", priority="standard", waited=99), POLICY, NOW
    )


def test_choose_prefers_smallest_adequate_model_then_utilisation_then_id() -> None:
    workers = [
        wk("big", "llama-3.1-70b-awq"),
        wk("mid-busy", "llama-2-13b", kv=4096, used_slots=3),
        wk("mid-b", "llama-2-13b", kv=4096, used_slots=1),
        wk("mid-a", "llama-2-13b", kv=4096, used_slots=1),
    ]
    r = req(route=">=13b", prompt=100, max_tokens=100)
    chosen = choose_worker(r, workers, POLICY, NOW)
    assert chosen is not None and chosen.id == "mid-a"
    full = [w for w in workers if w.model == "llama-3.1-70b-awq"]
    chosen = choose_worker(r, full, POLICY, NOW)
    assert chosen is not None and chosen.id == "big"


def test_choose_prefers_the_exact_model_over_its_fallback() -> None:
    workers = [wk("small", "llama-3.1-8b"), wk("big", "llama-3.1-70b-awq")]
    r = req(route="llama-3.1-70b-awq", priority="realtime", waited=5)
    chosen = choose_worker(r, workers, POLICY, NOW)
    assert chosen is not None and chosen.id == "big"


def test_choose_avoids_the_excluded_worker_unless_alone() -> None:
    r = req(excluded="a")
    chosen = choose_worker(r, [wk("a"), wk("b", used_slots=3)], POLICY, NOW)
    assert chosen is not None and chosen.id == "b"
    chosen = choose_worker(r, [wk("a")], POLICY, NOW)
    assert chosen is not None and chosen.id == "a"
    assert choose_worker(r, [wk("a", ready=False)], POLICY, NOW) is None


def test_unschedulable_names_the_need_and_the_largest_worker() -> None:
    # 32,000 tokens x 0.125 MiB/token on the 8b model = 4000 MiB = 3.9 GiB
    r = req(route="llama-3.1-8b", prompt=2_000, max_tokens=30_000)
    reason = unschedulable_reason(r, [wk(kv=2048), wk("w2", kv=3000)], POLICY)
    assert reason == "needs 3.9 GiB KV cache, largest llama-3.1-8b worker has 2.9 GiB"
    assert unschedulable_reason(r, [wk(kv=4000)], POLICY) is None


def test_unschedulable_counts_busy_and_starting_workers_as_able() -> None:
    r = req(prompt=100, max_tokens=100)
    assert unschedulable_reason(r, [wk(ready=False, used_slots=4, used_mib=8192)], POLICY) is None


def test_unschedulable_when_no_live_worker_serves_the_route() -> None:
    r = req(route="llama-3.1-70b-awq")
    reason = "no live worker or scaler pool serves model llama-3.1-70b-awq"
    assert unschedulable_reason(r, [wk()], POLICY) == reason
    assert unschedulable_reason(r, [], POLICY) == reason
    assert unschedulable_reason(req(route=">=60b"), [wk()], POLICY) == (
        "no live worker or scaler pool serves a >=60b model"
    )
    # A running scaler's pool serves it: it waits for the pool's cold start (issue 12, 4).
    assert unschedulable_reason(r, [wk()], POLICY, frozenset({"llama-3.1-70b-awq"})) is None
    assert unschedulable_reason(r, [], POLICY, frozenset({"llama-3.1-8b"})) == reason
    # realtime may degrade to the 8b fallback: it is schedulable later
    assert (
        unschedulable_reason(req(route="llama-3.1-70b-awq", priority="realtime"), [wk()], POLICY)
        is None
    )


def test_unschedulable_other_reasons() -> None:
    assert unschedulable_reason(req(priority="vip"), [wk()], POLICY) == (
        "priority class 'vip' is not configured"
    )
    assert unschedulable_reason(req(route="no-such"), [wk()], POLICY) == (
        "no model in the registry serves no-such"
    )
    assert unschedulable_reason(req(route="!!"), [wk()], POLICY) == (
        "route '!!' is invalid: '!!' is neither a model name (letters, digits, '.', '_', '-', "
        "at most 64) nor a size requirement like '>=13b'"
    )
    sized = req(route=">=13b", prompt=3000, max_tokens=1000)  # 3125 MiB on 13b, 1250 MiB on 70b
    fleet = [wk("m", "llama-2-13b", kv=3000), wk("b", "llama-3.1-70b-awq", kv=1000)]
    assert unschedulable_reason(sized, fleet, POLICY) == (
        "needs 3.1 GiB KV cache, largest llama-2-13b worker has 2.9 GiB"
    )
    long = req(route="llama-2-13b", prompt=4000, max_tokens=500)
    assert unschedulable_reason(long, [wk(model="llama-2-13b", kv=1e6)], POLICY) == (
        "needs 4500 tokens (prompt + max_tokens), more than the 4096-token context of llama-2-13b"
    )


# --- the index agrees with the plain rule ------------------------------------------


@st.composite
def fleet_st(draw: st.DrawFn) -> list[WorkerView]:
    out = []
    for i in range(draw(st.integers(0, 12))):
        slots = draw(st.integers(1, 4))
        kv = float(draw(st.integers(0, 4000)))
        out.append(
            wk(
                f"w{i}",
                draw(st.sampled_from([*PARAMS_B, "unknown-3b"])),
                ready=draw(st.booleans()),
                slots=slots,
                kv=kv,
                used_slots=draw(st.integers(0, slots)),
                used_mib=draw(st.floats(0, kv)),
                measured=draw(st.one_of(st.none(), st.floats(0, 4000))),
            )
        )
    return out


@st.composite
def req_st(draw: st.DrawFn, ids: list[str]) -> QueuedRequest:
    return req(
        route=draw(st.sampled_from([*PARAMS_B, ">=8b", ">=13b", ">=70b"])),
        priority=draw(st.sampled_from(["realtime", "standard"])),
        prompt=draw(st.integers(0, 6000)),
        max_tokens=draw(st.integers(1, 6000)),
        waited=draw(st.floats(0, 3)),
        excluded=draw(st.sampled_from([None, *ids])),
    )


def expected_pick(
    r: QueuedRequest, snapshot: list[WorkerView], current: list[WorkerView]
) -> str | None:
    """The rule spelled out: eligible now, not excluded if possible, then
    (route preference, utilisation as of the snapshot, id)."""
    order = {m: i for i, m in enumerate(serving_models(r, POLICY, NOW))}
    at_start = {w.id: w.utilisation for w in snapshot}
    found = [w for w in current if eligible(w, r, POLICY, NOW)]
    preferred = [w for w in found if w.id != r.excluded_worker] or found
    if not preferred:
        return None
    return min(preferred, key=lambda w: (order[w.model], at_start[w.id], w.id)).id


@settings(max_examples=300, deadline=None)
@given(fleet_st(), st.data())
def test_index_picks_what_the_rule_picks(workers: list[WorkerView], data: st.DataObject) -> None:
    index = WorkerIndex(workers, POLICY)
    current = list(workers)
    for step in range(4):  # placements in a row, each against the fleet as it now stands
        r = data.draw(req_st([w.id for w in workers]))
        tokens = r.prompt_tokens + r.max_tokens
        batch = index.place(serving_models(r, POLICY, NOW), tokens, r.excluded_worker)
        got = batch.worker.id if batch is not None else None
        if step == 0:  # nothing placed yet: the plain linear rule agrees exactly
            first = choose_worker(r, workers, POLICY, NOW)
            assert got == (first.id if first is not None else None)
        assert got == expected_pick(r, workers, current)
        if batch is None:
            continue
        need = need_mib(r, batch.spec)
        index.add(batch, Assignment(r.id, r.priority, r.tenant, need, 0.0), tokens)
        current = [
            dataclasses.replace(  # the measured room shrinks by the need too
                w,
                reserved_slots=w.reserved_slots + 1,
                reserved_mib=w.reserved_mib + need,
                measured_free_mib=None
                if w.measured_free_mib is None
                else w.measured_free_mib - need,
            )
            if w.id == got
            else w
            for w in current
        ]


@pytest.mark.parametrize("route", ["llama-3.1-8b", ">=8b"])
def test_index_fills_the_least_used_worker_first(route: str) -> None:
    workers = [wk("b", used_slots=1), wk("a", used_slots=2), wk("c", slots=2)]
    pol = dataclasses.replace(POLICY, max_batch=8)
    index = WorkerIndex(workers, pol)
    order = []
    r = req(route=route, prompt=10, max_tokens=10)
    while (batch := index.place(serving_models(r, pol, NOW), 20)) is not None:
        index.add(batch, Assignment("x", "standard", "t", 1.0, 0.0), 20)
        order.append(batch.worker.id)
    # utilisation as of the snapshot: c 0/2, b 1/4, a 2/4 -> fill c, then b, then a
    assert order == ["c", "c", "b", "b", "b", "a", "a"]
    assert index.open_count == 0
