"""Bounded label values for the metrics: tenants (top N plus ``other``), error kinds.

A Prometheus label whose values grow without bound (one series per tenant of a
public API, one per error message) eats the server's memory; these rules keep
each label to a fixed, documented set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from inferq.models import FailureKind

#: The label value every tenant outside the top N shares.
OTHER = "other"

#: (pattern, kind) in order: the first that matches an error message names its kind.
#: The messages are the workers' (``ServerError`` of the model servers) and the Lua
#: scripts' requeue reasons; ``unknown`` when an event carries no message.
_ERROR_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.I), kind)
    for pattern, kind in (
        (r"lease expired", "lease_lapsed"),
        (r"shut down|drain|hand(ed)? back|orphan", "handed_back"),
        (r"no time left|deadline", "deadline"),
        (r"timed out|timeout", "timeout"),
        (r"HTTP 429|rate.?limit", "http_429"),
        (r"HTTP 5\d\d", "http_5xx"),
        (r"HTTP 4\d\d", "http_4xx"),
        (r"connection|connect", "connection"),
        (r"error in stream", "stream"),
        (r"malformed", "malformed"),
        (r"\(truncated\)|with an empty body", "truncated"),
        (r"corrupt", "corrupt"),
        (r"not ready|load", "server_not_ready"),
        (r"simulated", "simulated"),
    )
)

#: A URL inside an error message (the model server's); its words are not the error's.
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.I)

#: The ``failure`` label's domain: the workers' failure kinds (the retry rule each
#: follows, :class:`~inferq.models.FailureKind`), and ``other`` for requeues the
#: scripts make themselves (a lapsed lease, a hand-back).
FAILURES: tuple[str, ...] = (*(k.value for k in FailureKind), OTHER)

#: Every value :func:`error_kind` returns (the label's whole domain).
ERROR_KINDS: tuple[str, ...] = (*(kind for _, kind in _ERROR_KINDS), "other", "unknown")


def error_kind(message: str) -> str:
    """The kind of a failed attempt's error message, one of :data:`ERROR_KINDS`.

    ``"unknown"`` for an empty message, ``"other"`` when no pattern matches.
    """
    if not message:
        return "unknown"
    message = _URL.sub("<url>", message)  # a host named "loadbalancer" is no load failure
    for pattern, kind in _ERROR_KINDS:
        if pattern.search(message):
            return kind
    return "other"


def top_n(values: Mapping[str, float], n: int) -> dict[str, float]:
    """The ``n`` largest entries of ``values`` by value, the rest summed under ``other``.

    Ties break by name, so the same input always gives the same labels. The result has
    at most ``n + 1`` entries and the same total as ``values``; ``other`` appears only
    when something was folded into it (a real key named ``other`` is merged with it).

    Raises:
        ValueError: ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"top_n: n must be >= 0, got {n}")
    ranked = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    out: dict[str, float] = {}
    for name, value in ranked[:n]:
        if name != OTHER:
            out[name] = value
    rest = [v for name, v in ranked if name not in out]
    if rest:
        out[OTHER] = sum(rest)
    return out


class StickyLabels:
    """Label values for a counter: the first ``n`` names seen keep their own, the rest ``other``.

    A counter cannot move its past increments between label values, so the set is
    sticky: once a tenant holds one of the ``n`` places it keeps it for the life of
    the process. At most ``n + 1`` values ever appear.
    """

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"StickyLabels: n must be >= 0, got {n}")
        self.n = n
        self._named: set[str] = set()

    def __call__(self, name: str) -> str:
        if name in self._named:
            return name
        if len(self._named) < self.n and name != OTHER:
            self._named.add(name)
            return name
        return OTHER
