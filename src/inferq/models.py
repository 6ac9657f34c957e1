"""The data model, in one place: requests, results, workers, events.

Times are epoch seconds (float) in these models and integer milliseconds in
Redis sorted-set scores. Each model converts to and from the flat string hash
stored in Redis (``to_fields`` / ``from_fields``); a hash that does not parse
raises :class:`~inferq.errors.CorruptRecord`, so callers can quarantine it.
Nothing is ever pickled: payloads are JSON.
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferq.errors import CorruptRecord
from inferq.prefix import decode as decode_chain
from inferq.prefix import encode as encode_chain

TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$"
KEY_PATTERN = r"^[\x21-\x7e]{1,128}$"  # printable ASCII, no spaces
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
#: Worker ids may be host names or pod names (``node-1.example.com-4242``).
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class RequestState(StrEnum):
    """Request lifecycle: queued -> assigned -> running -> succeeded | failed.

    ``expired`` and ``cancelled`` are reachable from ``queued`` and ``assigned``;
    a retry goes back to ``queued`` (attempt + 1 at the next assignment).
    """

    QUEUED = "queued"
    ASSIGNED = "assigned"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        """True for the four states a request never leaves."""
        return self in FINAL_STATES


FINAL_STATES = frozenset(
    {RequestState.SUCCEEDED, RequestState.FAILED, RequestState.EXPIRED, RequestState.CANCELLED}
)


class WorkerState(StrEnum):
    """Worker lifecycle: starting (loading the model) -> ready -> draining -> gone.

    ``unhealthy``: ready, but its model server fails its probes (down, overloaded,
    answering errors); it is assigned nothing and returns to ``ready`` by itself when
    a probe passes (:mod:`inferq.workers.health`).
    """

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class FailureKind(StrEnum):
    """What failed, which decides how a request is retried (see :mod:`inferq.workers.failures`).

    ``infrastructure``: the model server could not be reached or was overloaded
    (connection refused or reset, 502/503/504, 429, a timeout before the first byte):
    retried without spending an attempt, bounded by the deadline. ``server``: the server
    failed on the request (500, other 5xx, 408, a malformed answer): retried up to
    ``max_attempts``. ``request``: the server rejected the request itself (other 4xx):
    fails at once. ``truncated``: the answer ended without a finish reason (a stream cut
    off before ``[DONE]``, a 200 with an empty body): retried up to ``max_attempts``.
    """

    INFRASTRUCTURE = "infrastructure"
    SERVER = "server"
    REQUEST = "request"
    TRUNCATED = "truncated"


class FunctionCall(BaseModel):
    """The function a model called: its name and its arguments as JSON text (OpenAI's
    ``tool_calls[].function``; the text is the model's and may not parse)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    """One tool call of an answer, or of an assistant message sent back (OpenAI's
    ``{"id", "type": "function", "function": {"name", "arguments"}}``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    """A piece of a tool call as a stream carries it (OpenAI's
    ``choices[].delta.tool_calls[]``): the call's ``index`` in the answer, its ``id`` and
    function ``name`` on its first piece, then pieces of the ``arguments`` text. The
    pieces of one index concatenate to the call (:func:`merge_tool_deltas`,
    :func:`tool_calls_of`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        """The piece in OpenAI's chunk shape."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


def merge_tool_deltas(
    first: tuple[ToolCallDelta, ...], then: tuple[ToolCallDelta, ...]
) -> tuple[ToolCallDelta, ...]:
    """``first`` followed by ``then`` as few pieces: a piece of the index the last piece
    has, and no id or name of its own, extends that piece's arguments."""
    out = list(first)
    for piece in then:
        last = out[-1] if out else None
        if (
            last is not None
            and last.index == piece.index
            and piece.id is None
            and piece.name is None
        ):
            out[-1] = last.model_copy(update={"arguments": last.arguments + piece.arguments})
        else:
            out.append(piece)
    return tuple(out)


def tool_calls_of(pieces: tuple[ToolCallDelta, ...]) -> tuple[ToolCall, ...]:
    """The whole tool calls the pieces of a stream add up to, by index (a call whose id
    or name never came gets ``call_<index>`` or an empty name)."""
    calls: dict[int, dict[str, str]] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = call["id"] or (piece.id or "")
        call["name"] = call["name"] or (piece.name or "")
        call["arguments"] += piece.arguments
    return tuple(
        ToolCall(
            id=call["id"] or f"call_{index}",
            function=FunctionCall(name=call["name"], arguments=call["arguments"]),
        )
        for index, call in sorted(calls.items())
    )


def tool_deltas_of(calls: tuple[ToolCall, ...]) -> tuple[ToolCallDelta, ...]:
    """Whole tool calls as one piece each (a stream's reset chunk, a model server that
    did not stream them)."""
    return tuple(
        ToolCallDelta(index=i, id=c.id, name=c.function.name, arguments=c.function.arguments)
        for i, c in enumerate(calls)
    )


def tool_calls_json(calls: tuple[ToolCall, ...] | tuple[ToolCallDelta, ...]) -> str:
    """Tool calls (or pieces) as the JSON text Redis stores (``""`` for none)."""
    if not calls:
        return ""
    return json.dumps([c.model_dump(mode="json", exclude_none=True) for c in calls])


def parse_tool_calls(text: str | None) -> tuple[ToolCall, ...]:
    """:func:`tool_calls_json`'s text back (``""`` or None: none).

    Raises:
        ValueError: the text is not such JSON (pydantic's ValidationError is one).
    """
    if not text:
        return ()
    return tuple(ToolCall.model_validate(c) for c in json.loads(text))


def parse_tool_deltas(text: str | None) -> tuple[ToolCallDelta, ...]:
    """The pieces of :func:`tool_calls_json` back (``""`` or None: none).

    Raises:
        ValueError: the text is not such JSON.
    """
    if not text:
        return ()
    return tuple(ToolCallDelta.model_validate(c) for c in json.loads(text))


class ChatMessage(BaseModel):
    """One chat message (OpenAI chat format).

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool``.
        content: its text (empty for an assistant message that only calls tools).
        tool_calls: an assistant message's calls, as the model made them (sent back
            with the tools' answers in a conversation); None otherwise.
        tool_call_id: a ``tool`` message's answer to that call; None otherwise.
        name: the name OpenAI's API lets a message carry; None when not given.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(strict=True)  # bytes are refused, not decoded (the prompt's rule)
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Payload(BaseModel):
    """What to generate from: a prompt or chat messages, plus generation parameters.

    Exactly one of ``prompt`` and ``messages`` is set. ``params`` holds the
    model server's sampling parameters (temperature, top_p, stop, seed, ...) as JSON.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_input(self) -> Payload:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def text(self) -> str:
        """All input text, concatenated (for size limits): the prompt, or the messages'
        contents and the names and arguments of their tool calls."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        calls = [
            c.function.name + c.function.arguments
            for m in self.messages
            for c in m.tool_calls or ()
        ]
        return "\n".join([*(m.content for m in self.messages), *calls])


class InferenceRequest(BaseModel):
    """A request as submitted: immutable once in Redis except ``attempts`` and ``caller``.

    Attributes:
        id: unique id (hex), generated by the client.
        model: the route: a model name or a size requirement (``>=13b``).
        priority: the priority class name.
        tenant: who is charged for fairness and queue limits.
        task_type: free-form kind (``chat``, ``code``...), feeds the classifier.
        payload: prompt or messages plus generation parameters.
        max_tokens: output tokens at most.
        prompt_tokens: estimated prompt tokens (scheduling estimate).
        timeout_s: seconds from submit to deadline.
        deadline: epoch seconds after which the request expires.
        idempotency_key: a resubmission of the same request with the same key
            returns the first id while its record lives (see ``fingerprint``).
        submitted_at: epoch seconds.
        attempts: deliveries so far (the fencing number of the latest one).
        stream: the worker publishes the output as it is generated, chunk by chunk, to
            the request's Redis stream (``handle.stream()``, the gateway's SSE).
        caller: the id of the gateway process that submitted it and relays its answer
            (None: any other submitter, whose requests are tied to no process). When
            that gateway's liveness lease lapses the request is cancelled (``P callers``,
            ``reap_callers.lua``). Unlike the other fields it can change in Redis: a
            resubmission of the idempotency key takes the request over (``submit.lua``),
            so a retry through another gateway is not cancelled with the first one.
        api_key: the id of the gateway API key it came with (the first 12 hex digits of
            the key's SHA-256, as ``inferq keys list`` shows it); None when submitted
            otherwise. Its usage is metered under it (``inferq usage --by key``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=ID_PATTERN)
    model: str = Field(min_length=1, max_length=64)
    priority: str = Field(min_length=1, max_length=64)
    tenant: str = Field(default="default", pattern=TENANT_PATTERN)
    task_type: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    payload: Payload
    max_tokens: int = Field(ge=1)
    prompt_tokens: int = Field(ge=0)
    timeout_s: float = Field(gt=0)
    deadline: float = Field(gt=0)
    idempotency_key: str | None = Field(default=None, pattern=KEY_PATTERN)
    submitted_at: float = Field(gt=0)
    attempts: int = Field(default=0, ge=0)
    stream: bool = False
    caller: str | None = Field(default=None, pattern=ID_PATTERN)
    api_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{12}$")
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = Field(default=0, ge=0)

    @property
    def route(self) -> str:
        """The route: stored (and given by the client) as ``model``."""
        return self.model

    def fingerprint(self) -> str:
        """What an idempotency key remembers of its request: SHA-256 hex of its work.

        The canonical JSON (sorted keys, no spaces) of the route, class, task type,
        payload (prompt or messages, generation parameters) and ``max_tokens``.
        Resubmitting a key with another fingerprint is refused, as payment APIs
        refuse a reused key with other parameters (Stripe's idempotent requests).
        The tenant is in the key's name; the deadline and timeout are left out, so
        a retry seconds later (a later deadline) still matches. ``stream`` and
        ``caller`` are left out too, on purpose: they say how the answer travels and
        who relays it, not what is computed, so a retry without streaming after a
        dropped stream is the same request (``result()`` gives its whole text) and a
        streaming retry of a plain one gets its whole text from ``stream()`` at the end.
        """
        work = {
            "model": self.model,
            "priority": self.priority,
            "task_type": self.task_type,
            "payload": self.payload.model_dump(mode="json", exclude_none=True),
            "max_tokens": self.max_tokens,
        }
        text = json.dumps(work, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()

    def to_fields(self) -> dict[str, str]:
        """Flat string hash for Redis (payload as JSON)."""
        fields = {
            "id": self.id,
            "model": self.model,
            "priority": self.priority,
            "tenant": self.tenant,
            "payload": self.payload.model_dump_json(exclude_none=True),
            "max_tokens": str(self.max_tokens),
            "prompt_tokens": str(self.prompt_tokens),
            "timeout_s": repr(self.timeout_s),
            "deadline_ms": str(to_ms(self.deadline)),
            "submitted_ms": str(to_ms(self.submitted_at)),
            "attempts": str(self.attempts),
        }
        if self.task_type is not None:
            fields["task_type"] = self.task_type
        if self.idempotency_key is not None:
            fields["idempotency_key"] = self.idempotency_key
        if self.stream:
            fields["stream"] = "1"
        if self.caller is not None:
            fields["caller"] = self.caller
        if self.api_key is not None:
            fields["api_key"] = self.api_key
        if self.prefix_hashes:
            fields["prefix"] = encode_chain(self.prefix_block_tokens, self.prefix_hashes)
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, str], key: str = "?") -> InferenceRequest:
        """Parse a request hash read from Redis.

        Raises:
            CorruptRecord: a field is missing or mistyped.
        """
        try:
            block_tokens, chain = decode_chain(fields.get("prefix", ""))
            return cls(
                id=fields["id"],
                model=fields["model"],
                priority=fields["priority"],
                tenant=fields["tenant"],
                task_type=fields.get("task_type"),
                payload=Payload.model_validate_json(fields["payload"]),
                max_tokens=int(fields["max_tokens"]),
                prompt_tokens=int(fields["prompt_tokens"]),
                timeout_s=float(fields["timeout_s"]),
                deadline=from_ms(int(fields["deadline_ms"])),
                idempotency_key=fields.get("idempotency_key"),
                submitted_at=from_ms(int(fields["submitted_ms"])),
                attempts=int(fields.get("attempts", "0")),
                stream=fields.get("stream") == "1",
                caller=fields.get("caller") or None,
                api_key=fields.get("api_key") or None,
                prefix_hashes=chain,
                prefix_block_tokens=block_tokens,
            )
        except KeyError as exc:
            raise CorruptRecord(key, f"missing field {exc.args[0]!r}") from None
        except (ValueError, ValidationError) as exc:
            raise CorruptRecord(key, _first_error(exc)) from None


