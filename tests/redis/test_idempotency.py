"""Idempotency keys on the real Redis: one request per (tenant, key), never across tenants.

Issue 12, fault 6: ``submit("secret", tenant="acme", idempotency_key="inv:42")`` and
``submit("hi", tenant="acme:inv", idempotency_key="42")`` once shared the key
``idem:acme:inv:42``, so the second caller got the first one's request and result.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from inferq.client import AsyncClient, BatchRefused, Client
from inferq.config import Settings
from inferq.errors import IdempotencyConflict
from inferq.models import RequestState, Result, StreamChunk

from ..conftest import REDIS_URL
from .fleet import Fleet

#: Pairs of (tenant, key) whose plain ``tenant:key`` (or ``tenant|key``, ``tenant.key``)
#: joins collide, with a separator (":", "|", ".", "@", "-", "/") in every part, and
#: parts that look like the length-prefixed form itself.
COLLIDING = [
    (("acme", "inv:42"), ("acme:inv", "42")),
    (("a:b", "c:d"), ("a", "b:c:d")),
    (("a@b", "c|d"), ("a@b:c", "d")),
    (("t.1", "x.y/z"), ("t", "1.x.y/z")),
    (("4.acme", "6.inv:42"), ("acme", "inv:42")),
    (("3.a:b", "1.c"), ("3.a", "b:1.c")),
    (("x-1", ":"), ("x-1:", ":")),
]


@pytest.fixture
def client(redis_client: redis.Redis, settings: Settings) -> Client:
    return Client(settings=settings, connection=redis_client)


@pytest.fixture
def fast_client(redis_client: redis.Redis, fast_settings: Settings) -> Client:
    """A client on the settings of the ``fleet`` fixture (the worker's heartbeats)."""
    return Client(settings=fast_settings, connection=redis_client)


@pytest.mark.parametrize(("first", "second"), COLLIDING)
def test_keys_of_different_tenants_never_meet(
    client: Client, first: tuple[str, str], second: tuple[str, str]
) -> None:
    a = client.submit("secret", tenant=first[0], idempotency_key=first[1])
    b = client.submit("hi", tenant=second[0], idempotency_key=second[1])
    assert a.id != b.id and not a.duplicate and not b.duplicate
    rec_a, rec_b = client.status(a.id).request, client.status(b.id).request
    assert (rec_a.tenant, rec_a.payload.prompt) == (first[0], "secret")
    assert (rec_b.tenant, rec_b.payload.prompt) == (second[0], "hi")
    # Each key still finds its own request, and only its own.
    assert client.submit("secret", tenant=first[0], idempotency_key=first[1]).id == a.id
    assert client.submit("hi", tenant=second[0], idempotency_key=second[1]).id == b.id


def test_the_same_key_in_another_tenant_is_another_request(client: Client) -> None:
    a = client.submit("secret", tenant="acme", idempotency_key="k")
    b = client.submit("secret", tenant="other", idempotency_key="k")
    assert a.id != b.id and not b.duplicate


def test_async_client_keeps_tenants_apart_and_reports_duplicates(settings: Settings) -> None:
    async def main() -> None:
        async with AsyncClient(settings=settings) as client:
            for i, (first, second) in enumerate(COLLIDING):
                # One namespace for all pairs: a suffix (plain joins still collide) keeps
                # one pair's keys from another's.
                key_a, key_b = f"{first[1]}~{i}", f"{second[1]}~{i}"
                a = await client.submit("secret", tenant=first[0], idempotency_key=key_a)
                b = await client.submit("hi", tenant=second[0], idempotency_key=key_b)
                assert a.id != b.id and not a.duplicate and not b.duplicate
                rec_b = (await b.status()).request
                assert (rec_b.tenant, rec_b.payload.prompt) == (second[0], "hi")
                again = await client.submit("secret", tenant=first[0], idempotency_key=key_a)
                assert again.id == a.id and again.duplicate
            await client.submit("secret", tenant="acme", idempotency_key="inv:42")
            with pytest.raises(IdempotencyConflict) as info:
                await client.submit("changed", tenant="acme", idempotency_key="inv:42")
            assert info.value.key == "inv:42" and "'inv:42'" in str(info.value)

    asyncio.run(main())


def test_the_same_request_again_returns_the_first(client: Client) -> None:
    fields = {"tenant": "acme", "max_tokens": 8, "params": {"temperature": 0.2, "top_p": 0.9}}
    first = client.submit("hello", idempotency_key="order:7", **fields)
    # Same work, parameters in another order and a later timeout: the same request.
    again = client.submit(
        "hello",
        idempotency_key="order:7",
        tenant="acme",
        max_tokens=8,
        params={"top_p": 0.9, "temperature": 0.2},
        timeout=999,
    )
    assert again.duplicate and again.id == first.id
    assert client.store.queued_counts()["c:standard"] == 1


@pytest.mark.parametrize(
    "changed",
    [
        {"prompt": "hello, but different"},
        {"params": {"temperature": 0.9}},
        {"max_tokens": 9},
        {"priority": "batch"},
        {"model": ">=13b"},
        {"task_type": "chat"},
    ],
)
def test_a_key_reused_for_another_request_is_refused(
    client: Client, changed: dict[str, object]
) -> None:
    base: dict[str, object] = {"prompt": "hello", "tenant": "acme", "max_tokens": 8}
    first = client.submit(idempotency_key="inv:42", **base)
    with pytest.raises(IdempotencyConflict) as info:
        client.submit(idempotency_key="inv:42", **{**base, **changed})
    err = info.value
    assert (err.key, err.tenant, err.request_id) == ("inv:42", "acme", first.id)
    assert "idempotency key 'inv:42' of tenant 'acme'" in str(err)
    counts = client.store.queued_counts()
    assert sum(v for k, v in counts.items() if k.startswith("c:")) == 1  # nothing written


def test_submit_many_reports_a_conflict_and_writes_the_rest(client: Client) -> None:
    first = client.submit("hello", tenant="acme", idempotency_key="a")
    with pytest.raises(BatchRefused) as info:
        client.submit_many(
            [
                {"prompt": "hello", "tenant": "acme", "idempotency_key": "a"},
                {"prompt": "not hello", "tenant": "acme", "idempotency_key": "a"},
                {"prompt": "new", "tenant": "acme", "idempotency_key": "b"},
            ]
        )
    accepted, refused = info.value.accepted, info.value.refused
    assert accepted[0].id == first.id and accepted[0].duplicate
    assert len(accepted) == 2 and not accepted[1].duplicate
    assert [i for i, _ in refused] == [1] and isinstance(refused[0][1], IdempotencyConflict)


def test_a_key_never_outlives_its_request(redis_client: redis.Redis, namespace: str) -> None:
    # result_ttl_s below idempotency_ttl_s: once the record is gone, the key is re-pointed
    # to a new request instead of handing out an id that result() no longer knows.
    settings = Settings.load(
        redis_url=REDIS_URL, namespace=namespace, result_ttl_s=1, idempotency_ttl_s=3600
    )
    client = Client(settings=settings, connection=redis_client)
    first = client.submit("hello", tenant="acme", idempotency_key="inv:42")
    assert first.cancel() is RequestState.CANCELLED
    assert client.submit("hello", tenant="acme", idempotency_key="inv:42").id == first.id
    stop = time.monotonic() + 10
    while redis_client.exists(client.store.keys.req(first.id)) and time.monotonic() < stop:
        time.sleep(0.1)
    assert not redis_client.exists(client.store.keys.req(first.id))
    again = client.submit("hello", tenant="acme", idempotency_key="inv:42")
    assert again.id != first.id and not again.duplicate
    assert client.status(again.id).state is RequestState.QUEUED
    # A different request is welcome too once the old one is gone: nothing to conflict with.
    idem = client.store.keys.idem("acme", "inv:42")
    assert 0 < redis_client.ttl(idem) <= 3600


def test_a_key_of_the_old_layout_is_a_stale_pointer(client: Client) -> None:
    # A string at the key (the layout before fingerprints) is replaced, not an error.
    idem = client.store.keys.idem("acme", "k")
    client.store.redis.set(idem, "0" * 26, ex=60)
    handle = client.submit("hello", tenant="acme", idempotency_key="k")
    assert not handle.duplicate
    assert client.submit("hello", tenant="acme", idempotency_key="k").id == handle.id


def test_stream_is_transport_not_work_a_retry_either_way_gets_the_whole_answer(
    fleet: Fleet, fast_client: Client
) -> None:
    """``stream`` (like the deadline) is left out of the fingerprint on purpose: it says
    how the answer travels, not what is computed. A request streamed, then resubmitted
    under its key without streaming (the usual retry after a dropped stream), is the
    same request and ``result()`` gives its whole text; resubmitted streaming after a
    plain submission, ``stream()`` gives the whole text (one chunk when it is final)
    and the result. Neither is refused nor run twice."""
    fleet.worker("w1", time_scale=0.0)
    fields = {"priority": "standard", "max_tokens": 6, "params": {"sim_output_tokens": 6}}
    first = fast_client.submit("story", stream=True, idempotency_key="k-stream", **fields)
    items = list(first.stream(timeout=30))
    text = "".join(i.delta for i in items if isinstance(i, StreamChunk))
    again = fast_client.submit("story", stream=False, idempotency_key="k-stream", **fields)
    assert again.duplicate and again.id == first.id
    whole = again.result(timeout=30)
    assert whole.ok and whole.output == text and len(text.split()) == 6

    plain = fast_client.submit("tale", stream=False, idempotency_key="k-plain", **fields)
    streamed = fast_client.submit("tale", stream=True, idempotency_key="k-plain", **fields)
    assert streamed.duplicate and streamed.id == plain.id
    items = list(streamed.stream(timeout=30))
    final = items[-1]
    assert isinstance(final, Result) and final.ok
    assert "".join(i.delta for i in items if isinstance(i, StreamChunk)) == final.output
    assert final.output == plain.result(timeout=30).output
    assert fast_client.status(plain.id).request.stream is False  # as first submitted
    stats = fleet.store.redis.hgetall(fleet.store.keys.stats)
    assert stats["submitted"] == "2" and stats["succeeded"] == "2"
