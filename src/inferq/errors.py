"""Every exception inferq raises, each with a message that says what to do."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: Characters of a caller's value an error message shows (:func:`shown`).
SHOW_CHARS = 80


def shown(value: Any) -> str:
    """A short, one-line repr of a caller's value for an error message: at most about
    ``SHOW_CHARS`` characters, however long the value (a huge integer by its bits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str | bytes) and len(value) > SHOW_CHARS:
        return f"{value[:SHOW_CHARS]!r}... ({len(value)} characters)"
    text = repr(value) if isinstance(value, str | bytes | int | float) else type(value).__name__
    return text if len(text) <= SHOW_CHARS else f"{text[:SHOW_CHARS]}..."


class InferqError(Exception):
    """Base class of every inferq error."""


class InvalidRequest(InferqError, ValueError):
    """A request was refused before it reached Redis.

    Attributes:
        field: the offending field's name (e.g. ``"max_tokens"``).
        reason: what is wrong with the value, naming the limit.
        code: the refusal's kind as OpenAI's error codes spell it (the gateway's
            ``code``): ``invalid_value`` here, a narrower one in the subclasses.
    """

    code = "invalid_value"

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class InvalidUsageQuery(InvalidRequest):
    """A usage query (``inferq usage``, the gateway's ``GET /v1/usage``) was refused:
    ``field`` names the parameter (``by``, ``since``, ``until``, ``cell``)."""


class UnknownPriorityClass(InvalidRequest):
    """The priority names no configured class (or the level is out of range)."""


class UnknownRoute(InvalidRequest):
    """The model route names no model in the registry and no size satisfies it."""

    code = "model_not_found"


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt plus ``max_tokens``, does not fit the route's largest
    context (the prompt's tokens are inferq's estimate unless the model's tokenizer
    counted them)."""

    code = "context_length_exceeded"


class UnsupportedParameter(InvalidRequest):
    """A field inferq does not serve (OpenAI's ``logprobs``, ``audio``, ...): refused
    rather than silently ignored."""

    code = "unsupported_parameter"


class MissingParameter(InvalidRequest):
    """A required field is absent."""

    code = "missing_required_parameter"


class QueueFull(InferqError):
    """Backpressure: a per-class or per-tenant queue limit is reached (HTTP 429).

    Attributes:
        priority: the priority class whose queue is full.
        tenant: the tenant, when the per-tenant limit was hit, else ``None``.
        limit: the limit that was reached (queued requests).
    """

    def __init__(self, priority: str, tenant: str | None, limit: int) -> None:
        self.priority = priority
        self.tenant = tenant
        self.limit = limit
        who = f"tenant {tenant!r} in class {priority!r}" if tenant else f"class {priority!r}"
        super().__init__(
            f"queue full: {who} already has {limit} queued requests (limit {limit}); "
            "retry later or raise the limit"
        )


class BudgetExceeded(QueueFull):
    """A tenant's or API key's budget has no room for the request (HTTP 429,
    ``insufficient_quota``); nothing written. A :class:`QueueFull` so that every caller
    that handles backpressure handles it too.

    Attributes:
        budget: the budget's name (``[budgets.<name>]``).
        limit / used: the period's limit and what its final and admitted requests use,
            in ``unit`` (``tokens`` or ``usd``).
        period: ``day`` or ``month`` (UTC).
        resets_at: epoch seconds when the period ends (Redis time).
    """

    def __init__(
        self,
        priority: str,
        tenant: str,
        budget: str,
        limit: float,
        used: float,
        period: str,
        unit: str,
        resets_at: float,
    ) -> None:
        self.priority = priority
        self.tenant = tenant
        self.limit = int(limit) if unit == "tokens" else limit  # type: ignore[assignment]
        self.budget = budget
        self.used = used
        self.period = period
        self.unit = unit
        self.resets_at = resets_at
        when = datetime.fromtimestamp(resets_at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if unit == "tokens":
            amount = f"{used:,.0f} of {limit:,.0f} tokens"
        else:
            amount = f"${used:,.4f} of ${limit:,.2f}"
        InferqError.__init__(
            self,
            f"budget {budget!r} exhausted: {amount} used this {period} (tenant {tenant!r}); "
            f"it resets at {when}; raise the budget or wait",
        )


class IdempotencyConflict(InferqError):
    """An idempotency key was reused for a different request (HTTP 409); nothing written.

    A key stands for one request: resubmitting it with another prompt, messages,
    parameters, route, class, task type or ``max_tokens`` is refused, as payment
    APIs refuse a reused key with other parameters (Stripe's idempotent requests).

    Attributes:
        key: the idempotency key.
        tenant: the tenant that owns the key.
        request_id: the request the key already names.
    """

    def __init__(self, key: str, tenant: str, request_id: str) -> None:
        self.key = key
        self.tenant = tenant
        self.request_id = request_id
        super().__init__(
            f"idempotency key {key!r} of tenant {tenant!r} already names request "
            f"{request_id} with a different prompt or parameters; resubmit the same "
            "request, or use a new key"
        )


class RequestNotFound(InferqError, KeyError):
    """No request with this id exists (never submitted, or its result expired)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"no request {request_id!r} (never submitted, or its result expired)")

    def __str__(self) -> str:
        return str(self.args[0])


class ResultTimeout(InferqError, TimeoutError):
    """``result(timeout=...)`` ran out before the request finished; it is still in flight."""


class ConfigError(InferqError, ValueError):
    """A setting or the TOML file is invalid; the message names the setting."""


class RedisUnavailable(InferqError, ConnectionError):
    """Redis did not answer. The URL in the message has its password redacted."""

    def __init__(self, url: str, cause: BaseException) -> None:
        self.url = redact_url(url)
        super().__init__(f"cannot reach Redis at {self.url}: {redact_text(str(cause))}")


class MissingExtra(InferqError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names
    the extra of ``pyproject.toml`` that brings it (``pip install 'inferq[demo]'``)."""

    def __init__(self, module: str, extra: str, needed_by: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(
            f"{needed_by} needs {module}, which is not installed: "
            f"install inferq[{extra}] (pip install 'inferq[{extra}]')"
        )


class CorruptRecord(InferqError):
    """A record read from Redis does not parse; it is quarantined, never fatal."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"corrupt record {key}: {reason}")


#: ``scheme://user:password@``: the password runs to the last ``@`` before a ``/`` or space.
URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^/\s]*@")
#: Secret options of a connection URL's query string (redis-py and Sentinel ones).
SECRET_QUERY = re.compile(r"(?i)(?<![A-Za-z0-9_])((?:sentinel_|ssl_)?password=)[^&#\s]*")


def redact_url(url: str) -> str:
    """Return ``url`` with every password replaced by ``***``.

    ``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``; also the
    multi-host Sentinel form (``redis+sentinel://:secret@h1,h2/mymaster``) and
    ``password=`` / ``sentinel_password=`` / ``ssl_password=`` query options.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}, not a URL>"
    if "://" not in url:
        return "<redacted: not a URL>" if "@" in url else url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    query = SECRET_QUERY.sub(r"\1***", parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Replace the password of every URL in free ``text`` (a log line, an error) with ``***``."""
    return SECRET_QUERY.sub(r"\1***", URL_USERINFO.sub(r"\g<scheme>\g<user>:***@", text))
