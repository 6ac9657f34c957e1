"""Prefix-cache affinity on the real Redis: chains stored with requests, the prefix log
written by assign.lua, dispatcher replicas that converge, resets and corrupt entries."""

from __future__ import annotations

import json

import pytest

from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.dispatcher.prefix_cache import PrefixCache
from inferq.errors import InvalidRequest
from inferq.models import RequestState
from inferq.policy.snapshot import DispatchPolicy
from inferq.store import Completion, Store

from ..helpers import ready_worker

SYSTEM = "You are a careful assistant. " * 200  # ~5,800 characters: ~22 blocks of 64 tokens


@pytest.fixture
def client(settings: Settings, redis_client) -> Client:  # type: ignore[no-untyped-def]
    return Client(settings=settings, connection=redis_client)


def _finish(store: Store, client: Client, ids: list[str]) -> dict[str, str]:
    """Complete the given assigned requests; return request id -> worker."""
    where = {}
    for rid in ids:
        rec = client.status(rid)
        assert rec.state is RequestState.ASSIGNED, rec.state
        assert rec.worker is not None
        where[rid] = rec.worker
        store.start(rec.worker, [(rid, rec.attempt)])
        store.complete(rec.worker, [Completion(rid, rec.attempt, "succeeded", output="ok")])
    return where


def test_a_conversation_s_later_turns_follow_its_cache(store: Store, client: Client) -> None:
    for w in ("w1", "w2", "w3"):
        ready_worker(store, w, slots=8, kv_cache_mib=16_000)
    dispatcher = Dispatcher(store)
    turns = [SYSTEM + f"user: question {i} " + "context " * 300 * i for i in range(1, 4)]
    first = client.submit(turns[0], priority="realtime", max_tokens=16)
    dispatcher.step()
    [home] = _finish(store, client, [first.id]).values()
    # other work arrives, so the least-utilised worker is no longer the conversation's
    others = [client.submit(f"unrelated {i}", priority="realtime", max_tokens=16) for i in range(3)]
    dispatcher.step()
    _finish(store, client, [h.id for h in others])
    for text in turns[1:]:
        handle = client.submit(text, priority="realtime", max_tokens=16)
        dispatcher.step()
        rec = client.status(handle.id)
        assert rec.worker == home
        assert rec.cached_forecast >= 20 * 64  # the system prompt and the earlier turn
        _finish(store, client, [handle.id])


def test_two_dispatchers_learn_the_same_index_from_the_log(store: Store, client: Client) -> None:
    ready_worker(store, "w1", slots=8, kv_cache_mib=16_000)
    ready_worker(store, "w2", slots=8, kv_cache_mib=16_000)
    a = Dispatcher(store)
    for i in range(4):
        client.submit(SYSTEM + f"turn {i}", priority="realtime", max_tokens=8)
    a.step()
    a.step()  # a replica learns its own placements from the log too, at its next step
    other = Store(store.redis, store.settings)  # a second replica, its own memory
    cache = PrefixCache(other, DispatchPolicy.from_settings(store.settings))
    view = other.dispatch_view(["realtime"], 16, 30)
    index = cache.refresh(view.snapshot.workers)
    assert a.prefix is not None
    assert index.sizes() == a.prefix.index.sizes()
    assert index.sizes() and max(index.sizes().values()) >= 20
    chain = client.status(
        client.submit(SYSTEM, priority="realtime", max_tokens=8).id
    ).request.prefix_hashes
    assert index.match(chain) == a.prefix.index.match(chain) != {}


def test_a_reset_forgets_a_worker_and_a_corrupt_entry_is_skipped(
    store: Store, client: Client
) -> None:
    ready_worker(store, "w1", slots=8, kv_cache_mib=16_000)
    d = Dispatcher(store)
    client.submit(SYSTEM, priority="realtime", max_tokens=8)
    d.step()
    d.step()
    assert d.prefix is not None and d.prefix.index.blocks("w1") > 0
    store.redis.xadd(store.keys.prefix_log, {"w": "w1", "c": "64:zz"})  # not hex
    store.redis.xadd(store.keys.prefix_log, {"nonsense": "1"})
    store.note_prefix("w1", reset=1)
    d.step()
    assert d.prefix.index.blocks("w1") == 0
    assert d.prefix.skipped == 2


