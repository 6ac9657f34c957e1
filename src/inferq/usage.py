"""Usage roll-ups: what the metering in ``store/lua/includes/meter.lua`` wrote, read back,
summed by one dimension and priced. Pure: the records and the time are arguments.

:func:`window_ms` and :func:`report` are the one reading of a usage query, shared by
``inferq usage --json`` and the gateway's ``GET /v1/usage`` (through
:meth:`inferq.store.Store.usage_report`), so both give the same figures.

A record is one (UTC hour, tenant, API key id, class, model) with its counters (see
:data:`COUNTERS`). Cost is derived here, from the settings' prices at read time: a
changed price re-prices history as it is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from inferq.config import Price
from inferq.errors import InvalidUsageQuery

#: The counters of a record, in the order ``meter.lua`` writes them.
COUNTERS = (
    "succeeded",
    "failed",
    "expired",
    "cancelled",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "gpu_ms",
)
#: Outcomes counted (each a request made final in that state, as ``stats`` counts them).
OUTCOMES = COUNTERS[:4]
#: The dimensions ``inferq usage --by`` sums over.
DIMENSIONS = ("tenant", "key", "class", "model")
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
_AGO = re.compile(r"^([0-9]{1,6})([hd])$")  # ASCII digits only (\d takes any script's)
#: The furthest back a window may start, days: ten years of daily roll-ups (one HGETALL
#: each); ``999999d`` sent a million reads to Redis in one pipeline (12 s).
MAX_AGO_DAYS = 3660
_UNIT_MS = {"h": HOUR_MS, "d": DAY_MS}


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One roll-up field: the requests made final in ``hour`` (epoch hour, UTC) of one
    tenant, API key id ('' = not through the gateway), class and model."""

    hour: int
    tenant: str
    key: str
    klass: str
    model: str
    counts: tuple[int, ...]

    def dimension(self, by: str) -> str:
        """The record's value of dimension ``by`` (one of :data:`DIMENSIONS`)."""
        return {"tenant": self.tenant, "key": self.key, "class": self.klass, "model": self.model}[
            by
        ]


@dataclass(frozen=True, slots=True)
class Corrupt:
    """A roll-up field that does not parse: skipped, and reported by ``inferq usage``."""

    key: str
    field: str
    reason: str


def parse_record(key: str, name: str, value: str) -> UsageRecord | Corrupt:
    """The record of field ``name`` of roll-up key ``key``, or why it does not parse."""
    try:
        parts = json.loads(name)
        hour, tenant, api_key, klass, model = parts
        if not isinstance(hour, int) or not all(
            isinstance(p, str) for p in (tenant, api_key, klass, model)
        ):
            raise ValueError("mistyped dimensions")
    except (ValueError, TypeError) as exc:
        return Corrupt(key, name, f"field is not [hour, tenant, key, class, model]: {exc}")
    try:
        counts = tuple(int(n) for n in value.split())
    except ValueError:
        counts = ()
    if len(counts) != len(COUNTERS) or min(counts) < 0:
        return Corrupt(key, name, f"value is not {len(COUNTERS)} counts >= 0: {value[:80]!r}")
    return UsageRecord(hour, tenant, api_key, klass, model, counts)


@dataclass(slots=True)
class UsageRow:
    """The sum of the records of one value of a dimension, with their cost."""

    name: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    cost_usd: float = 0.0
    #: Models of these records without a price (their cost counts as 0).
    unpriced: set[str] = field(default_factory=set)

    @property
    def requests(self) -> int:
        return sum(self.counts[o] for o in OUTCOMES)

    @property
    def gpu_s(self) -> float:
        return self.counts["gpu_ms"] / 1000

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "requests": self.requests,
            **self.counts,
            "gpu_s": self.gpu_s,
            "cost_usd": round(self.cost_usd, 6),
            "unpriced_models": sorted(self.unpriced),
        }


@dataclass(frozen=True, slots=True)
class EventUsage:
    """One request's usage as its final event carries it (field ``usage``, written by
    ``meter.lua`` when it added the request to its roll-up): the dimensions and counts
    of :class:`UsageRecord` for that one request. ``gpu_ms``: milliseconds."""

    outcome: str
    tenant: str
    key: str
    klass: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_ms: int


def parse_event_usage(text: str) -> EventUsage:
    """The usage of a final event's ``usage`` field: JSON ``[outcome, tenant, key id, class,
    model, prompt, cached, completion, gpu_ms]``.

    Raises:
        ValueError: not that shape, an outcome that is not final, or a count below 0.
    """
    parts = json.loads(text)
    if not isinstance(parts, list) or len(parts) != 9:
        raise ValueError(f"usage is not 9 values: {text[:80]!r}")
    dims, nums = parts[:5], parts[5:]
    if dims[0] not in OUTCOMES or not all(isinstance(d, str) for d in dims):
        raise ValueError(f"usage dimensions are not [outcome, tenant, key, class, model]: {dims}")
    if not all(isinstance(n, int | float) and n >= 0 and n == int(n) for n in nums):
        raise ValueError(f"usage counts are not integers >= 0: {nums}")
    return EventUsage(*dims, *(int(n) for n in nums))


