"""The store and its Lua scripts, against the real Redis (one namespace per test)."""

from __future__ import annotations

import time

import pytest

from inferq.config import PriorityClass, Settings
from inferq.errors import QueueFull, RequestNotFound
from inferq.models import RequestState, WorkerState, to_ms
from inferq.store import Abort, Completion, Store, calls

from ..builders import inference_request
from ..helpers import queue_key, ready_worker


def test_submit_writes_record_queue_deadline_and_counts(store: Store, settings: Settings) -> None:
    req = inference_request(settings, priority="realtime", tenant="acme")
    out = store.submit(req)
    assert out.id == req.id and not out.duplicate
    rec = store.record(req.id)
    assert rec.state is RequestState.QUEUED
    assert rec.request.payload.prompt == "hello world"
    assert store.redis.zscore(queue_key(store, req), req.id) is not None
    assert store.redis.zscore(store.keys.deadlines, req.id) is not None
    counts = store.queued_counts()
    assert counts["c:realtime"] == 1 and counts["t:realtime:acme"] == 1
    assert [e.type for e in store.events()] == ["submit"]


def test_idempotency_key_returns_the_first_request(store: Store, settings: Settings) -> None:
    first = store.submit(inference_request(settings, idempotency_key="order-42"))
    again = store.submit(inference_request(settings, idempotency_key="order-42"))
    assert again.duplicate and again.id == first.id
    assert store.queued_counts()["c:standard"] == 1


def test_class_queue_limit_refuses_and_writes_nothing(redis_client, namespace: str) -> None:  # type: ignore[no-untyped-def]
    classes = [
        PriorityClass(
            name="realtime", sla_s=2, timeout_s=10, weight=8, batch_delay_s=0, queue_limit=2
        ),
        PriorityClass(name="standard", sla_s=10, timeout_s=60, weight=3, batch_delay_s=0),
    ]
    settings = Settings.load(namespace=namespace, classes=classes, classifier={})
    store = Store(redis_client, settings)
    for _ in range(2):
        store.submit(inference_request(settings, priority="realtime"))
    refused = inference_request(settings, priority="realtime")
    with pytest.raises(QueueFull) as info:
        store.submit(refused)
    assert info.value.priority == "realtime" and info.value.limit == 2
    assert "class 'realtime'" in str(info.value) and "limit 2" in str(info.value)
    assert not store.redis.exists(store.keys.req(refused.id))
    assert store.queued_counts()["c:realtime"] == 2
    store.submit(inference_request(settings, priority="standard"))  # other classes unaffected


def test_tenant_limit_leaves_other_tenants_unaffected(redis_client, namespace: str) -> None:  # type: ignore[no-untyped-def]
    classes = [
        PriorityClass(
            name="standard", sla_s=10, timeout_s=60, weight=3, batch_delay_s=0, tenant_queue_limit=3
        )
    ]
    settings = Settings.load(namespace=namespace, classes=classes, classifier={})
    store = Store(redis_client, settings)
    for _ in range(3):
        store.submit(inference_request(settings, tenant="flood"))
    with pytest.raises(QueueFull, match="tenant 'flood' in class 'standard'") as info:
        store.submit(inference_request(settings, tenant="flood"))
    assert info.value.tenant == "flood" and info.value.limit == 3
    store.submit(inference_request(settings, tenant="polite"))


