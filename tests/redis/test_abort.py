"""Aborting held requests (``abort.lua``, ``requeue_preempted.lua``, the worker's control
channel): the path preemption takes, and a cancel of a running request."""

from __future__ import annotations

import json

import pytest

from inferq.client import Client
from inferq.config import Settings
from inferq.models import RequestState
from inferq.store import Abort, Completion, Store, calls
from inferq.store.calls import Chunk

from ..builders import inference_request
from ..helpers import queue_key, ready_worker, wait_for
from .fleet import Fleet


def penalised_attempts(store: Store, rid: str) -> int:
    """Attempts counted towards max_attempts (``attempts - attempt_base``)."""
    fields = store.redis.hmget(store.keys.req(rid), "attempts", "attempt_base")
    return int(fields[0] or 0) - int(fields[1] or 0)


def test_abort_of_an_assigned_request_requeues_it_at_once(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    older, r = inference_request(settings), inference_request(settings)
    store.submit(older)
    store.submit(r)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 5.0)])
    store.redis.zadd(store.keys.fair_vtc("standard"), {r.tenant: 100.0})
    verdicts = store.abort([Abort(rid, attempt, "w1", "requeue", "for realtime", charged=40.0)])
    assert verdicts == ["done"]
    assert store.record(rid).state is RequestState.QUEUED
    # original position (score = submit time), reservation given back, no attempt spent
    assert store.redis.zrange(queue_key(store, r), 0, -1) == [older.id, r.id]
    assert int(store.redis.hget(store.keys.load("w1"), "slots") or 0) == 0
    assert penalised_attempts(store, rid) == 0
    assert store.redis.zscore(store.keys.fair_vtc("standard"), r.tenant) == 60.0
    assert store.stats()["preempted"] == 1
    # the batch job arriving late finds its attempt stale
    assert store.start("w1", [(rid, attempt)]) == ["stale"]
    # a stale abort (the attempt moved on) does nothing
    assert store.abort([Abort(rid, attempt, "w1", "requeue", "again")]) == ["stale"]


def test_abort_of_a_running_request_goes_to_its_worker(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings)
    store.submit(r)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 5.0)])
    assert store.start("w1", [(rid, attempt)]) == ["run"]
    abort = Abort(rid, attempt, "w1", "requeue", "for realtime", charged=30.0)
    assert store.abort([abort], output_weight=2.0) == ["sent"]
    assert store.abort([abort]) == ["pending"]  # asked once per attempt
    assert store.redis.pttl(store.keys.ctl("w1")) > 0  # a dead worker's channel expires
    [command] = store.take_control("w1", 0.1)
    assert (command.request_id, command.attempt, command.action) == (rid, attempt, "requeue")
    assert store.take_control("w1", 0.05) == []
    store.redis.zadd(store.keys.fair_vtc("standard"), {r.tenant: 100.0})
    # the worker aborted it after 3 generated tokens: charged prompt + 2 x 3 only
    assert store.requeue_preempted("w1", [(rid, attempt, 3)]) == ["queued"]
    used = r.prompt_tokens + 2 * 3
    fair = store.redis.zscore(store.keys.fair_vtc("standard"), r.tenant)
    assert fair == pytest.approx(100.0 - (30.0 - used))
    rec = store.record(rid)
    assert rec.state is RequestState.QUEUED and penalised_attempts(store, rid) == 0
    assert store.requeue_preempted("w1", [(rid, attempt, 3)]) == ["stale"]
    assert [e.type for e in store.events(count=100)][-1] == "preempt"


def test_unreadable_control_commands_are_dropped(store: Store) -> None:
    ready_worker(store, "w1")
    key = store.keys.ctl("w1")
    good = json.dumps({"id": "r1", "attempt": 2, "action": "cancel", "reason": "x"})
    store.redis.rpush(key, "not json", json.dumps({"id": "r1", "action": "explode"}), good)
    [command] = store.take_control("w1", 0.1)
    assert (command.request_id, command.attempt, command.action) == ("r1", 2, "cancel")


def running_attempt(client: Client, rid: str) -> int | None:
    status = client.status(rid)
    return status.attempt if status.state is RequestState.RUNNING else None


