"""The client library against the real Redis: submit, wait, cancel, refusals, async twin."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inferq.client import AsyncClient, BatchRefused, Client
from inferq.config import PriorityClass, Settings
from inferq.errors import InvalidRequest, RequestNotFound, ResultTimeout
from inferq.models import RequestState
from inferq.store import Completion, Store

from ..helpers import ready_worker


@pytest.fixture
def client(settings: Settings) -> Client:
    c = Client(settings=settings)
    yield c  # type: ignore[misc]
    c.close()


def serve_one(store: Store, worker: str = "w1", output: str = "ok") -> None:
    """Act as dispatcher + worker for the one queued request (no daemons needed)."""
    ids = store.redis.zrange(store.keys.tenant_queue("standard", "llama-3.1-8b", "default"), 0, 0)
    claimed = store.assign(
        worker, "b", [(ids[0], store.keys.tenant_queue("standard", "llama-3.1-8b", "default"), 1)]
    )
    store.start(worker, claimed)
    rid, attempt = claimed[0]
    store.complete(
        worker, [Completion(rid, attempt, "succeeded", output=output, completion_tokens=1)]
    )


def test_submit_and_block_for_the_result(client: Client, store: Store) -> None:
    ready_worker(store)
    handle = client.submit("hello", max_tokens=4)
    timer = threading.Timer(0.2, serve_one, args=(store,))
    timer.start()
    t0 = time.monotonic()
    result = handle.result(timeout=5)
    assert result.ok and result.output == "ok"
    assert 0.15 < time.monotonic() - t0 < 2  # woken by the push, not a poll interval
    assert handle.status().state is RequestState.SUCCEEDED


def test_result_timeout_leaves_the_request_running(client: Client) -> None:
    handle = client.submit("hello")
    with pytest.raises(ResultTimeout, match=r"still queued after 0\.2 s"):
        handle.result(timeout=0.2)
    assert handle.status().state is RequestState.QUEUED


def test_result_without_dispatcher_returns_expired_at_the_deadline(client: Client) -> None:
    handle = client.submit("hello", timeout=0.3)
    t0 = time.monotonic()
    result = handle.result()
    assert result.status == "expired"
    assert "deadline passed" in (result.error or "")
    assert time.monotonic() - t0 < 2


def test_cancel(client: Client) -> None:
    handle = client.submit("hello")
    assert handle.cancel() is RequestState.CANCELLED
    assert handle.result(timeout=1).status == "cancelled"
    with pytest.raises(RequestNotFound):
        client.status("nope")


def test_invalid_submission_writes_nothing(client: Client, store: Store) -> None:
    with pytest.raises(InvalidRequest, match="max_tokens"):
        client.submit("hello", max_tokens=0)
    assert list(store.redis.scan_iter(match=store.keys.pattern())) == []


def test_submit_many_validates_everything_first(client: Client, store: Store) -> None:
    items = [{"prompt": f"p{i}", "max_tokens": 4} for i in range(5)]
    items[3]["max_tokens"] = -1
    with pytest.raises(InvalidRequest, match=r"items\[3\]\.max_tokens"):
        client.submit_many(items)
    assert list(store.redis.scan_iter(match=store.keys.pattern())) == []


def test_a_script_submits_1000_and_reads_back_their_states(client: Client) -> None:
    handles = client.submit_many({"prompt": f"p{i}", "tenant": f"t{i % 5}"} for i in range(1000))
    states = {client.status(h.id).state for h in handles}
    assert len(handles) == 1000 and states == {RequestState.QUEUED}


def test_submit_many_reports_partial_refusal(redis_client, namespace: str) -> None:  # type: ignore[no-untyped-def]
    classes = [
        PriorityClass(
            name="standard", sla_s=10, timeout_s=60, weight=1, batch_delay_s=0, queue_limit=3
        )
    ]
    settings = Settings.load(namespace=namespace, classes=classes, classifier={})
    client = Client(settings=settings, connection=redis_client)
    with pytest.raises(BatchRefused) as info:
        client.submit_many({"prompt": "x"} for _ in range(5))
    assert len(info.value.accepted) == 3
    assert [i for i, _ in info.value.refused] == [3, 4]
    assert info.value.limit == 3


def test_async_client(settings: Settings, store: Store) -> None:
    ready_worker(store)

    async def main() -> None:
        async with AsyncClient(settings=settings) as client:
            handle = await client.submit("hello", max_tokens=4)
            loop = asyncio.get_running_loop()
            loop.call_later(0.1, serve_one, store)
            result = await handle.result(timeout=5)
            assert result.ok
            many = await client.submit_many([{"prompt": "a"}, {"prompt": "b"}])
            assert await many[0].cancel() is RequestState.CANCELLED
            late = await client.submit("x", timeout=0.2)
            assert (await late.result()).status == "expired"

    asyncio.run(main())


def test_waits_longer_than_the_socket_timeout(client: Client) -> None:
    # redis-py 8 closes a socket read after 5 s: a 6 s wait must still end as a ResultTimeout.
    handle = client.submit("hello")
    t0 = time.monotonic()
    with pytest.raises(ResultTimeout):
        handle.result(timeout=6)
    assert 5.9 < time.monotonic() - t0 < 8
