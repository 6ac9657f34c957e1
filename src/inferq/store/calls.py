"""Each Lua script's arguments and reply, as pure functions shared by both stores.

For every script of ``lua/`` one builder returns its :class:`Call` (script name, KEYS,
ARGV) and one parser turns its reply into Python values; :class:`~inferq.store.Store`
and :class:`~inferq.store.AsyncStore` only run them, so the synchronous and the asyncio
side can never spell a script's arguments differently. The parsers of plain reads (a
request hash, an event, the output estimates) live here for the same reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from inferq import defaults
from inferq.config import Settings
from inferq.errors import BudgetExceeded, IdempotencyConflict, QueueFull, RequestNotFound
from inferq.models import (
    Event,
    InferenceRequest,
    RequestRecord,
    StreamChunk,
    ToolCall,
    ToolCallDelta,
    from_ms,
    parse_tool_deltas,
    to_ms,
    tool_calls_json,
)
from inferq.policy.fairness import vtc_cost
from inferq.store.keys import Keys


class Call(NamedTuple):
    """One script call: the script's name (``lua/<script>.lua``), KEYS and ARGV."""

    script: str
    keys: list[str]
    args: list[Any]


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
class Completion:
    """A finished request's result, as a worker hands it to :meth:`Store.complete`.

    Attributes:
        status: ``succeeded``, ``failed`` (not retryable), ``expired`` or ``cancelled``.
        first_token_at: epoch seconds of the first output token, when known.
        rejection: the model server's own message when it refused the request as
            invalid (``ServerError.rejection``), else empty.
        cached_tokens: of the prompt tokens, those the model server reported reusing
            from its prefix cache (0 when it does not say); metered as cached tokens.
        tool_calls: the tool calls the model made; () when none.
    """

    request_id: str
    attempt: int
    status: Literal["succeeded", "failed", "expired", "cancelled"]
    output: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    error: str = ""
    finish_reason: str | None = None
    rejection: str = ""
    cached_tokens: int = 0
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a running request's output, as a worker hands it to
    :meth:`Store.publish_chunks` (the reader's view is :class:`~inferq.models.StreamChunk`).

    Attributes:
        request_id / attempt: whose output; the attempt voids older attempts' chunks.
        seq: position within the attempt, from 0 (a reader detects a gap by it).
        delta: the new text.
        tokens: output tokens of this attempt so far.
        finish_reason: set on the attempt's last chunk.
        first_token_at: set on the attempt's first chunk (epoch seconds).
        ttl_s: the stream expires this many seconds from now unless the request's
            final write (``finalize``) sets its expiry first.
        tool_calls: pieces of the tool calls the model makes (() when none).
    """

    request_id: str
    attempt: int
    seq: int
    delta: str
    tokens: int
    finish_reason: str | None = None
    first_token_at: float | None = None
    ttl_s: int = 60
    tool_calls: tuple[ToolCallDelta, ...] = ()


def chunk_fields(chunk: Chunk) -> dict[str, str]:
    """The stream entry of ``chunk``: ``a`` attempt, ``s`` seq, ``d`` delta, ``n`` tokens,
    ``f`` finish reason, ``t`` first-token time in ms and ``c`` the tool-call pieces as
    JSON (:func:`~inferq.models.tool_calls_json`), each when set."""
    fields = {
        "a": str(chunk.attempt),
        "s": str(chunk.seq),
        "d": chunk.delta,
        "n": str(chunk.tokens),
    }
    if chunk.finish_reason:
        fields["f"] = chunk.finish_reason
    if chunk.first_token_at is not None:
        fields["t"] = str(to_ms(chunk.first_token_at))
    if chunk.tool_calls:
        fields["c"] = tool_calls_json(chunk.tool_calls)
    return fields


def queue_chunks(pipe: Any, keys: Keys, chunks: Sequence[Chunk]) -> None:
    """Queue on ``pipe`` (sync or asyncio) the writes of output chunks: each an XADD to
    its request's stream, capped at ``defaults.STREAM_MAXLEN`` entries (approximately),
    and an EXPIRE ``chunk.ttl_s`` from now (``finalize`` sets the result's TTL when it
    ends the stream)."""
    for chunk in chunks:
        key = keys.stream(chunk.request_id)
        pipe.xadd(key, chunk_fields(chunk), maxlen=defaults.STREAM_MAXLEN, approximate=True)
        pipe.expire(key, max(1, chunk.ttl_s))


def parse_xread(reply: Any) -> list[tuple[str, StreamChunk | str | None]]:
    """The entries of an XREAD reply on a request's stream (RESP2:
    ``[[key, [[id, fields], ...]]]``), in order, each parsed by :func:`parse_stream_entry`."""
    out: list[tuple[str, StreamChunk | str | None]] = []
    for _key, entries in reply or []:
        for eid, fields in entries:
            out.append((str(eid), parse_stream_entry(str(eid), dict(fields or {}))))
    return out


def parse_stream_entry(entry_id: str, fields: dict[str, str]) -> StreamChunk | str | None:
    """One entry of a request's stream: a :class:`StreamChunk`, the final state (str) of
    the ``end`` entry ``finalize`` appends, or None for an entry that does not parse
    (skipped by the reader; the final result still carries the whole text)."""
    if "end" in fields:
        return str(fields["end"])
    try:
        first = fields.get("t")
        return StreamChunk(
            id=entry_id,
            attempt=int(fields["a"]),
            seq=int(fields["s"]),
            delta=fields.get("d", ""),
            tokens=int(fields.get("n", "0")),
            finish_reason=fields.get("f") or None,
            first_token_at=from_ms(int(first)) if first else None,
            tool_calls=parse_tool_deltas(fields.get("c")),
        )
    except (KeyError, ValueError):
        return None


def parse_live_models(rows: Sequence[Sequence[str | None]]) -> dict[str, int]:
    """Models of live workers (``starting`` or ``ready``) with their counts, from each
    worker hash's ``HMGET model state``."""
    out: dict[str, int] = {}
    for model, state in rows:
        if model and state in ("starting", "ready"):
            out[model] = out.get(model, 0) + 1
    return out


