"""Turn a caller's arguments into a validated :class:`InferenceRequest`, or refuse them.

Everything a submission can get wrong is caught here, before anything reaches
Redis; each refusal is an :class:`~inferq.errors.InvalidRequest` naming the
field, what is wrong and the limit. The request classifier fills in the
priority class and route from ``task_type`` when the caller gives none.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from inferq import defaults, prefix, tokens, tools
from inferq.config import PriorityClass, Settings
from inferq.errors import SHOW_CHARS, InvalidRequest, UnknownPriorityClass, shown
from inferq.ids import new_id
from inferq.models import ChatMessage, InferenceRequest, Payload
from inferq.policy.estimate import estimate_messages_tokens, estimate_prompt_tokens
from inferq.routes import check_context, check_known, default_max_tokens, parse_route

#: Largest JSON encoding of generation parameters, bytes, ``tools`` left out (they have
#: their own limit, :data:`inferq.tools.MAX_TOOLS_BYTES`).
MAX_PARAMS_BYTES = 16 * 1024
#: Deepest nesting of generation parameters (OpenAI-style params nest 2-3 levels:
#: ``{"response_format": {"json_schema": {...}}}``); deeper input is refused before
#: encoding, so no recursion limit is ever hit.
MAX_PARAMS_DEPTH = 32
#: Most values (JSON nodes) in ``params``: each costs at least one byte of JSON.
MAX_VALUES = MAX_PARAMS_BYTES + tools.MAX_TOOLS_BYTES
#: Longest timeout, and farthest deadline, seconds (7 days).
MAX_TIMEOUT_S = 7 * 24 * 3600
#: Shortest timeout, seconds: deadlines are kept in integer milliseconds.
MIN_TIMEOUT_S = 0.001
#: Longest route, class name, tenant or key echoed back in a refusal, characters.
#: The arguments a submission may carry (``Client.submit`` passes them through).
#: A session hint: printable ASCII without spaces, 1-128 characters.
SESSION_RE = re.compile(r"[\x21-\x7e]{1,128}")

FIELDS = (
    "prompt",
    "messages",
    "model",
    "priority",
    "tenant",
    "task_type",
    "max_tokens",
    "timeout",
    "deadline",
    "idempotency_key",
    "params",
    "stream",
    "prefix_hashes",
    "session",
)


def classify(settings: Settings, task_type: str | None) -> tuple[str, str]:
    """Default (priority class, route) for ``task_type`` (the request classifier).

    Unknown or absent task types get ``settings.default_priority`` and
    ``settings.default_model``.
    """
    rule = settings.classifier.get(task_type) if task_type else None
    priority = rule.priority if rule else settings.default_priority
    model = rule.model if rule and rule.model else settings.default_model
    return priority, model


def build_request(
    settings: Settings,
    *,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, Any] | ChatMessage] | None = None,
    model: str | None = None,
    priority: str | int | None = None,
    tenant: str = "default",
    task_type: str | None = None,
    max_tokens: int | None = None,
    timeout: float | None = None,
    deadline: float | None = None,
    idempotency_key: str | None = None,
    params: Mapping[str, Any] | None = None,
    stream: bool = False,
    prefix_hashes: Sequence[int] | None = None,
    session: str | None = None,
    now: float | None = None,
    **unknown: Any,
) -> InferenceRequest:
    """Validate a submission and build the request (nothing is written anywhere).

    Args:
        prompt / messages: exactly one: the prompt text, or chat messages
            (``{"role": ..., "content": ...}``).
        model: a registry model name or a size requirement (``>=13b``); default
            from the classifier.
        priority: a class name or level (0 = highest); default from the classifier.
        tenant: who is charged for fairness and queue limits.
        max_tokens: output tokens at most, 1..the route's largest max context.
        timeout: seconds until the deadline (> 0); default the class's timeout.
        deadline: absolute epoch seconds instead of ``timeout``.
        idempotency_key: resubmitting the same request under this key (same
            tenant) returns the first id while its record lives; another request
            under it is refused (IdempotencyConflict, at submit).
        params: sampling parameters passed to the model server (JSON, <= 16 KiB
            besides ``tools``, <= 64 KiB); OpenAI's ``tools``, ``tool_choice``,
            ``parallel_tool_calls`` and ``response_format`` among them are checked for
            OpenAI's shapes (:mod:`inferq.tools`), and the tools' JSON counts in the
            prompt's tokens (the server renders it into the prompt).
        stream: publish the output chunk by chunk while it is generated (read it with
            ``handle.stream()``); a bool.
        prefix_hashes: the chain of the prompt's block hashes, when the caller computed
            it (with the model's tokenizer; :mod:`inferq.prefix`): integers in
            [0, 2**63), at most ``MAX_PREFIX_BLOCKS``; default: computed from the text.
        session: an affinity hint (a session or user id, printable, <= 128
            characters): the session's requests prefer the worker that holds its cache.
        now: epoch seconds (default: the local clock).

    Raises:
        InvalidRequest: (or a subclass) naming the field and the limit; also for
            a field this function does not know, a value of the wrong type and
            text that is not valid Unicode (a lone surrogate) or holds NUL.
    """
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequest(_show_name(name), f"unknown field (known: {', '.join(FIELDS)})")
    now = _now(now)
    default_priority, default_route = classify(settings, _task_type(task_type))
    cls = _priority(settings, default_priority if priority is None else priority)
    route = parse_route(_model(default_route if model is None else model))
    specs = check_known(route, settings.models)
    _check_str("tenant", tenant)
    _check_str("idempotency_key", idempotency_key, optional=True)
    payload = _payload(settings, prompt, messages, params)
    tokenizer = tokens.tokenizer_for(specs)
    prompt_tokens = _prompt_tokens(settings, payload, tokenizer)
    if max_tokens is None:
        max_tokens = default_max_tokens(settings.default_max_tokens, prompt_tokens, specs)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidRequest("max_tokens", f"must be an integer, got {shown(max_tokens)}")
    counted_by = tokenizer.model if tokenizer is not None else None
    check_context(max_tokens, prompt_tokens, specs, route.text, counted_by=counted_by)
    timeout_s, deadline_at = _deadline(cls, timeout, deadline, now)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream", f"must be true or false, got {shown(stream)}")
    block_tokens = settings.prefix_block_tokens(route.text)
    chain = _prefix_chain(settings, payload, block_tokens, prefix_hashes, session, tenant)
    try:
        return InferenceRequest(
            id=new_id(),
            model=route.text,
            priority=cls.name,
            tenant=tenant,
            task_type=task_type,
            payload=payload,
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            timeout_s=timeout_s,
            deadline=deadline_at,
            idempotency_key=idempotency_key,
            submitted_at=now,
            stream=stream,
            prefix_hashes=chain,
            prefix_block_tokens=block_tokens if chain else 0,
        )
    except ValidationError as exc:
        raise _invalid(exc) from None


def _now(now: Any) -> float:
    if now is None:
        return time.time()
    if isinstance(now, bool) or not isinstance(now, int | float) or not _finite(now) or now <= 0:
        raise InvalidRequest("now", f"must be positive epoch seconds, got {shown(now)}")
    return float(now)


def _priority(settings: Settings, value: Any) -> PriorityClass:
    """Resolve a class name or level; every refusal is an UnknownPriorityClass."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise UnknownPriorityClass(
            "priority", f"must be a class name or a level, got {type(value).__name__}"
        )
    if isinstance(value, int) and not 0 <= value < len(settings.classes):
        raise UnknownPriorityClass(
            "priority", f"level {shown(value)} is outside 0..{len(settings.classes) - 1}"
        )
    level_text = isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9
    if isinstance(value, str) and value not in settings.class_by_name and not level_text:
        known = ", ".join(settings.class_by_name)
        raise UnknownPriorityClass("priority", f"unknown class {shown(value)} (known: {known})")
    return settings.priority_class(value)