def test_a_worker_aborts_a_running_request_and_it_runs_again(fleet: Fleet, client: Client) -> None:
    """Preemption's path on the real stack: the sim server's call is cancelled, the slot
    freed, the request requeued without spending an attempt, then it succeeds."""
    fleet.worker("w1", time_scale=0.2, slots=1)
    handle = client.submit("x", priority="batch", max_tokens=1100, timeout=120)
    wait_for(lambda: running_attempt(client, handle.id) is not None, what="running")
    attempt = running_attempt(client, handle.id)
    assert attempt is not None
    store = fleet.store
    assert store.abort([Abort(handle.id, attempt, "w1", "requeue", "preempted by test")]) == [
        "sent"
    ]
    wait_for(lambda: store.stats().get("preempted", 0) == 1, timeout=10, what="preempted")
    result = handle.result(timeout=60)
    assert result.status == "succeeded" and result.attempt == attempt + 1
    assert penalised_attempts(store, handle.id) == 1  # the preempted attempt was not spent
    kinds = [e.type for e in store.events(count=1000)]
    assert "abort" in kinds and "preempt" in kinds


def test_a_worker_cancels_a_running_request(fleet: Fleet, client: Client) -> None:
    fleet.worker("w1", time_scale=1.0, slots=1)
    handle = client.submit("x", priority="batch", max_tokens=1100, timeout=120)
    wait_for(lambda: running_attempt(client, handle.id) is not None, what="running")
    attempt = running_attempt(client, handle.id)
    assert attempt is not None
    verdict = fleet.store.abort([Abort(handle.id, attempt, "w1", "cancel", "caller went away")])
    assert verdict == ["sent"]
    result = handle.result(timeout=10)  # long before its 18 s of decoding
    assert result.status == "cancelled" and result.error == "caller went away"
    wait_for(
        lambda: int(fleet.store.redis.hget(fleet.store.keys.load("w1"), "slots") or 0) == 0,
        what="slot freed",
    )


def _state(pid: int) -> str:
    """The process's state letter from ``/proc/<pid>/stat`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _stop_worker_then_abort(
    fleet: Fleet, client: Client, send: object, *, stream: bool = False
) -> tuple[str, int]:
    """A batch request runs on w1; w1 is frozen (SIGSTOP: its control thread reads nothing),
    ``send(id, attempt)`` writes an abort, then w1 is SIGKILLed before it could act.
    ``stream``: the request is a ``stream=True`` one, frozen once it streamed a few tokens.
    Returns (request id, the aborted attempt)."""
    import os
    import signal

    proc = fleet.worker("w1", time_scale=1.0, slots=1)
    handle = client.submit("x", priority="batch", max_tokens=1100, timeout=120, stream=stream)
    wait_for(lambda: running_attempt(client, handle.id) is not None, what="running")
    attempt = running_attempt(client, handle.id)
    assert attempt is not None
    if stream:
        wait_for(lambda: streamed(fleet.store, handle.id) >= 3, what="tokens streamed")
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(lambda: _state(proc.pid) == "T", what="w1 stopped")  # SIGSTOP is asynchronous
    if stream:  # what it wrote before it stopped has reached Redis: two reads 50 ms apart agree
        last: list[int | None] = [None]

        def settled() -> bool:
            n, previous = streamed(fleet.store, handle.id), last[0]
            last[0] = n
            return n == previous

        wait_for(settled, what="the frozen stream settled")
    try:
        assert callable(send)
        send(handle.id, attempt)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    return handle.id, attempt


def test_a_cancel_sent_to_a_worker_that_dies_is_not_lost(fleet: Fleet, client: Client) -> None:
    """The caller cancels a running request; its worker dies before carrying the abort out.
    The reaper must not run it again: it ends ``cancelled`` with the caller's reason."""
    rid, _ = _stop_worker_then_abort(
        fleet, client, lambda rid, _attempt: client.cancel(rid) is RequestState.RUNNING
    )
    wait_for(
        lambda: client.status(rid).state not in (RequestState.RUNNING, RequestState.ASSIGNED),
        timeout=30,
        what="the dead worker's request handled",
    )
    fleet.worker("w2", time_scale=0.05, slots=1)  # a live worker it could run on
    result = client.result(rid, timeout=30)
    assert result.status == "cancelled", result
    assert (result.error or "").startswith("cancelled by the caller"), result.error


def test_a_preemption_whose_worker_dies_spends_no_attempt(fleet: Fleet, client: Client) -> None:
    """A preemption's abort is sent; the worker dies before it requeues the victim. The
    reaper requeues it as the preemption it was: no attempt spent, no crash counted
    (a victim is not a suspect), counted in stats.preempted."""
    store = fleet.store

    def preempt(rid: str, attempt: int) -> None:
        assert store.abort([Abort(rid, attempt, "w1", "requeue", "for realtime")]) == ["sent"]

    rid, attempt = _stop_worker_then_abort(fleet, client, preempt)
    wait_for(
        lambda: client.status(rid).state is RequestState.QUEUED,
        timeout=30,
        what="the victim requeued",
    )
    assert penalised_attempts(store, rid) == 0
    assert store.redis.hget(store.keys.req(rid), "crashes") in (None, "0")
    assert store.stats().get("preempted", 0) == 1
    fleet.worker("w2", time_scale=0.02, slots=1)
    result = client.result(rid, timeout=60)
    assert result.status == "succeeded" and result.attempt == attempt + 1


