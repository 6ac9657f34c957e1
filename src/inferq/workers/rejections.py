"""Is this request bad, or is this server broken? A run of the same refusal decides.

A model server that refuses every request (HTTP 400 to all of them: a wrong
``--served-model-name``, a chat template that fails on every prompt, a proxy that
rewrites bodies) answers with a *request* error (:mod:`inferq.workers.failures`), so
each request failed at once as the caller's fault and the worker stayed ``ready``: the
dispatcher kept sending it work and every request routed there failed, for ever.

One refusal is the caller's error (a ``max_tokens`` of -3): it must not touch the
worker. The same refusal for ``BROKEN_SERVER_STREAK`` requests in a row, with no
success between them, from at least ``BROKEN_SERVER_TENANTS`` different tenants, is
the server's: no two callers make the same mistake by chance, over and over, while
nothing in between succeeds. :class:`RejectionStreak` keeps that run; it is pure (no
clock, no I/O), the worker feeds it every outcome.
"""

from __future__ import annotations

import re

from inferq import defaults

_NUMBER = re.compile(r"\d+")


def signature(status: int | None, message: str) -> str:
    """What two refusals share when they are "the same error": the HTTP status and the
    message with its numbers blanked (``got -3`` and ``got 7`` are one refusal: a
    server that rejects every prompt's length names each one's)."""
    return f"{status}:{_NUMBER.sub('#', message.strip())[:200]}"


class RejectionStreak:
    """The current run of identical request refusals on one model server.

    Args:
        length: refusals in a row that make the server broken (>= 1).
        tenants: distinct tenants among them, at least (>= 1).
    """

    def __init__(
        self,
        *,
        length: int = defaults.BROKEN_SERVER_STREAK,
        tenants: int = defaults.BROKEN_SERVER_TENANTS,
    ) -> None:
        if length < 1 or tenants < 1:
            raise ValueError("length and tenants must be >= 1")
        self.length = length
        self.tenants = tenants
        self._signature: str | None = None
        self._requests: set[str] = set()
        self._tenants: set[str] = set()

    def succeeded(self) -> None:
        """A request succeeded on the server: whatever refused before was the request."""
        self._signature = None
        self._requests.clear()
        self._tenants.clear()

    def refused(self, sig: str, *, request_id: str, tenant: str) -> bool:
        """Record a refusal (its :func:`signature`); True when the run now says the
        server is broken: ``length`` distinct requests refused alike, from at least
        ``tenants`` tenants, with no success and no other refusal between them. A
        request refused again (a retry) does not lengthen the run."""
        if sig != self._signature:
            self.succeeded()
            self._signature = sig
        self._requests.add(request_id)
        self._tenants.add(tenant)
        return len(self._requests) >= self.length and len(self._tenants) >= self.tenants

    @property
    def run(self) -> int:
        """Distinct requests in the current run."""
        return len(self._requests)