def _model(model: Any) -> Any:
    """Refuse route text no model name or size could be, before it is echoed or parsed."""
    if isinstance(model, str) and (len(model) > 2 * SHOW_CHARS or not model.isascii()):
        raise InvalidRequest(
            "model",
            f"{shown(model)} is neither a model name (ASCII letters, digits, '.', '_', '-', "
            "at most 64) nor a size requirement like '>=13b'",
        )
    return model


def _check_str(field: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise InvalidRequest(field, f"must be a string, got {type(value).__name__}")


def _task_type(task_type: str | None) -> str | None:
    if task_type is not None and not isinstance(task_type, str):
        raise InvalidRequest("task_type", f"must be a string, got {type(task_type).__name__}")
    return task_type


def _payload(
    settings: Settings,
    prompt: str | None,
    messages: Sequence[Mapping[str, Any] | ChatMessage] | None,
    params: Mapping[str, Any] | None,
) -> Payload:
    if (prompt is None) == (messages is None):
        raise InvalidRequest("prompt", "give exactly one of prompt and messages")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest("prompt", f"must be a string, got {type(prompt).__name__}")
    if prompt is not None and not prompt.strip():
        raise InvalidRequest("prompt", "must not be empty")
    if messages is not None and (isinstance(messages, str | bytes) or not messages):
        raise InvalidRequest("messages", "must be a non-empty list of {role, content}")
    params_json = _params_json(params)
    if prompt is not None and params is not None:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if params.get(name) is not None:
                raise InvalidRequest(
                    f"params.{name}", "only chat messages take tools, not a prompt"
                )
    try:
        payload = Payload(prompt=prompt, messages=messages, params=json.loads(params_json))
    except ValidationError as exc:
        raise _invalid(exc, prefix="messages" if messages is not None else "prompt") from None
    size = len(payload.text().encode("utf-8", errors="surrogatepass"))
    if size > settings.max_prompt_bytes:
        field = "prompt" if prompt is not None else "messages"
        raise InvalidRequest(
            field,
            f"{size} bytes exceeds the limit of {settings.max_prompt_bytes} bytes "
            "(max_prompt_bytes)",
        )
    _check_texts(payload)
    return payload


def _check_texts(payload: Payload) -> None:
    """Each text must encode as UTF-8 (no lone surrogate) and hold no NUL: the prompt, or
    the messages' contents and their tool calls' names and arguments."""
    if payload.prompt is not None:
        _check_text("prompt", payload.prompt)
        return
    assert payload.messages is not None
    for i, message in enumerate(payload.messages):
        _check_text(f"messages.{i}.content", message.content)
        for j, call in enumerate(message.tool_calls or ()):  # rendered into the prompt too
            at = f"messages.{i}.tool_calls.{j}.function"
            _check_text(f"{at}.name", call.function.name)
            _check_text(f"{at}.arguments", call.function.arguments)
    if not any(m.content.strip() for m in payload.messages):
        raise InvalidRequest("messages", "every message's content is empty")


def _check_text(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            field, f"is not valid Unicode: lone surrogate {text[exc.start]!r} at index {exc.start}"
        ) from None
    nul = text.find("\x00")
    if nul >= 0:
        raise InvalidRequest(field, f"must not contain NUL characters (one at index {nul})")


def _params_json(params: Mapping[str, Any] | None) -> str:
    if params is None:
        return "{}"
    if not isinstance(params, Mapping):
        raise InvalidRequest("params", f"must be a mapping, got {type(params).__name__}")
    _check_shape(params)
    _check_one_answer(params)
    tools.check_tools(params)
    try:
        text = json.dumps(dict(params), allow_nan=False, ensure_ascii=False)
        size = len(text.encode("utf-8"))
        if params.get("tools") is not None:
            size -= tools.tools_bytes(params["tools"])
    except UnicodeEncodeError as exc:
        raise InvalidRequest("params", f"is not valid Unicode: {exc.reason}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidRequest("params", f"must be JSON-serializable: {exc}") from None
    if size > MAX_PARAMS_BYTES:
        raise InvalidRequest(
            "params", f"{size} bytes of JSON exceeds the limit of {MAX_PARAMS_BYTES}"
        )
    return text


#: Parameters that ask an OpenAI-compatible server for several answers to one request
#: (``n`` choices, ``best_of`` candidates). One request gets one answer: a stream would
#: interleave the choices, and the result, token counts and KV-cache reservation are
#: sized for one sequence.
MULTI_ANSWER_PARAMS = ("n", "best_of")


def _check_one_answer(params: Mapping[str, Any]) -> None:
    for name in MULTI_ANSWER_PARAMS:
        value = params.get(name)
        if value is None or (type(value) is int and value == 1):
            continue
        raise InvalidRequest(
            f"params.{name}",
            f"must be 1 (one answer per request; submit several requests instead), "
            f"got {shown(value)}",
        )


def _check_shape(params: Mapping[str, Any]) -> None:
    """Bound nesting and size before encoding: deep or self-referencing params never recurse."""
    stack: list[tuple[Any, int]] = [(params, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_PARAMS_DEPTH:
            raise InvalidRequest(
                "params", f"nested deeper than the limit of {MAX_PARAMS_DEPTH} levels"
            )
        if nodes > MAX_VALUES:  # every value costs at least one byte of JSON
            raise InvalidRequest(
                "params", f"more than {MAX_VALUES} values exceeds the JSON size limit"
            )
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list | tuple):
            stack.extend((v, depth + 1) for v in value)


def _prefix_chain(
    settings: Settings,
    payload: Payload,
    block_tokens: int,
    given: Any,
    session: Any,
    tenant: str,
) -> tuple[int, ...]:
    """The request's prefix chain: the caller's (checked, then cut to the blocks its text
    could fill, at most one token a UTF-8 byte as byte-level tokenizers have it: a longer
    chain claims cache for a prompt it does not have, and 1-token prompts with 512
    made-up blocks evicted other chats from the index), else hashed from its text (chat
    messages rendered canonically, with their tool calls and the declared tools:
    :func:`prefix.chat_text`), the session hint first, hashed with the ``tenant``
    (two tenants' equal session names are not one session); ``()`` when prefix routing
    is off (a caller's chain is still checked)."""
    if session is not None:
        _check_str("session", session)
        if not SESSION_RE.fullmatch(session):
            raise InvalidRequest(
                "session", f"must be 1-128 printable characters, got {shown(session)}"
            )
    if given is not None:
        if session is not None:
            raise InvalidRequest("session", "give prefix_hashes or session, not both")
        chain = prefix.check_chain(given)
        if not settings.prefix.enabled:
            return ()
        size = len(payload.text().encode()) + len(tools.tools_text(payload.params).encode())
        return chain[: -(-size // block_tokens)]
    if not settings.prefix.enabled:
        return ()
    text = (
        payload.prompt
        if payload.messages is None
        else prefix.chat_text(payload.messages, tools.tools_text(payload.params))
    )
    assert text is not None
    hint = None if session is None else f"{tenant}\x1f{session}"
    return prefix.text_chain(text, block_tokens, settings.chars_per_token, session=hint)


def _prompt_tokens(
    settings: Settings, payload: Payload, tokenizer: tokens.ModelTokenizer | None = None
) -> int:
    """The prompt's tokens: its text, and for a chat the tools' JSON and the tool calls
    of its assistant messages, which the server renders into the prompt. Counted by the
    model's ``tokenizer`` when given (a chat's template markers estimated at
    ``TOKENS_PER_MESSAGE`` a message), else estimated."""
    cpt = settings.chars_per_token
    if tokenizer is not None:
        if payload.messages is None:
            assert payload.prompt is not None
            return max(1, tokenizer.count(payload.prompt))
        texts = [m.content for m in payload.messages] + [tools.tools_text(payload.params)]
        texts += [
            c.function.name + c.function.arguments
            for m in payload.messages
            for c in m.tool_calls or ()
        ]
        overhead = defaults.TOKENS_PER_MESSAGE * len(payload.messages)
        return sum(tokenizer.count(t) for t in texts if t) + overhead
    if payload.messages is not None:
        calls = "".join(
            c.function.name + c.function.arguments
            for m in payload.messages
            for c in m.tool_calls or ()
        )
        extra = tools.tools_text(payload.params) + calls
        return estimate_messages_tokens(payload.messages, cpt) + estimate_prompt_tokens(extra, cpt)
    assert payload.prompt is not None
    return estimate_prompt_tokens(payload.prompt, cpt)


def _deadline(cls: PriorityClass, timeout: Any, deadline: Any, now: float) -> tuple[float, float]:
    if timeout is not None and deadline is not None:
        raise InvalidRequest("timeout", "give timeout or deadline, not both")
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, int | float):
            raise InvalidRequest("deadline", f"must be epoch seconds, got {shown(deadline)}")
        if not _finite(deadline) or deadline <= now:
            raise InvalidRequest(
                "deadline", f"{shown(deadline)} is not in the future (now {now:.3f})"
            )
        if deadline > now + MAX_TIMEOUT_S:  # (no subtraction: an int may not fit a float)
            raise InvalidRequest(
                "deadline",
                f"{shown(deadline)} is more than {MAX_TIMEOUT_S} s (7 days) after now ({now:.3f})",
            )
        return deadline - now, float(deadline)
    if timeout is None:
        timeout = cls.timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidRequest("timeout", f"must be a number of seconds, got {shown(timeout)}")
    if not _finite(timeout) or timeout <= 0:
        raise InvalidRequest(
            "timeout", f"must be a positive number of seconds, got {shown(timeout)}"
        )
    if timeout < MIN_TIMEOUT_S:
        raise InvalidRequest(
            "timeout", f"{shown(timeout)} s is below {MIN_TIMEOUT_S} s (deadlines are in ms)"
        )
    if timeout > MAX_TIMEOUT_S:
        raise InvalidRequest(
            "timeout", f"{shown(timeout)} s exceeds the limit of {MAX_TIMEOUT_S} s (7 days)"
        )
    return float(timeout), now + float(timeout)


def _finite(value: int | float) -> bool:
    """math.isfinite without the OverflowError of an int too large for a float."""
    return isinstance(value, int) or math.isfinite(value)


def _show_name(name: str) -> str:
    """A field name as given, made safe to print on one line."""
    text = shown(name)
    return text[1:-1] if text.startswith("'") and text.endswith("'") else text


def _invalid(exc: ValidationError, prefix: str | None = None) -> InvalidRequest:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    field = loc[0] if loc else (prefix or "request")
    if prefix and field not in ("tenant", "idempotency_key", "task_type"):
        field = ".".join([prefix, *loc[1:]]) if loc and loc[0] == prefix else prefix
    msg = err["msg"]
    if err["type"] == "string_pattern_mismatch":
        pattern = err.get("ctx", {}).get("pattern", "")
        msg = f"{shown(err.get('input'))} does not match the pattern {pattern}"
    return InvalidRequest(field, msg)
