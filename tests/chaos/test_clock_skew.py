"""A worker whose host clock is 15 s ahead judges every deadline and timing on Redis TIME
(issue 13, fault 4).

Before: the worker computed a request's time left and its first-token time from its
host's wall clock, so with the clock 15 s ahead a request with 10 s left expired in
0.02 s and reported ``ttft_ms = -14994``. The worker now carries Redis TIME on its
monotonic clock (``inferq/workers/clock.py``) and never reads the wall clock for that.

The shifted clock is ``tests/fakes/skewed_clock.py``'s: the worker's ``time.time`` and
``time.time_ns`` run 15 s ahead (libfaketime cannot shift a Python process here; see
that module).
"""

from __future__ import annotations

from .conftest import Deployment

SKEW_S = 15.0


def test_a_worker_clock_15_s_ahead_neither_expires_early_nor_reports_negative_ttft(
    deployment: Deployment,
) -> None:
    d = deployment
    d.dispatcher()
    d.worker("skewed", time_scale=1.0, module=("tests.fakes.skewed_clock", repr(SKEW_S)))
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


def test_a_streamed_requests_first_chunk_is_stamped_on_redis_time(
    deployment: Deployment,
) -> None:
    """The first chunk of a stream carries the time the worker received the first token:
    it was read from the worker's wall clock, 15 s ahead, so a stream reader's time to
    first token (``first_token_at - submitted_at``) came out 15 s too long (issue 13
    attack)."""
    from inferq.models import StreamChunk

    d = deployment
    d.dispatcher()
    d.worker("skewed", time_scale=1.0, module=("tests.fakes.skewed_clock", repr(SKEW_S)))
    handle = d.client.submit("s", priority="realtime", max_tokens=16, timeout=10, stream=True)
    chunks = [item for item in handle.stream(timeout=30) if isinstance(item, StreamChunk)]
    record = handle.status()
    stamped = [c.first_token_at for c in chunks if c.first_token_at is not None]
    assert stamped, chunks
    ttft = stamped[0] - record.request.submitted_at
    assert 0 < ttft < 10, ttft
