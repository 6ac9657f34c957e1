"""The store's inspection and admin calls: what the CLI, the metrics and operators read.

The events stream, lifetime counters, the quarantine, the dead letter, purging a
namespace (queue depths and waits, event rates and the clock are
:class:`~inferq.store.glance.Glance`'s, which needs no settings). Part of
:class:`~inferq.store.Store`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inferq import defaults
from inferq.models import Event
from inferq.store import calls
from inferq.store.base import StoreBase


class AdminCalls(StoreBase):
    """Reads for people and dashboards, and the two admin writes (dead-letter requeue, purge)."""

    def events(self, count: int = 100, after: str = "-") -> list[Event]:
        """Oldest-first events after stream id ``after`` ('-' = from the start of the cap)."""
        start = after if after == "-" else f"({after}"
        entries = self.redis.xrange(self.keys.events, min=start, count=count)
        return [calls.parse_event(eid, fields) for eid, fields in entries]

    def recent_events(self, count: int = 20) -> list[Event]:
        """The newest ``count`` events, oldest first."""
        entries = self.redis.xrevrange(self.keys.events, count=count)
        return [calls.parse_event(eid, fields) for eid, fields in reversed(entries)]

    def tail_events(
        self, after: str, count: int = 1000, block_s: float = 1.0
    ) -> list[tuple[str, dict[str, str]]]:
        """Raw (stream id, fields) of the events after ``after`` (``$``: only new ones),
        blocking up to ``block_s`` for the first (XREAD)."""
        reply = self.redis.xread(
            {self.keys.events: after}, count=count, block=round(self.block_s(block_s) * 1000)
        )
        return [(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    def stats(self) -> dict[str, int]:
        """Lifetime counters: submitted, dispatched, succeeded, failed, expired, ..."""
        return {k: int(v) for k, v in self.redis.hgetall(self.keys.stats).items()}

    def queued_counts(self) -> dict[str, int]:
        """Raw queued counters (``c:<class>`` and ``t:<class>:<tenant>`` fields)."""
        return {k: int(v) for k, v in self.redis.hgetall(self.keys.counts).items()}

    def quarantined(self) -> dict[str, str]:
        """Quarantined keys and why."""
        return dict(self.redis.hgetall(self.keys.quarantine))

    # --- the gateway's API keys (values are the gateway's JSON; see inferq.gateway.tenants)

    def api_keys(self) -> dict[str, str]:
        """Every stored API key: SHA-256 hex digest -> JSON entry."""
        return dict(self.redis.hgetall(self.keys.api_keys))

    def put_api_key(self, key_digest: str, entry_json: str) -> bool:
        """Store an API key's entry under its digest; False when that digest was already
        stored (the entry is left as it was)."""
        return bool(self.redis.hsetnx(self.keys.api_keys, key_digest, entry_json))

    def api_key_count(self) -> int:
        """How many API keys are stored."""
        return int(self.redis.hlen(self.keys.api_keys))

    def delete_api_key(self, key_digest: str) -> bool:
        """Revoke an API key; False when the digest was not stored."""
        return bool(self.redis.hdel(self.keys.api_keys, key_digest))

    def dead_letters(self, limit: int = 100) -> list[str]:
        """Ids in the dead letter, oldest first."""
        return list(self.redis.zrange(self.keys.dead, 0, limit - 1))

    def dead_letter_count(self) -> int:
        """How many requests the dead letter holds."""
        return int(self.redis.zcard(self.keys.dead))

    def delete_dead(self, request_ids: Sequence[str] | None = None) -> list[str]:
        """Delete requests from the dead letter with their records; returns the ids deleted.

        Args:
            request_ids: the ids to delete (ids not in the dead letter are left alone);
                None deletes those kept longer than ``dead_letter_ttl_s``, at most
                :data:`~inferq.defaults.DEAD_LETTER_PRUNE_LIMIT` (the dispatcher's tick).
        """
        if request_ids is not None and not request_ids:
            return []
        call = calls.dead_delete_call(
            self.keys, self.settings, request_ids, defaults.DEAD_LETTER_PRUNE_LIMIT
        )
        return calls.parse_dead_delete(self._call(call))

    def requeue_dead(self, request_id: str) -> bool:
        """Requeue a dead-lettered request with a fresh attempt budget and deadline."""
        call = calls.dead_requeue_call(self.keys, self.settings, request_id)
        return calls.parse_dead_requeue(self._call(call))

    def purge(self, on_batch: Callable[[int], None] | None = None) -> int:
        """Delete every key of this namespace; returns how many. Irreversible.

        ``on_batch(n)`` is told after each batch of ``n`` deleted keys (progress).
        """
        deleted = 0
        batch: list[str] = []

        def flush() -> int:
            n = int(self.redis.unlink(*batch))
            batch.clear()
            if on_batch is not None:
                on_batch(n)
            return n

        for key in self.redis.scan_iter(match=self.keys.pattern(), count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += flush()
        if batch:
            deleted += flush()
        return deleted
