""":class:`Glance`: the reads that need only a connection and a namespace.

The part of :class:`~inferq.store.Store` that takes no settings and no scripts:
the Redis clock, queue depths and waits, event rates, whether a namespace was ever
used. ``inferq queues`` reads through it, so the command starts without the settings
(pydantic), the models or the Lua scripts (issue 15: CLI start time); every other
caller gets the same methods from :class:`~inferq.store.Store`, which extends it.
This module imports only the keys and redis-py's types (through the connection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from inferq.store.connection import Connection
from inferq.store.keys import Keys, count_field_queue


def redis_time(reply: Sequence[Any]) -> float:
    """Redis ``TIME`` (seconds, microseconds) as epoch seconds."""
    sec, usec = reply
    return float(sec) + float(usec) / 1e6


def redis_time_ms(reply: Sequence[Any]) -> int:
    """Redis ``TIME`` as epoch milliseconds, floored as the scripts' clock
    (``lua/includes/clock.lua``) floors it.

    A Python ms that rounded instead would be one ahead of the scripts' ms in half of
    each millisecond: a worker marked changed in that half-ms would score below a
    snapshot's ``since_ms`` and be missed until the next full read.
    """
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


class RedisMemory(NamedTuple):
    """The Redis server's memory figures (``INFO memory``; every namespace on it).

    Attributes:
        used_bytes: ``used_memory``, bytes.
        max_bytes: ``maxmemory``, bytes (0: no limit).
        policy: ``maxmemory_policy`` (``""`` where the server does not say).
    """

    used_bytes: int
    max_bytes: int
    policy: str

    @property
    def eviction_warning(self) -> str | None:
        """Why this server may drop inferq's keys, or None: with a memory limit and any
        policy but ``noeviction``, Redis deletes keys when full (under ``volatile-*``
        those with a TTL: heartbeats and results; under ``allkeys-*`` queued requests and
        leases too), so requests are lost without an error. Under ``noeviction`` a full
        Redis refuses writes instead, and a submit fails with the error (Sidekiq and
        BullMQ warn of the same at start)."""
        if self.max_bytes <= 0 or self.policy in ("", "noeviction"):
            return None
        return (
            f"Redis may evict inferq's keys (maxmemory-policy {self.policy}, maxmemory "
            f"{self.max_bytes / 2**20:.0f} MiB): requests can be lost; set "
            "maxmemory-policy noeviction"
        )


class Glance:
    """Reads of one deployment's keys (``inferq:<namespace>:*``) over a text connection.

    Args:
        client: a redis-py client created with ``decode_responses=True`` (see
            :func:`~inferq.store.connect`).
        namespace: the deployment's namespace (``Settings.namespace``).
    """

    def __init__(self, client: Connection, namespace: str) -> None:
        # Typed Any: with decode_responses=True every reply is str, which redis-py's
        # stubs (bytes | str for every call) cannot express.
        self.redis: Any = client
        self.keys = Keys(namespace)

    def close(self) -> None:
        """Close the connection pool."""
        self.redis.close()

    def now(self) -> float:
        """Redis server time, epoch seconds (the one clock every script uses)."""
        return redis_time(self.redis.time())

    def memory(self) -> RedisMemory:
        """The server's memory use, limit and eviction policy (one ``INFO memory``)."""
        info = self.redis.info("memory")
        return RedisMemory(
            used_bytes=int(info.get("used_memory", 0)),
            max_bytes=int(info.get("maxmemory", 0) or 0),
            policy=str(info.get("maxmemory_policy", "")),
        )

    def queue_depths(self) -> list[tuple[str, str, int, float | None]]:
        """(class, route, queued, oldest wait in seconds or None) for every queue.

        The depth is the queue's counter (``counts`` field ``q:<class>|<route>``, kept by
        the scripts with its sub-queues), the oldest wait the lowest head of its tenant
        index (scores are epoch ms): two reads per queue whatever its backlog or its
        tenants.
        """
        names = sorted(n for n in self.redis.smembers(self.keys.queues) if "|" in n)
        parts = [name.split("|", 1) for name in names]
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.hmget(self.keys.counts, [count_field_queue(c, r) for c, r in parts] or ["-"])
        for cls, route in parts:
            pipe.zrange(self.keys.tenant_index(cls, route), 0, 0, withscores=True)
        time_reply, depths, *heads = pipe.execute()
        now = redis_time(time_reply)
        out: list[tuple[str, str, int, float | None]] = []
        for (cls, route), depth, head in zip(parts, depths, heads, strict=False):
            oldest = max(0.0, now - head[0][1] / 1000.0) if head else None
            out.append((cls, route, max(0, int(depth or 0)), oldest))
        return out

    def event_rates(self, window_s: float = 60.0, cap: int = 20_000) -> dict[str, float]:
        """Events per second by type over the last ``window_s`` seconds (at most ``cap`` read)."""
        start = round((self.now() - window_s) * 1000)
        entries = self.redis.xrange(self.keys.events, min=f"{start}-0", count=cap)
        counts: dict[str, int] = {}
        for _, fields in entries:
            etype = fields.get("type", "?")
            n = int(fields.get("n", 1)) if etype == "dispatch" else 1
            counts[etype] = counts.get(etype, 0) + n
        return {etype: n / window_s for etype, n in counts.items()}

    def namespace_has_keys(self) -> bool:
        """Whether this namespace was ever used: one of the keys that every submit,
        heartbeat or event writes exists (one EXISTS, no scan of the keyspace)."""
        k = self.keys
        return int(self.redis.exists(k.stats, k.events, k.workers, k.queues)) > 0
