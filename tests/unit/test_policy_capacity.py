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
    strictest_tpot,
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
    running=st.floats(0, 10_000),
    rate=st.floats(0.001, 1_000),
    margin=st.floats(0, 1),
)
def test_the_censoring_factor_only_ever_lowers_a_capacity(
    measured: float, running: float, rate: float, margin: float
) -> None:
    f = censoring_factor(measured, running, rate, margin)
    assert 0 < f <= 1
    little_s = running / rate
    if little_s <= (1 + margin) * measured:  # the finishes agree with Little's law
        assert f == 1
    else:  # the corrected service time is Little's, less the margin
        assert measured / f == pytest.approx(little_s / (1 + margin))


def test_nothing_running_or_arriving_leaves_the_capacity_alone() -> None:
    assert censoring_factor(2.0, 0, 9.0, 0.2) == 1.0
    assert censoring_factor(2.0, 50, 0.0, 0.2) == 1.0


def _lognormal_start(sigma: float, elapsed_s: float, seed: int) -> tuple[float, float, float]:
    """A fleet that starts empty: Poisson arrivals at 20/s from 0, lognormal service
    times of mean 15 s. At ``elapsed_s``: (mean of the last 10 s of finishes, running
    / rate as Little's law has it, the true mean service time)."""
    rng = random.Random(seed)
    mean_s, rate = 15.0, 20.0
    mu = math.log(mean_s) - sigma**2 / 2
    t, finished, running = 0.0, [], 0
    while True:
        t += rng.expovariate(rate)
        if t >= elapsed_s:
            break
        end = t + rng.lognormvariate(mu, sigma)
        if end <= elapsed_s:
            if end >= elapsed_s - 10:
                finished.append(end - t)
        else:
            running += 1
    return sum(finished) / len(finished), running / rate, mean_s


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("elapsed_s", [10.0, 20.0, 40.0])
def test_on_a_lognormal_start_the_correction_is_less_biased_and_never_overshoots(
    sigma: float, elapsed_s: float
) -> None:
    measured, little_s, true_s = _lognormal_start(sigma, elapsed_s, seed=7)
    corrected = measured / censoring_factor(measured, little_s * 20.0, 20.0, 0.2)
    # the finishes alone see only the short requests: biased low
    assert measured < 0.92 * true_s
    # Little's law counts the long ones still running: never further from the truth, and
    # never past it (it estimates E[min(S, elapsed)] <= E[S]), so a capacity corrected by
    # it is never below what a worker carries. Not unbiased: nothing seen before a long
    # request ends can tell how long it is (at 20 s: 4.2 -> 6.1 s for sigma 1.5, truth 15).
    assert measured <= corrected <= true_s
    if sigma >= 1.0 and elapsed_s <= 20.0:  # heavy tail, early: a large correction
        assert corrected >= 1.2 * measured


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.5])
def test_in_steady_state_the_correction_does_not_apply(sigma: float) -> None:
    # long after the start, finishes and Little's law estimate the same mean
    measured, little_s, _ = _lognormal_start(sigma, 3_000.0, seed=11)
    assert censoring_factor(measured, little_s * 20.0, 20.0, 0.2) == 1.0