class StreamChunk(BaseModel):
    """A piece of a running request's output, as :meth:`RequestHandle.stream` yields it.

    The worker publishes chunks to the request's Redis stream (``P stream:<id>``) while
    it generates. The rule a caller relies on: **the deltas since the last chunk with
    ``reset=True`` (or since the start) concatenate to the text of the current attempt**,
    and at the end to the final ``Result.output``. A chunk with ``reset=True`` voids
    every delta before it: the request was retried (a new ``attempt`` restarts the text
    from its beginning), or the reader fell behind the stream's cap or missed chunks,
    in which case the reset chunk carries the whole text at once.

    Attributes:
        id: the stream entry id (``<ms>-<n>``); pass it as ``after=`` to resume reading.
        attempt: the attempt (fencing number) that produced the chunk.
        seq: the chunk's position within its attempt, from 0.
        delta: the new text.
        tokens: output tokens of this attempt so far (the model server's chunks, one
            token each on llama.cpp and vLLM; estimated otherwise).
        finish_reason: on the last chunk of an attempt: ``stop`` or ``length`` (as the
            model server says); None before.
        first_token_at: on an attempt's first chunk: when the worker received the first
            token (epoch seconds, on Redis TIME); None on later chunks.
        reset: the deltas yielded before this one are void (see above).
        tool_calls: pieces of the tool calls the model makes, in the order they came
            (they follow the same rule as ``delta``: since the last reset, their pieces
            add up to the result's ``tool_calls``, :func:`tool_calls_of`); () when none.
    """

    model_config = ConfigDict(frozen=True)

    id: str
    attempt: int = Field(ge=0)
    seq: int = Field(ge=0)
    delta: str
    tokens: int = Field(ge=0)
    finish_reason: str | None = None
    first_token_at: float | None = None
    reset: bool = False
    tool_calls: tuple[ToolCallDelta, ...] = ()


