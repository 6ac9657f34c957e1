"""Batching: per-worker batch limits and the batching delay."""

from __future__ import annotations

import pytest

from inferq.config import Settings
from inferq.policy.batching import OpenBatch, held_back
from inferq.policy.dispatch import decide
from inferq.policy.snapshot import DispatchPolicy, QueuedRequest, Snapshot, WorkerView

from ..builders import assignment, queued_request, worker_view

SETTINGS = Settings()
SPEC = {m.name: m for m in SETTINGS.models}["llama-3.1-8b"]
NOW = 1_000.0


def wk(wid: str = "w", slots: int = 4, kv: float = 10_000, used: int = 0) -> WorkerView:
    return worker_view(wid, SPEC.name, slots=slots, kv=kv, used_slots=used)


item = assignment


def req(
    rid: str, priority: str = "standard", *, waited: float = 0.0, tokens: int = 200
) -> QueuedRequest:
    return queued_request(
        rid, priority, route=SPEC.name, tenant="t", now=NOW, waited=waited, deadline=NOW + 100,
        prompt=tokens // 2, max_tokens=tokens - tokens // 2,
    )  # fmt: skip


def policy(**kw: object) -> DispatchPolicy:
    classes = [
        c.model_copy(update={"batch_delay_s": 2.0 if c.name != "realtime" else 0.0})
        for c in SETTINGS.classes
    ]
    return DispatchPolicy.from_settings(SETTINGS, classes=tuple(classes), **kw)


def ids(snapshot: Snapshot, pol: DispatchPolicy) -> list[list[str]]:
    return [[a.request_id for a in b.items] for b in decide(snapshot, pol).batches]


# --- OpenBatch -----------------------------------------------------------------------


def test_room_counts_slots_after_reservations() -> None:
    batch = OpenBatch(worker=wk(slots=3, used=1), spec=SPEC)
    assert batch.free_slots == 2 and batch.fill_target(max_batch=32) == 2
    batch.add(item("a"), 10)
    assert batch.has_room(10, 1.0, 32, 1000)
    batch.add(item("b"), 10)
    assert not batch.has_room(10, 1.0, 32, 1000) and batch.closed(32)


def test_room_counts_vram_of_the_batch() -> None:
    batch = OpenBatch(worker=wk(kv=250.0), spec=SPEC)
    batch.add(item("a", need=200.0), 10)
    assert batch.free_mib == 50.0
    assert batch.has_room(10, 50.0, 32, 1000)
    assert not batch.has_room(10, 50.5, 32, 1000)


def test_room_respects_max_batch_and_token_budget() -> None:
    batch = OpenBatch(worker=wk(slots=8), spec=SPEC)
    # a lone request above the budget still forms a batch, or it could never run
    assert batch.has_room(5000, 1.0, 32, 1000)
    batch.add(item("a"), 600)
    assert not batch.has_room(401, 1.0, 32, 1000)
    assert batch.has_room(400, 1.0, 32, 1000)
    assert not batch.has_room(1, 1.0, 1, 1000)
    assert batch.fill_target(max_batch=3) == 2


def test_to_batch_keeps_dispatch_order() -> None:
    batch = OpenBatch(worker=wk(), spec=SPEC)
    batch.add(item("a"), 1)
    batch.add(item("b"), 1)
    done = batch.to_batch()
    assert (done.worker_id, done.model) == ("w", SPEC.name)
    assert [a.request_id for a in done.items] == ["a", "b"]


# --- the batching delay -------------------------------------------------------------


@pytest.mark.parametrize(
    ("delay", "waited", "fillable", "target", "aging", "held"),
    [
        (0.0, 0.0, 1, 8, None, False),  # realtime: never held
        (2.0, 0.5, 3, 8, None, True),  # young, cannot fill
        (2.0, 0.5, 8, 8, None, False),  # young, but fills the batch
        (2.0, 2.0, 1, 8, None, False),  # waited its delay
        (2.0, 1.5, 1, 8, 1.0, False),  # past its aging bound
    ],
)
def test_held_back_rule(
    delay: float, waited: float, fillable: int, target: int, aging: float | None, held: bool
) -> None:
    cls = SETTINGS.classes[1].model_copy(update={"batch_delay_s": delay, "aging_s": aging})
    assert held_back(cls, waited, fillable, target) is held


def test_young_requests_wait_until_they_fill_the_worker() -> None:
    three = [req(f"s{i}", waited=0.1) for i in range(3)]
    snap = Snapshot(now=NOW, queued={"standard": three}, workers=[wk(slots=4)])
    assert ids(snap, policy()) == []
    four = [*three, req("s3", waited=0.1)]
    snap = Snapshot(now=NOW, queued={"standard": four}, workers=[wk(slots=4)])
    assert ids(snap, policy()) == [["s0", "s1", "s2", "s3"]]


def test_delay_over_means_dispatch_alone() -> None:
    snap = Snapshot(now=NOW, queued={"standard": [req("s", waited=2.0)]}, workers=[wk(slots=4)])
    assert ids(snap, policy()) == [["s"]]


def test_realtime_is_never_held() -> None:
    snap = Snapshot(now=NOW, queued={"realtime": [req("r", "realtime")]}, workers=[wk(slots=4)])
    assert ids(snap, policy()) == [["r"]]


def test_fill_target_is_what_is_left_of_the_worker() -> None:
    # a worker with one free slot is filled by a single young request
    snap = Snapshot(
        now=NOW, queued={"standard": [req("s", waited=0.1)]}, workers=[wk(slots=4, used=3)]
    )
    assert ids(snap, policy()) == [["s"]]
    # so is a batch capped at max_batch 1
    snap = Snapshot(now=NOW, queued={"standard": [req("s", waited=0.1)]}, workers=[wk(slots=4)])
    assert ids(snap, policy(max_batch=1)) == [["s"]]


def test_batches_split_by_max_batch_and_token_budget() -> None:
    reqs = [req(f"r{i}", "realtime", tokens=600) for i in range(4)]
    two = [wk("a", slots=8), wk("b", slots=8)]
    snap = Snapshot(now=NOW, queued={"realtime": reqs}, workers=two)
    assert ids(snap, policy(max_batch=3)) == [["r0", "r1", "r2"], ["r3"]]
    # 1000-token budget: one 600-token request per batch, one batch per worker
    assert ids(snap, policy(batch_token_budget=1000)) == [["r0"], ["r1"]]
    assert ids(snap, policy(batch_token_budget=1200)) == [["r0", "r1"], ["r2", "r3"]]
