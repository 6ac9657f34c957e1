"""The retry rules of inferq.workers.failures: kinds, attempts spent, full-jitter backoff."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq import defaults
from inferq.workers.failures import backoff_s, classify, plan
from inferq.workers.servers import FailureKind, ServerError


def error(status: int | None = None, *, retryable: bool = True, **kw: object) -> ServerError:
    return ServerError("x", retryable=retryable, status=status, **kw)  # type: ignore[arg-type]


def test_kinds_from_status_and_flags() -> None:
    assert classify(error(503)) is FailureKind.INFRASTRUCTURE
    assert classify(error(429)) is FailureKind.INFRASTRUCTURE
    assert classify(error(500)) is FailureKind.SERVER
    assert classify(error(None)) is FailureKind.SERVER  # a backend that raised
    assert classify(error(400, retryable=False)) is FailureKind.REQUEST
    assert classify(error(None, kind=FailureKind.TRUNCATED)) is FailureKind.TRUNCATED


def test_only_infrastructure_failures_spare_the_attempt() -> None:
    rng = random.Random(1)
    assert not plan(error(503), 1, rng=rng).spend_attempt
    assert plan(error(500), 1, rng=rng).spend_attempt
    assert plan(error(kind=FailureKind.TRUNCATED), 1, rng=rng).spend_attempt
    request = plan(error(422, retryable=False), 1, rng=rng)
    assert not request.retry and request.delay_s == 0


@given(st.integers(min_value=1, max_value=10_000), st.integers(min_value=0, max_value=2**32))
def test_backoff_is_within_its_full_jitter_ceiling(failures: int, seed: int) -> None:
    delay = backoff_s(failures, rng=random.Random(seed))
    ceiling = min(
        defaults.RETRY_BACKOFF_CAP_S, defaults.RETRY_BACKOFF_BASE_S * 2 ** min(failures - 1, 62)
    )
    assert 0.0 <= delay <= ceiling


def test_backoff_grows_exponentially_on_average() -> None:
    rng = random.Random(7)
    means = [sum(backoff_s(n, rng=rng) for _ in range(2000)) / 2000 for n in (1, 3, 5)]
    # full jitter's mean is half the ceiling: 0.125, 0.5, 2.0 s for base 0.25 s
    for mean, ceiling in zip(means, (0.25, 1.0, 4.0), strict=True):
        assert 0.4 * ceiling < mean < 0.6 * ceiling


@given(st.floats(min_value=0, max_value=600), st.integers(min_value=1, max_value=50))
def test_retry_after_is_a_floor_on_the_delay(retry_after: float, failures: int) -> None:
    """Honoured up to RETRY_AFTER_CAP_S (30 s): a longer one was honoured in full until an
    attack with ``Retry-After: 1000000000`` parked a request until its deadline."""
    retry = plan(error(429, retry_after_s=retry_after), failures, rng=random.Random(0))
    assert retry.delay_s >= min(retry_after, defaults.RETRY_AFTER_CAP_S)


@pytest.mark.parametrize("retry_after", [1e9, 1e300, 31.0, -5.0, 0.0])
def test_an_absurd_retry_after_is_capped(retry_after: float) -> None:
    for failures in (1, 5, 60):
        retry = plan(error(503, retry_after_s=retry_after), failures, rng=random.Random(1))
        assert 0.0 <= retry.delay_s <= defaults.RETRY_AFTER_CAP_S
