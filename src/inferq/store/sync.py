""":class:`Store`: every Redis call of inferq's synchronous processes, in one class.

Scripts are run through :mod:`inferq.store.calls` (their arguments and replies);
plain reads and writes are spelled here. Methods are grouped by who calls them:
the client, the dispatcher, the worker and the scaler here; the CLI's and the
metrics' reads in :class:`~inferq.store.admin.AdminCalls`, which it extends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from redis.exceptions import NoScriptError, ResponseError

from inferq import defaults, usage
from inferq.config import Settings
from inferq.errors import CorruptRecord, IdempotencyConflict, QueueFull, RequestNotFound
from inferq.ids import new_id
from inferq.models import InferenceRequest, RequestRecord, StreamChunk, WorkerInfo
from inferq.policy.estimate import update_moving_mean
from inferq.policy.snapshot import Decision, DispatchPolicy, RunningRequest
from inferq.store import calls, repair
from inferq.store.admin import AdminCalls
from inferq.store.calls import Abort, Chunk, Completion, Submitted
from inferq.store.connection import MIN_BLOCK_S, REPLY_ERRORS, Connection, connect
from inferq.store.glance import redis_time
from inferq.store.prefixlog import PrefixEntry, decode_rows, parse_entries
from inferq.store.snapshot import (
    ChainCache,
    DispatchView,
    FleetCache,
    read_dispatch_view,
    read_running,
)

log = logging.getLogger("inferq.store")


class Store(AdminCalls):
    """Synchronous access to one deployment's keys (``inferq:<namespace>:*``).

    Args:
        client: a redis-py client created with ``decode_responses=True`` (see :func:`connect`).
        settings: limits, TTLs and the namespace.
    """

    def __init__(self, client: Connection, settings: Settings) -> None:
        super().__init__(client, settings)
        #: The fleet as the last :meth:`dispatch_view` read it (only changed workers
        #: are read again: :class:`~inferq.store.snapshot.FleetCache`).
        self.fleet = FleetCache()
        #: The prefix chains of requests read before (:class:`~inferq.store.snapshot.ChainCache`).
        self.chains = ChainCache()

    @classmethod
    def from_settings(cls, settings: Settings) -> Store:
        """Connect to ``settings.redis_url`` and wrap it (raises RedisUnavailable)."""
        return cls(connect(settings.redis_url), settings)

    # --- client side ----------------------------------------------------------

    def submit(self, request: InferenceRequest, *, explicit_deadline: bool = False) -> Submitted:
        """Write one validated request (one round trip).

        Raises:
            QueueFull: a class or tenant queue limit refused it (nothing written).
            IdempotencyConflict: its idempotency key names a different request.
        """
        call = calls.submit_call(self.keys, self.settings, request, explicit_deadline)
        return calls.parse_submit(self._call(call), request)

    def submit_many(
        self, requests: Sequence[tuple[InferenceRequest, bool]]
    ) -> list[Submitted | QueueFull | IdempotencyConflict]:
        """Write many validated (request, explicit deadline) in one pipelined round trip.

        Returns one entry per request, in order: :class:`Submitted`, or the
        :class:`QueueFull` or :class:`IdempotencyConflict` that refused it (others
        are still written).
        """
        pipe = self.redis.pipeline(transaction=False)
        for request, explicit in requests:
            self._call(calls.submit_call(self.keys, self.settings, request, explicit), pipe)
        out: list[Submitted | QueueFull | IdempotencyConflict] = []
        for (request, _), reply in zip(requests, pipe.execute(), strict=True):
            try:
                out.append(calls.parse_submit(reply, request))
            except (QueueFull, IdempotencyConflict) as exc:
                out.append(exc)
        return out

    def record(self, request_id: str) -> RequestRecord:
        """The request's record. Raises RequestNotFound, CorruptRecord."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.req(request_id))
        pipe.get(self.keys.payload(request_id))
        fields, payload = pipe.execute()
        return calls.parse_record(request_id, fields, payload, self.keys)

    def records(self, request_ids: Iterable[str]) -> list[RequestRecord | None]:
        """Records of many requests in one round trip (None where absent or corrupt)."""
        ids = list(request_ids)
        pipe = self.redis.pipeline(transaction=False)
        self._read_records(pipe, ids)
        return self._parse_records(ids, pipe.execute())

    def _read_records(self, pipe: Any, ids: Sequence[str]) -> None:
        for rid in ids:
            pipe.hgetall(self.keys.req(rid))
            pipe.get(self.keys.payload(rid))

    def _parse_records(
        self, ids: Sequence[str], replies: Sequence[Any]
    ) -> list[RequestRecord | None]:
        out: list[RequestRecord | None] = []
        for rid, fields, payload in zip(ids, replies[::2], replies[1::2], strict=True):
            try:
                out.append(calls.parse_record(rid, fields, payload, self.keys))
            except (RequestNotFound, CorruptRecord):
                out.append(None)
        return out

    def wait_final(self, request_id: str, timeout_s: float) -> bool:
        """Block until the request is final, at most ``timeout_s`` (capped at
        ``defaults.BLOCK_CHUNK_S``; callers loop).

        Uses BLMOVE on the request's ``done`` list, rotating the token in place so
        every waiter wakes: no polling loop. Returns True when a token arrived.
        """
        key = self.keys.done(request_id)
        wait = self.block_s(min(timeout_s, defaults.BLOCK_CHUNK_S))
        token = self.redis.blmove(key, key, timeout=wait, src="RIGHT", dest="LEFT")
        return token is not None

    def cancel_running(self, request_id: str, reason: str, *, orphan_of: str = "") -> str:
        """Cancel a running request on its worker (``abort.lua``: a command on the worker's
        control channel; the worker stops the model-server call, frees the slot and writes
        ``cancelled``). Returns the verdict (``sent``, ``done``, ``pending``, ``stale``,
        ``kept``: ``orphan_of`` names a lapsed gateway that no longer holds it), or
        ``not_running``."""
        row = self.redis.hmget(self.keys.req(request_id), "state", "attempts", "worker")
        abort = calls.running_abort(request_id, row, reason, orphan_of)
        if abort is None:
            return "not_running"
        [verdict] = self.abort([abort])
        return verdict

    def read_stream(
        self, request_id: str, after: str, block_s: float
    ) -> list[tuple[str, StreamChunk | str | None]]:
        """Entries of the request's output stream after the entry id ``after`` (``"0"``
        for all), blocking up to ``block_s`` (capped at ``defaults.BLOCK_CHUNK_S``;
        callers loop) when there are none yet. Returns ``[(entry id, item)]``: a
        :class:`~inferq.models.StreamChunk`, the final state (str) of the ``end`` entry, or
        None for an entry that does not parse (see :func:`calls.parse_stream_entry`)."""
        block_ms = max(1, round(min(block_s, defaults.BLOCK_CHUNK_S) * 1000))
        reply = self.redis.xread({self.keys.stream(request_id): after}, block=block_ms)
        return calls.parse_xread(reply)

    def cancel(
        self, request_id: str, reason: str | None = None, *, orphan_of: str | None = None
    ) -> str:
        """Cancel a queued or assigned request; returns its state after the call.
        ``reason`` is its result's error (None: ``cancelled by the caller``).
        ``orphan_of``: the lapsed gateway the reaper cancels for; the cancel acts only
        while that gateway still holds the request and its lease is still lapsed, else
        it returns ``kept`` and changes nothing (``includes/orphan.lua``).

        Raises:
            RequestNotFound: no such request.
        """
        call = calls.cancel_call(self.keys, self.settings, request_id, reason, orphan_of)
        reply = self._call(call)
        return calls.parse_cancel(reply, request_id)

    # --- dispatcher side ------------------------------------------------------

    def assign(
        self,
        worker_id: str,
        batch_id: str,
        items: Sequence[tuple[str, str, float] | tuple[str, str, float, int]],
    ) -> list[tuple[str, int]]:
        """Claim ``items`` = [(request id, queue key, need MiB[, prompt tokens the prefix
        index forecast cached there])] for a worker, atomically; the claimed requests'
        prefix chains go to the prefix log (:mod:`inferq.store.prefixlog`).

        The queue key is the request's tenant sub-queue (:meth:`Keys.tenant_queue`, as
        :attr:`DispatchView.queue_of` gives it); any other key claims nothing.

        Returns the (request id, attempt) pairs actually claimed (others were taken,
        cancelled or expired meanwhile). Nothing is claimed for a worker that is not
        live and ready.
        """
        call = calls.assign_call(self.keys, self.settings, worker_id, batch_id, items)
        return calls.parse_assign(self._call(call))

    def expire_due(self, limit: int = 1000) -> list[tuple[str, float]]:
        """Expire queued/assigned requests past their deadline.

        Returns (request id, seconds waited) for each expired now.
        """
        return calls.parse_expire(
            self._call(calls.expire_due_call(self.keys, self.settings, limit))
        )

    def expire_ids(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, float]]:
        """Expire the given (request id, reason) now (e.g. cannot finish in time)."""
        if not pairs:
            return []
        return calls.parse_expire(
            self._call(calls.expire_ids_call(self.keys, self.settings, pairs))
        )

    def expire_waited(
        self, request_id: str, route: str, models: Sequence[str]
    ) -> list[tuple[str, float]]:
        """Expire a request its client waited for past the deadline, saying why it was
        kept (``expire.lua``, mode ``waited``: no dispatcher, or no ready worker of
        ``models``, or all of them busy)."""
        call = calls.expire_waited_call(self.keys, self.settings, request_id, route, models)
        return calls.parse_expire(self._call(call))

    def beat_dispatcher(self, ttl_s: float) -> None:
        """Say a dispatcher runs, for ``ttl_s`` seconds (``dispatcher:beat``)."""
        self.redis.set(self.keys.dispatcher_beat, "1", px=max(1, round(ttl_s * 1000)))

    def reap_paused(self, grace_s: float, stalled_s: float) -> None:
        """Record on the events stream that a dispatcher pauses reaping for ``grace_s``
        seconds after Redis was unavailable or its own loop stalled ``stalled_s`` seconds
        (0: a connection error): a dead worker is requeued that much later, by design."""
        self.redis.xadd(
            self.keys.events,
            {"type": "reap_paused", "grace_ms": round(grace_s * 1000),
             "stalled_ms": round(stalled_s * 1000)},
            maxlen=self.settings.events_maxlen,
            approximate=True,
        )  # fmt: skip

    def set_usage_retention(self) -> None:
        """Tell the metering (``lua/includes/meter.lua``) how long to keep a usage roll-up
        after its day: ``usage_retention_days`` (read when a roll-up field is created)."""
        self.redis.set(self.keys.usage_retention, self.settings.usage_retention_days * 86400)

    def usage_records(
        self, since_ms: int, until_ms: int
    ) -> tuple[list[usage.UsageRecord], list[usage.Corrupt]]:
        """The usage roll-up records of the days holding ``[since_ms, until_ms)`` (one
        pipelined round trip), and the fields (or keys) that do not parse: skipped."""
        days = usage.days_between(since_ms, until_ms)
        pipe = self.redis.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(self.keys.usage_day(day))
        records: list[usage.UsageRecord] = []
        corrupt: list[usage.Corrupt] = []
        for day, reply in zip(days, pipe.execute(raise_on_error=False), strict=True):
            key = self.keys.usage_day(day)
            if isinstance(reply, Exception):
                corrupt.append(usage.Corrupt(key, "", f"not a usage hash: {reply}"))
                continue
            for name, value in reply.items():
                parsed = usage.parse_record(key, name, value)
                (corrupt if isinstance(parsed, usage.Corrupt) else records).append(parsed)  # type: ignore[arg-type]
        return records, corrupt

    def usage_report(self, by: str, since: str, until: str) -> dict[str, object]:
        """The usage of ``[since, until)`` summed by ``by`` and priced now
        (:func:`inferq.usage.report`'s shape): what ``inferq usage --json`` prints and the
        gateway's ``GET /v1/usage`` returns.

        Args:
            by: one of :data:`inferq.usage.DIMENSIONS`.
            since / until: ``<n>h`` or ``<n>d`` ago (``until`` also ``now``), on Redis
                TIME, widened to whole UTC hours.

        Raises:
            InvalidUsageQuery: a parameter does not parse (its name is the ``field``).
        """
        usage.check_by(by)
        start, end = usage.window_ms(round(self.now() * 1000), since, until)
        records, corrupt = self.usage_records(start, end)
        return usage.report(records, corrupt, by, self.settings.prices, start, end)

    def reap_leases(self, limit: int = 1000) -> list[tuple[str, str]]:
        """Requeue requests whose lease lapsed; returns (id, verdict) pairs."""
        call = calls.reap_leases_call(self.keys, self.settings, limit)
        return calls.parse_reap_leases(self._call(call))

    def lapsed_callers(self, limit: int = 100) -> list[tuple[str, list[str]]]:
        """Gateways whose liveness lease lapsed, each with the ids of its requests that are
        not final yet: ``[(caller id, [request ids])]`` (``reap_callers.lua``; one with
        none left is forgotten). The dispatcher cancels them: nobody reads their answers.
        """
        return calls.parse_reap_callers(self._call(calls.reap_callers_call(self.keys, limit)))

    def remove_worker(
        self, worker_id: str, *, reason: str, dead: bool, stale_before: float = 0.0
    ) -> list[str] | None:
        """Take a worker out of the fleet and requeue what it held.

        Args:
            dead: true for the reaper (the worker stopped beating: its attempts count
                towards max_attempts, and a worker that beat since ``stale_before``
                is left alone); false for a worker leaving after its drain.

        Returns:
            The requeued request ids, or None when the worker turned out to be alive.
        """
        call = calls.remove_worker_call(
            self.keys, self.settings, worker_id, reason=reason, dead=dead, stale_before=stale_before
        )
        return calls.parse_remove_worker(self._call(call))

    def last_beat(self, worker_id: str) -> tuple[float, float | None]:
        """Redis time and the worker's last beat in the workers index (epoch s; None when
        it is not registered), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.zscore(self.keys.workers, worker_id)
        now, beat_ms = pipe.execute()
        return redis_time(now), None if beat_ms is None else float(beat_ms) / 1000

    def silent_workers(self, since: float) -> list[str]:
        """Ids in the workers index whose last beat is at or before ``since`` (epoch s)."""
        return list(self.redis.zrangebyscore(self.keys.workers, "-inf", round(since * 1000)))

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a submission, a requeue or a freed slot pushes the wake token, at
        most ``timeout_s`` (BLPOP: every dispatcher replica shares the one token), in
        chunks that fit the connection's socket timeout (:meth:`block_s`). Returns True
        when the token woke it, False when the time ran out."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) >= MIN_BLOCK_S:
            if self.redis.blpop([self.keys.wake], timeout=self.block_s(left)) is not None:
                return True
        return False

    def dispatch_view(
        self,
        classes: Sequence[str],
        head: int,
        heartbeat_ttl_s: float,
        *,
        tenant_weight: Callable[[str], float] = lambda _: 1.0,
        models: Sequence[str] | None = None,
        route_models: Callable[[str], Sequence[str]] | None = None,
        policy: DispatchPolicy | None = None,
    ) -> DispatchView:
        """Everything one dispatch decision needs (see :func:`read_dispatch_view`); the
        fleet is read incrementally through this store's :attr:`fleet` cache (and kept
        indexed for ``policy`` when given)."""
        return read_dispatch_view(
            self.redis,
            self.keys,
            classes,
            head,
            heartbeat_ttl_s,
            tenant_weight=tenant_weight,
            models=models,
            cache=self.fleet,
            route_models=route_models,
            policy=policy,
            chains=self.chains,
        )

    def read_prefix_log(
        self, after: str, count: int = defaults.PREFIX_LOG_READ
    ) -> tuple[list[PrefixEntry], str, int]:
        """Entries of the prefix log after id ``after`` (``"0"``: from the start), at most
        ``count``, in one XRANGE (:mod:`inferq.store.prefixlog`).

        Returns:
            (entries, the last id read or ``after`` when none, entries that did not parse).
        """
        start = "-" if after == "0" else f"({after}"
        try:
            rows = self.redis.xrange(self.keys.prefix_log, start, "+", count=count)
        except UnicodeDecodeError:  # an entry planted in bytes that are not UTF-8
            raw = self.redis.execute_command(
                "XRANGE", self.keys.prefix_log, start, "+", "COUNT", count, NEVER_DECODE=True
            )
            rows = decode_rows(raw)
        entries, last, bad = parse_entries(rows)
        return entries, last or after, bad

    def quarantine_mistyped_prefix_log(self) -> int:
        """Quarantine the prefix log when it is not a stream (every dispatcher step reads
        it, and assign.lua writes it with the claim, so both failed at every step);
        returns 1 when it did. The index loses its history: hits, never a request."""
        kind = self.redis.type(self.keys.prefix_log)
        if kind in ("stream", "none"):
            return 0
        self.quarantine(self.keys.prefix_log, f"prefix log is a {kind}, not a stream")
        return 1

    def prefix_log_info(self) -> dict[str, int]:
        """The prefix log's size: ``entries`` (XLEN) and ``bytes`` (MEMORY USAGE, all
        entries sampled); zeros when it does not exist. Three commands."""
        key = self.keys.prefix_log
        entries = int(self.redis.xlen(key))
        used = self.redis.memory_usage(key, samples=0) if entries else 0
        return {
            "entries": entries,
            "bytes": int(used or 0),
            "maxlen": defaults.PREFIX_STREAM_MAXLEN,
        }

    def note_prefix(self, worker_id: str, **fields: str | int) -> None:
        """Write a ``reset`` or ``miss`` entry of the prefix log for a worker (one XADD)."""
        self.redis.xadd(
            self.keys.prefix_log,
            {"w": worker_id, **{k: str(v) for k, v in fields.items()}},
            maxlen=defaults.PREFIX_STREAM_MAXLEN,
            approximate=True,
        )

    def running_on(self, worker_ids: Sequence[str]) -> dict[str, list[RunningRequest]]:
        """What the workers hold (assigned or running), for the preemption rule."""
        return read_running(self.redis, self.keys, worker_ids)

    def write_fairness(
        self,
        decision: Decision,
        classes: Sequence[str],
        tenant_weight: Callable[[str], float] = lambda _: 1.0,
    ) -> int:
        """Store the fairness state a decision carries forward (one script call).

        Credits are replaced, tenant charges added to their virtual time (tokens /
        weight), and up to :data:`~inferq.defaults.FOLD_LIMIT` idle tenants per class
        folded (``fairness.lua``). The decision's floors and active sets are not
        stored: the scripts that queue a request lift a newly backlogged tenant
        themselves (``includes/counts.lua``), with the same VTC rule. With several
        dispatchers the last writer wins the credits: a small drift in shares, never a
        correctness issue.

        Returns:
            Idle tenants folded.
        """
        credits: dict[str, float | None] = {c: decision.class_credit.get(c) for c in classes}
        charges = [
            (cls, tenant, delta / tenant_weight(tenant))
            for cls, deltas in decision.tenant_counter_delta.items()
            for tenant, delta in deltas.items()
        ]
        call = calls.fairness_call(
            self.keys,
            credits,
            charges,
            idle_s=defaults.TENANT_IDLE_S,
            limit=defaults.FOLD_LIMIT,
        )
        return calls.parse_fairness(self._call(call))

    def mark_unschedulable(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        """Record why queued requests cannot be served (one script call); returns the ids
        whose reason is new or changed (each also gets one ``unschedulable`` event).

        Every call refreshes the note's time, so an expiry uses the reason only while
        a dispatcher still confirms it (``note_unschedulable.lua``, ``expire.lua``).
        """
        if not pairs:
            return []
        call = calls.note_unschedulable_call(self.keys, self.settings, pairs)
        return calls.parse_note_unschedulable(self._call(call))

    def live_models(self) -> dict[str, int]:
        """Models served by live workers (``starting`` or ``ready``), with their counts."""
        ids = self.redis.zrange(self.keys.workers, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hmget(self.keys.worker(wid), "model", "state")
        return calls.parse_live_models(pipe.execute() if ids else [])

    def scaler_pools(self) -> frozenset[str]:
        """Models a running scaler manages (the fields of ``scaler:state`` while a replica
        holds the lease); empty when no scaler runs or its state is unreadable."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(self.keys.scaler_lease)
        pipe.hkeys(self.keys.scaler_state)
        try:
            held, models = pipe.execute()
        except REPLY_ERRORS:
            return frozenset()
        return frozenset(models) if held else frozenset()

    # --- repair -------------------------------------------------------------------

    def quarantine(self, key: str, reason: str, members: Sequence[tuple[str, str]] = ()) -> None:
        """Move a corrupt record aside and remove (zset key, member) references to it."""
        call = calls.quarantine_call(self.keys, self.settings, key, reason, members)
        calls.parse_quarantine(self._call(call))
        log.warning("quarantined %s: %s", key, reason)

    def quarantine_bad_queue_names(self) -> int:
        """Quarantine members of the ``queues`` set that are not ``<class>|<route>``.

        The member is recorded in the quarantine hash as ``<queues key>:<member>``, then
        removed from the set (the dispatcher skips such names; the scaler, metrics and
        the CLI read every name). Returns how many were found.
        """
        k = self.keys
        bad = repair.malformed_queue_names(self.redis, k)
        for name in bad:
            self.quarantine(f"{k.queues}:{name}", f"queue name {name!r} is not <class>|<route>")
            self.redis.srem(k.queues, name)
        return len(bad)

    def quarantine_mistyped_queues(self, classes: Sequence[str]) -> int:
        """Quarantine tenant indexes and sub-queues of the queues of ``classes`` that are
        not zsets (every read of the queue fails on them); a sub-queue's tenant leaves its
        index and the queued counters it held are recounted (``quarantine.lua``).
        Returns how many were found."""
        found = repair.mistyped_queues(self.redis, self.keys, classes)
        for key, reason, members in found:
            self.quarantine(key, reason, members)
        return len(found)

    def quarantine_mistyped_workers(self) -> int:
        """Quarantine heartbeat, load and in-flight keys of the workers index holding
        another type than theirs (every snapshot and the reaper fail on them); a heartbeat
        leaves the index with it. Returns how many were found."""
        found = repair.mistyped_workers(self.redis, self.keys)
        for key, reason, members in found:
            self.quarantine(key, reason, members)
        return len(found)

    def quarantine_non_hash_requests(self, classes: Sequence[str], head: int) -> int:
        """Quarantine request keys holding another type than a hash (every script fails on
        them), where the dispatcher's step meets request ids: the heads of the queues of
        ``classes`` (``head`` each), the due deadlines and the lapsed leases. Returns how
        many were found."""
        now_ms = round(self.now() * 1000)
        found = repair.non_hash_requests(self.redis, self.keys, classes, head, now_ms)
        for key, reason, members in found:
            self.quarantine(key, reason, members)
        return len(found)

    # --- worker side ----------------------------------------------------------

    def heartbeat(
        self, info: WorkerInfo, ttl_s: float, held: Sequence[tuple[str, int]] = ()
    ) -> calls.Beat:
        """Publish a heartbeat, extend the worker's leases, check its held attempts.

        Args:
            info: the worker's state.
            ttl_s: how long the hash lives without another beat, seconds.
            held: (request id, attempt) pairs the worker runs.

        Returns:
            A :class:`~inferq.store.calls.Beat` (joined, drain requested, Redis time,
            the held attempts that are no longer the worker's own).
        """
        return self.heartbeat_fields(info.id, info.to_fields(), ttl_s, held)

    def heartbeat_fields(
        self,
        worker_id: str,
        fields: dict[str, str],
        ttl_s: float,
        held: Sequence[tuple[str, int]] = (),
    ) -> calls.Beat:
        """:meth:`heartbeat` from a heartbeat hash already flattened (the heartbeat process)."""
        call = calls.heartbeat_call(self.keys, self.settings, worker_id, fields, ttl_s, held)
        return calls.parse_heartbeat(self._call(call))

    def start(self, worker_id: str, pairs: Sequence[tuple[str, int]]) -> list[str]:
        """Mark (request id, attempt) pairs running; returns 'run'/'stale'/'expired' each."""
        call = calls.start_call(self.keys, self.settings, worker_id, pairs, new_id())
        return calls.parse_start(self._call(call))

    def start_and_read(
        self, worker_id: str, pairs: Sequence[tuple[str, int]]
    ) -> tuple[list[str], list[RequestRecord | None]]:
        """:meth:`start` and the records of the pairs it lets run, in one round trip.

        The records are read after the script in the same pipeline, so they say
        ``running``. Returns the verdicts and, per pair, its record when the verdict is
        ``run`` (None otherwise, and where absent or corrupt, as :meth:`records`). A
        batch's start is on each of its requests' time to first token: two round trips
        were one more than needed (issue 14).

        A server whose script cache lacks ``start.lua`` (restarted, flushed) answers
        NOSCRIPT and runs nothing; then the two calls are made apart (:meth:`start`
        loads the script).
        """
        call = calls.start_call(self.keys, self.settings, worker_id, pairs, new_id())
        ids = [rid for rid, _ in pairs]
        pipe = self.redis.pipeline(transaction=False)
        # EVALSHA by hand: redis-py's Script on a pipeline sends SCRIPT EXISTS first, a
        # round trip of its own on every call.
        pipe.evalsha(self._scripts[call.script].sha, len(call.keys), *call.keys, *call.args)
        self._read_records(pipe, ids)
        reply, *rows = pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError):
            verdicts = self.start(worker_id, pairs)
            records = self.records(ids)
        else:
            failed = next((r for r in (reply, *rows) if isinstance(r, Exception)), None)
            if failed is not None:
                raise failed
            verdicts = calls.parse_start(reply)
            records = self._parse_records(ids, rows)
        return verdicts, [r if v == "run" else None for r, v in zip(records, verdicts, strict=True)]

    def complete(
        self, worker_id: str, completions: Sequence[Completion], model: str = ""
    ) -> list[str]:
        """Record final results, fenced by attempt; returns 'ok' or 'stale' per result.

        Args:
            model: the model the worker serves (its usage is metered under it); '' =
                the worker's heartbeat says (one more Redis read in the script).
        """
        call = calls.complete_call(self.keys, self.settings, worker_id, completions, model)
        return calls.parse_complete(self._call(call))

    def requeue(
        self,
        items: Sequence[tuple[str, int | None, str, str]],
        *,
        penalize: bool = True,
        infra: bool = False,
        delay_s: float = 0.0,
        kind: str = "",
    ) -> list[str]:
        """Send (request id, attempt or None, worker or '', error) back to their queues.

        Args:
            items: the requests and the attempt each failed or gave up.
            penalize: count the attempt towards ``max_attempts`` (a model server error);
                a drain hand-back passes False.
            infra: the model server's infrastructure failed (refused, 502/503/504, 429):
                no attempt is spent, the request's ``failures`` counts it; its deadline
                bounds such retries.
            delay_s: backoff before the request may be dispatched again, seconds (kept on
                Redis TIME in the delayed set; ``promote`` moves it back).
            kind: the failure's kind, recorded in the ``retry`` event.

        Returns:
            'queued', 'expired', 'dead' or 'stale' for each item; 'cancelled' or
            'preempted' where an abort of that attempt was pending (carried out instead).
        """
        call = calls.requeue_call(
            self.keys,
            self.settings,
            items,
            penalize=penalize,
            infra=infra,
            delay_s=delay_s,
            kind=kind,
        )
        return calls.parse_requeue(self._call(call))

    def abort(
        self, aborts: Sequence[Abort], output_weight: float = defaults.VTC_OUTPUT_WEIGHT
    ) -> list[str]:
        """Stop (request, attempt) pairs their workers hold: a preemption or a cancel.

        Not yet started: requeued (no attempt spent) or made final at once; running: an
        abort command goes on the worker's control channel (``ctl:<worker>``) and the
        worker writes the outcome. ``output_weight``: the tenant counter's weight of an
        output token (a requeue gives back what the attempt did not use). Returns
        'done'/'sent'/'pending'/'stale' each.
        """
        if not aborts:
            return []
        call = calls.abort_call(self.keys, self.settings, aborts, output_weight)
        return calls.parse_abort(self._call(call))

    def requeue_preempted(self, worker_id: str, items: Sequence[tuple[str, int, int]]) -> list[str]:
        """Send (request id, attempt, tokens generated) the worker aborted for a
        preemption back to their queues at their original position, spending no attempt;
        returns 'queued'/'expired'/'stale' each."""
        call = calls.requeue_preempted_call(self.keys, self.settings, worker_id, items)
        return calls.parse_requeue_preempted(self._call(call))

    def take_control(self, worker_id: str, timeout_s: float) -> list[Abort]:
        """Commands on the worker's control channel: blocks up to ``timeout_s`` for the
        first, then takes whatever else is there. Unreadable commands are logged and
        dropped."""
        key = self.keys.ctl(worker_id)
        first = self.redis.blpop([key], timeout=self.block_s(timeout_s))
        if first is None:
            return []
        raw = [first[1]]
        pipe = self.redis.pipeline(transaction=True)  # nothing pushed between is lost
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        rest, _ = pipe.execute()
        raw += list(rest)
        out = []
        for text in raw:
            command = calls.parse_control(text)
            if command is None:
                log.warning("dropped an unreadable control command: %r", text[:200])
            else:
                out.append(command)
        return out

    def promote_due(self, limit: int = 1000) -> tuple[int, float | None]:
        """Move retries whose backoff has passed back to their queues (``promote.lua``).

        Returns:
            (how many moved, seconds until the next one is due, or None when none waits).
        """
        return calls.parse_promote(self._call(calls.promote_call(self.keys, limit)))

    def publish_chunks(self, chunks: Sequence[Chunk]) -> None:
        """Append output chunks to their requests' streams in one round trip, each stream
        capped at ``defaults.STREAM_MAXLEN`` entries (approximately) and expiring
        ``chunk.ttl_s`` from now (``finalize`` sets the result's TTL when it ends it)."""
        if not chunks:
            return
        pipe = self.redis.pipeline(transaction=False)
        calls.queue_chunks(pipe, self.keys, chunks)
        pipe.execute()

    def reserved_mib(self, worker_id: str) -> float:
        """KV-cache MiB reserved on the worker by assigned work (``load:<id>``); 0 when
        the figure is not a finite number or the key not a hash (corrupt: the
        dispatcher's repair rebuilds it from what the worker holds), so a worker's
        heartbeat, its first included, never fails on it."""
        try:
            raw = self.redis.hget(self.keys.load(worker_id), "mib")
            mib = float(raw or 0)
        except (ValueError, ResponseError) as exc:
            log.warning("load:%s is corrupt (%s); read as nothing reserved", worker_id, exc)
            return 0.0
        return mib if math.isfinite(mib) else 0.0

    def held_by(self, worker_id: str) -> set[str]:
        """Request ids Redis says the worker holds (``inflight:<id>``): claimed for it,
        until their result is written or they are handed back."""
        return set(self.redis.smembers(self.keys.inflight(worker_id)))

    def forget_vanished(self, worker_id: str, request_ids: Sequence[str]) -> list[str]:
        """Take off a live worker the requests among ``request_ids`` whose record is gone
        (deleted, evicted): they leave its holdings and the leases, and its reservation
        is recounted (``forget_vanished.lua``). Returns the ids forgotten."""
        call = calls.forget_vanished_call(self.keys, self.settings, worker_id, request_ids)
        return calls.parse_forget_vanished(self._call(call))

    def holdings(self, request_ids: Sequence[str]) -> tuple[int, list[tuple[Any, Any]]]:
        """Redis time (ms) and, per request, its (state, worker, attempts, dispatched_ms,
        started_ms) and its batch id, in one round trip.

        A reply that failed (a key of another type) is the exception instead of its value.
        """
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for rid in request_ids:
            pipe.hmget(k.req(rid), "state", "worker", "attempts", "dispatched_ms", "started_ms")
            pipe.hget(k.req(rid), "batch")
        (sec, usec), *rows = pipe.execute(raise_on_error=False)
        now_ms = int(sec) * 1000 + int(usec) // 1000
        return now_ms, [(rows[2 * i], rows[2 * i + 1]) for i in range(len(request_ids))]

    def update_estimates(
        self, observed: Sequence[tuple[str, str | None, int]], alpha: float
    ) -> None:
        """Fold generated-token counts (model, task_type, tokens) into the moving means.

        Read-modify-write without a lock: two workers racing lose one sample, which
        an estimate tolerates.
        """
        if not observed:
            return
        fields = [f"{model}|{task or ''}" for model, task, _ in observed]
        old = dict(zip(fields, self.redis.hmget(self.keys.estimates, fields), strict=True))
        new: dict[str, float] = {}
        for field, (_, _, tokens) in zip(fields, observed, strict=True):
            prev = new.get(field, float(old[field]) if old[field] else None)
            new[field] = update_moving_mean(prev, tokens, alpha)
        call = calls.estimates_call(
            self.keys,
            new,
            idle_s=defaults.ESTIMATE_IDLE_S,
            cap=defaults.ESTIMATES_MAX,
            limit=defaults.FOLD_LIMIT,
        )
        calls.parse_estimates_put(self._call(call))

    # --- fleet ------------------------------------------------------------------

    def workers(self) -> tuple[list[WorkerInfo], list[tuple[str, str]]]:
        """Live workers' heartbeats, and (key, reason) for corrupt ones found."""
        ids = self.redis.zrange(self.keys.workers, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(self.keys.worker(wid))
        good: list[WorkerInfo] = []
        bad: list[tuple[str, str]] = []
        for wid, fields in zip(ids, pipe.execute(), strict=True):
            if not fields:
                continue  # expired: the reaper removes it
            key = self.keys.worker(wid)
            try:
                good.append(WorkerInfo.from_fields(fields, key))
            except CorruptRecord as exc:
                bad.append((key, exc.reason))
        return good, bad

    def worker_reservations(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Slots reserved by assigned work (``load:<id>``), per worker; 0 when unreadable."""
        pipe = self.redis.pipeline(transaction=False)
        for wid in worker_ids:
            pipe.hget(self.keys.load(wid), "slots")
        out: dict[str, int] = {}
        for wid, raw in zip(worker_ids, pipe.execute(), strict=True):
            try:
                out[wid] = max(0, int(float(raw or 0)))
            except (ValueError, OverflowError):  # nan, inf
                out[wid] = 0
        return out

    def worker_loads(self, worker_ids: Sequence[str]) -> dict[str, tuple[int, float]]:
        """(slots, KV cache MiB) reserved by assigned work (``load:<id>``), per worker;
        zeros when unreadable."""
        pipe = self.redis.pipeline(transaction=False)
        for wid in worker_ids:
            pipe.hmget(self.keys.load(wid), "slots", "mib")
        out: dict[str, tuple[int, float]] = {}
        for wid, (slots, mib) in zip(worker_ids, pipe.execute(), strict=True):
            try:
                out[wid] = (max(0, int(float(slots or 0))), max(0.0, float(mib or 0)))
            except (ValueError, OverflowError):  # nan, inf
                out[wid] = (0, 0.0)
        return out

    def worker_registered(self, worker_id: str) -> bool:
        """True while the worker's heartbeat hash exists (it has not left or lapsed)."""
        return bool(self.redis.exists(self.keys.worker(worker_id)))

    def request_drain(self, worker_id: str) -> bool:
        """Ask a worker to drain (``drain.lua``).

        Routing stops at once: the worker's heartbeat says ``draining`` from now on and
        it is marked changed, so no dispatcher offers it anything from its next step
        (the worker itself sees the flag on its next heartbeat).

        Returns False when no live worker has this id.
        """
        call = calls.drain_call(self.keys, worker_id, defaults.DRAIN_FLAG_TTL_S)
        return calls.parse_drain(self._call(call))

    def output_estimates(self) -> dict[tuple[str, str], float]:
        """Moving means of generated tokens: (model, task_type or '') -> tokens."""
        return calls.parse_estimates(self.redis.hgetall(self.keys.estimates))

    # --- metrics side ---------------------------------------------------------

    def hold_metrics_lease(self, replica_id: str, ttl_s: float) -> bool:
        """Take or renew the metrics exporter's lease for ``ttl_s`` seconds.

        Returns True when ``replica_id`` holds it now (and so exports the deployment-wide
        series), False when another replica does.
        """
        call = calls.lease_call(self.keys.metrics_lease, replica_id, ttl_s)
        return calls.parse_lease(self._call(call))

    def release_metrics_lease(self, replica_id: str) -> bool:
        """Give the metrics lease up if ``replica_id`` holds it (another takes over at once)."""
        call = calls.lease_call(self.keys.metrics_lease, replica_id, None)
        return calls.parse_lease(self._call(call))

    # --- scaler side ----------------------------------------------------------

    def hold_scaler_lease(self, replica_id: str, ttl_s: float) -> bool:
        """Take or renew the acting scaler's lease for ``ttl_s`` seconds.

        Returns True when ``replica_id`` holds it now, False when another replica does.
        """
        call = calls.lease_call(self.keys.scaler_lease, replica_id, ttl_s)
        return calls.parse_lease(self._call(call))

    def release_scaler_lease(self, replica_id: str) -> bool:
        """Give the lease up if ``replica_id`` holds it (so another replica takes over at once)."""
        call = calls.lease_call(self.keys.scaler_lease, replica_id, None)
        return calls.parse_lease(self._call(call))

    def scaler_hash(self, key: str) -> dict[str, str]:
        """One of the scaler's hashes (``keys.scaler_state``, ``keys.scaler_workers``).

        Raises:
            CorruptRecord: the key holds another type than a hash.
        """
        try:
            return dict(self.redis.hgetall(key))
        except REPLY_ERRORS as exc:
            raise CorruptRecord(key, f"not a hash: {exc}") from None

    def save_scaler(
        self,
        state: dict[str, str],
        workers: dict[str, str],
        desired: dict[str, int] | None,
    ) -> None:
        """Replace the scaler's state, worker tracking and (unless None) desired counts.

        One MULTI/EXEC, so a reader never sees half of a decision's state.
        """
        k = self.keys
        pipe = self.redis.pipeline(transaction=True)
        hashes: list[tuple[str, dict[str, Any]]] = [
            (k.scaler_state, state),
            (k.scaler_workers, workers),
        ]
        if desired is not None:
            hashes.append((k.scaler_desired, dict(desired)))
        for key, mapping in hashes:
            pipe.delete(key)
            if mapping:
                pipe.hset(key, mapping=mapping)
        pipe.execute()

    def desired_workers(self) -> dict[str, int]:
        """The scaler's latest desired worker count per model."""
        return {m: int(n) for m, n in self.redis.hgetall(self.keys.scaler_desired).items()}

    def scale_event(
        self,
        kind: Literal["scale_up", "scale_down"],
        model: str,
        before: int,
        after: int,
        reasons: Sequence[str],
        workers: Sequence[str],
    ) -> None:
        """Record a scale action on the events stream (``from``/``to`` are worker counts)."""
        self.redis.xadd(
            self.keys.events,
            {
                "type": kind,
                "model": model,
                "from": before,
                "to": after,
                "reason": "; ".join(reasons),
                "workers": ",".join(workers),
            },
            maxlen=self.settings.events_maxlen,
            approximate=True,
        )