class Timings(BaseModel):
    """Per-stage timestamps of one request (epoch seconds; None = not reached)."""

    model_config = ConfigDict(frozen=True)

    submitted_at: float
    dispatched_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds from submit to dispatch (the last dispatch, for a retried request)."""
        if self.dispatched_at is None:
            return None
        return max(0.0, self.dispatched_at - self.submitted_at)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: submit -> first output token, seconds."""
        if self.first_token_at is None:
            return None
        return max(0.0, self.first_token_at - self.submitted_at)

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: submit -> final result, seconds."""
        if self.finished_at is None:
            return None
        return max(0.0, self.finished_at - self.submitted_at)


ResultStatus = Literal["succeeded", "failed", "expired", "cancelled"]


class Result(BaseModel):
    """The one final result of a request.

    Attributes:
        status: ``succeeded``, ``failed``, ``expired`` or ``cancelled``.
        output: generated text when succeeded.
        prompt_tokens / completion_tokens: as counted by the model server.
        cached_tokens: of the prompt tokens, those the model server reported reusing from
            its prefix cache (0 when it does not say; OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``).
        worker: the worker that produced it (None if it never ran).
        attempt: the attempt (fencing number) that produced it.
        error: the reason for any status but ``succeeded``.
        finish_reason: why generation stopped, as the model server said (``stop``: the
            model ended or a stop sequence; ``length``: ``max_tokens`` reached); None
            when it did not say or the request did not succeed.
        rejection: on a ``failed`` result, the model server's own message when it refused
            the request as invalid (HTTP 400, 413, 422: a field inferq does not check):
            the caller's error, not a fault of the fleet (failed at once, never retried
            nor dead-lettered; the gateway answers 400 with it). None otherwise.
        tool_calls: the tool calls the model made (``finish_reason`` is then
            ``tool_calls``); () when none.
    """

    model_config = ConfigDict(frozen=True)

    request_id: str
    status: ResultStatus
    output: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    worker: str | None = None
    attempt: int = 0
    timings: Timings
    error: str | None = None
    finish_reason: str | None = None
    rejection: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the request succeeded."""
        return self.status == "succeeded"


