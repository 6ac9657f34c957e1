"""The simulator's policies: the production rules are called, and the FIFO baseline."""

from __future__ import annotations

from functools import partial
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferq.config import Settings
from inferq.policy.dispatch import decide
from inferq.policy.routing import need_mib
from inferq.policy.scaling import decide_scale
from inferq.policy.snapshot import (
    DispatchPolicy,
    FairnessState,
    QueuedRequest,
    Snapshot,
    WorkerView,
)
from inferq.sim.baselines import (
    keda_zcard_scale,
    seed_ratio_classes,
    seed_scale,
    strict_priority_classes,
)
from inferq.sim.policies import POLICIES, SEED_RATIO, FifoDispatch

from ..builders import placed, queued_request, snapshot, worker_view

SETTINGS = Settings()
NOW = 1_000.0
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def req(rid: str, priority: str = "realtime", *, at: float = NOW - 1, **kw: Any) -> QueuedRequest:
    return queued_request(rid, priority, submitted_at=at, **{"tenant": "t", **kw})


def worker(wid: str, model: str = "llama-3.1-8b", *, used: int = 0, **kw: Any) -> WorkerView:
    return worker_view(wid, model, used_slots=used, **{"slots": 4, "kv": 10_000.0, **kw})


snap = partial(snapshot, now=NOW)


def fifo() -> FifoDispatch:
    return FifoDispatch(DispatchPolicy.from_settings(SETTINGS))


# --- the named policies -----------------------------------------------------------------


def test_the_five_policies_and_their_production_parts() -> None:
    assert list(POLICIES) == ["static-fifo", "strict-priority", "seed", "keda-zcard", "inferq"]
    assert POLICIES["inferq"].scaler is decide_scale
    assert POLICIES["strict-priority"].scaler is decide_scale
    assert POLICIES["seed"].scaler is seed_scale
    assert POLICIES["keda-zcard"].scaler is keda_zcard_scale
    assert POLICIES["static-fifo"].scaler is None and POLICIES["static-fifo"].peak_fleet
    assert [p.ordering for p in POLICIES.values()] == ["fifo", "decide", "decide", "fifo", "decide"]
    assert all(p.summary for p in POLICIES.values())
    assert POLICIES["strict-priority"].classes(SETTINGS.classes) == strict_priority_classes(
        SETTINGS.classes
    )
    assert POLICIES["seed"].classes(SETTINGS.classes) == seed_ratio_classes(
        SETTINGS.classes, SEED_RATIO
    )
    assert SEED_RATIO == 5


snapshots = st.builds(
    lambda reqs, workers, credit: Snapshot(
        now=NOW,
        queued={
            c: sorted([r for r in reqs if r.priority == c], key=lambda r: (r.submitted_at, r.id))
            for c in ("realtime", "standard", "batch")
        },
        workers=workers,
        fairness=FairnessState(class_credit=credit),
    ),
    st.lists(
        st.builds(
            req,
            st.uuids().map(lambda u: u.hex[:8]),
            st.sampled_from(["realtime", "standard", "batch"]),
            at=st.floats(NOW - 100, NOW),
            tenant=st.sampled_from(["a", "b", "c"]),
            prompt=st.integers(0, 3000),
            max_tokens=st.integers(1, 1000),
        ),
        max_size=30,
        unique_by=lambda r: r.id,
    ),
    st.lists(
        st.builds(
            worker,
            st.uuids().map(lambda u: "w" + u.hex[:6]),
            slots=st.integers(1, 4),
            used=st.integers(0, 2),
        ),
        max_size=4,
        unique_by=lambda w: w.id,
    ),
    st.fixed_dictionaries({"realtime": st.floats(-10, 10), "batch": st.floats(-10, 10)}),
)


@given(snapshots)
@PROPS
def test_decide_policies_are_decide_with_their_classes(snapshot: Snapshot) -> None:
    for name, classes in (
        ("inferq", tuple(SETTINGS.classes)),
        ("strict-priority", strict_priority_classes(SETTINGS.classes)),
        ("seed", seed_ratio_classes(SETTINGS.classes, 5)),
    ):
        expected = decide(snapshot, DispatchPolicy.from_settings(SETTINGS, classes=classes))
        assert POLICIES[name].dispatcher(SETTINGS)(snapshot) == expected


