"""Bounded state (issue 12, fault 3): one-off tenants and task types leave no lasting cost.

10,000 requests, each with its own tenant and task type, are dispatched and finished.
Then a dispatcher step on an empty queue sends exactly the Redis commands it sent
before (counted on the connection, not timed), the output estimates stay under their
cap, and the tenants' VTC state folds away once they have been idle long enough.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from inferq import defaults
from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.models import WorkerInfo
from inferq.policy.snapshot import DispatchPolicy
from inferq.store import Store
from inferq.store.calls import Completion
from inferq.store.connection import connection_kwargs

from ..conftest import REDIS_URL
from ..helpers import ready_worker

N = 10_000
MODEL = "llama-3.1-8b"


def size(reply: Any) -> int:
    """Values in a reply: a list's, set's or dict's (keys and values) items, nested; else 1."""
    if isinstance(reply, dict):
        return sum(1 + size(v) for v in reply.values())
    if isinstance(reply, list | tuple | set):
        return sum(size(v) for v in reply)
    return 1


class CountingRedis(redis.Redis):
    """A client that counts the commands it sends (pipelined ones included) and the
    values their replies hold."""

    sent = 0
    values = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent += 1
        reply = super().execute_command(*args, **options)
        self.values += size(reply)
        return reply

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        run = pipe.execute

        def execute(raise_on_error: bool = True) -> Any:
            self.sent += len(pipe.command_stack)
            replies = run(raise_on_error=raise_on_error)
            self.values += size(replies)
            return replies

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


class NoDelivery:
    """Stands in for the RQ sender: remembers the claimed batches instead."""

    def __init__(self) -> None:
        self.claimed: list[tuple[str, int]] = []

    def send(self, worker_id: str, batch_id: str, claimed: Any, *, timeout_s: float) -> None:
        self.claimed.extend(claimed)

    def purge(self, worker_id: str) -> None:
        pass


def step_cost(d: Dispatcher, counting: CountingRedis) -> tuple[int, int]:
    """(Commands sent, values read) by the cheapest of 5 steps on an empty queue: a step
    that is a periodic full read of the fleet costs more and is not what is compared."""
    costs = []
    for _ in range(5):
        d._housekept_at = time.monotonic()  # expiry/recovery run once per tick: not this step
        sent, values = counting.sent, counting.values
        assert d.step().dispatched == 0
        costs.append((counting.sent - sent, counting.values - values))
    return min(costs)


def serve(
    store: Store,
    client: Client,
    d: Dispatcher,
    sender: NoDelivery,
    info: WorkerInfo,
    names: list[str],
) -> None:
    """Submit one request per name (tenant t<name>, task type task<name>), dispatch them
    all, and finish them as the worker would (results, output estimates)."""
    store.heartbeat(info, ttl_s=30)  # a live worker beats
    client.submit_many(
        {"prompt": "x", "tenant": f"t{n}", "task_type": f"task{n}", "max_tokens": 8} for n in names
    )
    give_up = time.monotonic() + 60
    while len(sender.claimed) < len(names):  # a class's batching delay may hold a step back
        d.step()
        store.heartbeat(info, ttl_s=30)
        assert time.monotonic() < give_up, f"{len(sender.claimed)} of {len(names)} dispatched"
    pairs = list(sender.claimed)
    assert store.start("w1", pairs) == ["run"] * len(pairs)
    store.complete("w1", [Completion(rid, attempt, "succeeded") for rid, attempt in pairs])
    store.update_estimates([(MODEL, f"task{n}", 5) for n in names], 0.5)
    sender.claimed.clear()


def test_one_off_tenants_and_task_types_leave_no_lasting_cost(settings: Settings) -> None:
    counting = CountingRedis.from_url(REDIS_URL, **connection_kwargs())
    store = Store(counting, settings)
    client = Client(settings=settings, connection=counting)
    info = ready_worker(store, "w1", slots=4096)
    d = Dispatcher(store, policy=DispatchPolicy.from_settings(settings, max_batch=1000))
    sender = NoDelivery()
    d.sender = sender  # type: ignore[assignment]
    serve(store, client, d, sender, info, ["warm"])  # the queue exists before and after
    cost_before = step_cost(d, counting)

    for start in range(0, N, 1000):
        serve(store, client, d, sender, info, [f"{i}" for i in range(start, start + 1000)])
    assert store.stats()["succeeded"] == N + 1
    k = store.keys
    assert store.redis.zcard(k.fair_vtc("standard")) == N + 1  # served within TENANT_IDLE_S: kept
    assert store.redis.hlen(k.estimates) <= defaults.ESTIMATES_MAX
    assert store.redis.zcard(k.estimates_seen) == store.redis.hlen(k.estimates)
    assert not store.redis.exists(k.tenant_index("standard", MODEL))
    assert [f for f in store.redis.hkeys(k.counts) if f.startswith("t:")] == []

    assert step_cost(d, counting) == cost_before  # the time per step: bench_dispatch.py

    # The tenants go idle: TENANT_IDLE_S later (their last-seen times moved back) every
    # step folds up to FOLD_LIMIT of them until none is left; a backlogged one stays.
    store.request_drain("w1")  # nothing is dispatched any more: t7 stays backlogged
    client.submit("x", tenant="t7", max_tokens=8)
    old = round((store.now() - defaults.TENANT_IDLE_S - 1) * 1000)
    seen = k.fair_seen("standard")
    store.redis.zadd(seen, dict.fromkeys(store.redis.zrange(seen, 0, -1), old))
    steps = 0
    while store.redis.zcard(k.fair_vtc("standard")) > 1:
        d.step()
        steps += 1
        assert steps <= N // defaults.FOLD_LIMIT + 2
    assert store.redis.zrange(k.fair_vtc("standard"), 0, -1) == ["t7"]
    assert store.redis.zrange(seen, 0, -1) == ["t7"]
