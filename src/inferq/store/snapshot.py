"""The dispatcher's snapshot: everything one dispatch decision needs, in five or six round trips.

:func:`read_dispatch_view` builds the policy's :class:`~inferq.policy.snapshot.Snapshot`
(queue heads, the policy fields of those requests, heartbeats and reservations, fairness
state, output estimates) and reports the corrupt records it met, for the dispatcher to
quarantine. Only the fields the policy needs are read (never a payload), with a
hand-rolled check instead of the pydantic models: it runs on every dispatcher step.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inferq import defaults
from inferq.models import WorkerState, from_ms
from inferq.policy.fleet import FleetIndex
from inferq.policy.snapshot import (
    DispatchPolicy,
    FairnessState,
    QueuedRequest,
    RunningRequest,
    Snapshot,
    WorkerView,
)
from inferq.prefix import decode as decode_chain
from inferq.store.calls import parse_estimates
from inferq.store.glance import redis_time, redis_time_ms
from inferq.store.keys import Keys

#: Requests per queue whose fields a snapshot reads at least, when any slot is free.
SNAPSHOT_MIN_WINDOW = 32
#: Tenants with the newest heads a snapshot reads besides the oldest and least served
#: (a tenant that just became active is among them).
SNAPSHOT_NEW_TENANTS = 8

#: Fields of a request hash the dispatch policy needs (never the payload).
POLICY_FIELDS = (
    "priority",
    "model",
    "tenant",
    "task_type",
    "submitted_ms",
    "deadline_ms",
    "prompt_tokens",
    "max_tokens",
    "attempts",
    "excluded_worker",
    "state",
    "suspect",
)

#: Heartbeat fields the dispatch policy needs (read with HMGET, never the whole hash).
WORKER_FIELDS = (
    "model",
    "params_b",
    "state",
    "slots",
    "kv_cache_mib",
    "id",
    "kv_measured_free_mib",
)

#: (key, reason, [(index key, member)]): a corrupt record and the index entries naming it.
Corrupt = tuple[str, str, list[tuple[str, str]]]


@dataclass(frozen=True, slots=True)
class DispatchView:
    """A policy snapshot plus what the dispatcher needs to act on it.

    Attributes:
        snapshot: the input of :func:`inferq.policy.dispatch.decide`.
        queue_of: request id -> the key it sits in, its tenant's sub-queue (for the
            assign script).
        corrupt: (key, reason, [(index key, member)]) records to quarantine.
        stale_workers: ids in the workers index whose last beat is older than the TTL.
        fleet: ``snapshot.workers`` indexed for the policy (the cache's
            :class:`~inferq.policy.fleet.FleetIndex`, valid until its next read); None
            when no ``policy`` was given or a stale worker is left out of the view.
    """

    snapshot: Snapshot
    queue_of: dict[str, str]
    corrupt: list[Corrupt]
    stale_workers: list[str]
    fleet: FleetIndex | None = None


def read_dispatch_view(
    client: Any,
    keys: Keys,
    classes: Sequence[str],
    head: int,
    heartbeat_ttl_s: float,
    *,
    tenant_weight: Callable[[str], float] = lambda _: 1.0,
    models: Sequence[str] | None = None,
    cache: FleetCache | None = None,
    route_models: Callable[[str], Sequence[str]] | None = None,
    policy: DispatchPolicy | None = None,
    chains: ChainCache | None = None,
) -> DispatchView:
    """Read everything one dispatch decision needs, in at most six pipelined round trips.

    What is read does not grow with the backlog nor with the tenants that ever existed:

    1. the clock, the queue names, the SWRR credits, and the workers index (a full
       read) or the workers marked changed since the last read and the index's size;
    2. per worker read its heartbeat fields and reservation, the workers whose beat is
       older than the TTL (stale: left out of the view); per queue the tenant index
       (tenants with queued requests, oldest head first) and per class the least-served
       backlogged tenants;
    3. the heads of the sub-queues of the first ``max(SNAPSHOT_MIN_TENANTS, window)``
       tenants of each index, the least served and the newest (``window`` =
       ``max(SNAPSHOT_MIN_WINDOW, 4 x free slots / queues of the route)``, counting
       the free slots of the workers that may serve the route and the route's queues
       with anything queued, at most ``head``),
       ``max(1, window // tenants)`` ids each, and those tenants' VTC
       virtual time (one ZMSCORE per class); when a queue's window is not filled that
       way (one tenant's backlog behind few others'), one more round trip reads deeper
       into the sub-queues that came back full;
    4. the policy fields of those ids (at most about ``window`` per queue);
    5. the output estimates of the (model, task type) pairs in view.

    Every backlogged tenant of a queue with fewer tenants than that is in the
    snapshot, however long another tenant's backlog (issue 12's tenant flood); rounds
    3-5 are skipped when nothing is queued.

    Args:
        client: a redis-py client with text replies.
        keys: the deployment's keys.
        classes: configured priority classes (queues of other classes are skipped).
        head: requests read from the head of each queue (and tenants of each index), at most.
        heartbeat_ttl_s: a worker whose last beat is older is reported stale.
        tenant_weight: tenant -> fair-share weight; stored virtual time x weight is the
            counter the policy compares.
        models: the registry's model names, whose estimates are read for the task types
            in view; None reads the whole (bounded) estimates hash.
        cache: the fleet as of the previous call (updated in place): only the workers
            marked changed since are read (:class:`FleetCache`); None reads every worker.
        route_models: route -> the models that may serve it (fallbacks included); a
            queue's window then counts the free slots of those models' workers only.
            None: every free slot counts for every queue.
        policy: the dispatch policy: the cache keeps the fleet indexed for it
            (:meth:`FleetCache.keep_index`) and the view carries that index.
        chains: the prefix chains read before (:class:`ChainCache`): a request's
            ``prefix`` field (up to 8 KiB) is read only the first time it is in view;
            None reads it every time.
    """
    k = keys
    fleet = cache if cache is not None else FleetCache()
    if policy is not None:
        fleet.keep_index(policy)
    full_read = fleet.full_due(time.monotonic())
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.smembers(k.queues)
    pipe.hgetall(k.fair_classes)
    if full_read:
        pipe.zrange(k.workers, 0, -1)
    else:
        pipe.zrangebyscore(k.worker_changes, fleet.since_ms, "+inf")
        pipe.zcard(k.workers)
    time_reply, queues, credits, *fleet_reply = pipe.execute()
    now = redis_time(time_reply)
    now_ms = redis_time_ms(time_reply)  # the scripts' ms: marks compare with it
    names = sorted(tuple(q.split("|", 1)) for q in queues if q.split("|", 1)[0] in classes)
    # Full: every worker of the index; else only those marked changed since the last read.
    workers: list[str] = list(dict.fromkeys(fleet_reply[0]))

    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(k.workers, "-inf", f"({now_ms - round(heartbeat_ttl_s * 1000)}")
    per_worker = 2 if full_read else 3
    for wid in workers:
        pipe.hmget(k.worker(wid), WORKER_FIELDS)
        pipe.hmget(k.load(wid), ("slots", "mib", "isolated"))
        if not full_read:
            pipe.zscore(k.workers, wid)
    for cls, route in names:
        pipe.zrange(k.tenant_index(cls, route), 0, head - 1)
    # The least-served backlogged tenants of each class (virtual time order): a tenant
    # that just became active is lifted to the minimum, so it is among them even when
    # more tenants than are read have older requests (the tenant index's order).
    live_classes = sorted({cls for cls, _ in names})
    for cls in live_classes:
        pipe.zrange(k.fair_live(cls), 0, head - 1)
    replies = pipe.execute()
    stale = replies[0]
    n = per_worker * len(workers)
    rows = replies[1 : 1 + n]
    indexes = replies[1 + n : 1 + n + len(names)]
    least_served = dict(zip(live_classes, replies[1 + n + len(names) :], strict=True))
    if full_read:
        fleet.reset(workers, rows, now_ms)
    else:
        fleet.update(workers, rows, now_ms)
        if fleet.size != int(fleet_reply[1]):
            # A worker joined or left without a mark (a write outside the scripts):
            # read the whole fleet now (two more round trips, rare).
            fleet.read_full(client, k, now_ms)

    corrupt: list[Corrupt] = [_bad_worker(k, wid, reason) for wid, reason in fleet.bad.items()]
    gone = set(stale).intersection(fleet.views)
    views = (
        [v for wid, v in fleet.views.items() if wid not in gone]
        if gone
        else list(fleet.views.values())
    )
    index = fleet.index if not gone else None

    # Read the policy fields of only as many requests per queue as the free slots
    # could take, x4 and at least a few dozen (unschedulable work is reported even on
    # a full fleet), spread over the tenants' sub-queues, so a tenant behind another's
    # flood is seen at once: a wake-up costs ~100 reads instead of thousands.
    # With ``route_models``, a queue's window counts only the free slots of the workers
    # that may serve its route (fallbacks included): 16 freed 8B workers do not make
    # the 70B queues read 4 x 128 requests each.
    free_of: dict[str, int] = {}
    if index is not None:
        free_of = index.free_slots_of  # kept per worker: no walk over the fleet
    else:
        for w in views:
            if w.ready:
                free_of[w.model] = free_of.get(w.model, 0) + w.free_slots
    free = sum(free_of.values())
    queue_of: dict[str, str] = {}
    tenants_of = {c: set[str]() for c in classes}
    per_queue: list[list[str]] = []  # sub-queue keys read, per queue
    windows: list[int] = []
    # The classes' queues of one route share its free slots: 4 x those slots in all
    # (the busiest fleet otherwise read 4 x free per class, 3x what any step can place).
    sharing: dict[str, int] = {}
    for (_, route), tenants in zip(names, indexes, strict=True):
        if tenants:
            sharing[route] = sharing.get(route, 0) + 1
    for (cls, route), tenants in zip(names, indexes, strict=True):
        served = (
            free if route_models is None else sum(free_of.get(m, 0) for m in route_models(route))
        )
        share = -(-4 * served // max(1, sharing.get(route, 1)))
        window = min(head, max(SNAPSHOT_MIN_WINDOW, share))
        windows.append(window)
        ntenants = min(head, max(defaults.SNAPSHOT_MIN_TENANTS, window))
        # The oldest heads (aging), the least served (VTC) and the newest heads (a tenant
        # that just became active: VTC lifts it to the minimum, where ties with many
        # tenants sort by name), each bounded: the cost does not grow with the backlog.
        # A least-served tenant with nothing on this route reads an empty sub-queue.
        newest = tenants[ntenants:][-SNAPSHOT_NEW_TENANTS:]
        picked = dict.fromkeys([*tenants[:ntenants], *least_served[cls][:ntenants], *newest])
        tenants_of[cls].update(picked)
        per_queue.append([k.tenant_queue(cls, route, tenant) for tenant in picked])
    counted = [c for c in classes if tenants_of[c]]
    depths = [max(1, w // max(1, len(tqs))) for tqs, w in zip(per_queue, windows, strict=True)]
    virtual: list[Any] = []
    if any(per_queue):
        pipe = client.pipeline(transaction=False)
        for tqs, depth in zip(per_queue, depths, strict=True):
            for tq in tqs:
                pipe.zrange(tq, 0, depth - 1)
        for c in counted:
            pipe.zmscore(k.fair_vtc(c), sorted(tenants_of[c]))
        replies = pipe.execute()
        reads = iter(replies)
        deeper: list[tuple[str, int, int]] = []  # (sub-queue, start, stop) of a second read
        for tqs, depth, window in zip(per_queue, depths, windows, strict=True):
            got = 0
            filled = []
            for tq in tqs:
                ids = next(reads)
                got += len(ids)
                for rid in ids:
                    queue_of[rid] = tq
                if len(ids) == depth:
                    filled.append(tq)
            # One tenant's backlog behind few others': the window's unread share goes
            # to the tenants whose read came back full (one more round trip, only then).
            extra = (window - got) // max(1, len(filled))
            deeper += [(tq, depth, depth + extra - 1) for tq in filled if extra > 0]
        virtual = replies[sum(len(tqs) for tqs in per_queue) :]
        if deeper:
            pipe = client.pipeline(transaction=False)
            for tq, start, stop in deeper:
                pipe.zrange(tq, start, stop)
            for (tq, _, _), ids in zip(deeper, pipe.execute(), strict=True):
                for rid in ids:
                    queue_of[rid] = tq
    counters: dict[str, dict[str, float]] = {c: {} for c in classes}
    for c, scores in zip(counted, virtual, strict=True):
        for tenant, score in zip(sorted(tenants_of[c]), scores, strict=True):
            if score is not None:
                counters[c][tenant] = float(score) * tenant_weight(tenant)

    queued: dict[str, list[QueuedRequest]] = {c: [] for c in classes}
    tasks: set[str] = set()
    if queue_of:
        known = chains if chains is not None else ChainCache()
        pipe = client.pipeline(transaction=False)
        for rid in queue_of:
            pipe.hmget(k.req(rid), POLICY_FIELDS if rid in known else CHAIN_FIELDS)
        for rid, values in zip(list(queue_of), pipe.execute(), strict=True):
            try:
                req = queued_request(rid, values, known)
            except ValueError as exc:
                members = [(queue_of.pop(rid), rid), (k.deadlines, rid)]
                corrupt.append((k.req(rid), f"queued request: {exc}", members))
                continue
            if req.priority in queued:
                queued[req.priority].append(req)
                tasks.add(req.task_type or "")
        for reqs in queued.values():
            reqs.sort(key=lambda r: (r.submitted_at, r.id))

    estimates: dict[tuple[str, str], float] = {}
    if tasks and models is None:
        estimates = parse_estimates(client.hgetall(k.estimates))
    elif tasks and models:
        fields = [f"{m}|{t}" for m in models for t in sorted(tasks)]
        values = client.hmget(k.estimates, fields)
        estimates = parse_estimates(
            {f: v for f, v in zip(fields, values, strict=True) if v is not None}
        )

    backlogged = {c: frozenset(tenants_of[c] | {r.tenant for r in queued[c]}) for c in classes}
    fairness = FairnessState(
        class_credit={c: float(v) for c, v in credits.items()},
        tenant_counter=counters,
        # The scripts that queue a request lift a newly backlogged tenant's counter
        # (includes/counts.lua): every tenant in view counts as active already.
        active_tenants=backlogged,
    )
    snapshot = Snapshot(
        now=now,
        queued=queued,
        workers=views,
        fairness=fairness,
        backlogged_tenants=backlogged,
        output_estimates=estimates,
    )
    return DispatchView(snapshot, queue_of, corrupt, stale, index)


class FleetCache:
    """The dispatcher's view of the fleet kept between steps (issue 17's busy fleet).

    A step re-reads the heartbeat fields (:data:`WORKER_FIELDS`, HMGET) and the
    reservation of only the workers marked in ``P wchanged`` since its last read (the
    scripts mark a worker when a routing field of its heartbeat changes, when it
    joins, when its ``load:<w>`` changes and when it is removed:
    ``lua/includes/changed.lua``), plus the size of the workers index. It reads the
    whole fleet, as every step did before, on the first step, every
    ``full_every_s`` seconds (a safety net: a change written outside the scripts, a
    Redis clock step back), when its marks may have been trimmed (it did not read
    them for half of ``WORKER_CHANGES_KEEP_S``), and when the index's size disagrees
    with what it holds (a worker planted or removed by hand).

    Attributes:
        views: worker id -> its policy view (workers in the index whose heartbeat parses).
        bad: worker id -> why its heartbeat does not parse (quarantined by the dispatcher).
        blank: ids in the index without a heartbeat hash (expired; the reaper removes them).
        since_ms: Redis ms of the last read of the marks (None: nothing read yet).
        index: ``views`` indexed for the dispatch policy (:meth:`keep_index`), updated
            with them worker by worker; None until asked for.
        full_reads, partial_reads, workers_read: counters for benchmarks.
    """

    def __init__(self, full_every_s: float = defaults.SNAPSHOT_FULL_REFRESH_S) -> None:
        self.full_every_s = full_every_s
        self.views: dict[str, WorkerView] = {}
        self.bad: dict[str, str] = {}
        self.blank: set[str] = set()
        self.since_ms: int | None = None
        self.index: FleetIndex | None = None
        self._full_at = -math.inf
        self._read_at = -math.inf
        self.full_reads = 0
        self.partial_reads = 0
        self.workers_read = 0

    @property
    def size(self) -> int:
        """Workers of the index this cache accounts for."""
        return len(self.views) + len(self.bad) + len(self.blank)

    def full_due(self, mono: float) -> bool:
        """Whether the next read must be a full one (monotonic seconds ``mono``)."""
        keep = defaults.WORKER_CHANGES_KEEP_S / 2
        return (
            self.since_ms is None
            or mono - self._full_at >= self.full_every_s
            or mono - self._read_at >= keep
        )

    def keep_index(self, policy: DispatchPolicy) -> FleetIndex:
        """The views indexed for ``policy``, kept in step from now on (made once, and
        again only for another registry)."""
        if self.index is None or not self.index.serves(policy):
            self.index = FleetIndex.build(self.views.values(), policy)
        return self.index

    def _set(self, wid: str, fields: Sequence[str | None], load: Sequence[str | None]) -> None:
        if all(v is None for v in fields):
            self._drop(wid)
            self.blank.add(wid)
            return
        try:
            view = worker_view(wid, fields, load)
        except LoadError as exc:
            self._drop(wid)
            self.bad[wid] = f"{LOAD_REASON}{exc}"
            return
        except ValueError as exc:
            self._drop(wid)
            self.bad[wid] = f"heartbeat: {exc}"
            return
        self.bad.pop(wid, None)
        self.blank.discard(wid)
        self.views[wid] = view  # in place when known: the fleet's order stays stable
        if self.index is not None:
            self.index.put(view)

    def _drop(self, wid: str) -> None:
        self.views.pop(wid, None)
        self.bad.pop(wid, None)
        self.blank.discard(wid)
        if self.index is not None:
            self.index.discard(wid)

    def reset(self, workers: Sequence[str], rows: Sequence[Any], now_ms: int) -> None:
        """Replace the cache with a full read: ``rows`` = (heartbeat fields, load) per worker."""
        self.views, self.bad, self.blank = {}, {}, set()
        index, self.index = self.index, None  # rebuilt below in one sort, not worker by worker
        for i, wid in enumerate(workers):
            self._set(wid, rows[2 * i], rows[2 * i + 1])
        if index is not None:
            self.index = FleetIndex.build(self.views.values(), index.policy)
        self.since_ms = now_ms
        self._full_at = self._read_at = time.monotonic()
        self.full_reads += 1
        self.workers_read += len(workers)

    def update(self, workers: Sequence[str], rows: Sequence[Any], now_ms: int) -> None:
        """Apply the marked workers: ``rows`` = (heartbeat fields, load, index score) each."""
        for i, wid in enumerate(workers):
            if rows[3 * i + 2] is None:
                self._drop(wid)  # no longer in the workers index
            else:
                self._set(wid, rows[3 * i], rows[3 * i + 1])
        # Marks written from now on score >= now_ms (Redis TIME, read before them).
        self.since_ms = now_ms
        self._read_at = time.monotonic()
        self.partial_reads += 1
        self.workers_read += len(workers)

    def read_full(self, client: Any, keys: Keys, now_ms: int) -> None:
        """A full read in two round trips of its own (the index, then every worker)."""
        workers = list(client.zrange(keys.workers, 0, -1))
        pipe = client.pipeline(transaction=False)
        for wid in workers:
            pipe.hmget(keys.worker(wid), WORKER_FIELDS)
            pipe.hmget(keys.load(wid), ("slots", "mib", "isolated"))
        self.reset(workers, pipe.execute(), now_ms)


#: How a reason in :attr:`FleetCache.bad` starts when the worker's reservation
#: (``load:<w>``) is what does not parse, not its heartbeat.
LOAD_REASON = "load: "


class LoadError(ValueError):
    """A worker's reservation (``load:<w>``) does not parse."""