def _pairs(flat: Sequence[Any]) -> list[tuple[Any, Any]]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


# --- submit ---------------------------------------------------------------------------


def budget_entries(settings: Settings, request: InferenceRequest) -> str:
    """The ``budgets`` argument of ``submit.lua``: one entry per budget of the request's
    tenant or API key (``includes/budget.lua``), '' when none applies. The estimate is
    prompt (as estimated) + ``max_tokens`` tokens, priced for a ``usd`` budget."""
    out = []
    for name, b in sorted(settings.budgets.items()):
        if not (b.tenant == request.tenant or (b.key is not None and b.key == request.api_key)):
            continue
        if b.unit == "tokens":
            rates = (1.0, 1.0, 0.0)
        else:
            price = settings.prices.get(request.model)
            rates = (
                ((price.prompt_per_1m_usd or 0.0) / 1e6, (price.completion_per_1m_usd or 0.0) / 1e6,
                 (price.gpu_hour_usd or 0.0) / 3.6e6)
                if price is not None
                else (0.0, 0.0, 0.0)
            )  # fmt: skip
        est = request.prompt_tokens * rates[0] + request.max_tokens * rates[1]
        soft = "" if b.soft is None else repr(b.soft)
        fields = [name, b.period, b.unit, repr(b.limit), soft, repr(est), *map(repr, rates)]
        out.append(",".join(fields))
    return " ".join(out)


def submit_call(
    keys: Keys, settings: Settings, request: InferenceRequest, explicit_deadline: bool
) -> Call:
    """``submit.lua`` for one validated request (``explicit_deadline``: the caller gave
    ``deadline``, so it is stored as is instead of Redis time + timeout)."""
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
        request.route,
        request.tenant,
        cls.queue_limit,
        cls.tenant_queue_limit,
        round(request.timeout_s * 1000),
        round(request.deadline * 1000) if explicit_deadline else "",
        settings.idempotency_ttl_s,
        settings.events_maxlen,
        request.fingerprint() if request.idempotency_key else "",
    ]
    for name, value in fields.items():
        argv += [name, value]
    held = budget_entries(settings, request)
    if held:
        argv += ["budgets", held]
    # a newcomer's finish tag (includes/counts.lua): its VTC charge at max_tokens
    argv += [
        "fair_size",
        vtc_cost(request.prompt_tokens, request.max_tokens, defaults.VTC_OUTPUT_WEIGHT),
    ]
    keys_ = [
        keys.req(request.id),
        keys.tenant_queue(request.priority, request.route, request.tenant),
        *idem,
    ]
    return Call("submit", keys_, argv)


