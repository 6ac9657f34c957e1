"""The worker's end of the RQ seam: a batch starts before RQ records it, and RQ still
records it (finished, or failed with the batch function's error)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from inferq import delivery
from inferq.delivery import BatchSender, InferqWorker, broken_job, job_id, make_consumer
from inferq.store import Store


class Handler:
    """A :class:`~inferq.delivery.BatchHandler` that records what RQ had written when
    each batch reached it."""

    def __init__(self, store: Store, worker_id: str, fail: bool = False) -> None:
        self.store, self.worker_id, self.fail = store, worker_id, fail
        self.namespace = store.keys.namespace
        self.lease_s = 30.0
        self.draining = False
        self.seen: list[dict[str, Any]] = []
        self.consumer: InferqWorker | None = None

    def accept(self, batch_id: str, items: list[tuple[str, int]]) -> dict[str, int]:
        assert self.consumer is not None
        queue = self.consumer.queues[0]
        jid = job_id(self.store.keys, batch_id)
        self.seen.append(
            {
                "batch": batch_id,
                "items": items,
                "started_registry": jid in StartedJobRegistry(queue=queue).get_job_ids(),
                "rq_state": self.consumer.connection.hget(self.consumer.key, "state"),
            }
        )
        if self.fail:
            raise RuntimeError("the batch could not start")
        return {"run": len(items), "stale": 0, "expired": 0}

    def begin_drain(self) -> None:
        self.draining = True

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return True

    def unreceived(self) -> set[str]:
        return set()

    def cold_shutdown(self) -> None:
        pass


@pytest.fixture
def restore_signals() -> Iterator[None]:
    """RQ installs SIGINT/SIGTERM handlers in this process: put pytest's back after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.usefixtures("restore_signals")
def test_a_batch_starts_before_rq_records_it_and_rq_still_records_it(store: Store) -> None:
    handler = Handler(store, "w1")
    batches = ["0" * 22 + "beef", "0" * 22 + "cafe"]
    queue_conn = BatchSender(store.settings.redis_url, store.keys).connection
    sender = BatchSender(store.settings.redis_url, store.keys)
    for batch in batches:
        sender.send("w1", batch, [(f"r-{batch[-4:]}", 1)], timeout_s=60)
    consumer = make_consumer(handler, store.settings.redis_url)
    handler.consumer = consumer
    delivery.bind(handler)
    try:
        consumer.work(burst=True, logging_level="WARNING")
        assert [s["batch"] for s in handler.seen] == batches
        assert all(s["items"] == [(f"r-{s['batch'][-4:]}", 1)] for s in handler.seen)
        # The batch ran before RQ's bookkeeping: not yet in the started registry, and
        # RQ's worker not yet marked busy.
        assert not any(s["started_registry"] for s in handler.seen)
        assert all(s["rq_state"] != b"busy" for s in handler.seen)
        # ... and RQ recorded each job afterwards as it always did: finished, the batch's
        # counts as its result, nothing left started.
        queue = consumer.queues[0]
        finished = set(FinishedJobRegistry(queue=queue).get_job_ids())
        assert finished == {job_id(store.keys, b) for b in batches}
        assert StartedJobRegistry(queue=queue).get_job_ids() == []
        job = queue.fetch_job(job_id(store.keys, batches[0]))
        assert job is not None and job.get_status() == JobStatus.FINISHED
        assert job.return_value() == {"run": 1, "stale": 0, "expired": 0}
        assert queue_conn.llen(queue.intermediate_queue_key) == 0
    finally:
        delivery.bind(None)
        consumer.purge()


@pytest.mark.usefixtures("restore_signals")
def test_an_error_of_the_batch_function_still_fails_the_rq_job(store: Store) -> None:
    handler = Handler(store, "w2", fail=True)
    batch = "0" * 22 + "dead"
    sender = BatchSender(store.settings.redis_url, store.keys)
    sender.send("w2", batch, [("r1", 1)], timeout_s=60)
    consumer = make_consumer(handler, store.settings.redis_url)
    handler.consumer = consumer
    delivery.bind(handler)
    try:
        consumer.work(burst=True, logging_level="WARNING")
        assert len(handler.seen) == 1  # ran once: RQ's perform replayed the error
        queue = consumer.queues[0]
        jid = job_id(store.keys, batch)
        assert FailedJobRegistry(queue=queue).get_job_ids() == [jid]
        job = queue.fetch_job(jid)
        assert job is not None and job.get_status() == JobStatus.FAILED
        assert "the batch could not start" in (job.latest_result().exc_string or "")
        # The worker tells it apart when it hands back a batch that never arrived.
        found = broken_job(consumer.connection, store.keys, batch)
        assert found is not None and "failed" in found[1]
    finally:
        delivery.bind(None)
        consumer.purge()


@pytest.mark.usefixtures("restore_signals")
def test_rq_heartbeat_is_one_round_trip_and_not_repeated_at_once(store: Store) -> None:
    handler = Handler(store, "w3")
    consumer = make_consumer(handler, store.settings.redis_url)
    sent: list[list[Any]] = []
    real = consumer.connection.pipeline

    def counting_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real(*args, **kwargs)
        execute = pipe.execute

        def counted(*a: Any, **k: Any) -> Any:
            sent.append([c[0][0] for c in pipe.command_stack])
            assert not pipe.transaction  # no MULTI/EXEC around the two commands
            return execute(*a, **k)

        pipe.execute = counted
        return pipe

    consumer.connection.pipeline = counting_pipeline  # type: ignore[method-assign]
    try:
        consumer.heartbeat()
        consumer.heartbeat()  # right after: skipped
        assert sent == [["HSET", "EXPIRE"]]
        key_ttl = consumer.connection.ttl(consumer.key)
        assert 0 < key_ttl <= consumer.worker_ttl + 60
        consumer.heartbeat(timeout=500)  # another TTL: always written
        assert len(sent) == 2 and 400 < consumer.connection.ttl(consumer.key) <= 500
        consumer.heartbeat()  # back to the plain TTL: written
        assert len(sent) == 3 and consumer.connection.ttl(consumer.key) <= consumer.worker_ttl + 60
    finally:
        consumer.connection.delete(consumer.key)


@pytest.mark.usefixtures("restore_signals")
def test_a_stop_signal_taken_before_rqs_handlers_stops_the_loop_before_any_batch(
    store: Store,
) -> None:
    """The worker records a stop signal that arrives before RQ's loop installs its own
    handlers (``stop_pending``); one that arrived after the worker checked it, but before
    RQ's handlers, was lost: the worker served on until a second signal (seen as the
    flaky ``test_a_sigterm_drain_exits_at_once_even_with_the_flag``). RQ's loop must
    drain at once, before dequeuing anything."""
    import os
    import threading

    handler = Handler(store, "w5")
    BatchSender(store.settings.redis_url, store.keys).send(
        "w5", "0" * 22 + "f00d", [("r1", 1)], timeout_s=60
    )
    stop = threading.Event()
    consumer = make_consumer(handler, store.settings.redis_url, stop_pending=stop)
    handler.consumer = consumer
    stop.set()  # the signal came in the gap: recorded, RQ's handlers not yet in place
    # Without the fix the loop serves the batch and then blocks: a later SIGTERM ends it.
    safety = threading.Timer(5.0, os.kill, (os.getpid(), signal.SIGTERM))
    delivery.bind(handler)
    safety.start()
    try:
        consumer.serve()
        assert handler.draining and handler.seen == []
        assert len(consumer.queues[0]) == 1  # left for accept_claimed after the drain
    finally:
        safety.cancel()
        delivery.bind(None)
        consumer.purge()
