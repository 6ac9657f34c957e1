"""``inferq demo`` end to end (a short window of the real trace) and its pieces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.config import Settings
from inferq.demo import (
    DemoOptions,
    LiveSample,
    TraceClock,
    build_workload,
    compressed,
    idle_worker_s,
    keep_up,
    parse_fleet_cards,
)
from inferq.errors import ConfigError
from inferq.latency import service_time
from inferq.reporting import KEEP_UP_SHARE, fell_behind, lag_summary


def test_workload_maps_traces_to_classes_routes_and_a_synthetic_batch() -> None:
    settings = Settings.load()
    work = build_workload(DemoOptions(duration_s=60), settings)
    by_class = {c: [r for r in work if r.priority == c] for c in ("realtime", "standard", "batch")}
    assert all(by_class.values())
    assert {r.route for r in by_class["realtime"]} == {"llama-3.1-8b"}
    assert {r.route for r in by_class["standard"]} == {">=8b"}
    assert {r.route for r in by_class["batch"]} == {"llama-3.1-70b-awq"}
    assert {r.source for r in by_class["batch"]} == {"synthetic"}
    assert [r.arrival_s for r in work] == sorted(r.arrival_s for r in work)


def test_compression_keeps_one_clock() -> None:
    base = Settings.load()
    fast = compressed(base, 10)
    rt, spec = fast.class_by_name["realtime"], fast.model_by_name["llama-3.1-8b"]
    assert rt.sla_s == pytest.approx(0.2) and rt.timeout_s == pytest.approx(12)
    slow = base.model_by_name["llama-3.1-8b"]
    assert service_time(spec, 1000, 100, 4).total_s == pytest.approx(
        service_time(slow, 1000, 100, 4).total_s / 10
    )
    assert spec.cold_start_s == pytest.approx(1.5)
    assert fast.scaling.idle_s == pytest.approx(30)
    assert fast.scaling.down_window_s == pytest.approx(base.scaling.down_window_s / 10)


def test_fleet_option_is_checked() -> None:
    settings = Settings.load()
    assert parse_fleet_cards("llama-3.1-8b:2@24576", settings)[0].count == 2
    with pytest.raises(ConfigError, match="unknown model 'gpt'"):
        parse_fleet_cards("gpt:1", settings)
    with pytest.raises(ConfigError, match="needs 37928 MiB of weights"):
        parse_fleet_cards("llama-3.1-70b-awq:1@24576", settings)
    with pytest.raises(ConfigError, match="is not model:count@vram_mib"):
        parse_fleet_cards("llama-3.1-8b:x", settings)


def test_lag_rule_names_what_fell_behind_by_more_than_a_tenth_of_the_tightest_sla() -> None:
    sla = {"realtime": 2.0, "standard": 10.0}
    assert fell_behind({"replay_lag": 0.19, "timer_lag": 0.2}, sla) == {}
    assert fell_behind({"replay_lag": 0.21, "timer_lag": None}, sla) == {"replay_lag": 0.21}
    assert fell_behind({"replay_lag": 5.0}, {}) == {}


@given(
    st.dictionaries(st.sampled_from(["replay_lag", "timer_lag"]), st.floats(0, 100)),
    st.dictionaries(st.sampled_from(["realtime", "batch"]), st.floats(0.01, 100), min_size=1),
)
def test_lag_rule_is_a_threshold_on_the_tightest_sla(
    lags: dict[str, float], sla: dict[str, float]
) -> None:
    behind = fell_behind(lags, sla)
    limit = KEEP_UP_SHARE * min(sla.values())
    assert behind == {n: v for n, v in lags.items() if v > limit}


def test_lag_summary_scales_into_trace_seconds_and_counts_early_as_on_time() -> None:
    summary = lag_summary([-0.01, 0.0, 0.02, 0.1], scale=10)
    assert summary == {"n": 4, "p50_s": 0.0, "p99_s": 1.0, "max_s": 1.0}
    assert lag_summary([])["p99_s"] is None


def test_keep_up_says_the_machine_was_the_bottleneck_and_how_to_rerun() -> None:
    clock = TraceClock(10)
    sla = {"realtime": 2.0, "batch": 60.0}
    fine = keep_up(clock, sla, [0.001] * 100, [0.002] * 100, (None, None))
    assert fine["machine_bound"] is False and fine["verdict"] is None
    # 40 ms of wall time late at 10x is 0.4 s of trace: 20% of the realtime SLA.
    slow = keep_up(clock, sla, [0.04] * 100, [0.002] * 100, ((0, 100), (5, 200)))
    assert slow["machine_bound"] and slow["behind"] == {"replay_lag": pytest.approx(0.4)}
    assert slow["replay_lag"]["wall"]["p99_s"] == pytest.approx(0.04)
    assert slow["cpu_steal_share"] == pytest.approx(0.05)
    assert slow["rerun_speedup"] == 5
    assert "machine, not the scheduler" in slow["verdict"]
    assert "inferq demo --speedup 5" in slow["verdict"]
    assert "0.40 s late at p99 (40 ms of wall time)" in slow["verdict"]


def test_trace_clock_reports_reasons_in_trace_seconds_and_no_time_before_the_replay() -> None:
    clock = TraceClock(10, t0_redis=1000.0)
    reason = "oldest realtime wait 0.1 s > 0.1 s (0.5 x SLA 0.2 s)"
    assert clock.reason(reason) == "oldest realtime wait 1.0 s > 1.0 s (0.5 x SLA 2.0 s)"
    rate = "need 2.00: arrivals 20.00 req/s x 0.05 s / 16 slots; 2 starting counted"
    assert (
        clock.reason(rate)
        == "need 2.00: arrivals 2.00 req/s x 0.50 s / 16 slots; 2 starting counted"
    )
    assert clock.at_s(999.9) is None
    assert clock.at_s(1001.0) == 10.0


def test_a_lag_that_cost_no_sla_is_a_figure_not_a_warning() -> None:
    """A fresh user's 5x run met 99-100% and still read "the machine was the
    bottleneck": the replay submits the batch job in one call, so its p99 lag passes
    the threshold whatever the machine. The verdict needs a missed SLA too."""
    clock = TraceClock(10)
    sla = {"realtime": 2.0, "batch": 60.0}
    late = [0.04] * 100  # 0.4 s of trace at p99: over 10% of the realtime SLA
    met = keep_up(clock, sla, late, [0.002] * 100, (None, None), {"realtime": 1.0, "batch": 0.995})
    assert met["verdict"] is None and not met["machine_bound"]
    assert met["replay_lag"]["trace"]["p99_s"] == pytest.approx(0.4)  # still reported
    missed = keep_up(
        clock, sla, late, [0.002] * 100, (None, None), {"realtime": 0.45, "batch": None}
    )
    assert missed["machine_bound"] and "machine, not the scheduler" in missed["verdict"]


def test_idle_worker_seconds_hold_each_samples_idle_count_until_the_next_in_trace_seconds() -> None:
    """Issue 24: the figure a late scale-up costs. Two idle ready workers for 1 wall
    second, then one for 2, at 10x: 2 x 10 + 1 x 20 = 40 trace worker-seconds (the last
    sample holds nothing: nothing follows it)."""
    m = "llama-3.1-70b-awq"
    samples = [
        LiveSample(0.0, {}, {m: 2}, {}, 0.0, 0.0, idle=2),
        LiveSample(1.0, {}, {m: 2}, {}, 0.0, 0.0, idle=1),
        LiveSample(3.0, {}, {m: 1}, {}, 0.0, 0.0, draining={m: 1}, idle=1),
    ]
    assert idle_worker_s(samples, TraceClock(10.0)) == 40.0
    assert idle_worker_s(samples[:1], TraceClock(10.0)) == 0.0