def parse_submit(reply: Sequence[str], request: InferenceRequest) -> Submitted:
    """:class:`Submitted` from ``submit.lua``'s reply.

    Raises:
        QueueFull: the class or tenant limit refused the request.
        IdempotencyConflict: the idempotency key already names a request with other
            fields (nothing written).
    """
    kind = reply[0]
    if kind == "ok":
        return Submitted(reply[1], False, from_ms(int(reply[2])), from_ms(int(reply[3])))
    if kind == "dup":
        return Submitted(reply[1], duplicate=True)
    if kind == "conflict":
        assert request.idempotency_key is not None
        raise IdempotencyConflict(request.idempotency_key, request.tenant, reply[1])
    if kind == "budget":
        name, limit, resets_ms, used, period, unit = reply[1:7]
        raise BudgetExceeded(
            request.priority,
            request.tenant,
            str(name),
            float(limit),
            float(used),
            str(period),
            str(unit),
            int(resets_ms) / 1000,
        )
    tenant = request.tenant if reply[1] == "tenant" else None
    raise QueueFull(request.priority, tenant, int(reply[2]))


# --- dispatch ---------------------------------------------------------------------------


def assign_call(
    keys: Keys,
    settings: Settings,
    worker_id: str,
    batch_id: str,
    items: Sequence[tuple[str, str, float] | tuple[str, str, float, int]],
) -> Call:
    """``assign.lua``: claim ``items`` = [(request id, its tenant sub-queue key, need MiB[,
    prompt tokens the prefix index forecast cached on the worker])] for a worker."""
    argv: list[Any] = [
        keys.prefix,
        worker_id,
        batch_id,
        round(settings.lease_s * 1000),
        settings.events_maxlen,
        defaults.PREFIX_STREAM_MAXLEN,
    ]
    for rid, queue_key, need, *cached in items:
        argv += [rid, queue_key, f"{need:.3f}", int(cached[0]) if cached else 0]
    worker_keys = [
        keys.worker(worker_id),
        keys.load(worker_id),
        keys.inflight(worker_id),
        keys.drain(worker_id),
    ]
    return Call("assign", worker_keys, argv)


def drain_call(keys: Keys, worker_id: str, ttl_s: float) -> Call:
    """``drain.lua``: ask a live worker to drain; the flag lives ``ttl_s`` seconds."""
    return Call(
        "drain",
        [keys.worker(worker_id), keys.drain(worker_id)],
        [keys.prefix, worker_id, round(ttl_s * 1000)],
    )


def parse_drain(reply: Any) -> bool:
    """True when a live worker was asked to drain, False when none has the id."""
    return bool(reply)


def parse_assign(reply: Sequence[Any]) -> list[tuple[str, int]]:
    """(request id, attempt) of each request claimed."""
    return [(str(rid), int(attempt)) for rid, attempt in _pairs(reply)]


def note_fresh_ms(settings: Settings) -> int:
    """How long a dispatcher's unschedulable note stays the reason of an expiry, ms: one
    heartbeat TTL (a dispatcher confirms it every step; past that, none may be running)."""
    return round(settings.heartbeat_interval_s * defaults.HEARTBEAT_TTL_INTERVALS * 1000)


def expire_due_call(keys: Keys, settings: Settings, limit: int) -> Call:
    """``expire.lua`` in ``due`` mode: every request of the deadlines index past its deadline."""
    s = settings
    argv = [keys.prefix, s.result_ttl_s, s.events_maxlen, limit, "due", note_fresh_ms(s)]
    return Call("expire", [], argv)


def expire_ids_call(keys: Keys, settings: Settings, pairs: Sequence[tuple[str, str]]) -> Call:
    """``expire.lua`` in ``ids`` mode: the given (request id, reason) now (a fresh
    unschedulable note of a queued request replaces the reason)."""
    s = settings
    argv: list[Any] = [
        keys.prefix,
        s.result_ttl_s,
        s.events_maxlen,
        len(pairs),
        "ids",
        note_fresh_ms(s),
    ]
    for rid, reason in pairs:
        argv += [rid, reason]
    return Call("expire", [], argv)


