"""Requests and tokens per minute per tenant, shared by every gateway replica.

Built on the ``limits`` library (its sliding-window-counter strategy, Redis storage
through redis-py), under the deployment's prefix (``P ratelimit:``, see
:mod:`inferq.store.keys`), so any number of gateway replicas count together and the
counts live as long as one window. Tokens are counted at admission as the request's
prompt estimate plus its ``max_tokens`` (the most it can cost), the same figure the
queue limits and the scheduler's estimates use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from inferq.gateway.tenants import ApiKey
from inferq.store import Keys


@dataclass(frozen=True, slots=True)
class Refusal:
    """A rate limit that refused a request.

    Attributes:
        what: ``requests`` or ``tokens``.
        limit: the per-minute limit.
        retry_after_s: seconds until the window has room again (>= 1).
    """

    what: str
    limit: int
    retry_after_s: int

    def message(self, tenant: str) -> str:
        return (
            f"rate limit: tenant {tenant!r} may use {self.limit} {self.what} per minute; "
            f"retry after {self.retry_after_s} s"
        )


def storage_uri(redis_url: str) -> str:
    """The ``limits`` async storage URI of a redis-py URL (``redis://`` -> ``async+redis://``)."""
    return redis_url if redis_url.startswith("async+") else f"async+{redis_url}"


class RateLimits:
    """Per-tenant rate limits on the deployment's Redis.

    Args:
        redis_url: the deployment's Redis.
        keys: the deployment's key builder (the limits' key prefix comes from it).
    """

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.storage = RedisStorage(
            storage_uri(redis_url), implementation="redispy", key_prefix=keys.rate_limits
        )
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)

    async def admit(self, key: ApiKey, tokens: int) -> Refusal | None:
        """Count one request of ``tokens`` for the key's tenant; the refusal when over a limit.

        A request refused by the token limit still counts as a request (it was made).
        """
        if key.requests_per_minute is not None:
            item = RateLimitItemPerMinute(key.requests_per_minute, namespace="req")
            if not await self.limiter.hit(item, key.tenant):
                return await self._refusal(item, key.tenant, "requests")
        if key.tokens_per_minute is not None:
            item = RateLimitItemPerMinute(key.tokens_per_minute, namespace="tok")
            cost = min(tokens, key.tokens_per_minute)  # a request larger than the limit
            if not await self.limiter.hit(item, key.tenant, cost=max(1, cost)):
                return await self._refusal(item, key.tenant, "tokens")
        return None

    async def _refusal(self, item: RateLimitItemPerMinute, tenant: str, what: str) -> Refusal:
        stats = await self.limiter.get_window_stats(item, tenant)
        wait = max(1, math.ceil(stats.reset_time - time.time()))
        return Refusal(what, item.amount, wait)
