"""Turn a caller's arguments into a validated :class:`InferenceRequest`, or refuse them.

Everything a submission can get wrong is caught here, before anything reaches
Redis; each refusal is an :class:`~inferq.errors.InvalidRequest` naming the
field, what is wrong and the limit. The request classifier fills in the
priority class and route from ``task_type`` when the caller gives none.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from inferq.config import PriorityClass, Settings
from inferq.errors import InvalidRequest
from inferq.models import ChatMessage, InferenceRequest, Payload
from inferq.policy.estimate import estimate_messages_tokens, estimate_prompt_tokens
from inferq.routes import check_known, parse_route

#: Largest JSON encoding of generation parameters, bytes.
MAX_PARAMS_BYTES = 16 * 1024


def new_id() -> str:
    """A 26-hex-digit id that sorts by creation time (ns clock + 40 random bits)."""
    return f"{time.time_ns():016x}{os.urandom(5).hex()}"


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
    now: float | None = None,
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
        idempotency_key: a resubmission with the same key returns the first id.
        params: sampling parameters passed to the backend (JSON, <= 16 KiB).
        now: epoch seconds (default: the local clock).

    Raises:
        InvalidRequest: (or a subclass) naming the field and the limit.
    """
    now = time.time() if now is None else now
    default_priority, default_route = classify(settings, _task_type(task_type))
    cls = settings.priority_class(default_priority if priority is None else priority)
    route = parse_route(default_route if model is None else model)
    specs = check_known(route, settings.models)
    payload = _payload(settings, prompt, messages, params)
    prompt_tokens = _prompt_tokens(settings, payload)
    max_context = max(s.max_context for s in specs)
    if max_tokens is None:
        max_tokens = min(settings.default_max_tokens, max(1, max_context - prompt_tokens))
    _check_max_tokens(max_tokens, prompt_tokens, max_context, route.text)
    timeout_s, deadline_at = _deadline(cls, timeout, deadline, now)
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
        )
    except ValidationError as exc:
        raise _invalid(exc) from None


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
    if "\x00" in payload.text():
        raise InvalidRequest("prompt", "must not contain NUL characters")
    return payload


def _params_json(params: Mapping[str, Any] | None) -> str:
    if params is None:
        return "{}"
    if not isinstance(params, Mapping):
        raise InvalidRequest("params", f"must be a mapping, got {type(params).__name__}")
    try:
        text = json.dumps(dict(params), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest("params", f"must be JSON-serializable: {exc}") from None
    if len(text) > MAX_PARAMS_BYTES:
        raise InvalidRequest(
            "params", f"{len(text)} bytes of JSON exceeds the limit of {MAX_PARAMS_BYTES}"
        )
    return text


def _prompt_tokens(settings: Settings, payload: Payload) -> int:
    if payload.messages is not None:
        return estimate_messages_tokens(payload.messages, settings.chars_per_token)
    assert payload.prompt is not None
    return estimate_prompt_tokens(payload.prompt, settings.chars_per_token)


def _check_max_tokens(max_tokens: Any, prompt_tokens: int, max_context: int, route: str) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidRequest("max_tokens", f"must be an integer, got {max_tokens!r}")
    if not 1 <= max_tokens <= max_context:
        raise InvalidRequest(
            "max_tokens", f"{max_tokens} is outside 1..{max_context} (max context of {route})"
        )
    if prompt_tokens + max_tokens > max_context:
        raise InvalidRequest(
            "max_tokens",
            f"prompt (~{prompt_tokens} tokens) + max_tokens {max_tokens} exceeds the max "
            f"context of {route} ({max_context} tokens)",
        )


def _deadline(cls: PriorityClass, timeout: Any, deadline: Any, now: float) -> tuple[float, float]:
    if timeout is not None and deadline is not None:
        raise InvalidRequest("timeout", "give timeout or deadline, not both")
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, int | float):
            raise InvalidRequest("deadline", f"must be epoch seconds, got {deadline!r}")
        if not math.isfinite(deadline) or deadline <= now:
            raise InvalidRequest("deadline", f"{deadline!r} is not in the future (now {now:.3f})")
        return deadline - now, float(deadline)
    if timeout is None:
        timeout = cls.timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidRequest("timeout", f"must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidRequest("timeout", f"must be a positive number of seconds, got {timeout!r}")
    if timeout > 7 * 24 * 3600:
        raise InvalidRequest("timeout", f"{timeout} s exceeds the limit of 604800 s (7 days)")
    return float(timeout), now + float(timeout)


def _invalid(exc: ValidationError, prefix: str | None = None) -> InvalidRequest:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    field = loc[0] if loc else (prefix or "request")
    if prefix and field not in ("tenant", "idempotency_key", "task_type"):
        field = ".".join([prefix, *loc[1:]]) if loc and loc[0] == prefix else prefix
    msg = err["msg"]
    if err["type"] == "string_pattern_mismatch":
        pattern = err.get("ctx", {}).get("pattern", "")
        msg = f"{err.get('input')!r} does not match the pattern {pattern}"
    return InvalidRequest(field, msg)
