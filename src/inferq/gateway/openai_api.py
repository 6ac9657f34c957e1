"""The OpenAI HTTP API's shapes, mapped onto inferq: request bodies in, response bodies out.

Pure functions of their arguments (no clock but the ``created`` stamp passed in, no I/O):
the gateway application calls them. The shapes follow OpenAI's API reference for
``POST /v1/chat/completions`` and ``POST /v1/completions`` (``choices``, ``usage``,
``finish_reason``, ``stream_options.include_usage``, ``chat.completion.chunk``) and its
error body ``{"error": {"message", "type", "param", "code"}}``.

Mapping (also in the README, "Use it from any language"):

- ``model``: the inferq route (a registry model name or ``>=13b``).
- ``max_tokens`` / ``max_completion_tokens``: the request's ``max_tokens``.
- priority: the ``X-Inferq-Priority`` header or a ``priority`` body field (an extension;
  the OpenAI SDKs send it with ``extra_body``); default: the API key's default class.
- deadline: the ``X-Inferq-Timeout`` header (seconds) or a ``timeout`` body field.
- ``user``: kept in the request's parameters (recorded, forwarded to the model server),
  and, unless the ``X-Inferq-Session`` header gives one, the request's session hint for
  prefix-cache affinity (hashed with the tenant: :func:`session_hint`).
- sampling fields (``temperature``, ``top_p``, ``stop``, ``seed``, penalties, ...):
  forwarded to the model server as parameters (OpenAI's numeric ones, ``seed``, ``stop``
  and ``logit_bias`` checked for type first, the numbers for OpenAI's ranges:
  temperature 0..2, top_p 0..1, penalties -2..2). ``logprobs``, the legacy
  ``functions`` / ``function_call`` and the other fields in :data:`_REFUSED` are refused
  (400 naming the field).
- ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``: forwarded to
  the model server as parameters, checked first for OpenAI's shapes and a size bound
  (:mod:`inferq.tools`, by intake). Chat messages may carry an assistant's
  ``tool_calls`` and a ``tool`` message's ``tool_call_id``. An answer's tool calls come
  back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``, or streamed as
  ``delta.tool_calls`` pieces (OpenAI's chunk shape).
- ``n``: 1..:data:`MAX_CHOICES` choices, served by the gateway as ``n`` requests
  (:class:`Submission`, ``n``); the response's ``usage`` sums them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from inferq.errors import InvalidRequest, MissingParameter, UnsupportedParameter
from inferq.models import Result, ToolCallDelta

Endpoint = Literal["chat", "completions"]

#: Header naming the priority class (or level) of a request.
PRIORITY_HEADER = "X-Inferq-Priority"
#: Header giving the request's timeout in seconds (OpenAI bodies have no such field).
TIMEOUT_HEADER = "X-Inferq-Timeout"
#: A session/affinity hint (issue 22): requests with the same value (per tenant) prefer
#: the worker holding their prefix cache; without it the OpenAI ``user`` field serves.
SESSION_HEADER = "X-Inferq-Session"
#: A number in a header: ASCII digits, optionally a dot and more digits (``30``, ``2.5``).
#: Python's ``float()``/``int()`` also take ``1_0``, ``1e1``, ``inf``, ``nan``, signs,
#: spaces and non-ASCII digits, none of which an HTTP client means as a plain number.
PLAIN_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")
#: A list index in a dotted field path (``messages.1.content``).
_INDEX = re.compile(r"\.([0-9]+)(?=\.|$)")
#: Body fields the gateway reads itself; every other known field is a sampling parameter.
_HANDLED = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "user",
        "priority",
        "timeout",
        "n",
    }
)
#: Most choices (``n``) one request may ask for. Each choice is a request of its own in
#: the queue (its own slot, KV cache and fair share), so ``n`` multiplies the load: 16
#: is what a sampling-heavy app (best-of-n reranking) asks for, and a bound keeps one
#: body from flooding its tenant's queue share (OpenAI's own limit is 128).
MAX_CHOICES = 16
#: OpenAI fields inferq does not serve: refused rather than silently ignored.
_REFUSED = frozenset(
    {
        "logprobs",
        "top_logprobs",
        "functions",
        "function_call",
        "best_of",
        "echo",
        "suffix",
        "audio",
        "modalities",
        "prediction",
    }
)
#: Roles of chat messages as inferq stores them (``developer`` is OpenAI's newer ``system``).
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True, slots=True)
class Submission:
    """An OpenAI request body, read: what to submit and how to answer.

    Attributes:
        endpoint: ``chat`` or ``completions``.
        model: the route as the caller named it (echoed back in the response).
        fields: keyword arguments of ``AsyncClient.submit`` (prompt or messages, model,
            max_tokens, params, stream, and priority/timeout when the body gave them).
        stream: answer with server-sent events.
        include_usage: ``stream_options.include_usage``: a last chunk with ``usage``.
        priority / timeout: from the body (headers are read by the application).
        names: inferq's name of a field -> the body field the caller sent it as, where
            they differ (``max_tokens`` given as ``max_completion_tokens``): a refusal
            names what the caller sent (:func:`as_sent`).
        n: choices asked for, 1..:data:`MAX_CHOICES`. The gateway submits ``n``
            requests of ``fields`` rather than passing ``n`` to the model server: each
            choice then takes its own slot and KV reservation, is charged to the
            tenant's fair share and metered as the sequence it is (a server's own ``n``
            would run n sequences on a slot and a reservation booked for one, and
            bill the tenant for one prompt while the server prefilled it once per
            choice: vLLM and llama.cpp do not share it), and the n choices spread over
            the fleet's workers instead of piling onto one.
    """

    endpoint: Endpoint
    model: str
    fields: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    priority: str | int | None = None
    timeout: float | None = None
    names: dict[str, str] = field(default_factory=dict)
    n: int = 1


def read_body(endpoint: Endpoint, body: Any) -> Submission:
    """Read an OpenAI request body.

    Raises:
        InvalidRequest: a field is missing, mistyped or not served (the field is named).
    """
    if not isinstance(body, Mapping):
        raise InvalidRequest("body", "must be a JSON object")
    for name in body:
        if name in _REFUSED and body[name] not in (None, False, [], {}):
            hint = "; use tools and tool_choice" if name.startswith("function") else ""
            raise UnsupportedParameter(name, f"is not supported by inferq's gateway{hint}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MissingParameter("model", "is required: a model name or a size route such as >=13b")
    n = body.get("n")
    if n is None:
        n = 1
    if type(n) is not int:  # not true, not 1.0
        raise InvalidRequest("n", f"must be an integer, got {_brief(n)}")
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest("n", f"{_brief(n)} is outside 1..{MAX_CHOICES} choices")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidRequest("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise InvalidRequest("stream_options", "must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool) and include_usage is not None:
        raise InvalidRequest(
            "stream_options.include_usage", f"must be true or false, got {include_usage!r}"
        )
    fields: dict[str, Any] = {"model": model, "stream": bool(stream)}
    if endpoint == "chat":
        fields["messages"] = _messages(body.get("messages"))
    else:
        fields["prompt"] = _prompt(body.get("prompt"))
    names = {}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None:  # OpenAI's newer name wins, as on OpenAI's API
        names["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    params = {k: v for k, v in body.items() if k not in _HANDLED and k not in _REFUSED}
    _check_sampling(params)
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise InvalidRequest("user", "must be a string")
        params["user"] = user
    if params:
        fields["params"] = params
    return Submission(
        endpoint=endpoint,
        model=model,
        fields=fields,
        stream=bool(stream),
        include_usage=bool(include_usage),
        priority=_priority(body.get("priority")),
        timeout=_timeout("timeout", body.get("timeout")),
        names=names,
        n=n,
    )


def as_sent(exc: InvalidRequest, sub: Submission, names: Mapping[str, str]) -> InvalidRequest:
    """``exc`` (a refusal by inferq's intake, which names its own fields) naming the
    field the caller sent instead: ``max_completion_tokens`` for ``max_tokens``, a
    header for the value it gave (``names``: inferq's name -> the caller's, over
    ``sub.names``), and a sampling field for ``params`` (the gateway gathers them there:
    ``params.<name>`` is ``<name>``, and a refusal of ``params`` as a whole names the
    field that breaks it, see :func:`_culprit`); a list index as the body spells it
    (intake's ``messages.1.content`` is ``messages[1].content``). Returns ``exc`` when
    nothing differs.
    """
    head, dot, rest = exc.field.partition(".")
    params = sub.fields.get("params") or {}
    if head == "params":
        sent = rest if dot else _culprit(params)
    else:
        sent = {**sub.names, **names}.get(head, head) + dot + rest
    sent = _INDEX.sub(r"[\1]", sent)
    if sent == exc.field:
        return exc
    return type(exc)(sent, exc.reason)


def _culprit(params: Mapping[str, Any]) -> str:
    """The sampling field that makes ``params`` refused: the first that does not encode
    as JSON text (a lone surrogate, NaN), else the most deeply nested, else the largest."""
    if not params:
        return "params"

    def badness(name: str) -> tuple[bool, int, int]:
        value = params[name]
        try:
            size = len(json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8"))
        except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            return True, 0, 0
        return False, _depth(value), size

    return max(params, key=badness)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 1), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)
    return deepest


#: OpenAI's numeric sampling fields and their ranges (OpenAI's API reference, chat
#: completions): a model server answers 400 to another type, which would reach the
#: caller as a failed generation (500) after a trip through the queue, and samples at a
#: value out of range (``temperature: 99``) where OpenAI refuses it.
_NUMBERS: dict[str, tuple[float, float]] = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "frequency_penalty": (-2, 2),
    "presence_penalty": (-2, 2),
}


def _check_sampling(params: Mapping[str, Any]) -> None:
    """Refuse a sampling field of the wrong type or range (OpenAI's API reference):
    numbers within :data:`_NUMBERS`' ranges, an integer ``seed``, ``stop`` a string or
    a list of strings, ``logit_bias`` an object.

    Raises:
        InvalidRequest: names the field and the type it must have.
    """
    for name, (low, high) in _NUMBERS.items():
        value = params.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(name, f"must be a number, got {_brief(value)}")
        if not low <= value <= high:  # NaN too: it compares false
            raise InvalidRequest(name, f"{_brief(value)} is outside {low}..{high}")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidRequest("seed", f"must be an integer, got {_brief(seed)}")
    stop = params.get("stop")
    strings = isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    if stop is not None and not isinstance(stop, str) and not strings:
        raise InvalidRequest("stop", f"must be a string or a list of strings, got {_brief(stop)}")
    bias = params.get("logit_bias")
    if bias is not None and not isinstance(bias, Mapping):
        raise InvalidRequest("logit_bias", f"must be an object, got {_brief(bias)}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({type(value).__name__})"


def session_hint(tenant: str, session: str | None) -> str | None:
    """The affinity hint of a session id or OpenAI ``user`` (any text): 32 hex digits of
    SHA-256 over the tenant and the id, so it is always a valid hint and two tenants'
    equal ids are different sessions; None without an id."""
    if not session:
        return None
    digest = hashlib.sha256(f"{tenant}\0{session}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def timeout_header(value: str | None) -> float | None:
    """The ``X-Inferq-Timeout`` header as seconds (None when absent).

    Raises:
        InvalidRequest: not a plain decimal (:data:`PLAIN_DECIMAL`), or not > 0; names
            the header.
    """
    if value is None:
        return None
    if not PLAIN_DECIMAL.fullmatch(value):
        raise InvalidRequest(
            TIMEOUT_HEADER,
            f"must be seconds as a plain decimal number (digits, optionally a dot and "
            f"more digits: 30 or 2.5), got {_brief(value)}",
        )
    return _timeout(TIMEOUT_HEADER, float(value))


def _timeout(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(name, f"must be seconds (a number), got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # a JSON integer too large for a float
        raise InvalidRequest(
            name, "must be seconds (a finite number), got a huge integer"
        ) from None
    if not finite:
        raise InvalidRequest(name, f"must be seconds (a finite number), got {value!r}")
    if value <= 0:
        raise InvalidRequest(name, f"must be > 0 seconds, got {value!r}")
    return float(value)


def _priority(value: Any) -> str | int | None:
    if value is None or (isinstance(value, str | int) and not isinstance(value, bool)):
        return value
    raise InvalidRequest("priority", f"must be a class name or level, got {value!r}")


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages as intake takes them (:class:`~inferq.models.ChatMessage`'s fields):
    role and text, and an assistant's ``tool_calls``, a tool's ``tool_call_id`` and a
    ``name`` when given.

    Raises:
        InvalidRequest: names the message's field (``messages[1].tool_call_id``).
    """
    if raw is None:
        raise MissingParameter("messages", "is required: a non-empty list of messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(where, "must be an object with role and content")
        role = _ROLES.get(str(message.get("role")))
        if role is None:
            raise InvalidRequest(f"{where}.role", f"must be one of {', '.join(_ROLES)}")
        item: dict[str, Any] = {
            "role": role,
            "content": _content(f"{where}.content", message.get("content")),
        }
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise InvalidRequest(f"{where}.tool_calls", "only an assistant message has them")
            item["tool_calls"] = _message_calls(f"{where}.tool_calls", calls)
        call_id = message.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise InvalidRequest(
                f"{where}.tool_call_id",
                f"a tool message needs the call's id, got {_brief(call_id)}",
            )
        if call_id is not None:
            if role != "tool":
                raise InvalidRequest(f"{where}.tool_call_id", "only a tool message has one")
            item["tool_call_id"] = call_id
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"{where}.name", f"must be a string, got {_brief(name)}")
            item["name"] = name
        out.append(item)
    return out


def _message_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as sent back: ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]``.

    Raises:
        InvalidRequest: names the call's field.
    """
    if not isinstance(calls, list):
        raise InvalidRequest(where, f"must be a list of tool calls, got {_brief(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise InvalidRequest(at, f"must be an object, got {_brief(call)}")
        if not isinstance(call.get("id"), str):
            raise InvalidRequest(f"{at}.id", f"must be a string, got {_brief(call.get('id'))}")
        if call.get("type", "function") != "function":
            raise InvalidRequest(
                f"{at}.type", f"must be 'function', got {_brief(call.get('type'))}"
            )
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequest(f"{at}.function", f"must be an object, got {_brief(function)}")
        for part in ("name", "arguments"):
            if not isinstance(function.get(part), str):
                raise InvalidRequest(
                    f"{at}.function.{part}", f"must be a string, got {_brief(function.get(part))}"
                )
        out.append(
            {
                "id": call["id"],
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return out


def _content(where: str, content: Any) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise InvalidRequest(f"{where}[{j}]", "only text parts are served")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidRequest(f"{where}[{j}].text", "must be a string")
            parts.append(text)
        return "".join(parts)
    raise InvalidRequest(where, "must be a string or a list of text parts")


def _prompt(raw: Any) -> str:
    if raw is None:
        raise MissingParameter("prompt", "is required: the prompt text")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        return raw[0]
    raise InvalidRequest("prompt", "must be a string (one prompt per request)")


# --- responses ---------------------------------------------------------------------------


def response_id(endpoint: Endpoint, request_id: str) -> str:
    """The response id: ``chatcmpl-<request id>`` or ``cmpl-<request id>``."""
    return f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{request_id}"


def finish_reason(result: Result, max_tokens: int, streamed: str | None = None) -> str:
    """``tool_calls`` when the model called tools, else what the stream said, else
    ``length`` when the output reached ``max_tokens``, else ``stop``."""
    if result.tool_calls:
        return "tool_calls"
    if streamed:
        return streamed
    return "length" if (result.completion_tokens or 0) >= max_tokens else "stop"


def usage_sum(results: list[Result]) -> dict[str, Any]:
    """OpenAI's ``usage`` of the ``n`` requests of one body: their counts added, the
    prompt's included (each choice was prefilled, and is metered, on its own), and
    ``prompt_tokens_details.cached_tokens``: the prompt tokens the model servers reported
    reusing from their prefix caches (0 when they do not say)."""
    prompt = sum(r.prompt_tokens or 0 for r in results)
    completion = sum(r.completion_tokens or 0 for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def completion_body(
    sub: Submission,
    request_id: str,
    results: Result | list[Result],
    max_tokens: int,
    created: int,
) -> dict[str, Any]:
    """The non-streamed response of succeeded requests: one choice per result (``n``),
    indexed in order; ``request_id`` (the first's) names the response. A chat choice
    whose model called tools carries ``message.tool_calls`` (``content`` null when it
    wrote no text) and ``finish_reason: "tool_calls"``."""
    results = results if isinstance(results, list) else [results]
    choices = []
    for index, result in enumerate(results):
        text = result.output or ""
        reason = finish_reason(result, max_tokens)
        choice: dict[str, Any]
        if sub.endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if result.tool_calls:
                message["tool_calls"] = [c.model_dump(mode="json") for c in result.tool_calls]
                message["content"] = text or None
            choice = {
                "index": index,
                "message": message,
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": None}
        choices.append(choice)
    return {
        "id": response_id(sub.endpoint, request_id),
        "object": "chat.completion" if sub.endpoint == "chat" else "text_completion",
        "created": created,
        "model": sub.model,
        "choices": choices,
        "usage": usage_sum(results),
    }


def chunk_body(
    sub: Submission,
    request_id: str,
    created: int,
    *,
    delta: str | None = None,
    first: bool = False,
    finish: str | None = None,
    result: Result | list[Result] | None = None,
    index: int = 0,
    tool_calls: tuple[ToolCallDelta, ...] = (),
) -> dict[str, Any]:
    """One streamed chunk of choice ``index``: text (``delta``) and pieces of tool calls
    (``delta.tool_calls``, OpenAI's shape), the role on the choice's first chat chunk,
    the finish reason on its last, or (``result``, the results of every choice, with no
    delta) the usage chunk with no choices."""
    base: dict[str, Any] = {
        "id": response_id(sub.endpoint, request_id),
        "created": created,
        "model": sub.model,
    }
    if sub.endpoint == "chat":
        base["object"] = "chat.completion.chunk"
    else:
        base["object"] = "text_completion"
    if result is not None and delta is None and finish is None:
        base["choices"] = []
        base["usage"] = usage_sum(result if isinstance(result, list) else [result])
        return base
    if sub.endpoint == "chat":
        content: dict[str, Any] = {}
        if first:
            content["role"] = "assistant"
        if delta is not None:  # null beside tool calls when there is no text, as OpenAI's
            content["content"] = delta if delta or not tool_calls else None
        if tool_calls:
            content["tool_calls"] = [piece.openai() for piece in tool_calls]
        choice: dict[str, Any] = {
            "index": index,
            "delta": content,
            "finish_reason": finish,
            "logprobs": None,
        }
    else:
        choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": None}
    base["choices"] = [choice]
    if sub.include_usage:
        base["usage"] = None  # OpenAI: null on every chunk but the last
    return base


def error_body(
    message: str, kind: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
