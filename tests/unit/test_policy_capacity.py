"""The capacity model: what one worker carries with its class targets met."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.config import ModelSpec, Settings
from inferq.devices import profile_for
from inferq.latency import service_time, step_s
from inferq.policy.capacity import (
    censoring_factor,
    mean_in_service_s,
    strictest_tpot,
    time_on_test_s,
    tpot_concurrency,
    worker_capacity,
)

# Pinned: an 8B model on an H200 (the measured card), 110 GiB of KV cache.
SPEC = ModelSpec(
    name="llama-3.1-8b",
    params_b=8,
    weights_mib=15_320,
    kv_bytes_per_token=131_072,
    max_context=131_072,
    cold_start_s=15,
    latency=profile_for("h200", "llama-3.1-8b"),
)
KV_MIB = 112_640  # 110 GiB: 901,120 tokens of 128 KiB


def test_kv_cache_limits_a_long_context_mix() -> None:
    cap = worker_capacity(SPEC, KV_MIB, 256, 30_000, 200, tpot_s=None, occupancy=0.9)
    assert cap.limited_by == "kv_cache"
    assert cap.kv_share == pytest.approx(0.9)
    # what the dispatcher reserves (prompt + output), not the 30,100 resident on average
    assert cap.concurrency == pytest.approx(0.9 * 901_120 / 30_200)
    assert cap.kv_tokens == pytest.approx(cap.concurrency * 30_100)


def test_tpot_limits_when_the_cache_is_not_the_bottleneck() -> None:
    cap = worker_capacity(SPEC, KV_MIB, 256, 8_000, 200, tpot_s=0.01, occupancy=0.9)
    assert cap.limited_by == "tpot"
    # The step at that concurrency is exactly the target.
    assert step_s(SPEC, int(cap.concurrency), cap.kv_tokens) <= 0.01 + 1e-9
    assert step_s(SPEC, int(cap.concurrency) + 2, cap.kv_tokens + 2 * 8_100) > 0.01


def test_slots_limit_a_short_mix() -> None:
    cap = worker_capacity(SPEC, KV_MIB, 8, 500, 200, tpot_s=0.1, occupancy=0.9)
    assert cap.limited_by == "slots" and cap.concurrency == 8
    assert cap.rate == pytest.approx(8 / service_time(SPEC, 500, 200, 8).total_s)


def test_an_impossible_tpot_still_runs_one_sequence() -> None:
    assert tpot_concurrency(SPEC, 1000, 0.001) == 0.0  # the weights alone take 3.7 ms
    cap = worker_capacity(SPEC, KV_MIB, 256, 1000, 200, tpot_s=0.001, occupancy=0.9)
    assert cap.concurrency == 1.0


def test_strictest_tpot_of_the_default_classes() -> None:
    assert strictest_tpot(Settings.load().classes) == 0.1
    assert strictest_tpot([]) is None


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="slots"):
        worker_capacity(SPEC, KV_MIB, 0, 1, 1, None, 0.9)
    with pytest.raises(ValueError, match="occupancy"):
        worker_capacity(SPEC, KV_MIB, 8, 1, 1, None, 1.5)


@given(
    st.integers(0, 100_000),
    st.integers(1, 4_000),
    st.integers(1, 512),
    st.floats(0.05, 1.0),
    st.one_of(st.none(), st.floats(0.005, 0.5)),
)
def test_capacity_stays_within_every_limit(
    prompt: int, out: int, slots: int, occ: float, tpot: float | None
) -> None:
    cap = worker_capacity(SPEC, KV_MIB, slots, prompt, out, tpot, occ)
    assert 1.0 <= cap.concurrency <= slots
    if cap.concurrency > 1:
        assert cap.kv_share <= occ + 1e-9
    assert cap.rate > 0


# --- the censoring correction (issue 16: the first finishes are the short requests) ---


@given(
    measured=st.floats(0.01, 1_000),
    in_service=st.floats(0, 10_000),
    margin=st.floats(0, 1),
)
def test_the_censoring_factor_only_ever_lowers_a_capacity(
    measured: float, in_service: float, margin: float
) -> None:
    f = censoring_factor(measured, in_service, margin)
    assert 0 < f <= 1
    if in_service <= (1 + margin) * measured:  # the finishes agree with the running
        assert f == 1
    else:  # the corrected service time is the one in service, less the margin
        assert measured / f == pytest.approx(in_service / (1 + margin))


def test_nothing_running_or_entering_leaves_the_capacity_alone() -> None:
    assert mean_in_service_s(0, 9.0) == 0.0
    assert mean_in_service_s(50, 0.0) == 0.0
    assert censoring_factor(2.0, 0.0, 0.2) == 1.0


def _lognormal_start(sigma: float, elapsed_s: float, seed: int) -> tuple[float, float, float]:
    """A fleet that starts empty: Poisson arrivals at 20/s from 0, lognormal service
    times of mean 15 s. At ``elapsed_s``: (mean of the last 10 s of finishes, the mean
    time in service as :func:`mean_in_service_s` has it from Little's law and the last
    10 s's time on test, the true mean service time)."""
    rng = random.Random(seed)
    mean_s, rate = 15.0, 20.0
    mu = math.log(mean_s) - sigma**2 / 2
    t, finished, running = 0.0, [], []
    while True:
        t += rng.expovariate(rate)
        if t >= elapsed_s:
            break
        end = t + rng.lognormvariate(mu, sigma)
        if end <= elapsed_s:
            if end >= elapsed_s - 10:
                finished.append((end, end - t))
        else:
            running.append(t)
    tested = time_on_test_s(finished, running, elapsed_s - 10, elapsed_s)
    served = mean_in_service_s(len(running), rate, tested)
    return sum(took for _, took in finished) / len(finished), served, mean_s


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("elapsed_s", [10.0, 20.0, 40.0])
def test_on_a_lognormal_start_the_correction_is_less_biased_and_never_overshoots(
    sigma: float, elapsed_s: float
) -> None:
    measured, served, true_s = _lognormal_start(sigma, elapsed_s, seed=7)
    corrected = measured / censoring_factor(measured, served, 0.2)
    # the finishes alone see only the short requests: biased low
    assert measured < 0.92 * true_s
    # the running requests counted: never further from the truth, and never past it
    # (Little's law estimates E[min(S, elapsed)] <= E[S]; the time on test, with few
    # finishes, would overshoot, and the smaller of the two is taken), so a capacity
    # corrected by it is never below what a worker carries. Not unbiased: nothing seen
    # before a long request ends can tell how long it is.
    assert measured <= corrected <= true_s
    if sigma >= 1.0 and elapsed_s <= 20.0:  # heavy tail, early: a large correction
        assert corrected >= 1.2 * measured


def test_after_a_burst_its_last_long_requests_are_not_taken_for_the_mean() -> None:
    # inferq demo's 70B batch burst (issue 24, item 5): 420 finishes of 0.08 s in the
    # window, the last 16 running since 1.4 s, nothing dispatched since. Little's law
    # over the rate they entered at reads 1.4 s each; the time on test, 0.13 s.
    now, start = 100.0, 90.0
    finishes = [(98.0 + i * 0.003, 0.08) for i in range(420)]
    tested = time_on_test_s(finishes, [now - 1.4] * 16, start, now)
    assert tested == pytest.approx((420 * 0.08 + 16 * 1.4) / 420)
    served = mean_in_service_s(16, 16 / 1.4, tested)
    assert served == pytest.approx(tested)
    assert censoring_factor(0.08, served, 0.2) > 0.7  # Little alone: 0.07


def test_time_on_test_counts_only_the_window() -> None:
    # a finish whose service began before the window counts its part inside it; a
    # request running since before the window counts from the window's start
    assert time_on_test_s([(12.0, 5.0), (15.0, 1.0)], [5.0, 18.0], 10.0, 20.0) == (
        pytest.approx((2.0 + 1.0 + 10.0 + 2.0) / 2)
    )
    assert time_on_test_s([], [5.0], 10.0, 20.0) is None


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.5])
def test_in_steady_state_the_correction_does_not_apply(sigma: float) -> None:
    # long after the start, finishes and Little's law estimate the same mean
    measured, served, _ = _lognormal_start(sigma, 3_000.0, seed=11)
    assert censoring_factor(measured, served, 0.2) == 1.0
