"""The simulated fleet's prefix caches: what each model server holds, and what the
dispatcher believes it holds.

Two :class:`~inferq.policy.prefix_index.PrefixIndex` instances, one per role:

- ``servers``, the truth: each worker's model server keeps an LRU of the prompt blocks
  it prefilled, sized from its *free* KV memory: the worker's KV cache in tokens less
  the output tokens its running requests reserve (``max_tokens`` each: generated KV is
  private to its sequence; prompt blocks stay in the cache, shared, as vLLM's
  automatic prefix caching and SGLang's radix cache keep them). A run looks its chain up
  when it starts (its leading blocks held are its ``cached_tokens``, whose prefill it
  skips) and then holds the whole chain as most recent;
- ``index``, what :func:`~inferq.policy.dispatch.decide` reads
  (``Snapshot.prefix_index``), kept the way the dispatcher keeps its own
  (:mod:`inferq.dispatcher.prefix_cache`): every worker sized to its whole KV cache
  (``kv_cache_mib x 2^20 / kv_bytes_per_token``), taught by every placement, a worker
  that leaves forgotten, and corrected by the servers' truth the way a worker reports
  it: a run whose server reused fewer prompt tokens than the index forecast by more
  than a block is a *miss* (:meth:`PrefixIndex.observe`), reported when it succeeds.

Pooled reference (:func:`pooled_cached_tokens`): one LRU holding the whole fleet's KV
capacity, fed the same requests in arrival order: the hit rate a fleet that behaved
like one cache would reach (issue 22's yardstick for a router).
"""

from __future__ import annotations

from collections.abc import Iterable

from inferq.policy.prefix_index import PrefixIndex
from inferq.policy.routing import MIB
from inferq.sim.fleet import SimWorker
from inferq.sim.workload import SimRequest


def kv_tokens(worker: SimWorker) -> float:
    """``worker``'s KV cache in tokens: ``kv_cache_mib x 2^20 / kv_bytes_per_token``."""
    return worker.kv_cache_mib * MIB / worker.spec.kv_bytes_per_token


def cached_prefix(index: PrefixIndex, worker: str, request: SimRequest) -> int:
    """Leading prompt tokens of ``request`` that ``worker``'s entry of ``index`` holds."""
    if not request.prefix:
        return 0
    blocks = index.held(worker, request.prefix)
    return min(blocks * request.block_tokens, request.prompt_tokens)


class PrefixCaches:
    """The servers' caches and the dispatcher's index of one run (module docstring)."""

    def __init__(self) -> None:
        self.servers = PrefixIndex()
        self.index = PrefixIndex()

    def launched(self, worker: SimWorker) -> None:
        """A worker joined the fleet: both caches sized, empty."""
        self.servers.set_capacity(worker.id, kv_tokens(worker))
        self.index.set_capacity(worker.id, kv_tokens(worker))

    def stopped(self, worker_id: str) -> None:
        """A worker left: both forget it."""
        self.servers.drop(worker_id)
        self.index.drop(worker_id)

    def placed(self, worker_id: str, request: SimRequest) -> None:
        """A decision placed ``request`` on ``worker_id``: the index learns its chain."""
        if request.prefix:
            self.index.touch(worker_id, request.block_tokens, request.prefix)

    def started(self, worker: SimWorker, request: SimRequest, decode_reserved: int) -> int:
        """``request`` starts on ``worker`` (already admitted, ``decode_reserved`` output
        tokens reserved by everything running there, itself included): its cached
        prompt tokens, after which the server holds its chain as most recent."""
        if not request.prefix:
            return 0
        self.servers.set_capacity(worker.id, max(0.0, kv_tokens(worker) - decode_reserved))
        cached = cached_prefix(self.servers, worker.id, request)
        self.servers.touch(worker.id, request.block_tokens, request.prefix)
        return cached

    def succeeded(self, worker_id: str, forecast: int, served: int, block_tokens: int) -> None:
        """A run ended: a forecast its server missed by more than a block corrects the index
        (the worker's ``miss`` entry of the prefix log)."""
        if missed(forecast, served, block_tokens):
            self.index.observe(worker_id, forecast, served, block_tokens)


def missed(forecast: int, served: int, block_tokens: int) -> bool:
    """The server reused fewer prompt tokens (``served``) than the index ``forecast`` by
    more than a block of ``block_tokens``: a *miss*, which corrects the index."""
    return forecast > 0 and served + block_tokens < forecast


def pooled_cached_tokens(requests: Iterable[SimRequest], capacity_tokens: float) -> list[int]:
    """Cached prompt tokens of each of ``requests`` (in the order given) in one LRU of
    ``capacity_tokens``: the pooled reference of :mod:`inferq.sim.report`."""
    pool = PrefixIndex()
    pool.set_capacity("pool", capacity_tokens)
    out = []
    for r in requests:
        out.append(cached_prefix(pool, "pool", r))
        if r.prefix:
            pool.touch("pool", r.block_tokens, r.prefix)
    return out