def streamed(store: Store, rid: str) -> int:
    """Output tokens so far by the request's last stream entry (0 before any)."""
    last = store.redis.xrevrange(store.keys.stream(rid), count=1)
    return int(last[0][1].get("n", 0)) if last else 0


def test_a_preemption_whose_worker_is_killed_charges_only_what_it_generated(
    fleet: Fleet, client: Client
) -> None:
    """Chaos: a streaming request is preempted, its worker frozen and SIGKILLed before it
    requeues the victim with its generated-token count. The reaper requeues it, charging
    the tenant prompt + 2 x the tokens it streamed; it kept the whole dispatch charge."""
    store = fleet.store
    seen: dict[str, float] = {}  # what the attempt used by the frozen stream

    def preempt(rid: str, attempt: int) -> None:
        rec = store.record(rid)
        vtc = store.keys.fair_vtc(rec.request.priority)
        store.redis.zadd(vtc, {rec.request.tenant: 10000.0})  # room for any refund
        seen["used"] = rec.request.prompt_tokens + 2.0 * streamed(store, rid)
        abort = Abort(rid, attempt, "w1", "requeue", "for realtime", charged=2000.0)
        assert store.abort([abort], output_weight=2.0) == ["sent"]

    rid, _ = _stop_worker_then_abort(fleet, client, preempt, stream=True)
    wait_for(lambda: client.status(rid).state is RequestState.QUEUED, timeout=30, what="requeued")
    rec = store.record(rid)
    fair = store.redis.zscore(store.keys.fair_vtc(rec.request.priority), rec.request.tenant)
    assert fair == pytest.approx(10000.0 - (2000.0 - seen["used"]))
    assert seen["used"] > rec.request.prompt_tokens  # it had streamed tokens


def test_a_lost_abort_command_is_delivered_again(fleet: Fleet, client: Client) -> None:
    """The abort command never reaches the worker (the list expired while the worker was
    stalled, a BLPOP reply lost to a socket timeout): the attempt stays marked as being
    aborted, and the dispatcher counts its room as on its way, so nothing else would ever
    free it. The worker's next beats must deliver the pending abort again."""
    fleet.worker("w1", time_scale=1.0, slots=1)
    handle = client.submit("x", priority="batch", max_tokens=1100, timeout=120)
    wait_for(lambda: running_attempt(client, handle.id) is not None, what="running")
    attempt = running_attempt(client, handle.id)
    assert attempt is not None
    store = fleet.store
    # abort.lua and the loss in one transaction: a blocked BLPOP is served only after it,
    # when the list is already gone.
    pipe = store.redis.pipeline(transaction=True)
    abort = Abort(handle.id, attempt, "w1", "requeue", "for realtime")
    store._call(calls.abort_call(store.keys, store.settings, [abort], 1.0), client=pipe)
    pipe.delete(store.keys.ctl("w1"))
    assert pipe.execute()[0] == ["sent"]
    # ~18 s of decoding left: the preemption must be carried out long before
    wait_for(lambda: store.stats().get("preempted", 0) == 1, timeout=10, what="preempted")
    result = handle.result(timeout=60)
    assert result.status == "succeeded" and result.attempt == attempt + 1
    assert penalised_attempts(store, handle.id) == 1


def test_a_cancel_while_a_preemption_is_pending_is_not_lost(
    store: Store, settings: Settings
) -> None:
    """A preemption's abort is on its way to the worker when the caller cancels: the
    cancel was answered 'pending' (one abort per attempt) and dropped, so the worker
    requeued the request and it ran again to the end. The cancel takes the abort over:
    the request ends cancelled whichever the worker carries out."""
    ready_worker(store, "w1")
    for worker_does in ("requeue", "cancel"):
        r = inference_request(settings)
        store.submit(r)
        [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 5.0)])
        assert store.start("w1", [(rid, attempt)]) == ["run"]
        preempt = Abort(rid, attempt, "w1", "requeue", "for realtime", charged=30.0)
        assert store.abort([preempt]) == ["sent"]
        assert store.cancel_running(rid, "cancelled by the caller while running") == "sent"
        if worker_does == "requeue":  # it had taken the preemption's command already
            assert store.requeue_preempted("w1", [(rid, attempt, 3)]) == ["cancelled"]
        else:  # it took the cancel's
            assert store.complete(
                "w1", [Completion(rid, attempt, "cancelled", error="cancelled by the caller")]
            ) == ["ok"]
        rec = store.record(rid)
        assert rec.state is RequestState.CANCELLED, worker_does
        assert store.redis.zscore(queue_key(store, r), rid) is None
        assert int(store.redis.hget(store.keys.load("w1"), "slots") or 0) == 0
        store.take_control("w1", 0.05)


