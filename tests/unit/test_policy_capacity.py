"""The capacity model: what one worker carries with its class targets met."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.config import ModelSpec, Settings
from inferq.devices import profile_for
from inferq.latency import service_time, step_s
from inferq.policy.capacity import strictest_tpot, tpot_concurrency, worker_capacity

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
