"""The rule against priority inversion (inferq.policy.preemption): overdue classes first,
reservations, and the fewest preemptions that make room; examples and properties."""

from __future__ import annotations

import dataclasses
from functools import partial

from hypothesis import given
from hypothesis import strategies as st

from inferq.policy.dispatch import decide
from inferq.policy.fairness import vtc_cost
from inferq.policy.preemption import choose_victims, preemption_refund, refunded_counter, reserve
from inferq.policy.routing import eligible, need_mib, serving_models
from inferq.policy.snapshot import (
    Decision,
    DispatchPolicy,
    FairnessState,
    QueuedRequest,
    Reservation,
    RunningRequest,
    Snapshot,
)

from ..builders import SETTINGS, assigned, dispatch_policy, queued_request, snapshot, worker_view
from .test_policy_dispatch import PROPS, case_st, may_be_held, requests_of

NOW = 1000.0
request = partial(queued_request, now=NOW)
SPEC = {m.name: m for m in SETTINGS.models}["llama-3.1-8b"]


def running(
    rid: str,
    priority: str = "batch",
    *,
    started: float = NOW - 5,
    need: float = 200.0,
    **kw: object,
) -> RunningRequest:
    fields: dict[str, object] = {
        "id": rid,
        "worker_id": "w1",
        "priority": priority,
        "tenant": "t0",
        "task_type": None,
        "attempt": 1,
        "started_at": started,
        "need_mib": need,
        "prompt_tokens": 10,
        "max_tokens": 1100,
    }
    fields.update(kw)
    return RunningRequest(**fields)  # type: ignore[arg-type]


# --- the examples --------------------------------------------------------------


def test_a_slot_hog_reserves_the_worker_and_preempts_one_batch_request() -> None:
    """Issue 12: 4 batch requests hold the 4 slots; realtime waited 0.6 s (bound 0.5 s)."""
    pol = dispatch_policy()
    w = worker_view("w1", slots=4, kv=6798, used_slots=4, used_mib=4 * 140.0)
    rt = request("rt", "realtime", waited=0.6, max_tokens=16)
    snap = snapshot([rt, request("b5", "batch", waited=3.0)], [w], now=NOW)
    decision = decide(snap, pol)
    assert decision.batches == ()
    [res] = decision.reservations
    assert (res.worker_id, res.request_id, res.missing_slots) == ("w1", "rt", 1)
    held = [running(f"b{i}", started=NOW - 2 - i / 10, need=140.0) for i in range(4)]
    victims = choose_victims(decision.reservations, {"w1": held}, snap, pol)
    assert [v.request_id for v in victims] == ["b0"]  # the latest start: least progress
    assert "realtime request rt" in victims[0].reason and victims[0].charged > 0


def test_not_yet_overdue_preempts_nothing() -> None:
    pol = dispatch_policy()
    w = worker_view("w1", slots=4, used_slots=4)
    snap = snapshot([request("rt", "realtime", waited=0.3)], [w], now=NOW)
    assert decide(snap, pol).reservations == ()


def test_a_kv_hog_gets_the_room_of_as_few_victims_as_needed() -> None:
    """A large realtime request needs 3,000 MiB; small batch requests hold the KV cache."""
    pol = dispatch_policy()
    big = request("big", "realtime", waited=1.0, prompt=10_000, max_tokens=13_000)
    need = need_mib(big, SPEC)
    assert 2800 < need < 3000
    w = worker_view("w1", slots=64, kv=4000, used_slots=10, used_mib=3800)
    small = [request(f"s{i}", "batch", waited=40.0, prompt=50, max_tokens=50) for i in range(5)]
    snap = snapshot([big, *small], [w], now=NOW)
    decision = decide(snap, pol)
    # the batch requests would fit, but the worker is reserved for the big one
    assert decision.batches == () and [r.request_id for r in decision.reservations] == ["big"]
    held = [running(f"h{i}", need=380.0, started=NOW - 10 + i) for i in range(10)]
    victims = choose_victims(decision.reservations, {"w1": held}, snap, pol)
    # it needs 2,875 MiB, 200 are free: 8 x 380 MiB more (7 would leave it 15 MiB
    # short), the latest-started first
    assert [v.request_id for v in victims] == [f"h{i}" for i in range(9, 1, -1)]


def test_a_reserved_worker_admits_lower_classes_nowhere_else_blocked() -> None:
    pol = dispatch_policy()
    big = request("big", "realtime", waited=1.0, prompt=10_000, max_tokens=13_000)
    w1 = worker_view("w1", slots=8, kv=4000, used_slots=2, used_mib=3000)
    w2 = worker_view("w2", slots=8, kv=2000, used_slots=2, used_mib=1500)  # could never hold it
    small = request("s", "batch", waited=40.0, prompt=50, max_tokens=50)
    decision = decide(snapshot([big, small], [w1, w2], now=NOW), pol)
    assert assigned(decision) == {"s": "w2"}
    assert [r.worker_id for r in decision.reservations] == ["w1"]