def _bad_worker(k: Keys, wid: str, reason: str) -> Corrupt:
    """What to quarantine for a worker whose view does not parse: its heartbeat, out of the
    workers index; or, when its reservation is what is broken, that alone (the worker is
    live and beats on; ``quarantine.lua`` rebuilds the reservation from what it holds),
    or the worker would be quarantined again after each beat and never given work."""
    if reason.startswith(LOAD_REASON):
        return (k.load(wid), reason, [])
    return (k.worker(wid), reason, [(k.workers, wid)])


def worker_view(wid: str, fields: Sequence[str | None], load: Sequence[str | None]) -> WorkerView:
    """The policy's view of a worker from :data:`WORKER_FIELDS` and its load hash.

    A hand-rolled check rather than the pydantic model: it runs for every worker on
    every dispatcher step (500 workers: ~40 ms of validation saved per step).

    Raises:
        LoadError: the reservation does not parse (it is quarantined and rebuilt).
        ValueError: a field is missing or out of range (the record is quarantined).
    """
    try:
        reserved_slots = max(0, int(load[0] or 0))
        reserved_mib = max(0.0, float(load[1] or 0.0))
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    model, params_b, state, slots, kv, _, measured = fields
    if not model or state is None:
        raise ValueError("missing field 'model' or 'state'")
    view = WorkerView(
        id=wid,
        model=model,
        params_b=float(params_b or "nan"),
        ready=WorkerState(state) is WorkerState.READY,
        slots=int(slots or "0"),
        kv_cache_mib=float(kv or "nan"),
        reserved_slots=reserved_slots,
        reserved_mib=reserved_mib,
        isolated=len(load) > 2 and bool(load[2]),
        measured_free_mib=float(measured) if measured else None,
    )
    if not (view.params_b > 0 and 1 <= view.slots <= 4096 and 0 <= view.kv_cache_mib < 1e9):
        raise ValueError(
            f"params_b {params_b!r}, slots {slots!r} or kv_cache_mib {kv!r} out of range"
        )
    if view.measured_free_mib is not None and not 0 <= view.measured_free_mib < 1e9:
        raise ValueError(f"kv_measured_free_mib {measured!r} out of range")
    return view