def note_unschedulable_call(
    keys: Keys, settings: Settings, pairs: Sequence[tuple[str, str]]
) -> Call:
    """``note_unschedulable.lua``: record (request id, reason) on queued requests."""
    argv: list[Any] = [keys.prefix, settings.events_maxlen]
    for rid, reason in pairs:
        argv += [rid, reason]
    return Call("note_unschedulable", [], argv)


def parse_note_unschedulable(reply: Sequence[Any]) -> list[str]:
    """Ids whose unschedulable reason is new or changed."""
    return [str(rid) for rid in reply]


def expire_waited_call(
    keys: Keys, settings: Settings, request_id: str, route: str, models: Sequence[str]
) -> Call:
    """``expire.lua`` in ``waited`` mode: a client that waited for ``request_id`` past
    its deadline expires it, with a reason that names a missing dispatcher only when no
    dispatcher beat (``dispatcher:beat``), else what kept it: ``models`` (those that may
    serve ``route``) with no ready worker, or all busy."""
    s = settings
    argv: list[Any] = [keys.prefix, s.result_ttl_s, s.events_maxlen, 1, "waited"]
    return Call("expire", [], [*argv, note_fresh_ms(s), request_id, route, *models])


def parse_expire(reply: Sequence[Any]) -> list[tuple[str, float]]:
    """(request id, seconds waited) of each request expired."""
    return [(str(rid), int(waited_ms) / 1000) for rid, waited_ms in _pairs(reply)]


def reap_leases_call(keys: Keys, settings: Settings, limit: int) -> Call:
    """``reap_leases.lua``: requeue up to ``limit`` requests whose lease lapsed."""
    s = settings
    return Call(
        "reap_leases", [], [keys.prefix, s.max_attempts, s.result_ttl_s, s.events_maxlen, limit]
    )


def parse_reap_leases(reply: Sequence[Any]) -> list[tuple[str, str]]:
    """(request id, verdict: queued/expired/dead/stale, or cancelled/preempted when an
    abort of the attempt was pending, see ``includes/requeue.lua``) of each lapsed lease."""
    return [(str(rid), str(verdict)) for rid, verdict in _pairs(reply)]


def remove_worker_call(
    keys: Keys, settings: Settings, worker_id: str, *, reason: str, dead: bool, stale_before: float
) -> Call:
    """``remove_worker.lua``: a lost worker (``dead``: penalised, only if still silent since
    ``stale_before``, epoch s) or one leaving after its drain."""
    s, k = settings, keys
    worker_keys = [
        k.worker(worker_id),
        k.inflight(worker_id),
        k.load(worker_id),
        k.drain(worker_id),
    ]
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
    return Call("remove_worker", worker_keys, argv)


def parse_remove_worker(reply: Sequence[Any]) -> list[str] | None:
    """The requeued request ids, or None when the worker turned out to be alive."""
    if not int(reply[0]):
        return None
    return [str(x) for x in reply[1:]]


# --- worker -----------------------------------------------------------------------------


class Beat(NamedTuple):
    """What a heartbeat tells its worker.

    Attributes:
        joined: the hash was absent: a first beat, or the worker had been declared dead.
        drain: ``inferq drain`` (or the scaler) asked it to drain.
        now_ms: Redis TIME when the beat was written, milliseconds since the epoch.
        lost: (request id, attempt) pairs the worker said it runs that are no longer its
            own under that attempt (requeued by the reaper, re-dispatched, or final).
        aborts: (request id, attempt, action, reason) of held attempts with an abort
            pending (``abort.lua`` marked them): delivered on every beat until the attempt
            ends, since the control channel's command may have been lost.
        refused: a process's first beat found the hash of another process of the same
            id and wrote nothing (two processes started under one id at once).
    """

    joined: bool
    drain: bool
    now_ms: int
    lost: list[tuple[str, int]]
    aborts: Sequence[tuple[str, int, str, str]] = ()
    refused: bool = False


def heartbeat_call(
    keys: Keys,
    settings: Settings,
    worker_id: str,
    fields: Mapping[str, str],
    ttl_s: float,
    held: Sequence[tuple[str, int]] = (),
) -> Call:
    """``heartbeat.lua``: publish ``fields`` (a :class:`WorkerInfo` hash) for ``ttl_s``
    seconds, extend the worker's leases, and check the ``held`` (request id, attempt) pairs."""
    argv: list[Any] = [
        keys.prefix,
        worker_id,
        round(ttl_s * 1000),
        round(settings.lease_s * 1000),
        settings.events_maxlen,
        len(held),
    ]
    for rid, attempt in held:
        argv += [rid, attempt]
    for name, value in fields.items():
        argv += [name, value]
    return Call(
        "heartbeat", [keys.worker(worker_id), keys.inflight(worker_id), keys.drain(worker_id)], argv
    )