def test_no_preemption_for_non_preemptible_classes_or_when_it_would_not_help() -> None:
    pol = dispatch_policy()
    w = worker_view("w1", slots=2, kv=6798, used_slots=2, used_mib=280)
    snap = snapshot([request("rt", "realtime", waited=1.0)], [w], now=NOW)
    decision = decide(snap, pol)
    standard = [running("a", "standard"), running("b", "standard")]
    # standard is preemptible by realtime by default (a standard slot hog is a hog too)
    [victim] = choose_victims(decision.reservations, {"w1": standard}, snap, pol)
    assert victim.priority == "standard"
    kept = dispatch_policy(
        [
            c.model_copy(update={"preemptible": False}) if c.name == "standard" else c
            for c in pol.classes
        ]
    )
    assert choose_victims(decision.reservations, {"w1": standard}, snap, kept) == ()
    realtime = [running("a", "realtime"), running("b", "realtime")]
    assert choose_victims(decision.reservations, {"w1": realtime}, snap, pol) == ()


def test_a_request_preempted_often_is_no_victim_and_fewer_preemptions_go_first() -> None:
    """Least progress alone picks the request just dispatched again after its last
    preemption: a light realtime stream would abort it in every gap for ever."""
    pol = dispatch_policy()
    assert pol.max_preemptions == 3
    w = worker_view("w1", slots=2, kv=6798, used_slots=2, used_mib=280)
    snap = snapshot([request("rt", "realtime", waited=1.0)], [w], now=NOW)
    decision = decide(snap, pol)
    # "new" started last but was preempted twice already; "old" never was
    held = [running("new", started=NOW - 1, preemptions=2), running("old", started=NOW - 9)]
    [victim] = choose_victims(decision.reservations, {"w1": held}, snap, pol)
    assert victim.request_id == "old"
    # preempted max_preemptions times: it finishes; the realtime request waits for room
    held = [running("a", preemptions=3), running("b", preemptions=3)]
    assert choose_victims(decision.reservations, {"w1": held}, snap, pol) == ()
    never = dataclasses.replace(pol, max_preemptions=0)
    assert (
        choose_victims(decision.reservations, {"w1": [running("a"), running("b")]}, snap, never)
        == ()
    )


def test_a_reservation_holds_its_worker_against_its_own_class_only_behind_in_vtc() -> None:
    """A large realtime request lacks KV room on its reserved worker. A younger small
    realtime request of a tenant served more does not take the room it waits for; one of
    a tenant VTC serves first, or ties with (a newly active tenant is lifted to the
    lowest backlogged counter), still does: else one tenant's flood of large requests
    would hold a new tenant behind it (measured: 2.76 s, past realtime's 2 s SLA)."""
    pol = dispatch_policy()
    big = request("big", "realtime", waited=2.0, prompt=10_000, max_tokens=13_000, tenant="b")
    small = request("small", "realtime", waited=1.0, prompt=50, max_tokens=50, tenant="s")
    w = worker_view("w1", slots=16, kv=4000, used_slots=10, used_mib=3800)

    def decide_with(counters: dict[str, float]) -> Decision:
        state = FairnessState(
            tenant_counter={"realtime": counters},
            active_tenants={"realtime": frozenset(counters)},
        )
        return decide(snapshot([big, small], [w], now=NOW, fairness=state), pol)

    held = decide_with({"b": 100.0, "s": 9000.0})  # s was served far more: it waits
    assert held.batches == () and [r.request_id for r in held.reservations] == ["big"]
    tied = decide_with({"b": 500.0, "s": 500.0})  # a tie is VTC's to break
    assert assigned(tied) == {"small": "w1"}
    ahead = decide_with({"b": 9000.0, "s": 100.0})  # VTC serves s first: not held back
    assert assigned(ahead) == {"small": "w1"}


def test_an_abort_on_its_way_counts_as_freed_room() -> None:
    pol = dispatch_policy()
    w = worker_view("w1", slots=2, kv=6798, used_slots=2, used_mib=280)
    snap = snapshot([request("rt", "realtime", waited=1.0)], [w], now=NOW)
    decision = decide(snap, pol)
    held = [running("a", aborting=True), running("b")]
    assert choose_victims(decision.reservations, {"w1": held}, snap, pol) == ()


