"""``inferq demo`` end to end (a short window of the real trace) and its pieces."""

from __future__ import annotations

import pytest

from inferq.config import Settings
from inferq.demo import DemoOptions, build_workload, compressed, parse_fleet_cards
from inferq.errors import ConfigError
from inferq.latency import service_time


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