def parse_heartbeat(reply: Sequence[Any]) -> Beat:
    """The :class:`Beat` of a ``heartbeat.lua`` reply."""
    joined, drain, now, n_lost = reply[:4]
    end = 4 + 2 * int(n_lost)
    pairs = reply[4:end]
    lost = [(str(pairs[i]), int(pairs[i + 1])) for i in range(0, len(pairs) - 1, 2)]
    rest = reply[end:]
    aborts = [
        (str(rest[i]), int(rest[i + 1]), str(rest[i + 2]), str(rest[i + 3]))
        for i in range(0, len(rest) - 3, 4)
    ]
    refused = int(joined) == -1
    return Beat(int(joined) == 1, bool(drain), int(now), lost, aborts, refused)


def start_call(
    keys: Keys,
    settings: Settings,
    worker_id: str,
    pairs: Sequence[tuple[str, int]],
    token: str = "",
) -> Call:
    """``start.lua``: begin (request id, attempt) pairs on ``worker_id``; ``token`` names
    this call (a fresh id per start), so the same call resent after a lost reply runs them
    still, where a second start of the same attempts does not."""
    s = settings
    argv: list[Any] = [
        keys.prefix,
        worker_id,
        round(s.lease_s * 1000),
        s.result_ttl_s,
        s.events_maxlen,
        token,
    ]
    for rid, attempt in pairs:
        argv += [rid, attempt]
    return Call("start", [keys.worker(worker_id)], argv)


def parse_start(reply: Sequence[Any]) -> list[str]:
    """One verdict per pair: ``run``, ``stale`` or ``expired``."""
    return [str(v) for v in reply]


def complete_call(
    keys: Keys,
    settings: Settings,
    worker_id: str,
    completions: Sequence[Completion],
    model: str = "",
) -> Call:
    """``complete.lua``: record final results of ``worker_id``, fenced by attempt; ``model``
    is the model the worker serves, which the usage is metered under ('' = the script
    reads it from the worker's heartbeat)."""
    s = settings
    argv: list[Any] = [keys.prefix, worker_id, s.result_ttl_s, s.events_maxlen, model]
    for c in completions:
        first = "" if c.first_token_at is None else str(round(c.first_token_at * 1000))
        argv += [
            c.request_id,
            c.attempt,
            c.status,
            c.output,
            c.prompt_tokens,
            c.completion_tokens,
            first,
            c.error,
            c.finish_reason or "",
            c.rejection,
            c.cached_tokens,
            tool_calls_json(c.tool_calls),
        ]
    return Call("complete", [], argv)


def parse_complete(reply: Sequence[Any]) -> list[str]:
    """One verdict per result: ``ok`` or ``stale``."""
    return [str(v) for v in reply]


def requeue_call(
    keys: Keys,
    settings: Settings,
    items: Sequence[tuple[str, int | None, str, str]],
    *,
    penalize: bool,
    infra: bool = False,
    delay_s: float = 0.0,
    kind: str = "",
) -> Call:
    """``requeue.lua``: (request id, attempt or None, worker or '', error) back to their queues.

    ``infra`` (the model server's infrastructure failed) spends no attempt but counts a
    failure, whatever ``penalize`` says; ``delay_s`` holds them back that long (on Redis
    TIME) before they may be dispatched again; ``kind`` labels the retry events.
    """
    s = settings
    mode = "infra" if infra else ("1" if penalize else "0")
    argv: list[Any] = [
        keys.prefix,
        s.max_attempts,
        s.result_ttl_s,
        s.events_maxlen,
        mode,
        max(0, round(delay_s * 1000)),
        kind,
    ]
    for rid, attempt, worker, error in items:
        argv += [rid, "" if attempt is None else attempt, worker, error]
    return Call("requeue", [], argv)


def parse_requeue(reply: Sequence[Any]) -> list[str]:
    """One verdict per item: ``queued``, ``expired``, ``dead`` or ``stale``; ``cancelled``
    or ``preempted`` when an abort of that attempt was pending (it is carried out instead)."""
    return [str(v) for v in reply]


