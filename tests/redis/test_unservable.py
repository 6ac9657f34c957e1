"""Requests nothing can serve, on the real Redis (issue 12, fault 4).

A request for a model no live worker and no running scaler's pool serves is not
backlog for the scaler, and when it expires its reason says why, whoever expires
it (the dispatcher's deadline sweep, or the client's own ``result()``), instead
of "deadline passed with no dispatcher" while a dispatcher runs.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from inferq.client import EXPIRED_BY_CLIENT, Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.models import RequestState
from inferq.scaler.daemon import Scaler
from inferq.store import Store

from ..conftest import REDIS_URL
from ..helpers import ready_worker
from .test_scaler_daemon import MODEL, RecordingPlatform, config

NONE_SERVES = "no live worker or scaler pool serves model llama-2-13b"


@pytest.fixture
def fast(redis_client: redis.Redis, namespace: str) -> tuple[Store, Client]:
    # Heartbeat 0.3 s: a dispatcher's note stays fresh for one heartbeat TTL (0.9 s).
    settings = Settings.load(redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.3)
    store = Store(redis_client, settings)
    return store, Client(settings=settings, connection=redis_client)


def expire_reasons(store: Store) -> dict[str, str]:
    return {e.fields["id"]: e.fields["reason"] for e in store.events() if e.type == "expire"}


def test_the_clients_expiry_names_the_missing_model_while_a_dispatcher_runs(
    fast: tuple[Store, Client],
) -> None:
    store, client = fast
    ready_worker(store, "w8", model=MODEL)
    h = client.submit("hi", model="llama-2-13b", priority="standard", max_tokens=8, timeout=0.5)
    d = Dispatcher(store)
    report = d.step()
    assert report.unschedulable == 1 and d.step().unschedulable == 0  # reported once
    rec = store.redis.hgetall(store.keys.req(h.id))
    assert rec["unschedulable"] == NONE_SERVES
    # The dispatcher keeps running (its ticks confirm the note); the client's result()
    # without a timeout expires the request itself at its deadline, racing the
    # dispatcher's sweep: whichever wins, the reason is the same.
    running = Dispatcher(store, tick_s=0.05)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    try:
        result = h.result()
    finally:
        running.stop()
        thread.join()
    assert result.status == "expired"
    assert (result.error or "").startswith(f"deadline passed: {NONE_SERVES} (waited ")
    assert expire_reasons(store)[h.id] == f"deadline passed: {NONE_SERVES}"


def test_the_dispatchers_deadline_sweep_gives_the_same_reason(fast: tuple[Store, Client]) -> None:
    store, client = fast
    ready_worker(store, "w8", model=MODEL)
    h = client.submit("hi", model="llama-2-13b", priority="standard", max_tokens=8, timeout=0.2)
    d = Dispatcher(store, tick_s=0.05)
    stop = time.monotonic() + 5
    while client.status(h.id).state is RequestState.QUEUED and time.monotonic() < stop:
        d.step()
        time.sleep(0.02)
    result = h.result(timeout=1)
    assert result.status == "expired" and NONE_SERVES in (result.error or "")


def test_without_a_dispatcher_the_client_says_so(fast: tuple[Store, Client]) -> None:
    _, client = fast
    h = client.submit("hi", model="llama-2-13b", priority="standard", max_tokens=8, timeout=0.2)
    result = h.result()
    assert result.status == "expired"
    assert (result.error or "").startswith(EXPIRED_BY_CLIENT)


def test_a_note_no_dispatcher_confirms_any_more_is_not_the_reason(
    fast: tuple[Store, Client],
) -> None:
    # The dispatcher found it unschedulable, then stopped: past one heartbeat TTL its
    # note is stale (a worker may have joined since), so the reason is the client's. The
    # deadline leaves a loaded host 2 s to take the step in before the note is a TTL old.
    store, client = fast
    h = client.submit("hi", model="llama-2-13b", priority="standard", max_tokens=8, timeout=3.0)
    Dispatcher(store).step()
    assert store.redis.hget(store.keys.req(h.id), "unschedulable") == NONE_SERVES
    result = h.result()
    assert (result.error or "").startswith(EXPIRED_BY_CLIENT)


def test_a_running_scalers_pool_makes_its_model_servable_and_others_not_backlog(
    fast: tuple[Store, Client],
) -> None:
    store, client = fast
    backend = RecordingPlatform()
    scaler = Scaler(store, config=config(), platform=backend)  # pool: llama-3.1-8b, 1..4
    first = scaler.step()
    assert len(first.launched) == 1  # the minimum pool; no heartbeat yet: nothing live
    assert store.scaler_pools() == frozenset({MODEL})
    pooled = client.submit("hi", model=MODEL, priority="standard", max_tokens=8)
    unserved = [
        client.submit("hi", model="llama-2-13b", priority="standard", max_tokens=8)
        for _ in range(30)
    ]
    d = Dispatcher(store)
    assert d.step().unschedulable == 30
    # The 8b request waits for the pool's cold start; the 13b ones are unschedulable.
    assert "unschedulable" not in store.redis.hgetall(store.keys.req(pooled.id))
    assert store.redis.hget(store.keys.req(unserved[0].id), "unschedulable") == NONE_SERVES
    # Thirty requests nothing serves are no backlog for the 8b pool: it holds.
    report = scaler.step()
    (decision,) = report.decisions
    assert decision.model == MODEL and decision.action == "hold" and report.launched == []
    # No scaler (its lease released): the 8b request has nowhere to go either.
    scaler.close()
    time.sleep(1.1)  # the dispatcher reads the pools once a second
    d.step()
    assert store.redis.hget(store.keys.req(pooled.id), "unschedulable") == (
        "no live worker or scaler pool serves model llama-3.1-8b"
    )


def test_with_a_dispatcher_running_the_reason_is_the_unhealthy_worker(
    fast: tuple[Store, Client],
) -> None:
    # A fresh user's run: dispatcher up, the model's only worker unhealthy (its server
    # answers 500). The client expired the request with "deadline passed with no
    # dispatcher"; a dispatcher beat (dispatcher:beat) says one runs, so the reason
    # names what kept the request instead.
    from inferq.models import WorkerState

    store, client = fast
    Dispatcher(store).step()  # its housekeeping beats
    assert store.redis.exists(store.keys.dispatcher_beat)
    store.beat_dispatcher(30)  # as a dispatcher running through the wait would
    ready_worker(store, "w1", state=WorkerState.UNHEALTHY)
    h = client.submit("hi", model="llama-3.1-8b", priority="standard", max_tokens=8, timeout=0.3)
    result = h.result()
    want = "deadline passed: no ready worker serves llama-3.1-8b (1 unhealthy)"
    assert result.status == "expired" and (result.error or "").startswith(want), result.error
    assert expire_reasons(store)[h.id] == want


def test_with_a_dispatcher_and_a_ready_worker_the_reason_says_it_was_busy(
    fast: tuple[Store, Client],
) -> None:
    store, client = fast
    store.beat_dispatcher(30)
    ready_worker(store, "w1")
    h = client.submit("hi", model="llama-3.1-8b", priority="standard", max_tokens=8, timeout=0.3)
    error = h.result().error or ""
    assert "no dispatcher" not in error and "1 ready worker(s) of llama-3.1-8b" in error, error