def queued_request(
    rid: str, values: list[str | None], chains: ChainCache | None = None
) -> QueuedRequest:
    """The policy's view of a request from :data:`POLICY_FIELDS` values (and its prefix
    chain: the value after them, :data:`CHAIN_FIELDS`, else from ``chains``).

    Raises:
        ValueError: a field is missing or does not parse (the record is quarantined).
    """
    f = dict(zip(POLICY_FIELDS, values[: len(POLICY_FIELDS)], strict=True))
    if len(values) > len(POLICY_FIELDS):
        block_tokens, chain = decode_chain(values[-1] or "")
        if chains is not None:
            chains.put(rid, block_tokens, chain)
    elif chains is not None:
        block_tokens, chain = chains.get(rid)
    else:
        block_tokens, chain = 0, ()
    missing = [name for name in POLICY_FIELDS[:8] if not f[name] and name != "task_type"]
    if missing:
        raise ValueError(f"missing field {missing[0]!r}")
    return QueuedRequest(
        id=rid,
        priority=str(f["priority"]),
        route=str(f["model"]),
        tenant=str(f["tenant"]),
        task_type=f["task_type"] or None,
        submitted_at=from_ms(int(str(f["submitted_ms"]))),
        deadline=from_ms(int(str(f["deadline_ms"]))),
        prompt_tokens=int(str(f["prompt_tokens"])),
        max_tokens=int(str(f["max_tokens"])),
        attempts=int(f["attempts"] or 0),
        excluded_worker=f["excluded_worker"] or None,
        alone=f["suspect"] == "1",
        prefix=chain,
        block_tokens=block_tokens,
    )