@dataclass(frozen=True, slots=True)
class Abort:
    """An abort of one (request, attempt) on the worker that holds it.

    Attributes:
        request_id / attempt / worker_id: what to abort; a newer attempt is untouched.
        action: ``requeue`` (a preemption: back to its queue at its original position,
            no attempt spent), ``cancel`` or ``expire`` (made final with ``reason``).
        reason: why, for the event and (cancel/expire) the result's error.
        charged: tokens its dispatch charged the tenant's counter (``prompt +
            output_weight x estimated output``, before the tenant's weight); a requeue
            gives back what the attempt did not use.
        tenant_weight: the tenant's fair-share weight: the counter lives in Redis as
            virtual time (tokens / weight), so the refund is divided by it too.
        orphan_of: the gateway whose lapsed lease this cancel is for (the dispatcher's
            reaper), or "" (none). With one, the abort acts only while that gateway
            still holds the request and its lease is still lapsed, else the verdict is
            ``kept`` (``includes/orphan.lua``: a same-key retry took it over meanwhile).
    """

    request_id: str
    attempt: int
    worker_id: str
    action: Literal["requeue", "cancel", "expire"]
    reason: str
    charged: float = 0.0
    tenant_weight: float = 1.0
    orphan_of: str = ""


#: Control-channel commands outlive a worker's silence by this factor of the lease, then
#: the list expires (a dead worker's channel is not kept; remove_worker deletes it too).
CONTROL_TTL_LEASES = 2


def abort_call(
    keys: Keys, settings: Settings, aborts: Sequence[Abort], output_weight: float
) -> Call:
    """``abort.lua``: stop assigned/running requests (not started: at once; running: a
    command on the worker's control channel). ``output_weight`` is the tenant counter's
    weight of an output token (the dispatch policy's ``vtc_output_weight``): a requeue
    gives back the charge beyond ``prompt + output_weight x generated``."""
    s = settings
    ttl_ms = round(s.lease_s * 1000 * CONTROL_TTL_LEASES)
    argv: list[Any] = [keys.prefix, s.result_ttl_s, s.events_maxlen, ttl_ms, repr(output_weight)]
    for a in aborts:
        argv += [
            a.request_id,
            a.attempt,
            a.worker_id,
            a.action,
            a.reason,
            repr(a.charged),
            repr(a.tenant_weight),
            a.orphan_of,
        ]
    return Call("abort", [], argv)


def running_abort(
    request_id: str, row: Sequence[Any], reason: str, orphan_of: str = ""
) -> Abort | None:
    """The cancel :class:`Abort` of a request from an HMGET of its ``state``, ``attempts``
    and ``worker``: None unless it is assigned or running on a worker. ``orphan_of``: see
    :class:`Abort`."""
    state, attempts, worker = row
    if state not in ("assigned", "running") or not worker or not attempts:
        return None
    return Abort(request_id, int(attempts), str(worker), "cancel", reason, orphan_of=orphan_of)


def parse_abort(reply: Sequence[Any]) -> list[str]:
    """One verdict per abort: ``done``, ``sent``, ``pending``, ``stale`` or ``kept``."""
    return [str(v) for v in reply]


def requeue_preempted_call(
    keys: Keys, settings: Settings, worker_id: str, items: Sequence[tuple[str, int, int]]
) -> Call:
    """``requeue_preempted.lua``: (request id, attempt, tokens generated) aborted for a
    preemption on ``worker_id`` go back to their queues."""
    s = settings
    argv: list[Any] = [keys.prefix, s.result_ttl_s, s.events_maxlen, worker_id]
    for rid, attempt, generated in items:
        argv += [rid, attempt, generated]
    return Call("requeue_preempted", [], argv)


def parse_requeue_preempted(reply: Sequence[Any]) -> list[str]:
    """One verdict per item: ``queued``, ``expired``, ``cancelled`` (a cancel took the
    preemption over while it was on its way) or ``stale``."""
    return [str(v) for v in reply]


