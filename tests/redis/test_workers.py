"""Worker processes (real subprocesses, real Redis): join, run, drain, crash, hand back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from inferq.client import Client
from inferq.config import Settings
from inferq.models import RequestState, WorkerState
from inferq.store import Store
from inferq.workers.worker import WorkerOptions, build_engine

from ..conftest import REDIS_URL
from ..helpers import wait_for
from .fleet import Fleet


def finals(client: Client, ids: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rid in ids:
        state = client.status(rid).state.value
        out[state] = out.get(state, 0) + 1
    return out


def test_worker_joins_runs_batches_and_drains_on_sigterm(fleet: Fleet, client: Client) -> None:
    proc = fleet.worker("w1", time_scale=0.2)
    info = {k: v for k, v in fleet.store.redis.hgetall(fleet.store.keys.worker("w1")).items()}
    assert info["model"] == "llama-3.1-8b" and info["slots"] == "4"
    assert int(info["kv_cache_mib"]) == int(24576 * 0.9) - 15320
    handles = client.submit_many(
        {"prompt": f"p{i}", "priority": "realtime", "max_tokens": 40} for i in range(12)
    )
    ids = [h.id for h in handles]
    wait_for(lambda: fleet.store.stats().get("succeeded", 0) >= 2, what="first results")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, fleet.output("w1")
    assert fleet.store.redis.exists(fleet.store.keys.worker("w1")) == 0  # deregistered
    states = finals(client, ids)
    # Nothing it held was lost: finished, or handed back to the queue for the next worker.
    assert states.get("succeeded", 0) + states.get("queued", 0) == 12, states
    fleet.worker("w2", time_scale=0.2)
    for rid in ids:
        assert client.result(rid, timeout=30).status == "succeeded"
    log = fleet.output("w1")
    assert "draining" in log and "hello" not in log  # prompts never logged


def test_sigkill_mid_batch_finishes_on_another_worker(fleet: Fleet, client: Client) -> None:
    doomed = fleet.worker("doomed", time_scale=1.0, slots=8)
    handles = client.submit_many(
        {"prompt": f"p{i}", "priority": "realtime", "max_tokens": 120, "timeout": 60}
        for i in range(6)
    )
    ids = [h.id for h in handles]
    wait_for(
        lambda: all(client.status(i).state is RequestState.RUNNING for i in ids),
        what="requests running on the doomed worker",
    )
    doomed.kill()
    killed_at = time.monotonic()
    fleet.worker("rescuer", time_scale=0.05, slots=8)
    results = [client.result(rid, timeout=60) for rid in ids]
    assert all(r.status == "succeeded" and r.worker == "rescuer" for r in results)
    assert all(r.attempt == 2 for r in results)
    assert time.monotonic() - killed_at < 20
    assert any(e.type == "worker_lost" for e in fleet.store.events(count=10_000))


def test_second_signal_hands_in_flight_requests_back(fleet: Fleet, client: Client) -> None:
    proc = fleet.worker("w1", time_scale=1.0, slots=4)
    handles = client.submit_many(
        {"prompt": "x", "priority": "realtime", "max_tokens": 400, "timeout": 60} for _ in range(3)
    )
    ids = [h.id for h in handles]
    wait_for(
        lambda: all(client.status(i).state is RequestState.RUNNING for i in ids), what="running"
    )
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: fleet.state("w1") == WorkerState.DRAINING.value, what="draining")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 1
    assert all(client.status(i).state is RequestState.QUEUED for i in ids)
    assert all(client.status(i).attempt == 1 for i in ids)


def test_remote_drain(fleet: Fleet) -> None:
    proc = fleet.worker("w1", time_scale=0.1)
    assert fleet.store.request_drain("w1")
    assert proc.wait(timeout=20) == 0
    assert fleet.store.redis.exists(fleet.store.keys.worker("w1")) == 0


def test_backend_failures_retry_elsewhere_then_dead_letter(fleet: Fleet, client: Client) -> None:
    fleet.worker("flaky", time_scale=0.01, extra=("-o", "failure_rate=1.0"))
    handle = client.submit("x", priority="realtime", max_tokens=4, timeout=30)
    result = handle.result(timeout=30)
    assert result.status == "failed"
    assert "failed after 3 attempts" in (result.error or "")
    assert fleet.store.dead_letters() == [handle.id]


def test_bad_worker_options_exit_with_one_line(fast_settings: Settings) -> None:
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": fast_settings.namespace}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferq",
            "worker",
            "--model",
            "llama-3.1-70b-awq",
            "--vram-mib",
            "16000",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "needs 37928 MiB of weights" in out.stderr and "Traceback" not in out.stderr


def test_bad_worker_id_is_refused_with_one_line(fast_settings: Settings) -> None:
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": fast_settings.namespace}
    out = subprocess.run(
        [sys.executable, "-m", "inferq", "worker", "--model", "llama-3.1-8b", "--vram-mib",
         "24576", "--id", "has space"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1
    assert "id: 'has space' is not a worker id" in out.stderr and "Traceback" not in out.stderr


def test_a_beat_built_before_a_state_change_cannot_publish_the_old_state(
    settings: Settings, store: Store
) -> None:
    """The interleaving of issue 25's loaded run, made on purpose: the heartbeat thread
    builds its beat (``ready``), the health monitor turns the worker ``unhealthy`` and
    publishes it, then the heartbeat thread's beat arrives. ``unhealthy`` stays."""
    opts = WorkerOptions(
        model="llama-3.1-8b", worker_id="w1", vram_mib=24576, heartbeat_process=False
    )
    engine = build_engine(settings, opts, store)
    assert engine.start()
    try:
        built_first = engine.info()
        assert built_first.state is WorkerState.READY
        engine._set_health_state(WorkerState.UNHEALTHY)
        store.heartbeat(built_first, ttl_s=30)
        (worker,), _ = store.workers()
        assert worker.state is WorkerState.UNHEALTHY
        assert worker.beat_seq > built_first.beat_seq
        engine.beat()  # the next beat, built after: published
        assert store.workers()[0][0].beat_seq > worker.beat_seq
    finally:
        engine.stop()


