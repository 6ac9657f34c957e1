"""Rate shapes of ``inferq simulate --scenario``: diurnal, sinusoid, bursts."""

from __future__ import annotations

import collections
import itertools
import statistics

import pytest

from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.sim.catalog import build_scenario, scenario_names
from inferq.sim.scenarios import ScenarioContext
from inferq.sim.shapes import warp
from inferq.sim.workload import SimRequest

CTX = ScenarioContext(Settings.load(), seed=3, duration_s=600)


def arrivals(name: str, ctx: ScenarioContext = CTX) -> list[float]:
    return [r.arrival_s for r in build_scenario(name, ctx)[1].requests]


def per_bin(times: list[float], width: float) -> list[int]:
    counts = collections.Counter(int(t // width) for t in times)
    return [counts[i] for i in range(int(max(times) // width))]


def test_shapes_are_registered_with_their_arguments() -> None:
    names = scenario_names()
    assert "diurnal" in names and "sinusoid:PERIOD_S:AMPLITUDE" in names
    assert "bursts:[SHAPE]" in names


def test_diurnal_peak_over_trough_is_three_to_one() -> None:
    bins = per_bin(arrivals("diurnal"), 30.0)
    assert max(bins) / min(bins) == pytest.approx(3.0, rel=0.15)
    assert bins.index(max(bins)) in range(len(bins) // 2 - 2, len(bins) // 2 + 2)


def test_sinusoid_follows_its_period_and_amplitude() -> None:
    times = arrivals("sinusoid:200:0.5")
    bins = per_bin(times, 50.0)  # quarter periods: up, up, down, down
    assert bins[0] > bins[2] and bins[1] > bins[3] and bins[4] > bins[6]
    assert (bins[0] + bins[1]) / (bins[2] + bins[3]) == pytest.approx(
        (1 + 2 * 0.5 / 3.14159) / (1 - 2 * 0.5 / 3.14159), rel=0.05
    )


def test_shapes_keep_the_requests_and_their_sizes() -> None:
    flat = build_scenario("bursts:10", CTX)[1].requests  # nearly regular gaps
    shaped = build_scenario("sinusoid:200:0.5", CTX)[1].requests
    assert len(flat) == len(shaped)
    key = sorted((r.prompt_tokens, r.output_tokens, r.priority) for r in flat)
    assert key == sorted((r.prompt_tokens, r.output_tokens, r.priority) for r in shaped)
    assert [r.arrival_s for r in shaped] == sorted(r.arrival_s for r in shaped)


def test_bursts_are_burstier_than_poisson_and_seeded() -> None:
    times = arrivals("bursts")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.pstdev(gaps) / statistics.mean(gaps) > 1.5  # CV 2 at shape 0.25
    assert arrivals("bursts") == times
    other = ScenarioContext(CTX.settings, seed=4, duration_s=600)
    assert arrivals("bursts", other) != times


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("sinusoid", "PERIOD_S:AMPLITUDE"),
        ("sinusoid:abc:0.5", "PERIOD_S must be a number"),
        ("sinusoid:600:1.5", "AMPLITUDE must be in"),
        ("bursts:0", "SHAPE must be in"),
        ("diurnal:2", "no arguments"),
    ],
)
def test_malformed_arguments_name_the_argument(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_scenario(text, CTX)


def test_warp_refuses_a_rate_that_reaches_zero() -> None:
    reqs = [SimRequest(str(i), float(i), "realtime", "t", "m", 1, 1, 1) for i in range(10)]
    with pytest.raises(ValueError, match="must stay > 0"):
        warp(reqs, lambda t: 1.0 - t / 9)