def parse_control(raw: str) -> Abort | None:
    """A command read from a worker's control channel, or None when it does not parse
    (a worker never dies of a bad command: it is logged and dropped)."""
    try:
        data = json.loads(raw)
        action = str(data["action"])
        if action not in ("requeue", "cancel", "expire"):
            return None
        return Abort(
            request_id=str(data["id"]),
            attempt=int(data["attempt"]),
            worker_id="",
            action=action,  # type: ignore[arg-type]
            reason=str(data.get("reason", "")),
        )
    except (ValueError, KeyError, TypeError):
        return None


def promote_call(keys: Keys, limit: int) -> Call:
    """``promote.lua``: move up to ``limit`` due delayed retries back to their queues."""
    return Call("promote", [], [keys.prefix, limit])


def parse_promote(reply: Sequence[Any]) -> tuple[int, float | None]:
    """(requests promoted, seconds until the next delayed one is due or None when none)."""
    promoted, wait_ms = reply
    return int(promoted), (None if int(wait_ms) < 0 else int(wait_ms) / 1000)


# --- client and admin -------------------------------------------------------------------


def cancel_call(
    keys: Keys,
    settings: Settings,
    request_id: str,
    reason: str | None = None,
    orphan_of: str | None = None,
) -> Call:
    """``cancel.lua``: cancel a request that has not started; ``reason`` is its result's
    error (None: ``cancelled by the caller``). ``orphan_of``: the lapsed gateway the
    reaper cancels for; the cancel then acts only while that gateway still holds the
    request (``kept`` otherwise, see :class:`Abort`)."""
    s = settings
    args: list[Any] = [keys.prefix, request_id, s.result_ttl_s, s.events_maxlen]
    if orphan_of is not None:
        return Call("cancel", [], [*args, reason or "cancelled by the caller", orphan_of])
    return Call("cancel", [], args if reason is None else [*args, reason])


def parse_cancel(reply: Any, request_id: str) -> str:
    """The request's state after the call.

    Raises:
        RequestNotFound: no such request.
    """
    if not reply:
        raise RequestNotFound(request_id)
    return str(reply)


def dead_requeue_call(keys: Keys, settings: Settings, request_id: str) -> Call:
    """``dead_requeue.lua``: a dead-lettered request back to its queue."""
    return Call("dead_requeue", [], [keys.prefix, request_id, settings.events_maxlen])


def parse_dead_requeue(reply: Any) -> bool:
    """True when the request was in the dead letter and is queued again."""
    return bool(reply)


def dead_delete_call(
    keys: Keys, settings: Settings, request_ids: Sequence[str] | None, limit: int = 100
) -> Call:
    """``dead_delete.lua``: delete ``request_ids`` from the dead letter (records included),
    or with None those kept longer than ``settings.dead_letter_ttl_s`` (``limit`` at most)."""
    s = settings
    if request_ids is None:
        argv = [keys.prefix, s.events_maxlen, "due", s.dead_letter_ttl_s * 1000, limit]
        return Call("dead_delete", [], argv)
    return Call("dead_delete", [], [keys.prefix, s.events_maxlen, "ids", 0, 0, *request_ids])


def parse_dead_delete(reply: Sequence[Any]) -> list[str]:
    """The ids deleted."""
    return [str(rid) for rid in reply]


def quarantine_call(
    keys: Keys, settings: Settings, key: str, reason: str, members: Sequence[tuple[str, str]]
) -> Call:
    """``quarantine.lua``: move ``key`` aside, removing (zset key, member) references to it.

    A request hash goes aside with its payload key (the two keys of one record).
    """
    argv: list[Any] = [keys.prefix, reason, settings.events_maxlen]
    for index_key, member in members:
        argv += [index_key, member]
    request_id = keys.request_id_of(key)
    return Call(
        "quarantine", [key] if request_id is None else [key, keys.payload(request_id)], argv
    )


def parse_quarantine(reply: Any) -> None:
    """The script always answers 1: nothing to report."""


def forget_vanished_call(
    keys: Keys, settings: Settings, worker_id: str, request_ids: Sequence[str]
) -> Call:
    """``forget_vanished.lua``: take off ``worker_id`` the ``request_ids`` whose record is
    gone, and recount its reservation."""
    return Call(
        "forget_vanished",
        [keys.inflight(worker_id), keys.load(worker_id)],
        [keys.prefix, worker_id, settings.events_maxlen, *request_ids],
    )


def parse_forget_vanished(reply: Sequence[Any]) -> list[str]:
    """The ids forgotten."""
    return [str(rid) for rid in reply]