def _restarting(namespace: str) -> tuple[Settings, WorkerOptions]:
    """Settings with leases far longer than the test, and a worker beating every 0.2 s."""
    settings = Settings.load(
        redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.2, lease_s=60
    )
    opts = WorkerOptions(
        model="llama-3.1-8b",
        worker_id="w1",
        vram_mib=24576,
        heartbeat_process=False,
        heartbeat_interval_s=0.2,
    )
    return settings, opts


def test_a_worker_restarted_under_its_id_requeues_what_the_dead_process_held_at_once(
    namespace: str, redis_client: redis.Redis
) -> None:
    """A worker killed and restarted in place (Kubernetes keeps the pod name) beats again
    before its old heartbeat is reaped. Its new beats extended the dead process's leases,
    so those requests waited a whole lease (here 60 s) for the orphan check. The new
    process takes the id over: the dead one's requests are queued again before it joins,
    each with its crash counted, and a ``worker_lost`` event says why."""
    from inferq.dispatcher.daemon import Dispatcher

    from ..builders import worker_info

    settings, opts = _restarting(namespace)
    store = Store(redis_client, settings)
    client = Client(store=store)
    store.heartbeat(worker_info("w1"), ttl_s=30)  # the process about to die
    ids = [client.submit(f"p{i}", priority="realtime", max_tokens=8).id for i in range(2)]
    Dispatcher(store).step()
    assert {client.status(i).state for i in ids} == {RequestState.ASSIGNED}
    engine = build_engine(settings, opts, store)  # the new process, while the hash lives
    assert engine.start()
    try:
        assert {client.status(i).state for i in ids} == {RequestState.QUEUED}
        assert all(store.redis.hget(store.keys.req(i), "crashes") == "1" for i in ids)
        [lost] = [e for e in store.events(count=1000) if e.type == "worker_lost"]
        assert lost.fields["worker"] == "w1" and lost.fields["requeued"] == "2"
        assert "replaced by a new process" in lost.fields["reason"]
        (worker,), _ = store.workers()
        assert worker.state is WorkerState.READY and store.held_by("w1") == set()
    finally:
        engine.stop()


def test_a_second_live_process_under_one_worker_id_is_refused(
    namespace: str, redis_client: redis.Redis
) -> None:
    from inferq.errors import ConfigError

    from ..builders import worker_info
    from ..helpers import KeepAlive

    settings, opts = _restarting(namespace)
    store = Store(redis_client, settings)
    with KeepAlive(store, [worker_info("w1")], interval_s=0.1):
        engine = build_engine(settings, opts, store)
        with pytest.raises(ConfigError, match="worker id 'w1' is in use"):
            engine.start()
        (worker,), _ = store.workers()  # the live one is left alone
        assert worker.id == "w1" and store.events(count=1000)[-1].type != "worker_lost"


