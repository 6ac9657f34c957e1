"""All of inferq's Redis I/O: connections, the Lua scripts, and typed calls around them.

Every multi-key change is one Lua script in ``inferq/lua/`` (prepended with
``lib.lua``); this module only gathers arguments and parses replies. The
argument builders and reply parsers are module functions so the synchronous
:class:`Store` and the asyncio client share them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

import redis

from inferq import connection, defaults
from inferq.config import Settings
from inferq.errors import CorruptRecord, QueueFull, RedisUnavailable, RequestNotFound
from inferq.keys import Keys
from inferq.models import (
    Event,
    InferenceRequest,
    RequestRecord,
    WorkerInfo,
    WorkerState,
    from_ms,
)
from inferq.policy.snapshot import (
    Decision,
    FairnessState,
    QueuedRequest,
    Snapshot,
    WorkerView,
)

log = logging.getLogger(__name__)

SCRIPTS = (
    "submit",
    "assign",
    "start",
    "complete",
    "requeue",
    "expire",
    "cancel",
    "heartbeat",
    "remove_worker",
    "reap_leases",
    "dead_requeue",
    "quarantine",
    "scaler_lease",
)

#: Errors meaning "Redis is not reachable right now" (retried with backoff by daemons).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
)


@cache
def script_source(name: str) -> str:
    """Source of ``lua/<name>.lua`` with ``lib.lua`` prepended."""
    lua = resources.files("inferq") / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def connection_kwargs() -> dict[str, Any]:
    """Options every inferq connection uses (see :func:`inferq.connection.connection_kwargs`)."""
    return connection.connection_kwargs()


def connect(url: str, *, check: bool = True) -> redis.Redis:
    """Open a connection pool to ``url`` (text replies).

    Any URL form of :mod:`inferq.connection`: ``redis://``, ``rediss://`` (TLS
    options in the query), ``unix://``, ``redis+sentinel://`` (the primary a
    sentinel names, followed across failovers).

    Raises:
        ConfigError: the URL is malformed (password redacted).
        RedisUnavailable: ``check`` is true and the server does not answer PING
            (the message carries the URL with its password redacted).
    """
    client = connection.open_redis(url)
    if check:
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            client.close()
            raise RedisUnavailable(url, connection.explain(url, exc)) from None
    return client


@dataclass(frozen=True, slots=True)
class Submitted:
    """Outcome of one accepted submission.

    Attributes:
        id: the request id (the first one's, for a duplicate idempotency key).
        duplicate: true when the idempotency key mapped to an earlier request.
        submitted_at / deadline: epoch seconds as recorded by Redis (None for a duplicate).
    """

    id: str
    duplicate: bool = False
    submitted_at: float | None = None
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """A completed request result a worker hands to :meth:`Store.complete`.

    Attributes:
        status: ``succeeded``, ``failed`` (not retryable) or ``expired``.
        first_token_at: epoch seconds of the first output token, when known.
    """

    request_id: str
    attempt: int
    status: Literal["succeeded", "failed", "expired"]
    output: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    error: str = ""


def submit_call(
    keys: Keys, settings: Settings, request: InferenceRequest, explicit_deadline: bool
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the submit script for one validated request."""
    cls = settings.class_by_name[request.priority]
    # No idempotency key: no third key at all (an ACL user confined to inferq:* may not
    # name the empty key).
    idem = [keys.idem(request.tenant, request.idempotency_key)] if request.idempotency_key else []
    fields = request.to_fields()
    for derived in ("submitted_ms", "deadline_ms", "attempts"):
        fields.pop(derived)
    argv: list[Any] = [
        keys.prefix,
        request.id,
        request.priority,
        request.model,
        request.tenant,
        cls.queue_limit,
        cls.tenant_queue_limit,
        round(request.timeout_s * 1000),
        fields_deadline(request) if explicit_deadline else "",
        settings.idempotency_ttl_s,
        settings.events_maxlen,
    ]
    for name, value in fields.items():
        argv += [name, value]
    return [keys.req(request.id), keys.queue(request.priority, request.model), *idem], argv


def fields_deadline(request: InferenceRequest) -> int:
    """The request's absolute deadline, integer ms."""
    return round(request.deadline * 1000)


def parse_submit(reply: Sequence[str], request: InferenceRequest) -> Submitted:
    """Turn the submit script's reply into :class:`Submitted`.

    Raises:
        QueueFull: the class or tenant limit refused the request.
    """
    kind = reply[0]
    if kind == "ok":
        return Submitted(reply[1], False, from_ms(int(reply[2])), from_ms(int(reply[3])))
    if kind == "dup":
        return Submitted(reply[1], duplicate=True)
    tenant = request.tenant if reply[1] == "tenant" else None
    raise QueueFull(request.priority, tenant, int(reply[2]))


def parse_record(request_id: str, fields: dict[str, str], keys: Keys) -> RequestRecord:
    """Parse a request hash, raising :class:`RequestNotFound` when it is empty."""
    if not fields:
        raise RequestNotFound(request_id)
    return RequestRecord.from_fields(fields, keys.req(request_id))


class Store:
    """Synchronous access to one deployment's keys (``inferq:<namespace>:*``).

    Args:
        client: a redis-py client created with ``decode_responses=True`` (see :func:`connect`).
        settings: limits, TTLs and the namespace.
    """

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        # Typed Any: with decode_responses=True every reply is str, which redis-py's
        # stubs (bytes | str for every call) cannot express.
        self.redis: Any = client
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}

    @classmethod
    def from_settings(cls, settings: Settings) -> Store:
        """Connect to ``settings.redis_url`` and wrap it (raises RedisUnavailable)."""
        return cls(connect(settings.redis_url), settings)

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        return self._scripts[name](keys=list(keys), args=list(args), client=client)

    def now(self) -> float:
        """Redis server time, epoch seconds (the one clock every script uses)."""
        sec, usec = self.redis.time()
        return float(sec) + float(usec) / 1e6

    # --- client side ----------------------------------------------------------

    def submit(self, request: InferenceRequest, *, explicit_deadline: bool = False) -> Submitted:
        """Write one validated request (one round trip).

        Raises:
            QueueFull: a class or tenant queue limit refused it (nothing written).
        """
        keys, argv = submit_call(self.keys, self.settings, request, explicit_deadline)
        return parse_submit(self._run("submit", keys, argv), request)

    def submit_many(
        self, requests: Sequence[tuple[InferenceRequest, bool]]
    ) -> list[Submitted | QueueFull]:
        """Write many validated requests in one pipelined round trip.

        Returns one entry per request, in order: :class:`Submitted`, or the
        :class:`QueueFull` that refused it (others are still written).
        """
        pipe = self.redis.pipeline(transaction=False)
        for request, explicit in requests:
            keys, argv = submit_call(self.keys, self.settings, request, explicit)
            self._run("submit", keys, argv, client=pipe)
        out: list[Submitted | QueueFull] = []
        for (request, _), reply in zip(requests, pipe.execute(), strict=True):
            try:
                out.append(parse_submit(reply, request))
            except QueueFull as exc:
                out.append(exc)
        return out

    def record(self, request_id: str) -> RequestRecord:
        """The request's record. Raises RequestNotFound, CorruptRecord."""
        return parse_record(request_id, self.redis.hgetall(self.keys.req(request_id)), self.keys)

    def records(self, request_ids: Iterable[str]) -> list[RequestRecord | None]:
        """Records of many requests in one round trip (None where absent or corrupt)."""
        ids = list(request_ids)
        pipe = self.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(self.keys.req(rid))
        out: list[RequestRecord | None] = []
        for rid, fields in zip(ids, pipe.execute(), strict=True):
            try:
                out.append(parse_record(rid, fields, self.keys))
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
        wait = min(timeout_s, defaults.BLOCK_CHUNK_S)
        token = self.redis.blmove(key, key, timeout=wait, src="RIGHT", dest="LEFT")
        return token is not None

    def cancel(self, request_id: str) -> str:
        """Cancel a queued or assigned request; returns its state after the call.

        Raises:
            RequestNotFound: no such request.
        """
        s = self.settings
        state = self._run(
            "cancel", [], [self.keys.prefix, request_id, s.result_ttl_s, s.events_maxlen]
        )
        if not state:
            raise RequestNotFound(request_id)
        return str(state)

    # --- dispatcher side ------------------------------------------------------

    def assign(
        self, worker_id: str, batch_id: str, items: Sequence[tuple[str, str, float]]
    ) -> list[tuple[str, int]]:
        """Claim ``items`` = [(request id, queue key, need MiB)] for a worker, atomically.

        Returns the (request id, attempt) pairs actually claimed (others were taken,
        cancelled or expired meanwhile). Nothing is claimed for a worker that is not
        live and ready.
        """
        argv: list[Any] = [
            self.keys.prefix,
            worker_id,
            batch_id,
            round(self.settings.lease_s * 1000),
            self.settings.events_maxlen,
        ]
        for rid, queue_key, need in items:
            argv += [rid, queue_key, f"{need:.3f}"]
        keys = [
            self.keys.worker(worker_id),
            self.keys.load(worker_id),
            self.keys.inflight(worker_id),
            self.keys.drain(worker_id),
        ]
        flat = self._run("assign", keys, argv)
        return [(flat[i], int(flat[i + 1])) for i in range(0, len(flat), 2)]

    def expire_due(self, limit: int = 1000) -> list[tuple[str, float]]:
        """Expire queued/assigned requests past their deadline.

        Returns (request id, seconds waited) for each expired now.
        """
        s = self.settings
        flat = self._run(
            "expire", [], [self.keys.prefix, s.result_ttl_s, s.events_maxlen, limit, "due"]
        )
        return [(flat[i], int(flat[i + 1]) / 1000) for i in range(0, len(flat), 2)]

    def expire_ids(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, float]]:
        """Expire the given (request id, reason) now (e.g. cannot finish in time)."""
        if not pairs:
            return []
        s = self.settings
        argv: list[Any] = [self.keys.prefix, s.result_ttl_s, s.events_maxlen, len(pairs), "ids"]
        for rid, reason in pairs:
            argv += [rid, reason]
        flat = self._run("expire", [], argv)
        return [(flat[i], int(flat[i + 1]) / 1000) for i in range(0, len(flat), 2)]

    def reap_leases(self, limit: int = 1000) -> list[tuple[str, str]]:
        """Requeue requests whose lease lapsed; returns (id, verdict) pairs."""
        s = self.settings
        flat = self._run(
            "reap_leases",
            [],
            [self.keys.prefix, s.max_attempts, s.result_ttl_s, s.events_maxlen, limit],
        )
        return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]

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
        s = self.settings
        k = self.keys
        keys = [k.worker(worker_id), k.inflight(worker_id), k.load(worker_id), k.drain(worker_id)]
        argv = [
            k.prefix,
            worker_id,
            round(stale_before * 1000),
            "1" if dead else "0",
            "1" if dead else "0",
            s.max_attempts,
            s.result_ttl_s,
            s.events_maxlen,
            reason,
            "worker_lost" if dead else "worker_left",
        ]
        out = self._run("remove_worker", keys, argv)
        if not int(out[0]):
            return None
        return [str(x) for x in out[1:]]

    # --- worker side ----------------------------------------------------------

    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> tuple[bool, bool]:
        """Publish a heartbeat and extend the worker's leases.

        Returns:
            (joined, drain_requested): joined is true on the first beat (or after
            the hash expired); drain_requested when ``inferq drain`` asked it to drain.
        """
        k = self.keys
        argv: list[Any] = [
            k.prefix,
            info.id,
            round(ttl_s * 1000),
            round(self.settings.lease_s * 1000),
            self.settings.events_maxlen,
        ]
        for name, value in info.to_fields().items():
            argv += [name, value]
        keys = [k.worker(info.id), k.inflight(info.id), k.drain(info.id)]
        joined, drain, _now = self._run("heartbeat", keys, argv)
        return bool(joined), bool(drain)

    def start(self, worker_id: str, pairs: Sequence[tuple[str, int]]) -> list[str]:
        """Mark (request id, attempt) pairs running; returns 'run'/'stale'/'expired' each."""
        s = self.settings
        argv: list[Any] = [
            self.keys.prefix,
            worker_id,
            round(s.lease_s * 1000),
            s.result_ttl_s,
            s.events_maxlen,
        ]
        for rid, attempt in pairs:
            argv += [rid, attempt]
        return [str(v) for v in self._run("start", [self.keys.worker(worker_id)], argv)]

    def complete(self, worker_id: str, outcomes: Sequence[Outcome]) -> list[str]:
        """Record final results, fenced by attempt; returns 'ok' or 'stale' per outcome."""
        s = self.settings
        argv: list[Any] = [self.keys.prefix, worker_id, s.result_ttl_s, s.events_maxlen]
        for o in outcomes:
            first = "" if o.first_token_at is None else str(round(o.first_token_at * 1000))
            argv += [
                o.request_id,
                o.attempt,
                o.status,
                o.output,
                o.prompt_tokens,
                o.completion_tokens,
                first,
                o.error,
            ]
        return [str(v) for v in self._run("complete", [], argv)]

    def requeue(
        self,
        items: Sequence[tuple[str, int | None, str, str]],
        *,
        penalize: bool = True,
    ) -> list[str]:
        """Send (request id, attempt or None, worker or '', error) back to their queues.

        ``penalize`` counts the attempt towards ``max_attempts`` (a backend error);
        a drain hand-back passes False. Returns 'queued'/'expired'/'dead'/'stale' each.
        """
        s = self.settings
        argv: list[Any] = [
            self.keys.prefix,
            s.max_attempts,
            s.result_ttl_s,
            s.events_maxlen,
            "1" if penalize else "0",
        ]
        for rid, attempt, worker, error in items:
            argv += [rid, "" if attempt is None else attempt, worker, error]
        return [str(v) for v in self._run("requeue", [], argv)]

    def request_drain(self, worker_id: str) -> bool:
        """Ask a worker to drain (it sees the flag on its next heartbeat).

        Returns False when no live worker has this id.
        """
        if not self.redis.exists(self.keys.worker(worker_id)):
            return False
        self.redis.set(self.keys.drain(worker_id), "1", ex=24 * 3600)
        return True

    # --- dispatcher snapshot -------------------------------------------------

    def dispatch_view(
        self, classes: Sequence[str], head: int, heartbeat_ttl_s: float
    ) -> DispatchView:
        """Read everything one dispatch decision needs, in at most three pipelined round trips.

        Args:
            classes: configured priority classes (queues of other classes are skipped).
            head: requests read from the head of each queue.
            heartbeat_ttl_s: a worker whose last beat is older is reported stale.
        """
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.smembers(k.queues)
        pipe.zrange(k.workers, 0, -1, withscores=True)
        pipe.hgetall(k.counts)
        pipe.hgetall(k.fair_classes)
        pipe.hgetall(k.estimates)
        for c in classes:
            pipe.hgetall(k.fair_tenants(c))
            pipe.smembers(k.fair_active(c))
        (sec, usec), queues, beats, counts, credits, estimates, *fair = pipe.execute()
        now = float(sec) + float(usec) / 1e6
        queue_keys = sorted(
            k.queue(*q.split("|", 1)) for q in queues if q.split("|", 1)[0] in classes
        )
        workers = [wid for wid, _ in beats]
        stale = [wid for wid, ms in beats if from_ms(ms) < now - heartbeat_ttl_s]

        pipe = self.redis.pipeline(transaction=False)
        for qk in queue_keys:
            pipe.zrange(qk, 0, head - 1)
        for wid in workers:
            pipe.hmget(k.worker(wid), _WORKER_FIELDS)
            pipe.hmget(k.load(wid), ("slots", "mib"))
        replies = pipe.execute()
        heads, fleet = replies[: len(queue_keys)], replies[len(queue_keys) :]

        corrupt: list[tuple[str, str, list[tuple[str, str]]]] = []
        views: list[WorkerView] = []
        for i, wid in enumerate(workers):
            fields, load = fleet[2 * i], fleet[2 * i + 1]
            if all(v is None for v in fields):
                continue  # heartbeat expired (no field, not even its id); the reaper removes it
            try:
                views.append(_worker_view(wid, fields, load))
            except ValueError as exc:
                corrupt.append((k.worker(wid), f"heartbeat: {exc}", [(k.workers, wid)]))

        # Read the policy fields of only as many requests per queue as the free slots
        # could take, x4 and at least a few dozen (tenant fairness must still see
        # several tenants, and unschedulable work is reported even on a full fleet):
        # on a busy fleet a wake-up then costs ~100 reads instead of thousands.
        free = sum(w.free_slots for w in views if w.ready)
        window = min(head, max(SNAPSHOT_MIN_WINDOW, 4 * free))
        queue_of = {
            rid: qk for qk, ids in zip(queue_keys, heads, strict=True) for rid in ids[:window]
        }
        pipe = self.redis.pipeline(transaction=False)
        for rid in queue_of:
            pipe.hmget(k.req(rid), _POLICY_FIELDS)
        queued: dict[str, list[QueuedRequest]] = {c: [] for c in classes}
        for rid, values in zip(list(queue_of), pipe.execute(), strict=True):
            try:
                req = _queued_request(rid, values)
            except ValueError as exc:
                members = [(queue_of.pop(rid), rid), (k.deadlines, rid)]
                corrupt.append((k.req(rid), f"queued request: {exc}", members))
                continue
            queued[req.priority].append(req)
        for reqs in queued.values():
            reqs.sort(key=lambda r: (r.submitted_at, r.id))

        backlogged: dict[str, set[str]] = {c: set() for c in classes}
        for field, n in counts.items():
            if field.startswith("t:") and int(n) > 0:
                _, cls, tenant = field.split(":", 2)
                if cls in backlogged:
                    backlogged[cls].add(tenant)
        fairness = FairnessState(
            class_credit={c: float(v) for c, v in credits.items()},
            tenant_counter={
                c: {t: float(v) for t, v in fair[2 * i].items()} for i, c in enumerate(classes)
            },
            active_tenants={c: frozenset(fair[2 * i + 1]) for i, c in enumerate(classes)},
        )
        snapshot = Snapshot(
            now=now,
            queued=queued,
            workers=views,
            fairness=fairness,
            backlogged_tenants={c: frozenset(t) for c, t in backlogged.items()},
            output_estimates=_parse_estimates(estimates),
        )
        return DispatchView(snapshot, queue_of, corrupt, stale)

    def write_fairness(self, decision: Decision) -> None:
        """Store the fairness state a decision carries forward (one pipelined round trip).

        Credits and active sets are replaced; tenant floors set, then charges added.
        With several dispatchers the last writer wins the credits: a small drift in
        shares, never a correctness issue.
        """
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        if decision.class_credit:
            pipe.hset(
                k.fair_classes, mapping={c: repr(v) for c, v in decision.class_credit.items()}
            )
        for cls, floors in decision.tenant_counter_floor.items():
            if floors:
                pipe.hset(k.fair_tenants(cls), mapping={t: repr(v) for t, v in floors.items()})
        for cls, deltas in decision.tenant_counter_delta.items():
            for tenant, delta in deltas.items():
                pipe.hincrbyfloat(k.fair_tenants(cls), tenant, delta)
        for cls, tenants in decision.active_tenants.items():
            pipe.delete(k.fair_active(cls))
            if tenants:
                pipe.sadd(k.fair_active(cls), *sorted(tenants))
        pipe.execute()

    def mark_unschedulable(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        """Record why requests cannot be served; returns the ids newly marked.

        Each id is reported (field ``unschedulable`` + one event) only once.
        """
        if not pairs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid, reason in pairs:
            pipe.hsetnx(self.keys.req(rid), "unschedulable", reason)
        fresh = [rid for (rid, _), new in zip(pairs, pipe.execute(), strict=True) if new]
        if fresh:
            reasons = dict(pairs)
            pipe = self.redis.pipeline(transaction=False)
            for rid in fresh:
                pipe.xadd(
                    self.keys.events,
                    {"type": "unschedulable", "id": rid, "reason": reasons[rid]},
                    maxlen=self.settings.events_maxlen,
                    approximate=True,
                )
            pipe.execute()
        return fresh

    def update_estimates(
        self, observed: Sequence[tuple[str, str | None, int]], alpha: float
    ) -> None:
        """Fold generated-token counts (model, task_type, tokens) into the moving means.

        Read-modify-write without a lock: two workers racing lose one sample, which
        an estimate tolerates.
        """
        from inferq.policy.estimate import update_moving_mean

        if not observed:
            return
        fields = [f"{model}|{task or ''}" for model, task, _ in observed]
        old = dict(zip(fields, self.redis.hmget(self.keys.estimates, fields), strict=True))
        new: dict[str, float] = {}
        for field, (_, _, tokens) in zip(fields, observed, strict=True):
            prev = new.get(field, float(old[field]) if old[field] else None)
            new[field] = update_moving_mean(prev, tokens, alpha)
        self.redis.hset(self.keys.estimates, mapping={f: repr(v) for f, v in new.items()})

    # --- fleet and admin ------------------------------------------------------

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

    def quarantine(self, key: str, reason: str, members: Sequence[tuple[str, str]] = ()) -> None:
        """Move a corrupt record aside and remove (zset key, member) references to it."""
        argv: list[Any] = [self.keys.prefix, reason, self.settings.events_maxlen]
        for index_key, member in members:
            argv += [index_key, member]
        self._run("quarantine", [key], argv)
        log.warning("quarantined %s: %s", key, reason)

    def queue_depths(self) -> list[tuple[str, str, int, float | None]]:
        """(class, route, queued, oldest wait in seconds or None) for every queue."""
        names = sorted(n for n in self.redis.smembers(self.keys.queues) if "|" in n)
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for name in names:
            qk = self.keys.queue(*name.split("|", 1))
            pipe.zcard(qk)
            pipe.zrange(qk, 0, 0, withscores=True)
        (sec, usec), *replies = pipe.execute()
        now = float(sec) + float(usec) / 1e6
        out: list[tuple[str, str, int, float | None]] = []
        for i, name in enumerate(names):
            cls, route = name.split("|", 1)
            depth, head = int(replies[2 * i]), replies[2 * i + 1]
            oldest = max(0.0, now - from_ms(head[0][1])) if head else None
            out.append((cls, route, depth, oldest))
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

    def desired_workers(self) -> dict[str, int]:
        """The scaler's latest desired worker count per model."""
        return {m: int(n) for m, n in self.redis.hgetall(self.keys.scaler_desired).items()}

    # --- scaler side ----------------------------------------------------------

    def hold_scaler_lease(self, replica_id: str, ttl_s: float) -> bool:
        """Take or renew the acting scaler's lease for ``ttl_s`` seconds.

        Returns True when ``replica_id`` holds it now, False when another replica does.
        """
        ttl_ms = max(1, round(ttl_s * 1000))
        return bool(self._run("scaler_lease", [self.keys.scaler_lease], [replica_id, ttl_ms]))

    def release_scaler_lease(self, replica_id: str) -> bool:
        """Give the lease up if ``replica_id`` holds it (so another replica takes over at once)."""
        return bool(self._run("scaler_lease", [self.keys.scaler_lease], [replica_id, 0]))

    def scaler_hash(self, key: str) -> dict[str, str]:
        """One of the scaler's hashes (``keys.scaler_state``, ``keys.scaler_workers``).

        Raises:
            CorruptRecord: the key holds another type than a hash.
        """
        try:
            return dict(self.redis.hgetall(key))
        except redis.ResponseError as exc:
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

    def worker_reservations(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Slots reserved by assigned work (``load:<id>``), per worker; 0 when unreadable."""
        pipe = self.redis.pipeline(transaction=False)
        for wid in worker_ids:
            pipe.hget(self.keys.load(wid), "slots")
        out: dict[str, int] = {}
        for wid, raw in zip(worker_ids, pipe.execute(), strict=True):
            try:
                out[wid] = max(0, int(float(raw or 0)))
            except ValueError:
                out[wid] = 0
        return out

    def worker_registered(self, worker_id: str) -> bool:
        """True while the worker's heartbeat hash exists (it has not left or lapsed)."""
        return bool(self.redis.exists(self.keys.worker(worker_id)))

    def output_estimates(self) -> dict[tuple[str, str], float]:
        """Moving means of generated tokens: (model, task_type or '') -> tokens."""
        return _parse_estimates(self.redis.hgetall(self.keys.estimates))

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

    def quarantined(self) -> dict[str, str]:
        """Quarantined keys and why."""
        return dict(self.redis.hgetall(self.keys.quarantine))

    def dead_letters(self, limit: int = 100) -> list[str]:
        """Ids in the dead letter, oldest first."""
        return list(self.redis.zrange(self.keys.dead, 0, limit - 1))

    def requeue_dead(self, request_id: str) -> bool:
        """Requeue a dead-lettered request with a fresh attempt budget and deadline."""
        reply = self._run(
            "dead_requeue", [], [self.keys.prefix, request_id, self.settings.events_maxlen]
        )
        return bool(reply)

    def events(self, count: int = 100, after: str = "-") -> list[Event]:
        """Oldest-first events after stream id ``after`` ('-' = from the start of the cap)."""
        start = after if after == "-" else f"({after}"
        entries = self.redis.xrange(self.keys.events, min=start, count=count)
        return [_event(eid, fields) for eid, fields in entries]

    def recent_events(self, count: int = 20) -> list[Event]:
        """The newest ``count`` events, oldest first."""
        entries = self.redis.xrevrange(self.keys.events, count=count)
        return [_event(eid, fields) for eid, fields in reversed(entries)]

    def stats(self) -> dict[str, int]:
        """Lifetime counters: submitted, dispatched, succeeded, failed, expired, ..."""
        return {k: int(v) for k, v in self.redis.hgetall(self.keys.stats).items()}

    def queued_counts(self) -> dict[str, int]:
        """Raw queued counters (``c:<class>`` and ``t:<class>:<tenant>`` fields)."""
        return {k: int(v) for k, v in self.redis.hgetall(self.keys.counts).items()}

    def purge(self) -> int:
        """Delete every key of this namespace; returns how many. Irreversible."""
        deleted = 0
        batch: list[str] = []
        for key in self.redis.scan_iter(match=self.keys.pattern(), count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += int(self.redis.unlink(*batch))
                batch.clear()
        if batch:
            deleted += int(self.redis.unlink(*batch))
        return deleted


#: Requests per queue whose fields a snapshot reads at least, when any slot is free.
SNAPSHOT_MIN_WINDOW = 32

#: Fields of a request hash the dispatch policy needs (never the payload).
_POLICY_FIELDS = (
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
)


@dataclass(frozen=True, slots=True)
class DispatchView:
    """A policy snapshot plus what the dispatcher needs to act on it.

    Attributes:
        snapshot: the input of :func:`inferq.policy.dispatch.decide`.
        queue_of: request id -> the queue key it sits in (for the assign script).
        corrupt: (key, reason, [(index key, member)]) records to quarantine.
        stale_workers: ids in the workers index whose last beat is older than the TTL.
    """

    snapshot: Snapshot
    queue_of: dict[str, str]
    corrupt: list[tuple[str, str, list[tuple[str, str]]]]
    stale_workers: list[str]


#: Heartbeat fields the dispatch policy needs (read with HMGET, never the whole hash).
_WORKER_FIELDS = ("model", "params_b", "state", "slots", "kv_cache_mib", "id")


def _worker_view(
    wid: str, fields: Sequence[str | None], load: Sequence[str | None]
) -> WorkerView:
    """The policy's view of a worker from ``_WORKER_FIELDS`` and its load hash.

    A hand-rolled check rather than the pydantic model: it runs for every worker on
    every dispatcher step (500 workers: ~40 ms of validation saved per step).

    Raises:
        ValueError: a field is missing or out of range (the record is quarantined).
    """
    model, params_b, state, slots, kv, _ = fields
    if not model or state is None:
        raise ValueError("missing field 'model' or 'state'")
    view = WorkerView(
        id=wid,
        model=model,
        params_b=float(params_b or "nan"),
        ready=WorkerState(state) is WorkerState.READY,
        slots=int(slots or "0"),
        kv_cache_mib=float(kv or "nan"),
        reserved_slots=max(0, int(load[0] or 0)),
        reserved_mib=max(0.0, float(load[1] or 0.0)),
    )
    if not (view.params_b > 0 and 1 <= view.slots <= 4096 and 0 <= view.kv_cache_mib < 1e9):
        raise ValueError(
            f"params_b {params_b!r}, slots {slots!r} or kv_cache_mib {kv!r} out of range"
        )
    return view


def _queued_request(rid: str, values: list[str | None]) -> QueuedRequest:
    """Build the policy's view of a request from ``_POLICY_FIELDS`` values (raises ValueError)."""
    f = dict(zip(_POLICY_FIELDS, values, strict=True))
    missing = [name for name in _POLICY_FIELDS[:8] if not f[name] and name != "task_type"]
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
    )


def _event(eid: str, fields: dict[str, str]) -> Event:
    ms = int(eid.split("-", 1)[0])
    rest = {k: v for k, v in fields.items() if k != "type"}
    return Event(id=eid, type=fields.get("type", "?"), at=from_ms(ms), fields=rest)


def _parse_estimates(raw: dict[str, str]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for field, value in raw.items():
        model, _, task = field.partition("|")
        try:
            out[(model, task)] = float(value)
        except ValueError:
            continue
    return out


def dumps(value: Any) -> str:
    """Compact JSON (the only serialization inferq uses)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