def test_an_overdue_class_goes_before_lower_classes_within_tenant_order() -> None:
    """Only 1 slot: the overdue standard request takes it although batch is older and the
    round-robin credit favours batch."""
    classes = [c.model_copy(update={"aging_s": None}) for c in SETTINGS.classes]
    pol = dispatch_policy(classes)
    w = worker_view("w1", slots=1)
    std = request("std", "standard", waited=6.0)
    old_batch = request("b", "batch", waited=50.0)
    from inferq.policy.snapshot import FairnessState

    fair = FairnessState(class_credit={"realtime": 0.0, "standard": -100.0, "batch": 100.0})
    decision = decide(snapshot([std, old_batch], [w], now=NOW, fairness=fair), pol)
    assert assigned(decision) == {"std": "w1"}


def test_a_preempted_tenant_is_charged_only_for_the_tokens_used() -> None:
    """Charged 10 + 2 x 1,100 at dispatch; 300 tokens generated: 600 used, the rest back."""
    charged = vtc_cost(10, 1100, 2.0)
    assert preemption_refund(charged, 10, 300, 2.0) == charged - (10 + 2.0 * 300)
    assert preemption_refund(charged, 10, 0, 2.0, started=False) == charged  # never started
    assert preemption_refund(5.0, 10, 300, 2.0) == 0.0  # never more than was charged
    assert refunded_counter(100.0, 250.0) == 0.0 and refunded_counter(100.0, 0.0) == 100.0


@given(
    st.floats(0, 1e6),
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    st.sampled_from([0.0, 1.0, 2.0, 4.0]),
)
def test_a_refund_leaves_the_counter_charged_with_what_was_used(
    charged: float, prompt: int, generated: int, weight: float
) -> None:
    refund = preemption_refund(charged, prompt, generated, weight)
    used = vtc_cost(prompt, generated, weight)
    assert 0.0 <= refund <= charged
    assert abs((charged - refund) - min(charged, used)) <= 1e-6 * max(1.0, charged)


# --- properties ----------------------------------------------------------------------------


def _overdue(req: QueuedRequest, pol: DispatchPolicy, now: float) -> bool:
    bound = pol.class_by_name[req.priority].may_preempt_after_s
    return bound is not None and now - req.submitted_at >= bound


def _fits_at_end(
    req: QueuedRequest, wid: str, snap: Snapshot, pol: DispatchPolicy, decision: Decision
) -> bool:
    reqs = requests_of(snap)
    w = next(w for w in snap.workers if w.id == wid)
    batch = next((b for b in decision.batches if b.worker_id == wid), None)
    items = batch.items if batch else ()
    tokens = req.prompt_tokens + req.max_tokens
    used = sum(reqs[a.request_id].prompt_tokens + reqs[a.request_id].max_tokens for a in items)
    if len(items) >= pol.max_batch or (items and used + tokens > pol.batch_token_budget):
        return False
    after = dataclasses.replace(
        w,
        reserved_slots=w.reserved_slots + len(items),
        reserved_mib=w.reserved_mib + sum(a.need_mib for a in items) + 1e-6,
    )
    return eligible(after, req, pol, snap.now)


@PROPS
@given(case_st())
def test_no_overdue_request_waits_while_a_lower_class_takes_a_worker_it_could_use(
    case: tuple[Snapshot, DispatchPolicy],
) -> None:
    """Issue 12's property: a request past its class's preemption bound (at most its SLA)
    is never left waiting while this decision admits lower-class work onto a worker that
    could have taken it; a worker reserved for it admits no lower class at all."""
    snap, pol = case
    decision = decide(snap, pol)
    placed = assigned(decision)
    skip = {rid for rid, _ in decision.expired} | {rid for rid, _ in decision.unschedulable}
    rank = {c.name: i for i, c in enumerate(pol.classes)}
    reqs = requests_of(snap)
    lower_on: dict[str, int] = {}
    for b in decision.batches:
        lower_on[b.worker_id] = max(rank[a.priority] for a in b.items)
    for rid, req in reqs.items():
        if rid in placed or rid in skip or not _overdue(req, pol, snap.now):
            continue
        if may_be_held(req, pol, snap.now):
            continue
        for wid, lowest in lower_on.items():
            if lowest > rank[req.priority]:
                assert not _fits_at_end(req, wid, snap, pol, decision), (req, wid)
    for res in decision.reservations:
        assert res.request_id not in placed
        assert lower_on.get(res.worker_id, -1) <= res.rank


@st.composite
def victims_case_st(draw: st.DrawFn) -> tuple[Reservation, list[RunningRequest], Snapshot]:
    slots = draw(st.integers(1, 8))
    held_n = draw(st.integers(0, slots))
    held = [
        running(
            f"h{i}",
            draw(st.sampled_from(["realtime", "standard", "batch"])),
            started=NOW - draw(st.floats(0, 100)),
            need=float(draw(st.integers(0, 2000))),
            aborting=draw(st.booleans()),
        )
        for i in range(held_n)
    ]
    kv = float(draw(st.integers(0, 10_000))) + sum(h.need_mib for h in held)
    w = worker_view(
        "w1", slots=slots, kv=kv, used_slots=held_n, used_mib=sum(h.need_mib for h in held)
    )
    cls = draw(st.sampled_from(["realtime", "standard"]))
    need = float(draw(st.integers(1, 12_000)))
    res = Reservation("w1", "x", cls, ["realtime", "standard"].index(cls), need, 0.0, 0, 1.0)
    return res, held, snapshot([], [w], now=NOW)