def fairness_call(
    keys: Keys,
    credits: Mapping[str, float | None],
    charges: Sequence[tuple[str, str, float]],
    *,
    idle_s: float,
    limit: int,
) -> Call:
    """``fairness.lua``: store SWRR credits and VTC charges, fold idle tenants.

    Args:
        credits: class -> SWRR credit (None = unchanged); every class named here is
            also checked for idle tenants.
        charges: (class, tenant, virtual-time charge = tokens / tenant weight).
        idle_s: a tenant neither backlogged nor served this long is folded.
        limit: idle tenants folded per class at most.
    """
    argv: list[Any] = [keys.prefix, round(idle_s * 1000), limit, len(credits)]
    for cls, credit in credits.items():
        argv += [cls, "" if credit is None else repr(credit)]
    for cls, tenant, charge in charges:
        argv += [cls, tenant, repr(charge)]
    return Call("fairness", [], argv)


def parse_fairness(reply: Any) -> int:
    """Idle tenants folded."""
    return int(reply)


def estimates_call(
    keys: Keys, means: Mapping[str, float], *, idle_s: float, cap: int, limit: int
) -> Call:
    """``estimates.lua``: write ``means`` (``<model>|<task>`` -> mean), drop stale entries."""
    argv: list[Any] = [keys.prefix, round(idle_s * 1000), cap, limit]
    for field_, mean in means.items():
        argv += [field_, repr(mean)]
    return Call("estimates", [], argv)


def parse_estimates_put(reply: Any) -> int:
    """Entries dropped."""
    return int(reply)


def lease_call(key: str, replica_id: str, ttl_s: float | None) -> Call:
    """``lease.lua``: take or renew the lease ``key`` (``keys.scaler_lease``,
    ``keys.metrics_lease``) for ``ttl_s`` s (at least 1 ms), or release it (``ttl_s`` None)."""
    ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
    return Call("lease", [key], [replica_id, ttl_ms])


def parse_lease(reply: Any) -> bool:
    """True when the replica holds (or released) the lease, False when another holds it."""
    return bool(reply)


def caller_lease_call(keys: Keys, caller_id: str, ttl_s: float) -> Call:
    """``caller_lease.lua``: renew gateway ``caller_id``'s liveness lease for ``ttl_s`` s
    (at least 1 ms)."""
    return Call("caller_lease", [keys.callers], [caller_id, max(1, round(ttl_s * 1000))])


def reap_callers_call(keys: Keys, limit: int) -> Call:
    """``reap_callers.lua``: the live requests of at most ``limit`` lapsed gateways."""
    return Call("reap_callers", [keys.callers], [keys.prefix, limit])


def parse_reap_callers(reply: Sequence[Any]) -> list[tuple[str, list[str]]]:
    """``[(caller id, [its live request ids])]`` from the script's flat list."""
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(reply):
        n = int(reply[i + 1])
        out.append((reply[i], list(reply[i + 2 : i + 2 + n])))
        i += 2 + n
    return out


# --- plain reads ------------------------------------------------------------------------


def parse_record(
    request_id: str, fields: dict[str, str], payload: str | None, keys: Keys
) -> RequestRecord:
    """A request hash and its payload key's value as a :class:`RequestRecord`.

    Raises:
        RequestNotFound: the hash is empty (never submitted, or its result expired).
        CorruptRecord: the hash does not parse, or the payload is missing.
    """
    if not fields:
        raise RequestNotFound(request_id)
    if payload is not None:
        fields = {**fields, "payload": payload}
    return RequestRecord.from_fields(fields, keys.req(request_id))


def parse_event(eid: str, fields: dict[str, str]) -> Event:
    """An events stream entry (its id's milliseconds are its time)."""
    ms = int(eid.split("-", 1)[0])
    rest = {k: v for k, v in fields.items() if k != "type"}
    return Event(id=eid, type=fields.get("type", "?"), at=from_ms(ms), fields=rest)


def parse_estimates(raw: dict[str, str]) -> dict[tuple[str, str], float]:
    """The ``estimates`` hash: (model, task_type or '') -> mean output tokens (bad ones skipped)."""
    out: dict[tuple[str, str], float] = {}
    for field, value in raw.items():
        model, _, task = field.partition("|")
        try:
            out[(model, task)] = float(value)
        except ValueError:
            continue
    return out