#: :data:`POLICY_FIELDS` and the prefix chain, read the first time a request is in view.
CHAIN_FIELDS = (*POLICY_FIELDS, "prefix")


class ChainCache:
    """Prefix chains of queued requests already read (they never change once submitted).

    Bounded: the oldest entries go beyond ``size`` (a request still queued then has
    its chain read again).
    """

    def __init__(self, size: int = defaults.CHAIN_CACHE_SIZE) -> None:
        self.size = size
        self._chains: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()

    def __contains__(self, rid: object) -> bool:
        return rid in self._chains

    def get(self, rid: str) -> tuple[int, tuple[int, ...]]:
        """(block tokens, chain) of ``rid``; ``(0, ())`` when not held."""
        return self._chains.get(rid, (0, ()))

    def put(self, rid: str, block_tokens: int, chain: tuple[int, ...]) -> None:
        """Remember ``rid``'s chain, evicting the oldest beyond the size."""
        self._chains[rid] = (block_tokens, chain)
        while len(self._chains) > self.size:
            self._chains.popitem(last=False)


#: Fields of a held request the preemption rule needs (read only for reserved workers).
RUNNING_FIELDS = (
    "state",
    "worker",
    "priority",
    "tenant",
    "task_type",
    "attempts",
    "dispatched_ms",
    "started_ms",
    "need_mib",
    "prompt_tokens",
    "max_tokens",
    "abort_attempt",
    "preemptions",
)