@PROPS
@given(victims_case_st())
def test_victims_are_lower_preemptible_and_no_more_than_needed(
    case: tuple[Reservation, list[RunningRequest], Snapshot],
) -> None:
    res, held, snap = case
    pol = dispatch_policy()
    w = snap.workers[0]
    victims = choose_victims([res], {"w1": held}, snap, pol)
    by_id = {h.id: h for h in held}
    chosen = [by_id[v.request_id] for v in victims]
    rank = {c.name: i for i, c in enumerate(pol.classes)}
    assert all(
        not h.aborting and rank[h.priority] > res.rank and pol.class_by_name[h.priority].preemptible
        for h in chosen
    )
    freeing = [h for h in held if h.aborting]

    def room(extra: list[RunningRequest]) -> tuple[int, float]:
        gone = freeing + extra
        return w.free_slots + len(gone), w.free_mib + sum(h.need_mib for h in gone)

    def fits(extra: list[RunningRequest]) -> bool:
        slots, mib = room(extra)
        return slots >= 1 and mib >= res.need_mib

    if fits([]):
        assert chosen == []
    elif chosen:
        assert fits(chosen) and not fits(chosen[:-1])  # enough, and none too many
    else:  # nobody chosen: even every eligible request would not make room
        eligible_all = [
            h
            for h in held
            if not h.aborting
            and rank[h.priority] > res.rank
            and pol.class_by_name[h.priority].preemptible
        ]
        assert not fits(eligible_all)


def _reserve_reference(urgent, workers, policy, now):  # type: ignore[no-untyped-def]
    """reserve() as first written (every worker scored for every request), the oracle of
    the indexed version issue 17 made fast."""
    rank = {c.name: i for i, c in enumerate(policy.classes)}
    ordered = sorted(urgent, key=lambda r: (rank.get(r.priority, len(rank)), r.submitted_at, r.id))
    taken: set[str] = set()
    out = []
    for req in ordered:
        models = serving_models(req, policy, now)
        order = {m: i for i, m in enumerate(models)}
        best = None
        for w in workers:
            if not w.ready or w.id in taken or w.model not in order or w.slots < 1:
                continue
            need = need_mib(req, policy.model_by_name[w.model])
            if need > w.kv_cache_mib:
                continue
            key = (
                max(0.0, need - w.free_mib),
                0 if w.free_slots >= 1 else 1,
                order[w.model],
                w.utilisation,
                w.id,
            )
            if best is None or key < best[0]:
                best = (key, w)
        if best is not None:
            taken.add(best[1].id)
            out.append((req.id, best[1].id, best[0][0], best[0][1]))
    return out


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["llama-3.1-8b", "llama-2-13b", "llama-3.1-70b-awq"]),
            st.integers(1, 4),  # slots
            st.integers(0, 4),  # used slots
            st.sampled_from([2_000.0, 8_000.0, 16_384.0]),  # KV cache MiB
            st.sampled_from([0.0, 500.0, 1_500.0, 7_000.0]),  # reserved MiB
            st.booleans(),  # ready
        ),
        max_size=12,
    ),
    st.lists(
        st.tuples(
            st.sampled_from(["realtime", "standard"]),
            st.sampled_from(["llama-3.1-8b", ">=13b", "llama-2-13b"]),
            st.sampled_from([10, 2_000, 30_000]),  # prompt tokens
            st.integers(0, 50),  # submitted (s)
        ),
        max_size=10,
    ),
)
def test_reserve_picks_what_scoring_every_worker_picks(fleet, waiting) -> None:  # type: ignore[no-untyped-def]
    policy = dispatch_policy()
    workers = [
        worker_view(
            f"w{i}", m, slots=s, used_slots=min(u, s), kv=kv, used_mib=min(mib, kv), ready=r
        )
        for i, (m, s, u, kv, mib, r) in enumerate(fleet)
    ]
    urgent = [
        queued_request(f"r{i}", c, route=route, prompt=prompt, submitted_at=float(at), now=100.0)
        for i, (c, route, prompt, at) in enumerate(waiting)
    ]
    got = [
        (r.request_id, r.worker_id, r.missing_mib, r.missing_slots)
        for r in reserve(urgent, workers, policy, 100.0)
    ]
    assert got == _reserve_reference(urgent, workers, policy, 100.0)