class RequestRecord(BaseModel):
    """Everything Redis knows of a request: the submission, its state and result."""

    model_config = ConfigDict(frozen=True)

    request: InferenceRequest
    state: RequestState
    worker: str | None = None
    batch: str | None = None
    attempt: int = 0
    timings: Timings
    reason: str | None = None
    result: Result | None = None
    #: prompt tokens the prefix index forecast cached on ``worker`` at its last dispatch
    cached_forecast: int = 0

    @classmethod
    def from_fields(cls, fields: dict[str, str], key: str = "?") -> RequestRecord:
        """Parse a full request hash (submission + runtime fields).

        Raises:
            CorruptRecord: a field is missing or mistyped.
        """
        request = InferenceRequest.from_fields(fields, key)
        try:
            state = RequestState(fields.get("state", "queued"))
            timings = Timings(
                submitted_at=request.submitted_at,
                dispatched_at=_opt_ms(fields.get("dispatched_ms")),
                started_at=_opt_ms(fields.get("started_ms")),
                first_token_at=_opt_ms(fields.get("first_token_ms")),
                finished_at=_opt_ms(fields.get("finished_ms")),
            )
            attempt = int(fields.get("attempts", "0"))
            result = None
            if state.final:
                result = Result(
                    request_id=request.id,
                    status=state.value,
                    output=fields.get("output"),
                    prompt_tokens=_opt_int(fields.get("prompt_tokens_used")),
                    completion_tokens=_opt_int(fields.get("completion_tokens")),
                    cached_tokens=_opt_int(fields.get("cached_tokens")) or 0,
                    worker=fields.get("worker") or None,
                    attempt=attempt,
                    timings=timings,
                    error=fields.get("error") or None,
                    finish_reason=fields.get("finish_reason") or None,
                    rejection=fields.get("rejection") or None,
                    tool_calls=parse_tool_calls(fields.get("tool_calls")),
                )
            return cls(
                request=request,
                state=state,
                worker=fields.get("worker") or None,
                batch=fields.get("batch") or None,
                attempt=attempt,
                timings=timings,
                reason=fields.get("error") or fields.get("reason") or None,
                result=result,
                cached_forecast=int(fields.get("cached_fc") or 0),
            )
        except (ValueError, ValidationError) as exc:
            raise CorruptRecord(key, _first_error(exc)) from None