# --- FIFO ---------------------------------------------------------------------------------


def test_fifo_takes_the_oldest_first_whatever_the_class() -> None:
    queued = [
        req("a", "batch", at=NOW - 9),
        req("b", "realtime", at=NOW - 5),
        req("c", "standard", at=NOW - 7),
    ]
    decision = fifo()(snap(queued, [worker("w1", slots=2)]))
    assert [rid for rid, _ in placed(decision)] == ["a", "c"]
    assert decision.class_credit == {} and decision.tenant_counter_delta == {}


def test_fifo_round_robins_over_workers_across_decisions() -> None:
    dispatch = fifo()
    workers = [worker("w1"), worker("w2"), worker("w3")]
    first = dispatch(snap([req("a", at=NOW - 3), req("b", at=NOW - 2)], workers))
    assert placed(first) == [("a", "w1"), ("b", "w2")]
    second = dispatch(snap([req("c", at=NOW - 1), req("d")], workers))
    assert placed(second) == [("c", "w3"), ("d", "w1")]


def test_fifo_skips_full_starting_and_wrong_model_workers() -> None:
    workers = [
        worker("w1", used=4),
        worker("w2", ready=False),
        worker("w3", "llama-3.1-70b-awq"),
        worker("w4"),
    ]
    assert placed(fifo()(snap([req("a")], workers))) == [("a", "w4")]


def test_fifo_blocks_behind_a_head_that_does_not_fit_now() -> None:
    big = req("big", at=NOW - 2, prompt=20_000, max_tokens=1_000)  # ~2.6 GiB of KV cache
    small = req("small", at=NOW - 1)
    workers = [worker("w1", kv=3_000, used=1, used_mib=1_000)]
    decision = fifo()(snap([big, small], workers))
    assert placed(decision) == []  # a FIFO queue has no other order
    assert decision.unschedulable == ()


def test_fifo_reports_and_skips_what_no_worker_could_ever_hold() -> None:
    never = req("never", "standard", at=NOW - 3, route="llama-3.1-70b-awq")  # may not degrade
    late = req("late", at=NOW - 200, timeout=100)
    ok = req("ok", at=NOW - 1)
    decision = fifo()(snap([never, late, ok], [worker("w1")]))
    assert placed(decision) == [("ok", "w1")]
    assert [rid for rid, _ in decision.unschedulable] == ["never"]
    assert [rid for rid, _ in decision.expired] == ["late"]
    assert "deadline passed" in decision.expired[0][1]


@given(snapshots)
@PROPS
def test_fifo_never_overfills_a_worker_and_keeps_arrival_order(snapshot: Snapshot) -> None:
    decision = fifo()(snapshot)
    by_id = {r.id: r for reqs in snapshot.queued.values() for r in reqs}
    spec = SETTINGS.model_by_name["llama-3.1-8b"]
    for batch in decision.batches:
        w = next(w for w in snapshot.workers if w.id == batch.worker_id)
        assert w.ready and len(batch.items) <= w.free_slots
        need = sum(need_mib(by_id[a.request_id], spec) for a in batch.items)
        assert need <= w.free_mib + 1e-6
        assert all(a.need_mib == need_mib(by_id[a.request_id], spec) for a in batch.items)

    def key(r: QueuedRequest) -> tuple[float, str]:
        return (r.submitted_at, r.id)

    for batch in decision.batches:
        order = [by_id[a.request_id] for a in batch.items]
        assert order == sorted(order, key=key)
    # nothing older than the youngest dispatched request was passed over
    done = {rid for rid, _ in placed(decision)} | {rid for rid, _ in decision.expired}
    done |= {rid for rid, _ in decision.unschedulable}
    sent = [by_id[rid] for rid, _ in placed(decision)]
    if sent:
        last = max(key(r) for r in sent)
        assert [r for r in by_id.values() if key(r) < last and r.id not in done] == []