def test_a_miss_reported_by_the_server_shrinks_the_worker_s_model(
    store: Store, client: Client
) -> None:
    ready_worker(store, "w1", slots=8, kv_cache_mib=16_000)
    d = Dispatcher(store)
    client.submit(SYSTEM, priority="realtime", max_tokens=8)
    d.step()
    d.step()
    assert d.prefix is not None
    before = d.prefix.index.blocks("w1")
    store.note_prefix("w1", fc=1408, got=0, bt=64)
    d.step()
    assert d.prefix.index.blocks("w1") < before


def test_the_chain_is_stored_compactly_and_read_back(store: Store, client: Client) -> None:
    handle = client.submit(SYSTEM, priority="realtime", max_tokens=8)
    raw = store.redis.hget(store.keys.req(handle.id), "prefix")
    assert (
        raw is not None
        and raw.startswith("64:")
        and len(raw) == 3 + 16 * len(client.status(handle.id).request.prefix_hashes)
    )
    assert SYSTEM[:100] not in raw


def test_a_caller_s_chain_is_checked_before_redis(store: Store, client: Client) -> None:
    with pytest.raises(InvalidRequest, match="prefix_hashes"):
        client.submit("hi", prefix_hashes=[1, -2], max_tokens=8)
    with pytest.raises(InvalidRequest, match="session"):
        client.submit("hi", session="has space", max_tokens=8)
    assert store.redis.dbsize() >= 0 and not list(store.redis.scan_iter(store.keys.req("*")))
    text = "x" * 200  # 200 bytes: at most 4 blocks of 64 tokens
    given = client.submit(text, prefix_hashes=[5, 6, 7], max_tokens=8)
    assert client.status(given.id).request.prefix_hashes == (5, 6, 7)
    # A chain longer than its prompt could fill is cut: 1-token prompts with 512 made-up
    # blocks each evicted other chats from the modelled caches.
    long = client.submit("hi", prefix_hashes=list(range(512)), max_tokens=8)
    assert client.status(long.id).request.prefix_hashes == (0,)
    mine = client.submit(text, prefix_hashes=list(range(512)), max_tokens=8)
    assert client.status(mine.id).request.prefix_hashes == (0, 1, 2, 3)


