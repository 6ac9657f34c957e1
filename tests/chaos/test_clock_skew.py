"""A worker whose host clock is 15 s ahead judges every deadline and timing on Redis TIME
(issue 13, fault 4).

Before: the worker computed a request's time left and its first-token time from its
host's wall clock, so with the clock 15 s ahead a request with 10 s left expired in
0.02 s and reported ``ttft_ms = -14994``. The worker now carries Redis TIME on its
monotonic clock (``inferq/workers/clock.py``) and never reads the wall clock for that.

The shifted clock is libfaketime's (Debian's ``faketime``; ``.ci/run`` installs it),
skipped where it is missing (failed under ``INFERQ_REQUIRE_TOOLS=1``).
``FAKETIME=+15s`` shifts the monotonic clock by the same 15 s too: libfaketime
0.9.10 with ``DONT_FAKE_MONOTONIC=1`` breaks Python's ``time.sleep``
(``clock_nanosleep`` with an absolute monotonic time fails with EINVAL), and a
constant shift of the monotonic clock changes no interval the worker measures.
"""

from __future__ import annotations

from ..tools import require_tool
from .conftest import Deployment

SKEW_S = 15.0


def test_a_worker_clock_15_s_ahead_neither_expires_early_nor_reports_negative_ttft(
    deployment: Deployment,
) -> None:
    faketime = require_tool("faketime", "apt-get install faketime")
    d = deployment
    d.dispatcher()
    d.worker("skewed", time_scale=1.0, wrapper=[faketime, "-f", f"+{SKEW_S:g}s"])
    handles = [
        d.client.submit(f"q{i}", priority="realtime", max_tokens=16, timeout=10) for i in range(3)
    ]
    for handle in handles:
        result = handle.result(timeout=30)
        assert result.status == "succeeded", (result.status, result.error, d.logs())
        ttft = result.timings.ttft_s
        e2e = result.timings.e2e_s
        assert ttft is not None and e2e is not None
        assert 0 < ttft <= e2e < 10, (ttft, e2e)