def test_assign_is_a_compare_and_set(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    ready_worker(store, "w2")
    reqs = [inference_request(settings) for _ in range(3)]
    for r in reqs:
        store.submit(r)
    items = [(r.id, queue_key(store, r), 10.0) for r in reqs]
    first = store.assign("w1", "b1", items)
    assert [rid for rid, _ in first] == [r.id for r in reqs]
    assert all(attempt == 1 for _, attempt in first)
    assert store.assign("w2", "b2", items) == []  # already taken
    load = store.redis.hgetall(store.keys.load("w1"))
    assert int(load["slots"]) == 3 and float(load["mib"]) == pytest.approx(30.0)
    assert store.queued_counts().get("c:standard", 0) == 0
    rec = store.record(reqs[0].id)
    assert rec.state is RequestState.ASSIGNED and rec.worker == "w1" and rec.attempt == 1


def test_an_assign_resent_after_a_lost_reply_returns_its_own_claims(
    store: Store, settings: Settings
) -> None:
    """redis-py resends a call whose reply timed out (``retry_on_error``: TimeoutError),
    and the first run already claimed the batch: the resend found nothing queued and
    answered [], so the dispatcher sent no job and the requests sat assigned to the
    worker until its orphan check handed them back a lease later (5 s: realtime's SLA
    gone; seen with socket_timeout=0.05 under load). The same batch id claims nothing
    more and returns what it claimed, once."""
    ready_worker(store, "w1")
    reqs = [inference_request(settings) for _ in range(2)]
    for r in reqs:
        store.submit(r)
    items = [(r.id, queue_key(store, r), 10.0) for r in reqs]
    first = store.assign("w1", "b1", items)
    assert store.assign("w1", "b1", items) == first
    load = store.redis.hgetall(store.keys.load("w1"))
    assert int(load["slots"]) == 2 and float(load["mib"]) == pytest.approx(20.0)
    assert all(store.record(r.id).attempt == 1 for r in reqs)
    assert sum(e.type == "dispatch" for e in store.events(count=100)) == 1
    assert store.assign("w1", "b2", items) == []  # another batch: taken


def test_a_start_resent_after_a_lost_reply_still_runs_its_batch(
    store: Store, settings: Settings
) -> None:
    """The worker's start call resent by redis-py after its reply timed out found its
    requests already running and answered 'stale': the worker ran nothing and they sat
    running on it until its orphan check a lease later. The same call (its token) again
    answers 'run'; another start of the same attempts (a batch job delivered twice)
    still answers 'stale'."""
    ready_worker(store, "w1")
    reqs = [inference_request(settings) for _ in range(2)]
    for r in reqs:
        store.submit(r)
    claimed = store.assign("w1", "b1", [(r.id, queue_key(store, r), 10.0) for r in reqs])
    call = calls.start_call(store.keys, settings, "w1", claimed, token="t-1")
    assert calls.parse_start(store._call(call)) == ["run", "run"]
    assert calls.parse_start(store._call(call)) == ["run", "run"]  # the resend
    assert store.start("w1", claimed) == ["stale", "stale"]  # a second delivery


def test_a_reservation_that_does_not_parse_reads_as_nothing_reserved(store: Store) -> None:
    """The worker reads its reservation for every heartbeat, its first included: a
    ``load:<w>`` mib that is not a number (left while the worker was away, where no
    dispatcher's repair looks) raised ValueError, so ``inferq worker`` died at start,
    every restart again, and the fleet lost that worker for good. It reads as 0; the
    dispatcher's repair rebuilds the hash once the worker is in the fleet."""
    store.redis.hset(store.keys.load("w9"), mapping={"slots": "1", "mib": "lots"})
    assert store.reserved_mib("w9") == 0.0
    store.redis.hset(store.keys.load("w9"), "mib", "12.5")
    assert store.reserved_mib("w9") == 12.5
    store.redis.delete(store.keys.load("w9"))
    store.redis.set(store.keys.load("w9"), "not a hash")  # WRONGTYPE killed it the same way
    assert store.reserved_mib("w9") == 0.0


def test_a_load_hash_of_inf_or_nan_slots_reads_as_no_reservation(store: Store) -> None:
    """The scaler's decisions read every worker's load hash: ``slots`` of inf raised
    OverflowError (``int(float('inf'))``), which no caller expected (found attacking
    issue 24's scaler change); it reads as unreadable, 0."""
    for bad in ("inf", "nan", "-inf"):
        store.redis.hset(store.keys.load("w9"), mapping={"slots": bad, "mib": "1"})
        assert store.worker_reservations(["w9"]) == {"w9": 0}
        assert store.worker_loads(["w9"]) == {"w9": (0, 0.0)}


def test_a_corrupt_reservation_does_not_strand_a_finishing_request(
    store: Store, settings: Settings
) -> None:
    """release.lua took the request out of the leases and inflight:<w>, then failed on a
    load:<w> mib that is not a number (Lua does not roll back): the request stayed
    running, in no lease and no in-flight set, so no reaper or orphan check would ever
    end it. The load's arithmetic is skipped for a corrupt load (the dispatcher rebuilds
    it), and the result is written."""
    ready_worker(store, "w1")
    req = inference_request(settings)
    store.submit(req)
    [(rid, attempt)] = store.assign("w1", "b1", [(req.id, queue_key(store, req), 10.0)])
    assert store.start("w1", [(rid, attempt)]) == ["run"]
    store.redis.hset(store.keys.load("w1"), "mib", "lots")
    done = store.complete("w1", [Completion(rid, attempt, "succeeded", output="ok")])
    assert done == ["ok"]
    assert store.record(rid).state is RequestState.SUCCEEDED


def test_start_and_read_starts_and_reads_in_one_call(store: Store, settings: Settings) -> None:
    """The records come back for the pairs that may run, read after the start (running);
    a server without the script cached (NOSCRIPT: here a wrong digest) still starts them."""
    ready_worker(store, "w1")
    reqs = [inference_request(settings) for _ in range(3)]
    for r in reqs:
        store.submit(r)
    claimed = store.assign("w1", "b1", [(r.id, queue_key(store, r), 1.0) for r in reqs[:2]])
    pairs = [*claimed, (reqs[2].id, 1)]  # the third was never claimed: stale
    verdicts, records = store.start_and_read("w1", pairs[:1] + pairs[2:])
    assert verdicts == ["run", "stale"]
    assert records[0] is not None and records[0].state is RequestState.RUNNING
    assert records[1] is None
    store._scripts["start"].sha = "0" * 40  # not in the server's cache
    verdicts, records = store.start_and_read("w1", pairs[1:2])
    assert verdicts == ["run"] and records[0] is not None
    assert records[0].request.id == reqs[1].id and records[0].state is RequestState.RUNNING


def test_assign_refuses_a_worker_that_is_not_ready(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1", state=WorkerState.DRAINING)
    r = inference_request(settings)
    store.submit(r)
    assert store.assign("w1", "b1", [(r.id, queue_key(store, r), 1.0)]) == []
    assert store.assign("ghost", "b1", [(r.id, queue_key(store, r), 1.0)]) == []
    ready_worker(store, "w2")
    assert store.request_drain("w2")  # asked to drain, its heartbeat still says ready
    assert store.assign("w2", "b1", [(r.id, queue_key(store, r), 1.0)]) == []
    assert store.record(r.id).state is RequestState.QUEUED


def test_complete_is_fenced_by_attempt(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 5.0)])
    assert store.start("w1", [(rid, attempt)]) == ["run"]
    stale = Completion(rid, attempt + 1, "succeeded", output="late")
    assert store.complete("w1", [stale]) == ["stale"]
    good = Completion(rid, attempt, "succeeded", output="hi", prompt_tokens=3, completion_tokens=1)
    assert store.complete("w1", [good]) == ["ok"]
    assert store.complete("w1", [good]) == ["stale"]  # exactly one final result
    rec = store.record(rid)
    assert rec.state is RequestState.SUCCEEDED
    assert rec.result is not None and rec.result.output == "hi"
    assert rec.result.completion_tokens == 1 and rec.result.timings.e2e_s is not None
    assert int(store.redis.hget(store.keys.load("w1"), "slots") or 0) == 0
    assert store.redis.zscore(store.keys.leases, rid) is None
    assert store.redis.ttl(store.keys.req(rid)) > 0
    assert store.wait_final(rid, 0.1)


