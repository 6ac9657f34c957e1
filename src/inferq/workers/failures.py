"""How a failed request is retried: the failure's kind, whether it spends an attempt, the backoff.

Every :class:`~inferq.workers.servers.ServerError` is classified (:func:`classify`) into a
:class:`~inferq.models.FailureKind`:

=====================  =====================================================  ==============
kind                   examples                                               attempts
=====================  =====================================================  ==============
``infrastructure``     connection refused or reset (an answer cut off by a      not spent;
                       dying server included), 502/503/504, 429, a timeout     the deadline
                       before the first byte                                   bounds them
``server``             500 and other 5xx, 408, a malformed answer, a backend   spent (at most
                       that raised                                             ``max_attempts``)
``truncated``          a stream that ended cleanly without a finish reason or  spent
                       ``[DONE]``, a 200 with an empty body
``request``            any other 4xx (the request itself is invalid)           fails at once
=====================  =====================================================  ==============

A model server outage is then not charged to its requests (a 30 s restart under load
loses nothing whose deadline is later), while a request that keeps breaking a healthy
server still ends in the dead letter after ``max_attempts``.

Retries wait before they may be dispatched again: exponential backoff with *full jitter*
(``uniform(0, min(cap, base * 2**n))``, AWS Architecture Blog, "Exponential Backoff And
Jitter", M. Brooker, 2015: of the schemes compared it does the least work and spreads
retries best), never less than the server's ``Retry-After`` (honoured up to
``RETRY_AFTER_CAP_S``). The delay is kept in Redis as a not-before time on Redis TIME
(``requeue.lua``'s delayed set, ``promote.lua``), so no worker clock is involved.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from inferq import defaults
from inferq.models import FailureKind
from inferq.workers.servers.base import ServerError

#: HTTP statuses that mean the server (or a proxy before it) is down or overloaded, not
#: that it failed on this request: 429 Too Many Requests, 502 Bad Gateway, 503 Service
#: Unavailable, 504 Gateway Timeout (RFC 9110 section 15.6; RFC 6585 section 4).
INFRASTRUCTURE_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """What to do with a failed request.

    Attributes:
        kind: the failure's kind.
        retry: False: fail it now with the error (a request error).
        spend_attempt: True when the attempt counts towards ``max_attempts``.
        delay_s: seconds before it may be dispatched again (backoff).
    """

    kind: FailureKind
    retry: bool
    spend_attempt: bool
    delay_s: float


def classify(error: ServerError) -> FailureKind:
    """The kind of ``error``: its own ``kind`` when the model server set one, else from
    its HTTP status (:data:`INFRASTRUCTURE_STATUSES`: infrastructure; other 4xx but 408:
    request; anything else retryable: server)."""
    if error.kind is not None:
        return error.kind
    if error.status in INFRASTRUCTURE_STATUSES:
        return FailureKind.INFRASTRUCTURE
    if not error.retryable:
        return FailureKind.REQUEST
    return FailureKind.SERVER


def backoff_s(
    failures: int,
    *,
    base_s: float = defaults.RETRY_BACKOFF_BASE_S,
    cap_s: float = defaults.RETRY_BACKOFF_CAP_S,
    rng: random.Random | None = None,
) -> float:
    """Full-jitter exponential backoff: ``uniform(0, min(cap_s, base_s * 2**(failures-1)))``.

    Args:
        failures: failures of this request so far, this one included (>= 1).
        base_s / cap_s: the first ceiling and the largest ceiling, seconds.
        rng: the random source (seed one for reproducible tests).

    Returns:
        Seconds to wait, in ``[0, cap_s]``.
    """
    ceiling = min(cap_s, base_s * 2.0 ** min(max(failures, 1) - 1, 62))
    return (rng or random).uniform(0.0, ceiling)


def honoured_retry_after_s(retry_after_s: float) -> float:
    """A server's ``Retry-After`` as honoured: within ``[0, RETRY_AFTER_CAP_S]`` (an
    absurd value, ``1e9`` or negative, must not park a request or a worker)."""
    return min(defaults.RETRY_AFTER_CAP_S, max(0.0, retry_after_s))


def plan(error: ServerError, failures: int, *, rng: random.Random | None = None) -> RetryPlan:
    """The retry of a request that failed with ``error`` after ``failures`` failures
    (this one included): kind, whether it spends an attempt, and its delay — the jittered
    backoff, at least the server's ``Retry-After`` (:func:`honoured_retry_after_s`), at
    most the backoff cap unless the server asked for more."""
    kind = classify(error)
    if kind is FailureKind.REQUEST:
        return RetryPlan(kind, retry=False, spend_attempt=True, delay_s=0.0)
    delay = backoff_s(failures, rng=rng)
    if error.retry_after_s is not None:
        delay = max(delay, honoured_retry_after_s(error.retry_after_s))
    return RetryPlan(
        kind,
        retry=True,
        spend_attempt=kind is not FailureKind.INFRASTRUCTURE,
        delay_s=delay,
    )
