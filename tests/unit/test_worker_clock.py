"""The worker's clock: Redis TIME carried by the monotonic clock, never the host's wall clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.workers.clock import WINDOW, RedisClock


class Ticks:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_before_any_reading_it_falls_back_and_says_so() -> None:
    clock = RedisClock(monotonic=Ticks(), fallback=lambda: 42.0)
    assert not clock.synced and clock.now() == 42.0
    with pytest.raises(RuntimeError, match="no reading"):
        clock.offset_s()


def test_a_host_clock_15_s_ahead_is_never_read() -> None:
    ticks = Ticks()
    clock = RedisClock(monotonic=ticks, fallback=lambda: 1.7e9 + 15.0)
    clock.observe(1_700_000_000_000)
    ticks.t += 2.5
    assert clock.now() == pytest.approx(1_700_000_002.5)


@given(delays=st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=1, max_size=40))
def test_delayed_readings_never_make_it_early_and_the_least_delayed_wins(
    delays: list[float],
) -> None:
    """A reading arrives ``delay`` s after Redis took it: the clock may be late by the
    smallest delay of its window, never early."""
    ticks = Ticks()
    clock = RedisClock(monotonic=ticks)
    offset = 1.7e9  # the true Redis time minus the monotonic clock
    for delay in delays:
        ticks.t += 1.0
        clock.observe(round((ticks.t - delay + offset) * 1000))
    error = (ticks.t + offset) - clock.now()
    assert error >= -0.001  # never early (1 ms of rounding)
    assert error == pytest.approx(min(delays[-WINDOW:]), abs=0.001)