def test_start_skips_stale_and_expires_late_requests(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    # 1 s: a loaded host's stall between the submit and the claim must not expire it first.
    late = inference_request(settings, timeout=1.0)
    fresh = inference_request(settings)
    for r in (late, fresh):
        store.submit(r)
    claimed = store.assign("w1", "b", [(r.id, queue_key(store, r), 1.0) for r in (late, fresh)])
    time.sleep(1.1)
    verdicts = store.start("w1", [*claimed, (fresh.id, 99)])
    assert verdicts == ["expired", "run", "stale"]
    assert store.record(late.id).state is RequestState.EXPIRED


def test_requeue_returns_to_original_position_then_dead_letters(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    older, newer = inference_request(settings), inference_request(settings)
    store.submit(older)
    time.sleep(0.005)
    store.submit(newer)
    qkey = queue_key(store, older)
    for attempt in range(1, settings.max_attempts + 1):
        [(rid, got)] = store.assign("w1", f"b{attempt}", [(older.id, qkey, 1.0)])
        assert got == attempt
        verdict = store.requeue([(rid, got, "w1", "CUDA error")])
        if attempt < settings.max_attempts:
            assert verdict == ["queued"]
            assert store.redis.zrange(qkey, 0, 0) == [older.id]  # ahead of the newer one
            rec = store.record(older.id)
            assert rec.state is RequestState.QUEUED
            assert store.redis.hget(store.keys.req(older.id), "excluded_worker") == "w1"
        else:
            assert verdict == ["dead"]
    rec = store.record(older.id)
    assert rec.state is RequestState.FAILED
    assert rec.result is not None and "failed after 3 attempts: CUDA error" in (
        rec.result.error or ""
    )
    assert store.dead_letters() == [older.id]
    assert store.requeue_dead(older.id)
    assert store.record(older.id).state is RequestState.QUEUED
    [(_, attempt)] = store.assign("w1", "b9", [(older.id, qkey, 1.0)])
    assert attempt == settings.max_attempts + 1  # attempt numbers only grow


def test_requeue_is_fenced(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    [(rid, attempt)] = store.assign("w1", "b", [(r.id, queue_key(store, r), 1.0)])
    assert store.requeue([(rid, attempt + 1, "w1", "x")]) == ["stale"]
    assert store.requeue([(rid, attempt, "w2", "x")]) == ["stale"]
    assert store.record(rid).state is RequestState.ASSIGNED


def test_drain_hand_back_does_not_count_towards_max_attempts(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    for i in range(settings.max_attempts + 2):
        [(rid, attempt)] = store.assign("w1", f"b{i}", [(r.id, queue_key(store, r), 1.0)])
        assert store.requeue([(rid, attempt, "w1", "draining")], penalize=False) == ["queued"]


def test_infrastructure_failures_spend_no_attempt_but_count_failures(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    qkey = queue_key(store, r)
    for i in range(settings.max_attempts + 3):
        [(rid, attempt)] = store.assign("w1", f"b{i}", [(r.id, qkey, 1.0)])
        verdict = store.requeue(
            [(rid, attempt, "w1", "refused")], infra=True, kind="infrastructure"
        )
        assert verdict == ["queued"]
    key = store.keys.req(r.id)
    assert store.redis.hget(key, "failures") == str(settings.max_attempts + 3)
    assert int(store.redis.hget(store.keys.stats, "retried_infra")) == settings.max_attempts + 3
    retry = [e for e in store.events() if e.type == "retry"][-1]
    assert retry.fields["kind"] == "infrastructure"
    # the attempts budget is intact: a server error after all that still gets its retries
    for i in range(settings.max_attempts):
        [(rid, attempt)] = store.assign("w1", f"c{i}", [(r.id, qkey, 1.0)])
        verdict = store.requeue([(rid, attempt, "w1", "HTTP 500")])
        assert verdict == (["dead"] if i == settings.max_attempts - 1 else ["queued"])


def test_a_delayed_retry_waits_on_redis_time_then_returns_to_its_position(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    older, newer = inference_request(settings), inference_request(settings)
    store.submit(older)
    time.sleep(0.005)
    store.submit(newer)
    qkey = queue_key(store, older)
    [(rid, attempt)] = store.assign("w1", "b", [(older.id, qkey, 1.0)])
    before = time.monotonic()
    assert store.requeue([(rid, attempt, "w1", "429")], infra=True, delay_s=1.0) == ["queued"]
    assert store.record(rid).state is RequestState.QUEUED
    assert store.redis.zrange(qkey, 0, -1) == [newer.id]  # not dispatchable yet
    assert store.queued_counts()["c:standard"] == 2  # but still counted as queued
    promoted, wait_s = store.promote_due()
    elapsed = time.monotonic() - before  # however long this host took since the requeue
    assert promoted == 0 and wait_s is not None and 1.0 - elapsed - 0.01 <= wait_s <= 1.0
    time.sleep(wait_s + 0.05)  # the wait Redis time gave
    assert store.promote_due() == (1, None)
    assert store.redis.zrange(qkey, 0, -1) == [older.id, newer.id]  # original position
    assert store.redis.hget(store.keys.req(rid), "not_before_ms") is None


def test_a_delayed_retry_can_be_cancelled_or_expire(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    a, b = inference_request(settings), inference_request(settings, timeout=1.0)
    for r in (a, b):
        store.submit(r)
        [(rid, attempt)] = store.assign("w1", "x", [(r.id, queue_key(store, r), 1.0)])
        store.requeue([(rid, attempt, "w1", "503")], infra=True, delay_s=60)
    assert store.cancel(a.id) == "cancelled"
    time.sleep(1.05)
    assert [rid for rid, _ in store.expire_due()] == [b.id]
    assert store.redis.zcard(store.keys.delayed) == 0
    assert store.queued_counts().get("c:standard", 0) == 0
    assert store.promote_due() == (0, None)


def test_a_lost_workers_requests_become_suspects_that_run_alone(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    a, b = inference_request(settings), inference_request(settings)
    for r in (a, b):
        store.submit(r)
    qkey = queue_key(store, a)
    for crash in (1, 2):  # one crash costs no isolation; the second makes suspects
        wid = f"c{crash}"
        ready_worker(store, wid)
        assert len(store.assign(wid, "b1", [(a.id, qkey, 1.0), (b.id, qkey, 1.0)])) == 2
        requeued = store.remove_worker(
            wid, reason="crashed", dead=True, stale_before=time.time() + 60
        )
        assert sorted(requeued or []) == sorted([a.id, b.id])
        suspect = store.redis.hget(store.keys.req(a.id), "suspect")
        assert suspect == (None if crash == 1 else "1")
    ready_worker(store, "w2")
    [(first, attempt)] = store.assign("w2", "b2", [(a.id, qkey, 1.0), (b.id, qkey, 1.0)])
    assert first == a.id  # alone: b is not claimed beside it
    assert store.redis.hget(store.keys.load("w2"), "isolated") == a.id
    assert store.assign("w2", "b3", [(b.id, qkey, 1.0)]) == []  # nothing beside a suspect
    store.complete("w2", [Completion(a.id, attempt, "succeeded", output="ok")])
    assert not store.redis.hexists(store.keys.load("w2"), "isolated")
    assert [rid for rid, _ in store.assign("w2", "b4", [(b.id, qkey, 1.0)])] == [b.id]


def test_expire_due_tells_the_waiting_client(store: Store, settings: Settings) -> None:
    r = inference_request(settings, timeout=0.1)
    keep = inference_request(settings)
    store.submit(r)
    store.submit(keep)
    time.sleep(0.15)
    expired = store.expire_due()
    assert [rid for rid, _ in expired] == [r.id]
    assert expired[0][1] >= 0.1
    rec = store.record(r.id)
    assert rec.state is RequestState.EXPIRED
    assert rec.result is not None and "deadline passed while queued" in (rec.result.error or "")
    assert store.wait_final(r.id, 0.1)
    assert store.queued_counts()["c:standard"] == 1


def test_cancel_queued_assigned_and_running(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    a, b, c = (inference_request(settings) for _ in range(3))
    for r in (a, b, c):
        store.submit(r)
    assert store.cancel(a.id) == "cancelled"
    claimed = store.assign("w1", "b", [(r.id, queue_key(store, r), 2.0) for r in (b, c)])
    assert store.cancel(b.id) == "cancelled"
    store.start("w1", [claimed[1]])
    assert store.cancel(c.id) == "running"
    assert int(store.redis.hget(store.keys.load("w1"), "slots") or 0) == 1
    with pytest.raises(RequestNotFound, match="no request 'nope'"):
        store.cancel("nope")


def test_heartbeat_joins_extends_leases_and_reports_drain(store: Store, settings: Settings) -> None:
    info = ready_worker(store, "w1")
    assert store.heartbeat(info, ttl_s=30)[:2] == (False, False)
    r = inference_request(settings)
    store.submit(r)
    store.assign("w1", "b", [(r.id, queue_key(store, r), 1.0)])
    before = store.redis.zscore(store.keys.leases, r.id)
    time.sleep(0.01)
    store.heartbeat(info, ttl_s=30)
    assert (store.redis.zscore(store.keys.leases, r.id) or 0) > (before or 0)
    assert store.request_drain("w1")
    assert store.heartbeat(info, ttl_s=30)[:2] == (False, True)
    assert not store.request_drain("ghost")
    workers, bad = store.workers()
    assert [w.id for w in workers] == ["w1"] and bad == []


def test_a_beat_built_before_the_published_one_publishes_only_liveness(store: Store) -> None:
    """Two threads of a worker build beats; the one built first may arrive last. It must
    not write its older state back (issue 25: ``ready`` published over ``unhealthy``), but
    it still proves the worker alive. A new process of the same id is refused while the
    old one's hash is there, and starts its count anew once it has taken the id over."""
    info = ready_worker(store, "w1")
    newer = info.model_copy(update={"state": WorkerState.UNHEALTHY, "beat_seq": 7})
    older = info.model_copy(update={"state": WorkerState.READY, "beat_seq": 6, "in_flight": 3})
    store.heartbeat(newer, ttl_s=30)
    store.redis.pexpire(store.keys.worker("w1"), 1000)
    before = int(store.redis.hget(store.keys.worker("w1"), "last_heartbeat_ms") or 0)
    time.sleep(0.01)
    assert not store.heartbeat(older, ttl_s=30).joined
    (worker,), _ = store.workers()
    assert (worker.state, worker.beat_seq, worker.in_flight) == (WorkerState.UNHEALTHY, 7, 0)
    assert to_ms(worker.last_heartbeat) > before
    assert store.redis.pttl(store.keys.worker("w1")) > 20_000
    assert store.request_drain("w1")  # asked to drain: said so even by a refused beat
    store.heartbeat(older, ttl_s=30)
    assert store.workers()[0][0].state is WorkerState.DRAINING
    restarted = older.model_copy(update={"started_at": info.started_at + 5, "beat_seq": 1})
    store.redis.delete(store.keys.drain("w1"))
    assert store.heartbeat(restarted, ttl_s=30).refused  # not before a takeover
    assert store.workers()[0][0].beat_seq == 7
    assert (
        store.remove_worker("w1", reason="replaced", dead=True, stale_before=time.time() + 60) == []
    )
    assert store.heartbeat(restarted, ttl_s=30).joined
    (worker,), _ = store.workers()
    assert (worker.state, worker.beat_seq, worker.in_flight) == (WorkerState.READY, 1, 3)


def test_heartbeat_tells_a_reaped_worker_which_attempts_are_no_longer_its_own(
    store: Store, settings: Settings
) -> None:
    info = ready_worker(store, "w1")
    r, q = inference_request(settings), inference_request(settings)
    store.submit(r)
    store.submit(q)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 1.0)])
    [(qid, qattempt)] = store.assign("w1", "b2", [(q.id, queue_key(store, q), 1.0)])
    store.start("w1", [(rid, attempt), (qid, qattempt)])
    held = [(rid, attempt), (qid, qattempt)]
    beat = store.heartbeat(info, ttl_s=30, held=held)
    assert beat.lost == [] and not beat.joined and beat.now_ms > 0
    # Declared dead: both requeued; one of them dispatched to it again under a new attempt.
    assert store.remove_worker("w1", reason="test", dead=True, stale_before=time.time() + 60)
    beat = store.heartbeat(info, ttl_s=30, held=held)
    assert beat.joined and sorted(beat.lost) == sorted(held)
    [(rid2, attempt2)] = store.assign("w1", "b3", [(r.id, queue_key(store, r), 1.0)])
    assert (rid2, attempt2) == (rid, attempt + 1)
    beat = store.heartbeat(info, ttl_s=30, held=[(rid, attempt), (rid, attempt2)])
    assert beat.lost == [(rid, attempt)]  # the new attempt is its own, the old one is not


def test_heartbeat_delivers_a_pending_abort_until_its_attempt_ends(
    store: Store, settings: Settings
) -> None:
    """A lost control-channel command must not leave an abort pending for ever: every beat
    of the worker holding the attempt names it, with the lost attempts counted apart."""
    info = ready_worker(store, "w1")
    r, q = inference_request(settings), inference_request(settings)
    store.submit(r)
    store.submit(q)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 1.0)])
    [(qid, qattempt)] = store.assign("w1", "b2", [(q.id, queue_key(store, q), 1.0)])
    store.start("w1", [(rid, attempt), (qid, qattempt)])
    assert store.abort([Abort(rid, attempt, "w1", "requeue", "for realtime")]) == ["sent"]
    store.redis.delete(store.keys.ctl("w1"))  # lost
    held = [(rid, attempt), (qid, qattempt), ("gone", 1)]
    for _ in range(2):  # on every beat, not once
        beat = store.heartbeat(info, ttl_s=30, held=held)
        assert beat.lost == [("gone", 1)]
        assert list(beat.aborts) == [(rid, attempt, "requeue", "for realtime")]
    assert store.requeue_preempted("w1", [(rid, attempt, 0)]) == ["queued"]
    beat = store.heartbeat(info, ttl_s=30, held=[(qid, qattempt)])
    assert beat.lost == [] and list(beat.aborts) == []


def test_remove_dead_worker_requeues_but_spares_a_live_one(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    store.assign("w1", "b", [(r.id, queue_key(store, r), 1.0)])
    alive = store.remove_worker("w1", reason="no heartbeat", dead=True, stale_before=0.0)
    assert alive is None  # it beat after stale_before
    requeued = store.remove_worker(
        "w1", reason="no heartbeat", dead=True, stale_before=store.now() + 1
    )
    assert requeued == [r.id]
    assert store.record(r.id).state is RequestState.QUEUED
    assert not store.redis.exists(store.keys.worker("w1"), store.keys.load("w1"))
    assert "worker_lost" in [e.type for e in store.events()]


def test_reap_leases_requeues_lapsed_work(redis_client, namespace: str) -> None:  # type: ignore[no-untyped-def]
    settings = Settings.load(namespace=namespace, lease_s=1.0)
    store = Store(redis_client, settings)
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    store.assign("w1", "b", [(r.id, queue_key(store, r), 1.0)])
    assert store.reap_leases() == []  # within its lease (1 s: longer than a loaded host stalls)
    time.sleep(1.05)
    assert store.reap_leases() == [(r.id, "queued")]
    assert store.redis.hget(store.keys.req(r.id), "last_error") == "lease expired on worker w1"


def test_quarantine_moves_the_record_aside(store: Store, settings: Settings) -> None:
    r = inference_request(settings)
    store.submit(r)
    key = store.keys.req(r.id)
    store.quarantine(key, "missing field 'payload'", [(store.keys.deadlines, r.id)])
    assert not store.redis.exists(key)
    assert store.redis.exists(store.keys.quarantined(key))
    assert store.quarantined() == {key: "missing field 'payload'"}
    assert store.redis.zscore(store.keys.deadlines, r.id) is None


def test_submit_many_pipelines_and_reads_back_1000(store: Store, settings: Settings) -> None:
    reqs = [(inference_request(settings, tenant=f"t{i % 7}"), False) for i in range(1000)]
    outcomes = store.submit_many(reqs)
    assert all(not isinstance(o, Exception) for o in outcomes)
    records = store.records(r.id for r, _ in reqs)
    assert all(rec is not None and rec.state is RequestState.QUEUED for rec in records)
    assert store.queued_counts()["c:standard"] == 1000


def test_purge_removes_only_this_namespace(store: Store, settings: Settings) -> None:
    store.submit(inference_request(settings))
    store.redis.set("inferq:other-ns:keep", "1")
    try:
        assert store.purge() > 0
        assert list(store.redis.scan_iter(match=store.keys.pattern())) == []
        assert store.redis.get("inferq:other-ns:keep") == "1"
    finally:
        store.redis.delete("inferq:other-ns:keep")


def test_a_resent_submit_is_reported_as_written(store: Store, settings: Settings) -> None:
    # redis-py resends a script whose reply was lost: the second run must not fail.
    r = inference_request(settings)
    assert not store.submit(r).duplicate
    again = store.submit(r)
    assert again.duplicate and again.id == r.id
    assert store.queued_counts()["c:standard"] == 1
