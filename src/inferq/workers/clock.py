"""The worker's clock: Redis TIME, carried between readings by the monotonic clock.

Every deadline and timing in inferq is judged on Redis TIME (the Lua scripts read it,
``includes/clock.lua``), so hosts whose clocks disagree still agree on when a request
is due. A worker needs "now" between round trips too (how long a request has left, when
its first token came), so it keeps the offset between Redis TIME and its own monotonic
clock, refreshed by every heartbeat reply, and never reads its host's wall clock: a
worker whose clock is 15 s ahead neither expires a request with 10 s left nor reports a
negative TTFT (issue 13, fault 4).

A reading arrives some time after Redis took it (the reply's way back, a busy or
stalled process), so it can only make the clock look *late*, never early: the clock
keeps the largest offset of its last few readings, the one delayed least.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

#: Readings kept: at one heartbeat a second, the best of the last 16 s. Long enough to
#: skip a reading delayed by a stall; short enough to follow a stepped Redis clock.
WINDOW = 16


class RedisClock:
    """Epoch seconds on Redis TIME, between readings on the monotonic clock.

    Args:
        monotonic: the monotonic clock, seconds (a test may pass its own).
        fallback: wall clock used only before the first reading, epoch seconds.
    """

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        fallback: Callable[[], float] = time.time,
    ) -> None:
        self._monotonic = monotonic
        self._fallback = fallback
        self._offsets: deque[float] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()

    @property
    def synced(self) -> bool:
        """True once a Redis reading arrived."""
        return bool(self._offsets)

    def observe(self, redis_ms: int) -> None:
        """Take a Redis TIME reading (milliseconds since the epoch) that has just arrived."""
        offset = redis_ms / 1000.0 - self._monotonic()
        with self._lock:
            self._offsets.append(offset)

    def offset_s(self) -> float:
        """Redis epoch seconds minus the monotonic clock (the best recent reading).

        Raises:
            RuntimeError: no reading yet.
        """
        with self._lock:
            if not self._offsets:
                raise RuntimeError("the Redis clock has no reading yet")
            return max(self._offsets)

    def now(self) -> float:
        """Epoch seconds on Redis TIME (the host's wall clock before the first reading)."""
        with self._lock:
            if not self._offsets:
                return self._fallback()
            offset = max(self._offsets)
        return self._monotonic() + offset
