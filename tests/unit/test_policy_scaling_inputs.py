"""The scaler daemon on the real Redis with a recording backend; loads and the CLI command."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from inferq.config import ModelSpec, Settings
from inferq.models import Event, WorkerState
from inferq.policy.scaling_inputs import (
    LiveWorker,
    LoadInputs,
    ReconciledFleet,
    ServiceLog,
    Tracked,
    arrival_rates,
    backlog,
    build_loads,
    reconcile,
    route_model,
    service_logs,
    service_times,
)
from inferq.scaler.daemon import new_worker_id

MODEL = "llama-3.1-8b"


# --- the daemon ---------------------------------------------------------------------


def test_worker_ids_fit_the_id_pattern() -> None:
    wid = new_worker_id("llama-3.1-8b")
    assert wid.startswith("llama-3-1-8b-") and len(wid) <= 64
    assert new_worker_id("llama-3.1-8b") != wid


# --- loads (pure) -------------------------------------------------------------------


def registry() -> list[ModelSpec]:
    return Settings.load().models


def test_backlog_is_charged_to_the_first_managed_candidate() -> None:
    reg = registry()
    managed = [MODEL, "llama-3.1-70b-awq"]
    assert route_model(">=13b", reg, managed) == "llama-3.1-70b-awq"  # 13b is not managed
    assert route_model(">=1b", reg, managed) == MODEL
    assert route_model("llama-2-13b", reg, managed) is None
    assert route_model("not a route!", reg, managed) is None
    depths = [
        ("realtime", MODEL, 3, 1.5),
        ("realtime", ">=1b", 2, 4.0),
        ("batch", ">=13b", 5, 9.0),
        ("batch", MODEL, 0, None),
    ]
    out = backlog(depths, reg, managed)
    assert out[MODEL] == ({"realtime": 5}, {"realtime": 4.0})
    assert out["llama-3.1-70b-awq"] == ({"batch": 5}, {"batch": 9.0})


def test_rates_and_service_times_come_from_the_events() -> None:
    reg = registry()
    events = [
        Event(id="1-0", type="submit", at=1.0, fields={"route": MODEL}),
        Event(id="2-0", type="submit", at=2.0, fields={"route": ">=60b"}),
        Event(id="3-0", type="submit", at=3.0, fields={"route": MODEL}),
        Event(
            id="4-0",
            type="finish",
            at=4.0,
            fields={
                "worker": "w1",
                "e2e_ms": "900",
                "queue_ms": "100",
                "ptokens": "100",
                "tokens": "10",
            },
        ),
        Event(
            id="5-0",
            type="finish",
            at=5.0,
            fields={
                "worker": "w1",
                "e2e_ms": "1500",
                "queue_ms": "300",
                "ptokens": "300",
                "tokens": "30",
            },
        ),
        Event(id="6-0", type="finish", at=6.0, fields={"worker": "w1", "e2e_ms": "oops"}),
        Event(
            id="7-0",
            type="finish",
            at=7.0,
            fields={"worker": "gone", "e2e_ms": "10", "queue_ms": "1"},
        ),
    ]
    assert arrival_rates(events, 4.0, reg, [MODEL, "llama-3.1-70b-awq"]) == {
        MODEL: 0.5,
        "llama-3.1-70b-awq": 0.25,
    }
    [stats] = service_times(events, {"w1": MODEL}).values()
    assert (stats.service_s, stats.prompt_tokens, stats.output_tokens) == pytest.approx(
        (1.0, 200.0, 20.0)
    )
    assert stats.class_service_s == {}  # finishes naming no class: none per class


def test_service_times_per_class_weigh_the_queue_by_its_classes() -> None:
    """Issue 24, item 5: each class's finishes give its own service mean, so the
    scaler counts a queued request as its class's work, not the window's mean."""

    def finish(i: int, cls: str, service_ms: int) -> Event:
        fields = {"worker": "w1", "class": cls, "e2e_ms": str(service_ms + 50)}
        return Event(id=f"{i}-0", type="finish", at=float(i), fields=fields | {"queue_ms": "50"})

    events = [finish(i, "batch", 9000 if i % 2 else 7000) for i in range(10)]
    events += [finish(10 + i, "standard", 1000) for i in range(5)]
    events += [finish(20 + i, "realtime", 600_000) for i in range(4)]  # too few to trust
    [stats] = service_times(events, {"w1": MODEL}).values()
    mean = (80 + 5 + 2400) / 19
    assert stats.service_s == pytest.approx(mean)
    assert stats.class_service_s == pytest.approx({"batch": 8.0, "standard": 1.0})
    depths = [("batch", MODEL, 10, 3.0), ("standard", MODEL, 10, 1.0)]
    inputs = LoadInputs(
        depths=depths,
        live=[LiveWorker("w1", MODEL, WorkerState.READY, 8)],
        fleet=ReconciledFleet(tracked={}),
        arrivals={},
        service={MODEL: stats},
        fallback_service_s={MODEL: 1.0},
        default_slots=8,
    )
    [load] = build_loads([MODEL], registry(), inputs, now=10.0)
    assert load.queued_work == pytest.approx(10 * 8 / mean + 10 * 1 / mean)


def test_a_service_log_reads_what_runs_from_the_events_not_the_heartbeat() -> None:
    """Issue 24, item 5: the censoring correction counts the requests running now from
    the load hash (exact), enters them at the rate they were dispatched at, and reads
    which ones still run from the events."""

    def ev(i: int, etype: str, **fields: str) -> Event:
        return Event(id=f"{i}-0", type=etype, at=float(i), fields={"worker": "w1"} | fields)

    events = [
        ev(1, "dispatch", n="3", ids="a,b,c"),
        ev(2, "finish", id="a", e2e_ms="1100", queue_ms="100"),
        ev(2, "preempt", id="b"),  # back to the queue: no longer running
        ev(3, "dispatch", n="1", ids="d"),
        ev(3, "dispatch", n="x", ids=""),  # no ids: skipped
        ev(3, "dispatch", n="1" + "0" * 400, ids="e"),  # an n no id backs: counts 1
        ev(3, "finish", id="e", e2e_ms="9" * 311, queue_ms="0"),  # corrupt: not a finish
    ]
    [log] = service_logs(events, {"w1": MODEL}, start=-6.0, end=4.0).values()
    assert list(log.dispatches) == [(1.0, 3), (3.0, 1), (3.0, 1)]
    assert list(log.finishes) == [(2.0, 1.0)]
    assert sorted(log.running_since) == [1.0, 3.0]  # c and d
    # Little: the last 2 requests dispatched entered over the last 1 s -> 2 / 2 = 1 s;
    # time on test: (1 s finished + 3 s + 1 s running) / 1 finish = 5 s
    assert log.in_service_s(2) == pytest.approx(1.0)
    stale = LiveWorker("w1", MODEL, WorkerState.READY, 16, in_flight=15, reserved=2)
    inputs = LoadInputs(
        depths=[],
        live=[stale],
        fleet=ReconciledFleet(tracked={}),
        arrivals={},
        service={},
        fallback_service_s={MODEL: 1.0},
        default_slots=16,
        rate_window_s=10.0,
    )
    [unknown] = build_loads([MODEL], registry(), inputs, now=4.0)
    logs = {MODEL: log}
    [known] = build_loads([MODEL], registry(), replace(inputs, service_logs=logs), now=4.0)
    # the heartbeat's 15 would read as 30 s each; the load hash's 2 are what runs
    assert (unknown.in_service_s, known.in_service_s) == (None, pytest.approx(1.0))


@pytest.mark.parametrize(
    ("etype", "fields"),
    [
        ("expire", {"reason": "deadline before start"}),  # start.lua
        ("cancel", {"usage": ""}),  # cancel.lua
        ("retry", {"attempt": "1", "worker": ""}),  # a lease reaped: requeue.lua
        ("dead_letter", {"error": "x"}),
        ("expire", {"reason": "deadline after preemption"}),
    ],
)
def test_a_run_ended_by_an_event_without_a_worker_is_no_longer_running(
    etype: str, fields: dict[str, str]
) -> None:
    events = [
        Event(id="1-0", type="dispatch", at=1.0, fields={"worker": "w1", "n": "2", "ids": "a,b"}),
        Event(id="2-0", type=etype, at=2.0, fields={"id": "a", **fields}),
    ]
    [log] = service_logs(events, {"w1": MODEL}, start=0.0, end=4.0).values()
    assert list(log.running_since) == [1.0]  # b only


def test_a_service_log_stays_finite_and_continuous_on_hostile_counts() -> None:
    """The helper's attack on issue 24's correction: a corrupt ``reserved`` count, a
    window with no dispatch, and a read capped short of now."""
    finishes = [(1000.0 - i, 0.5) for i in range(5)]
    # 50 running since before the window, 5 short finishes, no dispatch: the time on
    # test alone, (5 x 0.5 + 50 x 10) / 5 s, not 0 (which switched the correction off)
    quiet = ServiceLog(990.0, 1000.0, finishes=finishes)
    assert quiet.in_service_s(50) == pytest.approx(100.5)
    with_one = ServiceLog(990.0, 1000.0, [(995.0, 1)], finishes, [995.0])
    assert with_one.in_service_s(50) == pytest.approx((2.5 + 5.0 + 49 * 10.0) / 5)
    # a load hash claiming 10**12 running builds no list of that length
    assert math.isfinite(quiet.in_service_s(10**12))
    # a read capped at 995 s ends the window there: nothing after it is missing
    capped = ServiceLog(990.0, 995.0, [(994.0, 1)], [(994.5, 0.5)], [994.0])
    assert capped.in_service_s(1) == pytest.approx(1.0)


def test_corrupt_finishes_are_skipped_by_the_service_means() -> None:
    def finish(i: int, **fields: str) -> Event:
        base = {"worker": "w1", "class": "batch", "e2e_ms": "1100", "queue_ms": "100"}
        return Event(id=f"{i}-0", type="finish", at=float(i), fields=base | fields)

    events = [
        finish(1),
        finish(2, e2e_ms="9" * 311),  # overflows a float
        finish(3, e2e_ms=str(10**9)),  # 11 days of service
        finish(4, ptokens="-5"),
        finish(5, tokens="1" + "0" * 400),
    ]
    [stats] = service_times(events, {"w1": MODEL}).values()
    assert (stats.service_s, stats.prompt_tokens, stats.output_tokens) == (1.0, 0.0, 0.0)


def test_reconcile_counts_listed_unregistered_workers_as_starting_until_timeouts() -> None:
    ready = LiveWorker("live", MODEL, WorkerState.READY, 8)
    listed = {"live": MODEL, "new": MODEL, "was-live": MODEL, "drained": MODEL}
    tracked = {
        "was-live": Tracked(MODEL, 0.0, seen_live=True),
        "drained": Tracked(MODEL, 0.0, seen_live=True, draining_since=5.0),
        "forgotten": Tracked(MODEL, 0.0, seen_live=True),
    }
    f = reconcile(tracked, [ready], listed, 10.0, start_timeout_s=60, lost_grace_s=5)
    assert f.starting == {MODEL: 2}  # new, and was-live within its grace
    assert f.to_stop == {"drained": "drained and deregistered"}
    assert "forgotten" not in f.tracked  # neither live nor listed
    later = reconcile(f.tracked, [ready], listed, 16.0, start_timeout_s=60, lost_grace_s=5)
    assert set(later.to_stop) == {"drained", "was-live"} and later.starting == {MODEL: 1}
    last = reconcile(later.tracked, [ready], listed, 71.0, start_timeout_s=60, lost_grace_s=5)
    assert "failed to start" in last.to_stop["new"] and last.starting == {}


def test_reconcile_stops_a_worker_that_drained_on_its_own_as_soon_as_it_left() -> None:
    draining = LiveWorker("w1", MODEL, WorkerState.DRAINING, 8)
    f = reconcile({}, [draining], {"w1": MODEL}, 1.0, start_timeout_s=60, lost_grace_s=5)
    assert f.tracked["w1"].draining_since == 1.0 and f.to_stop == {}
    gone = reconcile(f.tracked, [], {"w1": MODEL}, 2.0, start_timeout_s=60, lost_grace_s=5)
    assert gone.to_stop == {"w1": "drained and deregistered"} and gone.starting == {}


@st.composite
def fleets(draw: st.DrawFn) -> tuple[dict[str, Tracked], list[LiveWorker], dict[str, str], float]:
    ids = [f"w{i}" for i in range(8)]
    live_ids = draw(st.sets(st.sampled_from(ids)))
    listed = draw(st.sets(st.sampled_from(ids)))
    tracked = {
        w: Tracked(
            MODEL,
            draw(st.floats(0, 100)),
            seen_live=draw(st.booleans()),
            absent_since=draw(st.none() | st.floats(0, 100)),
            draining_since=draw(st.none() | st.floats(0, 100)),
        )
        for w in draw(st.sets(st.sampled_from(ids)))
    }
    live = [
        LiveWorker(w, MODEL, draw(st.sampled_from(list(WorkerState))), 4, draw(st.integers(0, 4)))
        for w in sorted(live_ids)
    ]
    return tracked, live, {w: MODEL for w in listed}, draw(st.floats(100, 1000))


@hsettings(max_examples=200, deadline=None)
@given(fleets())
def test_reconcile_never_stops_a_worker_with_a_heartbeat(
    fleet: tuple[dict[str, Tracked], list[LiveWorker], dict[str, str], float],
) -> None:
    tracked, live, listed, now = fleet
    f = reconcile(tracked, live, listed, now, start_timeout_s=10, lost_grace_s=5)
    live_ids = {w.id for w in live}
    assert not live_ids & set(f.to_stop)
    assert set(f.to_stop) <= set(listed)
    assert set(f.tracked) == live_ids | set(listed)
    for w in live:  # busy now means idle for 0 s
        assert f.tracked[w.id].seen_live and (not w.busy or f.tracked[w.id].last_busy_at == now)
    assert sum(f.starting.values()) + len(f.to_stop) == len(set(listed) - live_ids)


# --- the CLI command ----------------------------------------------------------------
