"""The fleet indexed for the dispatch policy, kept between decisions (issue 17's busy fleet).

A decision needs three views of the workers, each of which used to cost a walk over
the whole fleet per decision (5,000 workers: ~25 ms of a busy step on 2 cores):

- the *open* workers (ready, not isolated, a free slot, a registry model) in
  (utilisation, id) order, which :class:`~inferq.policy.routing.WorkerIndex` buckets
  by model;
- the largest KV cache per model over the live workers (any state), which
  :class:`~inferq.policy.routing.FleetCapacity` compares a request's need with;
- per model, the ready workers with a slot in the two orders
  :func:`~inferq.policy.preemption.reserve` scans (most free MiB first; and by
  slot, utilisation, id).

:class:`FleetIndex` keeps them as sorted lists, updated one worker at a time
(:meth:`FleetIndex.put`, :meth:`FleetIndex.discard`: O(log n) to find, a memmove to
insert), so the dispatcher's fleet cache updates it for only the workers whose
heartbeat or reservation changed, and a busy step touches a few dozen workers
instead of all of them. :meth:`FleetIndex.build` makes the same index from a list
of workers in one sort (the decision builds one that way when none is given); an
index built either way from the same workers holds the same lists, so a decision is
the same with either (``tests/unit/test_policy_fleet.py`` checks it on random
fleets).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from typing import Any

from inferq.config import ModelSpec
from inferq.policy.snapshot import DispatchPolicy, WorkerView

#: A worker in most-free order: (-free MiB, 0 if a free slot else 1, utilisation, id,
#: KV cache MiB, view); the natural tuple order is the scan order (ids are unique).
FreeRow = tuple[float, int, float, str, float, WorkerView]
#: A worker in slot order: (0 if a free slot else 1, utilisation, id, free MiB, KV cache
#: MiB, view).
RestRow = tuple[int, float, str, float, float, WorkerView]
#: An open worker: (utilisation, id, view).
OpenRow = tuple[float, str, WorkerView]


class FleetIndex:
    """The workers of a fleet, indexed for :func:`~inferq.policy.dispatch.decide`.

    Holds exactly the views given (by id); the index is valid for the registry of
    the policy it was made for (:meth:`serves`).

    Args:
        policy: the dispatch policy (its registry decides which workers are open).
        workers: initial views (unique ids), put one by one.

    Attributes:
        policy: the policy it was made for.
        views: worker id -> its view, every worker held.
        by_free: model -> ready workers with slots in most-free order (:data:`FreeRow`).
        by_rest: model -> the same workers in slot order (:data:`RestRow`).
        free_slots_of: model -> free slots summed over its ready workers.
    """

    def __init__(self, policy: DispatchPolicy, workers: Iterable[WorkerView] = ()) -> None:
        self.policy = policy
        self.models: tuple[ModelSpec, ...] = policy.models
        self._registry = policy.model_by_name
        self.views: dict[str, WorkerView] = {}
        self._open: list[OpenRow] = []
        self._kv: dict[str, dict[float, int]] = {}
        self.by_free: dict[str, list[FreeRow]] = {}
        self.by_rest: dict[str, list[RestRow]] = {}
        self.free_slots_of: dict[str, int] = {}
        for w in workers:
            self.put(w)

    @classmethod
    def build(cls, workers: Iterable[WorkerView], policy: DispatchPolicy) -> FleetIndex:
        """The index of ``workers`` (unique ids) in one pass and one sort per list."""
        index = cls(policy)
        for w in workers:
            index.views[w.id] = w
            index._count(w, +1)
            rows = index._rows(w)
            if rows.open is not None:
                index._open.append(rows.open)
            if rows.free is not None and rows.rest is not None:
                index.by_free.setdefault(w.model, []).append(rows.free)
                index.by_rest.setdefault(w.model, []).append(rows.rest)
        index._open.sort()
        for model in index.by_free:
            index.by_free[model].sort()
            index.by_rest[model].sort()
        return index

    def serves(self, policy: DispatchPolicy) -> bool:
        """True when this index was made for ``policy``'s registry (else rebuild it)."""
        return self.models is policy.models or self.models == policy.models

    def open_views(self) -> Iterator[WorkerView]:
        """Ready, not isolated registry workers with a free slot, by (utilisation, id)."""
        return (row[2] for row in self._open)

    def largest_mib(self) -> dict[str, float]:
        """Model -> the largest KV cache of its live workers (any state), MiB (>= 0)."""
        return {model: max(0.0, *sizes) for model, sizes in self._kv.items()}

    def put(self, view: WorkerView) -> None:
        """Hold ``view``, replacing the worker's previous view if any."""
        self.discard(view.id)
        self.views[view.id] = view
        self._count(view, +1)
        rows = self._rows(view)
        if rows.open is not None:
            insort(self._open, rows.open)
        if rows.free is not None and rows.rest is not None:
            insort(self.by_free.setdefault(view.model, []), rows.free)
            insort(self.by_rest.setdefault(view.model, []), rows.rest)

    def discard(self, worker_id: str) -> None:
        """Forget a worker (nothing happens when it is not held)."""
        view = self.views.pop(worker_id, None)
        if view is None:
            return
        self._count(view, -1)
        rows = self._rows(view)
        if rows.open is not None:
            _remove(self._open, rows.open)
        if rows.free is not None and rows.rest is not None:
            _remove(self.by_free[view.model], rows.free)
            _remove(self.by_rest[view.model], rows.rest)
            if not self.by_free[view.model]:
                del self.by_free[view.model], self.by_rest[view.model]

    def _count(self, w: WorkerView, sign: int) -> None:
        """Add (``sign`` +1) or take away (-1) ``w``'s KV cache and free slots."""
        sizes = self._kv.setdefault(w.model, {})
        left = sizes.get(w.kv_cache_mib, 0) + sign
        if left:
            sizes[w.kv_cache_mib] = left
        else:
            del sizes[w.kv_cache_mib]
            if not sizes:
                del self._kv[w.model]
        if w.ready:
            free = self.free_slots_of.get(w.model, 0) + sign * w.free_slots
            self.free_slots_of[w.model] = free

    def _rows(self, w: WorkerView) -> _Rows:
        rows = _Rows()
        if w.ready and w.slots >= 1:
            slot = 0 if w.free_slots >= 1 else 1
            util = w.utilisation
            free = w.free_mib
            rows.free = (-free, slot, util, w.id, w.kv_cache_mib, w)
            rows.rest = (slot, util, w.id, free, w.kv_cache_mib, w)
            if w.model in self._registry and not w.isolated and slot == 0:
                rows.open = (util, w.id, w)
        return rows


class _Rows:
    """The rows one worker has in the index's lists (None: not in that list)."""

    __slots__ = ("free", "open", "rest")

    def __init__(self) -> None:
        self.open: OpenRow | None = None
        self.free: FreeRow | None = None
        self.rest: RestRow | None = None


def _remove(rows: list[Any], row: tuple[Any, ...]) -> None:
    """Delete ``row`` from the sorted list ``rows`` (found by bisection; rows are unique
    by worker id, their first element that is a string)."""
    i = bisect_left(rows, row)
    if i < len(rows) and rows[i] == row:
        del rows[i]
        return
    rows.remove(row)  # not where its sort order says (never expected): find it anyway