def cost_usd(counts: Mapping[str, int], price: Price) -> float:
    """What ``counts`` cost at ``price`` (see :class:`~inferq.config.Price`)."""
    cached = counts["cached_tokens"]
    prompt_rate = price.prompt_per_1m_usd or 0.0
    cached_rate = price.cached_prompt_per_1m_usd
    if cached_rate is None:
        cached_rate = prompt_rate
    return (
        counts["gpu_ms"] / 3_600_000 * (price.gpu_hour_usd or 0.0)
        + (counts["prompt_tokens"] - cached) * prompt_rate / 1e6
        + cached * cached_rate / 1e6
        + counts["completion_tokens"] * (price.completion_per_1m_usd or 0.0) / 1e6
    )


def roll_up(
    records: Iterable[UsageRecord],
    by: str,
    prices: Mapping[str, Price],
    since_ms: int,
    until_ms: int,
) -> list[UsageRow]:
    """Sum the records of the hours in ``[since_ms, until_ms)`` by dimension ``by``, each
    record priced by its model; rows by name."""
    rows: dict[str, UsageRow] = {}
    for rec in records:
        if not since_ms <= rec.hour * HOUR_MS < until_ms:
            continue
        name = rec.dimension(by)
        row = rows.setdefault(name, UsageRow(name))
        counts = dict(zip(COUNTERS, rec.counts, strict=True))
        for c, n in counts.items():
            row.counts[c] += n
        price = prices.get(rec.model)
        if price is None:
            row.unpriced.add(rec.model)
        else:
            row.cost_usd += cost_usd(counts, price)
    return [rows[n] for n in sorted(rows)]


def days_between(since_ms: int, until_ms: int) -> list[int]:
    """The epoch days (UTC) whose roll-up keys hold the hours of ``[since_ms, until_ms)``."""
    if until_ms <= since_ms:
        return []
    return list(range(since_ms // DAY_MS, (until_ms - 1) // DAY_MS + 1))


def ago_ms(text: str, param: str) -> int:
    """Milliseconds before now of ``<n>h`` / ``<n>d`` (``now`` = 0).

    Raises:
        InvalidUsageQuery: anything else (field ``param``).
    """
    if text == "now":
        return 0
    m = _AGO.match(text.strip())
    if m is None:
        raise InvalidUsageQuery(param, f"{text!r}: give hours or days ago, e.g. 24h or 7d")
    ago = int(m.group(1)) * _UNIT_MS[m.group(2)]
    if ago > MAX_AGO_DAYS * DAY_MS:
        raise InvalidUsageQuery(param, f"{text!r} is further back than {MAX_AGO_DAYS}d")
    return ago


def window_ms(now_ms: int, since: str, until: str) -> tuple[int, int]:
    """``[since, until)`` in Redis ms, whole UTC hours: ``since`` starts at the hour it
    falls in, ``until`` ends with the hour it falls in.

    Raises:
        InvalidUsageQuery: a value does not parse (field ``since`` or ``until``), or
            ``since`` is not before ``until`` (field ``since``).
    """
    start = (now_ms - ago_ms(since, "since")) // HOUR_MS * HOUR_MS
    end = (now_ms - ago_ms(until, "until")) // HOUR_MS * HOUR_MS + HOUR_MS
    if start >= end:
        raise InvalidUsageQuery("since", f"{since!r} is not before until {until!r}")
    return start, end


def check_by(by: str) -> str:
    """``by`` when it is one of :data:`DIMENSIONS`.

    Raises:
        InvalidUsageQuery: it is not (field ``by``).
    """
    if by not in DIMENSIONS:
        raise InvalidUsageQuery("by", f"{by!r} is not one of {', '.join(DIMENSIONS)}")
    return by


def report(
    records: Iterable[UsageRecord],
    corrupt: Iterable[Corrupt],
    by: str,
    prices: Mapping[str, Price],
    since_ms: int,
    until_ms: int,
) -> dict[str, object]:
    """A usage query's answer, as ``inferq usage --json`` prints it and ``GET /v1/usage``
    returns it: ``by``, ``since_ms`` / ``until_ms`` (the window, Redis ms), ``rows`` (one
    per value of ``by``: :meth:`UsageRow.as_json`), ``total`` (their sum) and ``corrupt``
    (the records skipped: key, field, reason)."""
    rows = roll_up(records, by, prices, since_ms, until_ms)
    total = UsageRow("total")
    for row in rows:
        for c, n in row.counts.items():
            total.counts[c] += n
        total.cost_usd += row.cost_usd
        total.unpriced |= row.unpriced
    return {
        "by": by,
        "since_ms": since_ms,
        "until_ms": until_ms,
        "rows": [r.as_json() for r in rows],
        "total": total.as_json(),
        "corrupt": [{"key": c.key, "field": c.field, "reason": c.reason} for c in corrupt],
    }
