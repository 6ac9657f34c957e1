"""The router-side prefix-cache index: which prompt blocks each worker's KV cache holds.

A model server keeps the KV blocks of recent prompts and evicts the least recently
used ones when its cache is full. :class:`PrefixIndex` models that per worker: an LRU
of block hashes (:mod:`inferq.prefix`) bounded by the worker's KV capacity in
tokens (each block weighs its ``block_tokens``), plus a map from a block hash to the
workers holding it, so a request's longest cached prefix on every worker is found by
walking its chain once (:meth:`PrefixIndex.match`), not by visiting workers.

It is the *approximate* index of llm-d / the Gateway API Inference Extension: it
learns from the routing decisions themselves (a request sent to a worker leaves its
blocks there, :meth:`PrefixIndex.touch`), not from the servers. Two corrections keep
it near the truth (*precise* mode where the server reports): a worker whose model
server restarted is cleared (:meth:`PrefixIndex.drop`), and a server that reports
reusing fewer prompt tokens than the index forecast shrinks that worker's modelled
capacity (:meth:`PrefixIndex.observe`: its cache holds less than the index assumed,
for example because the server gives part of the KV memory to running requests).

The chain is touched last block first, so a chain's leading blocks, which more
requests share, are the most recently used and the last evicted (vLLM evicts a
sequence's tail blocks first for the same reason).

Pure data structure: no Redis, no clock. The dispatcher keeps one per process, fed
from the shared change stream (:mod:`inferq.store`), and the simulator one per run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

#: Lower bound of the capacity scale a worker's corrections can reach.
MIN_SCALE = 0.01
#: Factor a forecast that the server did not confirm shrinks the scale by, and the
#: step a confirmed one grows it back by (up to 1: fifty confirmations from nothing).
SHRINK = 0.8
GROW = 0.02


class _WorkerCache:
    """One worker's modelled cache: block hash -> its tokens, least recently used first."""

    __slots__ = ("blocks", "capacity", "scale", "used")

    def __init__(self, capacity: float) -> None:
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.capacity = capacity
        self.scale = 1.0
        self.used = 0


class PrefixIndex:
    """Per-worker LRU of cached prompt blocks, with a block -> workers map.

    Capacities are KV-cache tokens (a worker's KV MiB divided by its model's KV bytes
    per token); a worker not yet sized holds nothing.
    """

    def __init__(self) -> None:
        self._caches: dict[str, _WorkerCache] = {}
        self._holders: dict[int, set[str]] = {}

    # --- fleet ---------------------------------------------------------------

    def workers(self) -> frozenset[str]:
        """Workers the index holds blocks (or a capacity) for."""
        return frozenset(self._caches)

    def set_capacity(self, worker: str, tokens: float) -> None:
        """Size ``worker``'s cache, KV tokens; blocks beyond it are evicted oldest first."""
        cache = self._caches.get(worker)
        if cache is None:
            self._caches[worker] = _WorkerCache(max(0.0, tokens))
            return
        cache.capacity = max(0.0, tokens)
        self._evict(worker, cache)

    def drop(self, worker: str) -> None:
        """Forget ``worker``'s blocks and size (it left, or its model server restarted)."""
        cache = self._caches.pop(worker, None)
        if cache is None:
            return
        for h in cache.blocks:
            self._unhold(h, worker)

    def retain(self, live: Iterable[str]) -> None:
        """Drop every worker not in ``live``."""
        keep = set(live)
        for worker in [w for w in self._caches if w not in keep]:
            self.drop(worker)

    # --- learning ------------------------------------------------------------

    def touch(self, worker: str, block_tokens: int, hashes: Sequence[int]) -> None:
        """Record that ``worker`` now holds ``hashes`` (a request's chain) as most recent.

        A worker without a capacity (:meth:`set_capacity`) is ignored.
        """
        cache = self._caches.get(worker)
        if cache is None or not hashes or block_tokens < 1:
            return
        blocks = cache.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
                continue
            blocks[h] = block_tokens
            cache.used += block_tokens
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {worker}
            else:
                holders.add(worker)
        self._evict(worker, cache)

    def observe(self, worker: str, forecast_tokens: int, served_tokens: int, block: int) -> None:
        """Correct ``worker`` from its server's count of reused prompt tokens.

        A forecast the server missed by more than a block means the server holds less
        than the index models: the modelled capacity shrinks to :data:`SHRINK` times
        what the index held (or had room for, whichever is less; at least
        :data:`MIN_SCALE` of the capacity), evicting the oldest blocks; a confirmed
        forecast grows it back by :data:`GROW` of the capacity (up to all of it).
        """
        cache = self._caches.get(worker)
        if cache is None or forecast_tokens <= 0:
            return
        if served_tokens + block < forecast_tokens:
            held = cache.used / cache.capacity if cache.capacity > 0 else 1.0
            cache.scale = max(MIN_SCALE, min(cache.scale, held) * SHRINK)
            self._evict(worker, cache)
        else:
            cache.scale = min(1.0, cache.scale + GROW)

    # --- reading -------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Workers holding a prefix of ``hashes``: worker -> leading blocks held (>= 1).

        Walks the chain once; the set of workers holding blocks ``0..i`` only shrinks.
        """
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        alive = set(first)
        found = dict.fromkeys(alive, 1)
        for i in range(1, len(hashes)):
            holders = self._holders.get(hashes[i])
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for w in alive:
                found[w] = i + 1
        return found

    def deepest(self, hashes: Sequence[int], limit: int) -> dict[str, int]:
        """Workers holding the longest prefixes of ``hashes``, at most ``limit``: worker ->
        leading blocks held (>= 1).

        What the dispatcher weighs (:mod:`.affinity`). A block held by more than
        ``limit`` workers (a system prompt every worker has seen) names no candidate:
        those workers tie on it, and the least-loaded pick, weighed beside the
        candidates, is as good as any of them. So the candidates are the holders of the
        chain's first block held by at most ``limit`` workers, each with its own
        leading blocks; none when every block of the chain is held more widely. The
        cost is a dict lookup per widely held block and ``limit`` short walks, however
        large the fleet (:meth:`match` visits every holder).
        """
        if limit <= 0:
            return {}
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                return {}
            if len(holders) <= limit:
                break
        else:
            return {}
        out = {w: self.held(w, hashes) for w in holders}
        return {w: n for w, n in out.items() if n}

    def held(self, worker: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that ``worker``'s cache holds (0 if none)."""
        cache = self._caches.get(worker)
        if cache is None:
            return 0
        held = cache.blocks
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def blocks(self, worker: str) -> int:
        """Blocks held for ``worker``."""
        cache = self._caches.get(worker)
        return len(cache.blocks) if cache else 0

    def used_tokens(self, worker: str) -> int:
        """KV tokens the held blocks of ``worker`` stand for."""
        cache = self._caches.get(worker)
        return cache.used if cache else 0

    def sizes(self) -> Mapping[str, int]:
        """Worker -> blocks held."""
        return {w: len(c.blocks) for w, c in self._caches.items()}

    # --- internals -----------------------------------------------------------

    def _evict(self, worker: str, cache: _WorkerCache) -> None:
        limit = cache.capacity * cache.scale
        blocks = cache.blocks
        while blocks and cache.used > limit:
            h, tokens = blocks.popitem(last=False)
            cache.used -= tokens
            self._unhold(h, worker)

    def _unhold(self, h: int, worker: str) -> None:
        holders = self._holders.get(h)
        if holders is None:
            return
        holders.discard(worker)
        if not holders:
            del self._holders[h]
