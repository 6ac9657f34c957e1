"""The ``--scenario`` registry: builders, argument errors, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from inferq.cli.simulate import simulate_command
from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.sim.catalog import build_scenario, scenario_names
from inferq.sim.scenarios import ScenarioContext


@pytest.fixture
def context() -> ScenarioContext:
    return ScenarioContext(settings=Settings.load(redis_url="redis://127.0.0.1:1/0"))


def test_registry_lists_the_adversarial_scenarios() -> None:
    assert {"priority-inversion", "tenant-flood"} <= set(scenario_names())


def test_priority_inversion_is_the_issue_example(context: ScenarioContext) -> None:
    _, w = build_scenario("priority-inversion", context)
    lowest, top = context.settings.classes[-1].name, context.settings.classes[0].name
    batch = [r for r in w.requests if r.priority == lowest]
    realtime = [r for r in w.requests if r.priority == top]
    assert [r.max_tokens for r in batch] == [1_100] * 4 and {r.arrival_s for r in batch} == {0.0}
    assert [(r.arrival_s, r.max_tokens) for r in realtime] == [(2.0, 16)]
    assert (dict(w.fleet or {}), w.slots, w.vram_mib) == ({"llama-3.1-8b": 1}, 4, 24_576)
    assert [r.id for r in w.requests] == sorted(r.id for r in w.requests)


def test_tenant_flood_is_the_issue_example(context: ScenarioContext) -> None:
    _, w = build_scenario("tenant-flood", context)
    tenants = [r.tenant for r in w.requests]
    assert tenants.count("bulk") == 300 and tenants.count("quiet") == 3
    assert min(r.arrival_s for r in w.requests if r.tenant == "quiet") == 2.0
    assert w.watch_tenants == ("quiet",)


@pytest.mark.parametrize(
    ("text", "message"),
    [("bogus", "unknown scenario 'bogus'"), ("tenant-flood:3", "takes no arguments")],
)
def test_bad_scenarios_name_the_problem(context: ScenarioContext, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_scenario(text, context)


def test_simulate_runs_a_scenario_and_reports_the_watched_tenant(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        simulate_command,
        ["--scenario", "priority-inversion", "--policy", "inferq", "--json-out", str(out)],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["workload"]["scenario"] == "priority-inversion"
    assert data["workload"]["fleet"] == {"llama-3.1-8b": 1}
    tenant = data["policies"][0]["tenants"]["interactive"]
    assert tenant["requests"] == 1 and tenant["succeeded"] == 1


def test_scenario_and_trace_are_exclusive() -> None:
    result = CliRunner().invoke(simulate_command, ["--scenario", "tenant-flood", "--trace", "conv"])
    assert result.exit_code != 0 and "exclusive" in result.output
