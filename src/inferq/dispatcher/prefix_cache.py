"""The dispatcher's prefix-cache index, kept in step with the shared prefix log.

Each dispatcher replica holds a :class:`~inferq.policy.prefix_index.PrefixIndex` in
memory and, once per step, brings it up to date (:meth:`PrefixCache.refresh`):

1. every live worker of a registry model is sized: its KV cache in tokens
   (``kv_cache_mib x 2^20 / kv_bytes_per_token``); a worker is forgotten once it has been
   out of view ``FORGET_S`` (a worker missing from one step's view, a late heartbeat,
   kept its size, so the placements on it that step were not dropped on this replica
   alone and the replicas kept agreeing; a restarted worker writes a reset anyway);
2. the prefix log's new entries (:mod:`inferq.store.prefixlog`, one XRANGE) are applied
   in order: placements teach it which blocks went where, a reset forgets a worker
   whose model server restarted, a miss shrinks a worker the server contradicted.

Every replica applies the same entries in the same order, so all of them route on the
same index; a replica that starts (or restarts) replays what the log retains, which is
what the workers' LRU caches can still hold anyway. Nothing here is durable: losing it
loses cache hits, never a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from inferq import defaults
from inferq.policy.prefix_index import PrefixIndex
from inferq.policy.snapshot import DispatchPolicy, WorkerView
from inferq.store import Store
from inferq.store.prefixlog import PrefixEntry

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: XRANGE reads per refresh at most (a replica far behind catches up over a few steps).
MAX_READS = 4
#: Seconds a worker may be out of a replica's view before its modelled cache is dropped.
FORGET_S = 60.0


class PrefixCache:
    """One replica's prefix-cache index and its place in the prefix log.

    Args:
        store: the deployment's store.
        policy: the dispatch policy (its registry sizes the workers' caches).

    Attributes:
        index: the index :func:`~inferq.policy.dispatch.decide` reads.
        after: id of the last log entry applied (``"0"``: none yet).
        applied / skipped: log entries applied, and skipped because they did not parse.
    """

    def __init__(self, store: Store, policy: DispatchPolicy) -> None:
        self.store = store
        self.policy = policy
        self.index = PrefixIndex()
        self.after = "0"
        self.applied = 0
        self.skipped = 0
        self._sizes: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # worker -> monotonic time last in view

    def refresh(self, workers: Iterable[WorkerView]) -> PrefixIndex:
        """Size the live ``workers``, apply the log's new entries; returns the index."""
        self._size(workers)
        for _ in range(MAX_READS):
            entries, self.after, bad = self.store.read_prefix_log(self.after)
            for entry in entries:
                self._apply(entry)
            self.applied += len(entries)
            if bad:
                self.skipped += bad
                log.warning("prefix log: skipped %d entries that do not parse", bad)
            if len(entries) + bad < defaults.PREFIX_LOG_READ:
                break
        return self.index

    def _size(self, workers: Iterable[WorkerView]) -> None:
        now = time.monotonic()
        models = self.policy.model_by_name
        for w in workers:
            spec = models.get(w.model)
            if spec is None:
                continue
            tokens = w.kv_cache_mib * MIB / spec.kv_bytes_per_token
            self._seen[w.id] = now
            if self._sizes.get(w.id) != tokens:
                self.index.set_capacity(w.id, tokens)
                self._sizes[w.id] = tokens
        gone = [wid for wid, at in self._seen.items() if now - at > FORGET_S]
        if gone:
            for wid in gone:
                del self._seen[wid], self._sizes[wid]
            self.index.retain(self._sizes)

    def _apply(self, entry: PrefixEntry) -> None:
        w = entry.worker
        if entry.kind == "place":
            for block_tokens, chain in entry.chains:
                self.index.touch(w, block_tokens, chain)
        elif entry.kind == "reset":
            self.index.drop(w)
            if w in self._sizes:
                self.index.set_capacity(w, self._sizes[w])
        elif entry.kind == "miss":
            self.index.observe(w, entry.forecast_tokens, entry.served_tokens, entry.block_tokens)