def test_info_and_workers_show_the_index_and_the_hit_rate(store: Store, client: Client) -> None:
    from click.testing import CliRunner

    from inferq.cli.main import cli

    from ..builders import worker_info

    info = worker_info("w1", kv_cache_mib=16_000).model_copy(
        update={"prompt_tokens_total": 1000, "cached_tokens_total": 250}
    )
    store.heartbeat(info, ttl_s=30)
    client.submit(SYSTEM, priority="realtime", max_tokens=8)
    Dispatcher(store).step()
    base = ["--redis-url", store.settings.redis_url, "--namespace", store.settings.namespace]
    out = CliRunner().invoke(cli, [*base, "info", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["prefix_log"]["entries"] == 1 and data["prefix_log"]["bytes"] > 0
    assert data["prefix_tokens"]["hit_rate"] == 0.25
    rows = json.loads(CliRunner().invoke(cli, [*base, "workers", "--json"]).output)
    assert rows[0]["prefix_hit_rate"] == 0.25
    table = CliRunner().invoke(cli, [*base, "workers"]).output
    assert "25%" in table


def test_a_heartbeat_claiming_more_reuse_than_its_prompt_shows_at_most_100_percent(
    store: Store,
) -> None:
    from click.testing import CliRunner

    from inferq.cli.main import cli

    from ..builders import worker_info

    honest = worker_info("w1").model_copy(
        update={"prompt_tokens_total": 1000, "cached_tokens_total": 250}
    )
    liar = worker_info("w2").model_copy(
        update={"prompt_tokens_total": 1000, "cached_tokens_total": 9000}
    )
    store.heartbeat(honest, ttl_s=30)
    store.heartbeat(liar, ttl_s=30)
    base = ["--redis-url", store.settings.redis_url, "--namespace", store.settings.namespace]
    rows = json.loads(CliRunner().invoke(cli, [*base, "workers", "--json"]).output)
    assert {r["id"]: r["prefix_hit_rate"] for r in rows} == {"w1": 0.25, "w2": 1.0}
    assert {r["id"]: r["cached_tokens_total"] for r in rows}["w2"] == 9000  # shown as reported
    data = json.loads(CliRunner().invoke(cli, [*base, "info", "--json"]).output)
    assert data["prefix_tokens"]["cached_by_servers"] == 1250
    assert data["prefix_tokens"]["hit_rate"] == 0.625


def test_a_planted_prefix_log_entry_never_stops_dispatching(
    store: Store, client: Client, settings: Settings
) -> None:
    """Entries inferq never writes: bytes that are not UTF-8 (the reply failed to decode
    at every step, so nothing was dispatched), a 400 KB placement (decoded whole, one such
    entry cost a step 4.7 s and 1 GB); and the log as another type (assign.lua's write
    failed with every claim): skipped, or quarantined by the step's repair."""
    import redis as redis_lib

    from ..conftest import REDIS_URL

    raw = redis_lib.Redis.from_url(REDIS_URL)
    log = store.keys.prefix_log
    raw.xadd(log, {b"w": b"w1\xff\xfe", b"reset": b"1"})
    raw.xadd(log, {b"w": b"w1", b"c": b"64:" + b"0" * 400_000})
    ready_worker(store, "w1", kv_cache_mib=16_000)
    dispatcher = Dispatcher(store)
    first = client.submit(SYSTEM, priority="realtime", max_tokens=8)
    assert dispatcher.step().dispatched == 1
    assert dispatcher.prefix is not None and dispatcher.prefix.skipped == 2
    assert client.status(first.id).state is not RequestState.QUEUED
    store.redis.delete(log)
    store.redis.set(log, "not a stream")
    second = client.submit(SYSTEM, priority="realtime", max_tokens=8)
    with pytest.raises(redis_lib.ResponseError, match="WRONGTYPE"):
        dispatcher.step()
    assert dispatcher._repair() >= 1  # what run() does after a failed step
    assert log in store.redis.hkeys(store.keys.quarantine)
    assert dispatcher.step().dispatched == 1
    assert client.status(second.id).state is not RequestState.QUEUED


def test_with_prefix_routing_off_a_caller_s_chain_is_checked_and_not_stored(
    store: Store, settings: Settings, redis_client
) -> None:  # type: ignore[no-untyped-def]
    off = settings.model_copy(
        update={"prefix": settings.prefix.model_copy(update={"enabled": False})}
    )
    client = Client(settings=off, connection=redis_client)
    with pytest.raises(InvalidRequest, match="prefix_hashes"):
        client.submit("hi", prefix_hashes=[-1], max_tokens=8)
    handle = client.submit("x" * 200, prefix_hashes=[5, 6, 7], max_tokens=8)
    assert client.status(handle.id).request.prefix_hashes == ()


def test_a_worker_out_of_one_replica_s_view_for_a_step_keeps_its_placements(
    store: Store, client: Client, settings: Settings
) -> None:
    """A heartbeat that lapsed for one step (or came between a replica's view and its
    XRANGE) made that replica drop the worker and ignore the placements on it it read in
    that step: the replicas disagreed for good. A worker is forgotten only once it has
    been out of view ``FORGET_S``."""
    for w in ("w1", "w2"):
        ready_worker(store, w, slots=2, kv_cache_mib=16_000)
    policy = DispatchPolicy.from_settings(settings)
    dispatcher = Dispatcher(store)
    other = PrefixCache(store, policy)
    view = store.dispatch_view(["realtime"], 16, 30).snapshot.workers
    other.refresh(view)
    ids = [client.submit(f"chat {i} " * 400, priority="realtime").id for i in range(4)]
    dispatcher.step()  # the placements go to the log with the claims
    assert dispatcher.prefix is not None
    dispatcher.prefix.refresh(view)
    other.refresh([w for w in view if w.id != "w2"])  # w2 out of this step's view
    other.refresh(view)
    assert other.index.sizes() == dispatcher.prefix.index.sizes()
    assert all(n > 0 for n in other.index.sizes().values())
    _finish(store, client, ids)
