"""Streaming through Redis: a sim worker publishes chunks, the client reads them as they come.

Real Redis, a real dispatcher thread and real worker subprocesses (the sim model server
spreads its decode time over one chunk per token). The real llama.cpp server's streaming
is checked in ``test_real_server.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest
import redis

from inferq.client import AsyncClient, Client
from inferq.config import Settings
from inferq.models import Result, StreamChunk
from inferq.store import Chunk, Completion, Store
from inferq.workers.runtime import Engine
from inferq.workers.worker import WorkerOptions, build_engine

from ..helpers import queue_key, wait_for
from .fleet import Fleet


@pytest.fixture
def client(fast_settings: Settings, redis_client: Any) -> Client:
    return Client(settings=fast_settings, connection=redis_client)


def _collect(
    items: Iterator[StreamChunk | Result],
) -> tuple[list[tuple[float, StreamChunk]], Result]:
    chunks: list[tuple[float, StreamChunk]] = []
    for item in items:
        if isinstance(item, Result):
            return chunks, item
        chunks.append((time.time(), item))
    raise AssertionError("the stream ended without a result")


def text_since_reset(chunks: list[StreamChunk]) -> str:
    text = ""
    for chunk in chunks:
        text = chunk.delta if chunk.reset else text + chunk.delta
    return text


def test_chunks_arrive_before_the_request_finishes(fleet: Fleet, client: Client) -> None:
    # 40 tokens at the model's decode rate, slowed 20x: about a second of decoding.
    fleet.worker("w1", time_scale=20.0)
    handle = client.submit(
        "tell me",
        model="llama-3.1-8b",
        max_tokens=40,
        params={"sim_output_tokens": 40},
        stream=True,
    )
    timed, result = _collect(handle.stream(timeout=30))
    assert result.ok
    chunks = [c for _, c in timed]
    assert len(chunks) >= 10  # one per token unless the publisher coalesced
    assert chunks[0].first_token_at is not None and chunks[0].seq == 0
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert "".join(c.delta for c in chunks) == result.output
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].tokens == 40
    finished = result.timings.finished_at
    assert finished is not None
    # The first chunk reached the caller well before the request was finished.
    assert timed[0][0] < finished - 0.2
    # The first chunk's first-token time is the result's (the worker's clock, ms).
    assert result.timings.first_token_at is not None
    assert abs(chunks[0].first_token_at - result.timings.first_token_at) < 0.05


def test_async_stream_and_a_non_streamed_request(fleet: Fleet, fast_settings: Settings) -> None:
    fleet.worker("w1", time_scale=0.0)

    async def run() -> tuple[list[StreamChunk | Result], list[StreamChunk | Result]]:
        async with AsyncClient(settings=fast_settings) as aclient:
            streamed = await aclient.submit(
                "x", model="llama-3.1-8b", params={"sim_output_tokens": 5}, stream=True
            )
            plain = await aclient.submit("x", model="llama-3.1-8b", params={"sim_output_tokens": 5})
            a = [item async for item in streamed.stream(timeout=20)]
            b = [item async for item in plain.stream(timeout=20)]
            return a, b

    streamed, plain = asyncio.run(run())
    for items in (streamed, plain):
        result = items[-1]
        assert isinstance(result, Result) and result.ok
        chunks = [c for c in items[:-1] if isinstance(c, StreamChunk)]
        assert text_since_reset(chunks) == result.output
    # The request submitted without stream=True comes as one chunk at the end.
    assert len(plain) == 2


def test_retried_attempt_resets_and_a_reader_behind_the_cap_gets_the_text(
    store: Store, client: Client
) -> None:
    """Chunks written by hand: attempt 1 (then lost), attempt 2 with a gap, then the end."""
    handle = client.submit("x", model="llama-3.1-8b", stream=True, timeout=60)
    rid = handle.id
    store.publish_chunks(
        [
            Chunk(rid, 1, 0, "Hel", 1),
            Chunk(rid, 1, 1, "lo", 2),
            Chunk(rid, 2, 0, "Good", 1),
            Chunk(rid, 2, 2, "bye", 3, "stop"),  # attempt 2's seq 1 is missing
        ]
    )
    # Finish it as a worker would: assigned -> running -> succeeded under attempt 2.
    store.redis.hset(
        store.keys.req(rid),
        mapping={
            "attempts": "2",
            "state": "running",
            "worker": "w",
            "dispatched_ms": str(int(time.time() * 1000)),
            "need_mib": "0",
        },
    )
    store.redis.zadd(store.keys.leases, {rid: 0})
    assert store.complete("w", [Completion(rid, 2, "succeeded", output="Good day, bye")]) == ["ok"]
    items = list(handle.stream(timeout=5))
    chunks = [c for c in items if isinstance(c, StreamChunk)]
    assert [(c.attempt, c.delta, c.reset) for c in chunks] == [
        (1, "Hel", False),
        (1, "lo", False),
        (2, "Good", True),  # attempt 2 voids attempt 1's text
        (2, "Good day, bye", True),  # the gap: the whole text from the result
    ]
    assert isinstance(items[-1], Result) and items[-1].output == "Good day, bye"
    # A reader resuming after an entry gets what follows it, and no reset for its own text.
    resumed = list(handle.stream(timeout=5, after=chunks[0].id))
    assert [c.delta for c in resumed if isinstance(c, StreamChunk)][:1] == ["lo"]


def test_a_stream_expires_with_the_result(
    store: Store, client: Client, fast_settings: Settings
) -> None:
    handle = client.submit("x", model="llama-3.1-8b", stream=True, timeout=60)
    store.publish_chunks([Chunk(handle.id, 1, 0, "a", 1, ttl_s=3600)])
    assert client.cancel(handle.id).value == "cancelled"
    key = store.keys.stream(handle.id)
    ttl = store.redis.ttl(key)
    assert 0 < ttl <= fast_settings.result_ttl_s
    items = list(handle.stream(timeout=5))
    assert isinstance(items[-1], Result) and items[-1].status == "cancelled"


def test_cancelling_a_running_request_aborts_it_on_its_worker(fleet: Fleet, client: Client) -> None:
    fleet.worker("w1", time_scale=50.0, slots=1)  # 40 tokens: a few seconds of decoding
    handle = client.submit(
        "x", model="llama-3.1-8b", max_tokens=40, params={"sim_output_tokens": 40}, stream=True
    )
    stream = handle.stream(timeout=30)
    first = next(stream)
    assert isinstance(first, StreamChunk)
    assert client.cancel(handle.id).value == "running"  # the worker is told
    rest = list(stream)
    result = rest[-1]
    assert isinstance(result, Result) and result.status == "cancelled"
    assert result.error == "cancelled by the caller while running"
    finished = result.timings.finished_at
    assert finished is not None and finished - first.first_token_at < 2.0  # not the full run
    # The slot is free again: a second request runs on the one-slot worker.
    again = client.submit("y", model="llama-3.1-8b", max_tokens=2, params={"sim_output_tokens": 2})
    assert again.result(timeout=30).ok


# --- the worker's end: how soon a chunk reaches Redis ---------------------------------------


class RoundTrips(redis.Connection):
    """A connection that records its writes to the server (one per command, or one per
    pipeline: redis-py packs a pipeline's commands into one write) with the thread that
    sent each."""

    sent: ClassVar[list[tuple[str, str]]] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        parts = command if isinstance(command, list) else [command]
        head = bytes(parts[0][:64]) if parts else b""
        RoundTrips.sent.append((threading.current_thread().name, head.decode(errors="replace")))
        super().send_packed_command(command, check_health)


@pytest.fixture
def engine(fast_settings: Settings) -> Iterator[Engine]:
    """A sim worker ``w1`` in this process (one decode step = 50 ms), on a connection that
    counts round trips (:class:`RoundTrips`)."""
    url = fast_settings.redis_url
    counted = redis.Redis.from_url(url, decode_responses=True, connection_class=RoundTrips)
    opts = WorkerOptions(
        model="llama-3.1-8b",
        worker_id="w1",
        heartbeat_process=False,
        heartbeat_interval_s=0.2,
        vram_mib=81920,
        server_options={"time_scale": 50.0},
    )
    engine = build_engine(fast_settings, opts, Store(counted, fast_settings))
    assert engine.start()
    yield engine
    engine.stop()
    counted.close()


def _claimed(store: Store, client: Client, tokens: int) -> list[tuple[str, int]]:
    """A streamed request submitted and claimed for ``w1`` as the dispatcher would."""
    handle = client.submit(
        "x",
        model="llama-3.1-8b",
        max_tokens=tokens,
        params={"sim_output_tokens": tokens},
        stream=True,
        priority="realtime",
    )
    record = store.record(handle.id)
    claimed = store.assign("w1", "b1", [(handle.id, queue_key(store, record.request), 1.0)])
    assert [rid for rid, _ in claimed] == [handle.id]
    return claimed


def test_a_batch_starts_in_one_round_trip(engine: Engine, store: Store, client: Client) -> None:
    """accept() marks its requests running and reads their records in one round trip
    before their model-server calls begin (issue 14: the batch's start is on every
    request's time to first token)."""
    claimed = _claimed(store, client, 2)
    RoundTrips.sent.clear()
    assert engine.accept("b1", claimed) == {"run": 1, "stale": 0, "expired": 0}
    writes = [head for thread, head in RoundTrips.sent if thread == "MainThread"]
    assert len(writes) == 1, writes


def test_chunks_do_not_wait_for_the_engines_thread_pool(
    engine: Engine, store: Store, client: Client
) -> None:
    """A streamed request's chunks reach Redis from the engine's loop itself: with the
    loop's thread pool busy (here its only thread is held; in production a result write
    stalled on Redis) the first chunk still arrives, and no thread hand-off sits between
    the model server's token and its XADD (issue 14)."""
    held = threading.Event()
    engine._loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    engine._loop.call_soon_threadsafe(engine._loop.run_in_executor, None, held.wait)
    try:
        [(rid, attempt)] = _claimed(store, client, 40)
        engine.accept("b1", [(rid, attempt)])
        wait_for(lambda: store.redis.xlen(store.keys.stream(rid)) > 0, 10, "the first chunk")
    finally:
        held.set()


def test_a_handle_reads_its_stream_without_reading_its_record(
    store: Store, fast_settings: Settings
) -> None:
    """The handle of a streamed request it submitted knows the request: its first read is
    the XREAD (the record's HGETALL + GET came first, on the way to the first chunk).
    A duplicate's handle reads the record: the earlier request's settings rule."""
    url = fast_settings.redis_url
    counted = redis.Redis.from_url(url, decode_responses=True, connection_class=RoundTrips)
    client = Client(settings=fast_settings, connection=counted)
    handle = client.submit("x", model="llama-3.1-8b", stream=True, idempotency_key="k1")
    store.publish_chunks([Chunk(handle.id, 1, 0, "Hel", 1)])
    RoundTrips.sent.clear()
    first = next(iter(handle.stream(timeout=5)))
    assert isinstance(first, StreamChunk) and first.delta == "Hel"
    assert [head.split("\r\n")[2] for _, head in RoundTrips.sent] == ["XREAD"]
    again = client.submit("x", model="llama-3.1-8b", stream=True, idempotency_key="k1")
    assert again.duplicate and again.id == handle.id
    RoundTrips.sent.clear()
    assert next(iter(again.stream(timeout=5))) == first
    assert [head.split("\r\n")[2] for _, head in RoundTrips.sent][-1] == "XREAD"
    assert len(RoundTrips.sent) == 2  # the record (one pipeline), then the stream
    counted.close()