def test_a_request_whose_record_vanished_gives_its_slot_back(
    namespace: str, redis_client: redis.Redis
) -> None:
    """A request deleted (or evicted by a Redis that evicts) while assigned was never
    released: the worker's beats extended its lease for ever, and its slot and MiB stayed
    reserved while the worker lived. The orphan check takes it off the worker."""
    from inferq.dispatcher.daemon import Dispatcher

    settings, opts = _restarting(namespace)
    store = Store(redis_client, settings)
    client = Client(store=store)
    engine = build_engine(settings, opts, store)
    assert engine.start()
    try:
        ids = [client.submit(f"p{i}", priority="realtime", max_tokens=8).id for i in range(3)]
        Dispatcher(store).step()  # assigned to w1; no RQ consumer runs, so never received
        assert store.held_by("w1") == set(ids)
        need = {i: float(store.redis.hget(store.keys.req(i), "need_mib")) for i in ids}
        store.redis.delete(store.keys.req(ids[0]))
        engine.recover_orphans()
        assert store.held_by("w1") == set(ids[1:])  # the others wait out their lease
        load = store.redis.hgetall(store.keys.load("w1"))
        assert int(load["slots"]) == 2
        assert float(load["mib"]) == pytest.approx(need[ids[1]] + need[ids[2]])
        assert store.redis.zscore(store.keys.leases, ids[0]) is None
        [gone] = [e for e in store.events(count=1000) if e.type == "vanished"]
        assert gone.fields == {"id": ids[0], "worker": "w1"}
        assert store.forget_vanished("w1", ids[1:]) == []  # a record that exists stays
    finally:
        engine.stop()


def test_two_processes_starting_under_one_id_at_once_do_not_both_serve(
    namespace: str, redis_client: redis.Redis
) -> None:
    """Two workers given one ``--id`` and started at the same moment: each looks for an
    earlier process before either has beaten, finds none, and both joined and beat into
    one hash (both ``ready``, one silently overwriting the other's figures). The one that
    registers second must be refused, as a second live process is when it comes later."""
    from inferq.errors import ConfigError

    settings, opts = _restarting(namespace)
    first = build_engine(settings, opts, Store(redis_client, settings))
    second = build_engine(settings, opts, Store(redis_client, settings))
    looked = second._replace_earlier_process

    def look_then_the_other_starts() -> None:
        looked()  # nobody registered under w1 yet
        assert first.start()  # the other process registers meanwhile

    second._replace_earlier_process = look_then_the_other_starts  # type: ignore[method-assign]
    try:
        with pytest.raises(ConfigError, match="worker id 'w1' is in use"):
            if second.start():  # it joined, beside the other
                second.stop()
    finally:
        first.stop()


def test_a_takeover_does_not_wait_out_a_beat_stamped_in_the_future(
    namespace: str, redis_client: redis.Redis
) -> None:
    """Redis's clock moved back (a failover to a replica whose clock is behind, an NTP
    step): the dead process's last beat in the workers index is later than Redis's now.
    The new process slept until then plus two intervals (here an hour) before its first
    beat; it must wait two intervals at most."""
    import threading

    settings, opts = _restarting(namespace)
    store = Store(redis_client, settings)
    store.redis.hset(store.keys.worker("w1"), mapping={"model": "llama-3.1-8b"})
    store.redis.zadd(store.keys.workers, {"w1": round((store.now() + 3600) * 1000)})
    engine = build_engine(settings, opts, store)
    thread = threading.Thread(target=engine.start, daemon=True)
    thread.start()
    thread.join(timeout=15)
    try:
        assert not thread.is_alive(), "start() waited for a beat an hour ahead"
        (worker,), _ = store.workers()
        assert worker.state is WorkerState.READY
    finally:
        if not thread.is_alive():
            engine.stop()


def test_a_takeover_frees_the_dead_process_rq_worker_name(
    namespace: str, redis_client: redis.Redis
) -> None:
    """The dead process's RQ worker record (``rq:worker:<ns>-<id>``, no death recorded:
    it was SIGKILLed) outlives it by RQ's TTL (76 s). The reaper purges it with the queue
    (``BatchSender.purge``); the takeover did not, so the new process's RQ loop failed
    its birth ("There exists an active worker named ...", logged as an ERROR saying Redis
    may be unavailable) and sat out a 1 s pause before it dequeued the batches of the
    requests just requeued to it."""
    from inferq import delivery

    from ..builders import worker_info

    settings, opts = _restarting(namespace)
    store = Store(redis_client, settings)
    store.heartbeat(worker_info("w1"), ttl_s=30)  # the process about to die ...
    engine = build_engine(settings, opts, store)
    dead = delivery.make_consumer(engine, REDIS_URL)
    dead.register_birth()  # type: ignore[no-untyped-call]  # ... and its RQ loop
    assert engine.start()
    consumer = delivery.make_consumer(engine, REDIS_URL)
    try:
        consumer.register_birth()  # type: ignore[no-untyped-call]
        consumer.register_death()  # type: ignore[no-untyped-call]
    finally:
        engine.stop()
        consumer.connection.delete(consumer.key)