#: Largest count a model server's telemetry may report (:class:`ServerTelemetry`): 2**53,
#: the largest integer a float holds exactly.
MAX_TELEMETRY_COUNT = 2**53


class ServerTelemetry(BaseModel):
    """What a model server says of itself (its own slots, KV cache and queue); None: not said.

    Read by the worker on the heartbeat cadence (:mod:`inferq.workers.telemetry`):
    llama.cpp's ``/slots`` and ``/metrics``, vLLM's and TGI's Prometheus ``/metrics``.

    Attributes:
        slots: sequences the server runs at once (llama.cpp's slots).
        kv_tokens: tokens its KV cache holds at most (llama.cpp: the slots' ``n_ctx``
            summed; vLLM: ``num_gpu_blocks x block_size``; TGI: ``max_batch_total_tokens``).
        kv_used_tokens: tokens held by running sequences now.
        kv_usage: the share of the KV cache in use, 0..1, when the server reports a share
            rather than tokens (vLLM's ``kv_cache_usage_perc``).
        running / waiting: requests the server runs now, and queues inside itself.

    Counts are at most :data:`MAX_TELEMETRY_COUNT` (2**53, the largest integer a float
    holds exactly): a server that reports more is broken, and its figure must not reach
    float arithmetic (issue 13 attack: a ``/slots`` whose ``n_ctx`` was a 400-digit
    integer, valid JSON, overflowed the KV room in the heartbeat and killed the worker).

    Raises:
        pydantic.ValidationError: a count below 0 or above the bound, a share outside 0..1.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    slots: int | None = Field(default=None, ge=0, le=MAX_TELEMETRY_COUNT)
    kv_tokens: int | None = Field(default=None, ge=0, le=MAX_TELEMETRY_COUNT)
    kv_used_tokens: int | None = Field(default=None, ge=0, le=MAX_TELEMETRY_COUNT)
    kv_usage: float | None = Field(default=None, ge=0, le=1)
    running: int | None = Field(default=None, ge=0, le=MAX_TELEMETRY_COUNT)
    waiting: int | None = Field(default=None, ge=0, le=MAX_TELEMETRY_COUNT)

    @property
    def kv_free_fraction(self) -> float | None:
        """Share of the KV cache free, 0..1: from tokens when both are known, else
        ``1 - kv_usage``; None when the server says neither."""
        if self.kv_tokens and self.kv_used_tokens is not None:
            return max(0.0, 1.0 - self.kv_used_tokens / self.kv_tokens)
        if self.kv_usage is not None:
            return 1.0 - self.kv_usage
        return None

    @property
    def kv_free_tokens(self) -> int | None:
        """KV tokens free: ``kv_tokens - kv_used_tokens``, else ``kv_tokens x
        (1 - kv_usage)``; None when the total or both uses are unknown. A total of 0 is
        unknown too (a server that has not sized its cache yet, or a broken one): routing
        on it starved a healthy worker of all work (issue 13 attack)."""
        if not self.kv_tokens:
            return None
        if self.kv_used_tokens is not None:
            return max(0, self.kv_tokens - self.kv_used_tokens)
        if self.kv_usage is not None:
            return round(self.kv_tokens * (1.0 - self.kv_usage))
        return None


class WorkerInfo(BaseModel):
    """A worker's heartbeat: what it serves and how much room it has.

    Two kinds of figure sit side by side: the bookkeeping (what the registry and the
    reservations say) and the measured (NVML, the model server's telemetry), None when
    not measured. Routing takes the smaller KV room of the two
    (:attr:`inferq.policy.snapshot.WorkerView.free_mib`).

    Attributes:
        id: worker id; its private RQ queue is derived from it.
        host: hostname.
        model: the loaded model's registry name.
        params_b: the model's size, billions of parameters.
        vram_total_mib: the GPUs' memory, MiB (NVML, summed over ``gpu_index``, or
            ``--vram-mib``).
        vram_free_mib: booked: total minus the weights minus the KV reserved for
            assigned work, MiB.
        vram_measured_free_mib / vram_measured_used_mib: NVML's free and used memory of
            the GPUs at this beat, MiB (every process on them counted).
        kv_cache_mib: booked: VRAM the worker may fill with KV cache, MiB.
        kv_measured_free_mib: measured KV room for new work at this beat, MiB: the model
            server's own KV figure when it reports one, else (a model server inside the
            worker) NVML's free memory.
        server: the model server's own telemetry (all None when it reports none).
        slots: concurrent requests at most.
        in_flight: requests running now.
        state: ``starting``, ``ready``, ``unhealthy`` or ``draining``.
        health_reason: why the worker is ``unhealthy`` (the failed probe, or the refusal
            its server gave every request), ``""`` otherwise.
        last_heartbeat / started_at: epoch seconds.
        gpu_name / gpu_index: the cards, when known (CUDA indices; several for a
            tensor-parallel model server).
        gpu_uuids: their NVML UUIDs, when measured.
        labels: free-form ``key=value`` labels.
        prompt_tokens_total: prompt tokens of the requests it served (server's count).
        cached_tokens_total: of those, the tokens its model server reported reusing
            from its prefix cache (0 while the server reports nothing).
        forecast_tokens_total: of those, the tokens the dispatcher's prefix index
            forecast cached here (the approximate index against the server's count).
        beat_seq: the worker process's number for this heartbeat, counted from 1 as it
            builds them (0: not numbered). heartbeat.lua publishes nothing from a beat
            numbered lower than the one in Redis from the same process (``started_at``):
            two threads build beats, and the older one may arrive last.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=WORKER_ID_PATTERN)
    host: str = Field(default="localhost", max_length=255)
    model: str = Field(min_length=1, max_length=64)
    params_b: float = Field(gt=0)
    vram_total_mib: int = Field(ge=0)
    vram_free_mib: int = Field(ge=0)
    vram_measured_free_mib: int | None = Field(default=None, ge=0)
    vram_measured_used_mib: int | None = Field(default=None, ge=0)
    kv_cache_mib: int = Field(ge=0)
    kv_measured_free_mib: float | None = Field(default=None, ge=0)
    server: ServerTelemetry = Field(default_factory=ServerTelemetry)
    slots: int = Field(ge=1, le=4096)
    in_flight: int = Field(default=0, ge=0)
    state: WorkerState = WorkerState.STARTING
    last_heartbeat: float = Field(gt=0)
    started_at: float = Field(gt=0)
    gpu_name: str = ""
    gpu_index: tuple[int, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)
    prompt_tokens_total: int = Field(default=0, ge=0)
    cached_tokens_total: int = Field(default=0, ge=0)
    forecast_tokens_total: int = Field(default=0, ge=0)
    health_reason: str = Field(default="", max_length=500)
    beat_seq: int = Field(default=0, ge=0)

    @property
    def cached_tokens_capped(self) -> int:
        """``cached_tokens_total`` at most ``prompt_tokens_total``, tokens: a server
        reuses no more than the prompt, and the worker caps each report so
        (:class:`inferq.workers.runtime.Engine`); a heartbeat claiming more was
        not written by it and counts as a full hit, never above 100%."""
        return min(self.cached_tokens_total, self.prompt_tokens_total)

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens the model server reported reusing from its prefix cache over the
        prompt tokens it served, in ``[0, 1]``; None before any prompt token."""
        prompt = self.prompt_tokens_total
        return self.cached_tokens_capped / prompt if prompt else None

    def to_fields(self) -> dict[str, str]:
        """Flat string hash for Redis (an unmeasured figure is ``""``; the server's
        telemetry under ``server_<name>``)."""
        fields = {
            "id": self.id,
            "host": self.host,
            "model": self.model,
            "params_b": repr(self.params_b),
            "vram_total_mib": str(self.vram_total_mib),
            "vram_free_mib": str(self.vram_free_mib),
            "vram_measured_free_mib": _opt_str(self.vram_measured_free_mib),
            "vram_measured_used_mib": _opt_str(self.vram_measured_used_mib),
            "kv_cache_mib": str(self.kv_cache_mib),
            "kv_measured_free_mib": _opt_str(self.kv_measured_free_mib),
            "slots": str(self.slots),
            "in_flight": str(self.in_flight),
            "state": self.state.value,
            "last_heartbeat_ms": str(to_ms(self.last_heartbeat)),
            "started_ms": str(to_ms(self.started_at)),
            "gpu_name": self.gpu_name,
            "gpu_index": ",".join(map(str, self.gpu_index)),
            "gpu_uuids": ",".join(self.gpu_uuids),
            "labels": json.dumps(self.labels, sort_keys=True),
            "prompt_tokens_total": str(self.prompt_tokens_total),
            "cached_tokens_total": str(self.cached_tokens_total),
            "forecast_tokens_total": str(self.forecast_tokens_total),
            "health_reason": self.health_reason,
            "beat_seq": str(self.beat_seq),
        }
        for name, value in self.server:
            fields[f"server_{name}"] = _opt_str(value)
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, str], key: str = "?") -> WorkerInfo:
        """Parse a heartbeat hash.

        Raises:
            CorruptRecord: a field is missing or mistyped (e.g. nonsense VRAM).
        """
        try:
            server = {
                name: fields.get(f"server_{name}") or None for name in ServerTelemetry.model_fields
            }
            return cls(
                id=fields["id"],
                host=fields.get("host", "localhost"),
                model=fields["model"],
                params_b=float(fields["params_b"]),
                vram_total_mib=int(fields["vram_total_mib"]),
                vram_free_mib=int(fields["vram_free_mib"]),
                vram_measured_free_mib=_opt_int(fields.get("vram_measured_free_mib")),
                vram_measured_used_mib=_opt_int(fields.get("vram_measured_used_mib")),
                kv_cache_mib=int(fields["kv_cache_mib"]),
                kv_measured_free_mib=_opt_float(fields.get("kv_measured_free_mib")),
                server=ServerTelemetry.model_validate(server),
                slots=int(fields["slots"]),
                in_flight=int(fields.get("in_flight", "0")),
                state=WorkerState(fields["state"]),
                last_heartbeat=from_ms(int(fields["last_heartbeat_ms"])),
                started_at=from_ms(int(fields["started_ms"])),
                gpu_name=fields.get("gpu_name", ""),
                gpu_index=tuple(int(i) for i in _csv(fields.get("gpu_index"))),
                gpu_uuids=tuple(_csv(fields.get("gpu_uuids"))),
                labels=json.loads(fields.get("labels") or "{}"),
                prompt_tokens_total=int(fields.get("prompt_tokens_total") or 0),
                cached_tokens_total=int(fields.get("cached_tokens_total") or 0),
                forecast_tokens_total=int(fields.get("forecast_tokens_total") or 0),
                health_reason=fields.get("health_reason", ""),
                beat_seq=int(fields.get("beat_seq") or 0),
            )
        except KeyError as exc:
            raise CorruptRecord(key, f"missing field {exc.args[0]!r}") from None
        except (ValueError, TypeError, ValidationError) as exc:
            raise CorruptRecord(key, _first_error(exc)) from None


#: Event fields that stay strings even when they look like numbers (names, ids).
_EVENT_TEXT_FIELDS = frozenset(
    {"id", "ids", "worker", "tenant", "model", "route", "class", "batch", "key", "reason", "error"}
)
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


class Event(BaseModel):
    """One entry of the events stream.

    Attributes:
        id: the stream entry's id (``<ms>-<seq>``); a request's id, when the event
            concerns one, is the field ``id``.
        type: ``submit``, ``dispatch``, ``finish``, ...
        at: epoch seconds of the entry.
        fields: the entry's fields as Redis holds them (strings).
    """

    model_config = ConfigDict(frozen=True)

    id: str
    type: str
    at: float
    fields: dict[str, str]

    def typed_fields(self) -> dict[str, str | int | float]:
        """The fields with numbers as numbers (names and ids stay strings): for JSON."""
        out: dict[str, str | int | float] = {}
        for key, value in self.fields.items():
            if key not in _EVENT_TEXT_FIELDS and _NUMBER.match(value):
                out[key] = float(value) if "." in value else int(value)
            else:
                out[key] = value
        return out


def to_ms(t: float) -> int:
    """Epoch seconds -> integer milliseconds (Redis scores)."""
    return round(t * 1000)


def from_ms(ms: int | float) -> float:
    """Integer milliseconds -> epoch seconds."""
    return ms / 1000.0


def _opt_ms(raw: str | None) -> float | None:
    return from_ms(int(raw)) if raw else None


def _opt_int(raw: str | None) -> int | None:
    return int(raw) if raw else None


def _opt_float(raw: str | None) -> float | None:
    return float(raw) if raw else None


def _opt_str(value: float | None) -> str:
    return "" if value is None else str(value)


def _csv(raw: str | None) -> list[str]:
    return [part for part in (raw or "").split(",") if part]


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "value"
        return f"{where}: {err['msg']}"
    return str(exc)
