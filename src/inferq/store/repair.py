"""Finding the corrupt records that would break every script or read that meets them.

Plain reads (the quarantining itself is :meth:`inferq.store.Store.quarantine`): a
daemon whose step failed on something other than a connection error calls these
through the store, moves what they find aside, and goes on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from inferq.store.keys import Keys
from inferq.store.snapshot import Corrupt


def malformed_queue_names(client: Any, keys: Keys) -> list[str]:
    """Members of the ``queues`` set that are not ``<class>|<route>`` (both parts non-empty)."""
    return [n for n in client.smembers(keys.queues) if not all(n.partition("|")[::2])]


def mistyped_queues(client: Any, keys: Keys, classes: Sequence[str]) -> list[Corrupt]:
    """Tenant indexes and tenants' sub-queues holding another type than a zset (every
    read of the queue fails on them: the snapshot's, this repair's own), each with no
    index entry to drop (``quarantine.lua`` takes a sub-queue's tenant out of its index
    and recounts the counters it held).

    Reads every queue's tenant index and the type of each of its tenants' sub-queues:
    O(backlogged tenants), on the repair path only (after a failed step).
    """
    k = keys
    names = [n.split("|", 1) for n in client.smembers(k.queues) if "|" in n]
    names = [(c, r) for c, r in names if c in classes and r]
    pipe = client.pipeline(transaction=False)
    for cls, route in names:
        pipe.type(k.tenant_index(cls, route))
    out: list[Corrupt] = []
    zsets: list[tuple[str, str]] = []
    for (cls, route), kind in zip(names, pipe.execute(), strict=True):
        if kind in ("zset", "none"):
            zsets.append((cls, route))
        else:
            out.append((k.tenant_index(cls, route), f"tenant index is a {kind}, not a zset", []))
    pipe = client.pipeline(transaction=False)
    for cls, route in zsets:
        pipe.zrange(k.tenant_index(cls, route), 0, -1)
    subs = [
        k.tenant_queue(cls, route, tenant)
        for (cls, route), tenants in zip(zsets, pipe.execute(), strict=True)
        for tenant in tenants
    ]
    pipe = client.pipeline(transaction=False)
    for key in subs:
        pipe.type(key)
    for key, kind in zip(subs, pipe.execute(), strict=True):
        if kind not in ("zset", "none"):
            out.append((key, f"sub-queue is a {kind}, not a zset", []))
    return out


def non_hash_requests(
    client: Any, keys: Keys, classes: Sequence[str], head: int, now_ms: int
) -> list[Corrupt]:
    """Request keys holding another type than a hash, with the index entries naming them.

    Looks where the dispatcher's step meets request ids: the heads of the tenants'
    sub-queues of the queues of ``classes`` (about ``head`` ids per queue), the
    deadlines, leases and delayed retries due at ``now_ms``.
    """
    k = keys
    names = [n.split("|", 1) for n in client.smembers(k.queues) if "|" in n]
    names = [(c, r) for c, r in names if c in classes]
    pipe = client.pipeline(transaction=False)
    for cls, route in names:
        pipe.zrange(k.tenant_index(cls, route), 0, head - 1)
    pipe.zrangebyscore(k.deadlines, "-inf", now_ms, start=0, num=head)
    pipe.zrangebyscore(k.leases, "-inf", now_ms, start=0, num=head)
    pipe.zrangebyscore(k.delayed, "-inf", now_ms, start=0, num=head)
    *indexes, due, lapsed, promotable = pipe.execute()
    # The heads of the sub-queues of the first ``head`` tenants of each queue, about
    # ``head`` ids per queue in all (where a snapshot reads).
    sub_queues = [
        (k.tenant_queue(cls, route, tenant), max(1, head // len(tenants)))
        for (cls, route), tenants in zip(names, indexes, strict=True)
        for tenant in tenants
    ]
    pipe = client.pipeline(transaction=False)
    for tq, depth in sub_queues:
        pipe.zrange(tq, 0, depth - 1)
    found: dict[str, set[str]] = {}
    for (tq, _), ids in zip(sub_queues, pipe.execute(), strict=True):
        for rid in ids:
            found.setdefault(rid, set()).add(tq)
    for rid in [*due, *lapsed, *promotable]:
        found.setdefault(rid, set())
    ids = list(found)
    pipe = client.pipeline(transaction=False)
    for rid in ids:
        pipe.type(k.req(rid))
    types = pipe.execute()
    out: list[Corrupt] = []
    for rid, kind in zip(ids, types, strict=True):
        if kind in ("hash", "none"):
            continue
        members = [(qk, rid) for qk in sorted(found[rid])]
        members += [(k.deadlines, rid), (k.leases, rid), (k.delayed, rid)]
        out.append((k.req(rid), f"request record is a {kind}, not a hash", members))
    return out


def mistyped_workers(client: Any, keys: Keys) -> list[Corrupt]:
    """Per-worker keys of the workers index holding another type than theirs: a heartbeat
    (``worker:<w>``) or reservation (``load:<w>``) that is not a hash, an in-flight set
    (``inflight:<w>``) that is not a set. The snapshot's HMGETs, the reaper's
    ``remove_worker.lua`` and the scaler's reads fail on them at every step; a heartbeat
    that merely does not parse is quarantined by the snapshot itself.

    A reservation whose ``slots`` or ``mib`` is not a number is found too: written after
    the dispatcher cached the worker, its snapshot would not read it again for up to a
    full refresh, while assign.lua's HINCRBYFLOAT failed on it at every step.

    A heartbeat leaves the index with it (a live worker registers again on its next
    beat); a load or in-flight key is set aside alone (``quarantine.lua`` rebuilds a
    load from what the worker holds). Reads the type of three keys per worker and each
    reservation's numbers: O(workers), on the repair path only (after a failed step).
    """
    k = keys
    workers = client.zrange(k.workers, 0, -1)
    wanted = [
        (wid, key, kind)
        for wid in workers
        for key, kind in ((k.worker(wid), "hash"), (k.load(wid), "hash"), (k.inflight(wid), "set"))
    ]
    pipe = client.pipeline(transaction=False)
    for _, key, _ in wanted:
        pipe.type(key)
    out: list[Corrupt] = []
    for (wid, key, kind), found in zip(wanted, pipe.execute(), strict=True):
        if found in (kind, "none"):
            continue
        what = "heartbeat" if key == k.worker(wid) else key.removeprefix(k.prefix).split(":")[0]
        members = [(k.workers, wid)] if key == k.worker(wid) else []
        out.append((key, f"{what} is a {found}, not a {kind}", members))
    loads = [key for _, key, kind in wanted if key.startswith(k.load(""))]
    found_keys = {key for key, _, _ in out}
    pipe = client.pipeline(transaction=False)
    for key in loads:
        pipe.hmget(key, ("slots", "mib"))
    for key, row in zip(loads, pipe.execute(raise_on_error=False), strict=True):
        if key in found_keys or isinstance(row, Exception):
            continue
        slots, mib = row
        bad = [v for v, whole in ((slots, True), (mib, False)) if not _is_number(v, whole)]
        if bad:
            out.append((key, f"load: {bad[0]!r} is not a number", []))
    return out


def _is_number(value: str | None, whole: bool) -> bool:
    """Whether Redis' HINCRBY (``whole``) or HINCRBYFLOAT, and the snapshot, can read
    ``value`` (None, an absent field, reads as 0)."""
    if value is None:
        return True
    try:
        return math.isfinite(int(value) if whole else float(value))
    except ValueError:
        return False