def test_a_preempted_request_back_in_its_queue_does_not_lift_its_tenant(
    store: Store, settings: Settings
) -> None:
    """VTC lifts a tenant that becomes backlogged to the lowest backlogged counter, so idle
    time banks no credit. A preempted request going back to its queue is no new arrival:
    its tenant was not idle (its request ran). Lifting it charged tenant ``a`` the gap to
    ``b`` (990 virtual tokens here) for being preempted."""
    ready_worker(store, "w1")
    a = inference_request(settings, tenant="a")
    b = inference_request(settings, tenant="b")
    store.submit(a)
    [(rid, attempt)] = store.assign("w1", "b1", [(a.id, queue_key(store, a), 5.0)])
    store.submit(b)  # b stays queued: backlogged
    vtc, live = store.keys.fair_vtc(a.priority), store.keys.fair_live(a.priority)
    store.redis.zadd(vtc, {"a": 10.0, "b": 1000.0})
    store.redis.zadd(live, {"b": 1000.0}, xx=True)
    assert store.start("w1", [(rid, attempt)]) == ["run"]
    assert store.abort([Abort(rid, attempt, "w1", "requeue", "for realtime")]) == ["sent"]
    assert store.requeue_preempted("w1", [(rid, attempt, 0)]) == ["queued"]
    assert store.redis.zscore(vtc, "a") == pytest.approx(10.0)
    assert store.redis.zscore(live, "a") == pytest.approx(10.0)  # backlogged, unlifted


@pytest.mark.parametrize("recovery", ["remove_worker", "reap_leases"])
@pytest.mark.parametrize("streamed", [5, None])
def test_a_preempted_request_whose_worker_dies_is_charged_only_what_it_generated(
    store: Store, settings: Settings, recovery: str, streamed: int | None
) -> None:
    """A preemption's abort is sent; the worker is killed before it requeues the victim
    with its generated-token count. The recovery that requeues the victim instead (the
    reaper's ``remove_worker``, or a lapsed lease) charges its tenant what the attempt
    generated, as ``requeue_preempted`` does: the last streamed chunk's count of this
    attempt (an older attempt's chunks count nothing), or 0 when nothing was streamed.
    It kept the whole dispatch charge (30 tokens here, for a request that generated 5)."""
    ready_worker(store, "w1")
    r = inference_request(settings, stream=True)
    store.submit(r)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 5.0)])
    assert store.start("w1", [(rid, attempt)]) == ["run"]
    # an older attempt's chunk, then this attempt's (if any): only the latter counts
    chunks = [Chunk(rid, attempt - 1, 9, "old", 12)]
    if streamed is not None:
        chunks += [Chunk(rid, attempt, 0, "a", 2), Chunk(rid, attempt, 1, "bcd", streamed)]
    store.publish_chunks(chunks)
    vtc = store.keys.fair_vtc(r.priority)
    store.redis.zadd(vtc, {r.tenant: 100.0})
    preempt = Abort(rid, attempt, "w1", "requeue", "for realtime", charged=30.0)
    assert store.abort([preempt], output_weight=2.0) == ["sent"]
    # the worker is SIGKILLed here: its beat lapses, or its lease does
    if recovery == "remove_worker":
        assert store.remove_worker("w1", reason="lost", dead=True, stale_before=store.now() + 1)
    else:
        store.redis.zadd(store.keys.leases, {rid: 0})
        assert store.reap_leases() == [(rid, "preempted")]
    used = r.prompt_tokens + 2 * (streamed or 0)
    assert store.redis.zscore(vtc, r.tenant) == pytest.approx(100.0 - (30.0 - used))
    assert store.record(rid).state is RequestState.QUEUED
    assert penalised_attempts(store, rid) == 0 and store.stats()["preempted"] == 1
    [event] = [e for e in store.events(count=100) if e.type == "preempt"]
    assert event.fields["tokens"] == str(streamed or 0)