def read_running(
    client: Any, keys: Keys, worker_ids: Sequence[str]
) -> dict[str, list[RunningRequest]]:
    """What each worker holds (assigned or running), for the preemption rule: two round
    trips (the ``inflight:<w>`` sets, then the fields of their requests).

    Records that are gone, no longer this worker's, or do not parse are left out (the
    preemption rule then simply does not choose them).
    """
    pipe = client.pipeline(transaction=False)
    for wid in worker_ids:
        pipe.smembers(keys.inflight(wid))
    held = [sorted(ids) for ids in pipe.execute()]
    pipe = client.pipeline(transaction=False)
    for ids in held:
        for rid in ids:
            pipe.hmget(keys.req(rid), RUNNING_FIELDS)
    rows = iter(pipe.execute())
    out: dict[str, list[RunningRequest]] = {}
    for wid, ids in zip(worker_ids, held, strict=True):
        mine = out.setdefault(wid, [])
        for rid in ids:
            f = dict(zip(RUNNING_FIELDS, next(rows), strict=True))
            if f["state"] not in ("assigned", "running") or f["worker"] != wid:
                continue
            try:
                attempt = int(str(f["attempts"]))
                mine.append(
                    RunningRequest(
                        id=rid,
                        worker_id=wid,
                        priority=str(f["priority"]),
                        tenant=str(f["tenant"]),
                        task_type=f["task_type"] or None,
                        attempt=attempt,
                        started_at=from_ms(int(f["started_ms"] or f["dispatched_ms"] or 0)),
                        need_mib=float(f["need_mib"] or 0.0),
                        prompt_tokens=int(str(f["prompt_tokens"])),
                        max_tokens=int(str(f["max_tokens"])),
                        aborting=f["abort_attempt"] == str(attempt),
                        preemptions=int(f["preemptions"] or 0),
                    )
                )
            except (TypeError, ValueError):
                continue
    return out
