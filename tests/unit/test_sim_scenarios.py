"""The ``--scenario`` registry: builders, argument errors, and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from inferq.cli.simulate import simulate_command
from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.sim.catalog import build_scenario, scenario_names
from inferq.sim.deployment import SimConfig
from inferq.sim.engine import simulate
from inferq.sim.policies import POLICIES
from inferq.sim.result import SimResult
from inferq.sim.scenarios import ScenarioContext
from inferq.sim.workload import SimRequest


@pytest.fixture
def context() -> ScenarioContext:
    return ScenarioContext(settings=Settings.load(redis_url="redis://127.0.0.1:1/0"))


def test_registry_lists_the_adversarial_scenarios() -> None:
    assert {
        "priority-inversion",
        "kv-hog",
        "tenant-flood",
        "tenant-flood-aged",
        "tenant-crowd",
    } <= set(scenario_names())


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
    assert tenant["requests"] == 1 and tenant["succeeded"] == 1 and tenant["sla_met"] == 1
    assert data["policies"][0]["run"]["preemptions"] == 1
    assert data["policies"][0]["classes"]["batch"]["preemptions"] == 1
    assert "preempted" in result.output


def test_scenario_and_trace_are_exclusive() -> None:
    result = CliRunner().invoke(simulate_command, ["--scenario", "tenant-flood", "--trace", "conv"])
    assert result.exit_code != 0 and "exclusive" in result.output


@pytest.mark.parametrize("name", ["tenant-flood", "tenant-flood-aged"])
def test_quiet_tenant_gets_one_of_the_first_two_slots_in_the_simulator(
    context: ScenarioContext, name: str
) -> None:
    """The simulator applies the dispatcher's rule and reads what it reads (the tenants'
    sub-queue heads): behind 300 bulk requests, young or past the aging bound, quiet's
    first request is among the first two dispatched after it arrives (issue 12)."""
    _, w = build_scenario(name, context)
    config = SimConfig(
        settings=context.settings,
        fleet=dict(w.fleet or {}),
        slots=w.slots or 4,
        vram_mib=w.vram_mib or 24_576,
        max_workers=w.max_workers or 1,
    )
    result = simulate(list(w.requests), POLICIES["inferq"], config)
    tenant = {r.id: r.tenant for r in w.requests}
    arrived = min(r.arrival_s for r in w.requests if r.tenant == "quiet")
    after = [a for a in result.assignments if a.at >= arrived]
    first = next(i for i, a in enumerate(after) if tenant[a.request_id] == "quiet")
    assert first <= 1, [tenant[a.request_id] for a in after[:4]]
    before = [a for a in result.assignments if a.seq < after[first].seq]
    assert len(before) < 50  # served long before the flood is through (300 requests)


def test_tenant_crowd_advances_as_one_tenant_behind_a_returning_one(
    context: ScenarioContext,
) -> None:
    """Issue 24: 200 one-off tenants used to tie at the floor and all go ahead of the
    returning quiet tenant (59 s, its SLA 10 s) and of the flood. As one group they get
    about one tenant's share: the flood is served beside them, quiet within its SLA."""
    _, w = build_scenario("tenant-crowd", context)
    config = SimConfig(
        settings=context.settings,
        fleet=dict(w.fleet or {}),
        slots=4,
        vram_mib=24_576,
        max_workers=1,
    )
    result = simulate(list(w.requests), POLICIES["inferq"], config)
    tenant = {r.id: r.tenant for r in w.requests}
    served = [tenant[a.request_id] for a in result.assignments]
    assert sum(1 for t in served if t.startswith("crowd-")) == 200  # every one is served
    sla = context.settings.priority_class(context.settings.default_priority).sla_s
    back = [o for o in result.outcomes if o.request.tenant == "quiet" and o.request.arrival_s]
    assert len(back) == 3 and max(o.queue_wait_s or math.inf for o in back) < sla
    order = [tenant[a.request_id] for a in result.assignments if a.at >= 2.0]
    last_crowd = max(i for i, t in enumerate(order) if t.startswith("crowd-"))
    crowd, bulk = last_crowd + 1 - order[: last_crowd + 1].count("bulk"), order.count("bulk")
    # while the crowd is served, the flood gets about as many slots as all of it together
    assert order[: last_crowd + 1].count("bulk") >= 0.8 * crowd, (crowd, bulk)


# --- priority inversion in the simulator (issue 12, fault 1) ----------------------------


def _run(context: ScenarioContext, name: str, policy: str) -> tuple[list[SimRequest], SimResult]:
    _, w = build_scenario(name, context)
    config = w.sim_config(context.settings, check=True)
    return list(w.requests), simulate(list(w.requests), POLICIES[policy], config)


def _ttft(result: SimResult, tenant: str) -> float:
    [o] = [o for o in result.outcomes if o.request.tenant == tenant]
    assert o.status == "succeeded" and o.ttft_s is not None, o
    return o.ttft_s


def test_realtime_meets_its_sla_under_a_slot_hog_by_preempting_one_batch_request(
    context: ScenarioContext,
) -> None:
    """priority-inversion: inferq preempts one batch request (the dispatcher's rule, via
    choose_victims); it is requeued and finishes, its deadline and attempt kept."""
    sla = context.settings.class_by_name["realtime"].sla_s
    _, result = _run(context, "priority-inversion", "inferq")
    assert _ttft(result, "interactive") <= sla
    assert result.stats.preemptions == 1
    [victim] = [o for o in result.outcomes if o.preemptions]
    assert victim.request.priority == "batch" and victim.runs == 2
    assert victim.status == "succeeded" and victim.wasted_tokens > victim.request.prompt_tokens
    assert (
        victim.deadline
        == victim.request.arrival_s + context.settings.class_by_name["batch"].timeout_s
    )


@pytest.mark.parametrize("policy", ["strict-priority", "seed"])
def test_without_preemption_the_slot_hog_inverts_priorities(
    context: ScenarioContext, policy: str
) -> None:
    """The baselines keep preemption off (as documented): realtime waits for a batch
    request to finish, past its SLA (this is what inferq's test above guards against)."""
    sla = context.settings.class_by_name["realtime"].sla_s
    _, result = _run(context, "priority-inversion", policy)
    assert _ttft(result, "interactive") > sla
    assert result.stats.preemptions == 0


def test_large_requests_meet_their_slas_under_a_kv_hog(context: ScenarioContext) -> None:
    """kv-hog: the stream of small batch requests keeps the KV cache full; inferq reserves
    the worker for each large request and preempts the fewest batch requests that make
    room, so both start within their class's SLA."""
    classes = context.settings.class_by_name
    _, result = _run(context, "kv-hog", "inferq")
    assert _ttft(result, "interactive") <= classes["realtime"].sla_s
    assert _ttft(result, "analyst") <= classes["standard"].sla_s
    assert 0 < result.stats.preemptions <= 20  # room for 1 GiB + 3 GiB: 4 + 12 x 250 MiB
    lost = [o for o in result.outcomes if o.status != "succeeded"]
    assert lost == []  # every preempted batch request was requeued and served


def test_strict_priority_never_fits_the_kv_hogs_large_requests_in_time(
    context: ScenarioContext,
) -> None:
    classes = context.settings.class_by_name
    _, result = _run(context, "kv-hog", "strict-priority")
    assert _ttft(result, "interactive") > 10 * classes["realtime"].sla_s
    assert _ttft(result, "analyst") > 2 * classes["standard"].sla_s


def test_a_preempted_request_goes_back_to_its_original_position(
    context: ScenarioContext,
) -> None:
    """4 batch requests hold the slots, 3 younger ones queue; the preempted one (the
    latest started) runs again before the younger ones: its queue position was kept."""
    route = context.settings.default_model

    def req(i: int, at: float, priority: str, output: int) -> SimRequest:
        return SimRequest(
            id=f"r{i:07d}",
            arrival_s=at,
            priority=priority,
            tenant="bulk" if priority == "batch" else "interactive",
            route=route,
            prompt_tokens=200,
            output_tokens=output,
            max_tokens=output,
        )

    reqs = [req(i, i * 0.01, "batch", 1_100) for i in range(7)] + [req(7, 2.0, "realtime", 16)]
    config = SimConfig(
        settings=context.settings, fleet={route: 1}, slots=4, vram_mib=24_576, max_workers=1
    )
    result = simulate(reqs, POLICIES["inferq"], config)
    [victim] = [o for o in result.outcomes if o.preemptions]
    order = [a.request_id for a in result.assignments]
    assert order[:4] == [r.id for r in reqs[:4]]
    assert order[4] == "r0000007"  # the realtime request took the freed slot
    after = order[5:]
    assert after[0] == victim.request.id, order  # before r0000004..6, which queued later
    assert sorted(after) == sorted([victim.request.id, "r0000004", "r0000005", "r0000006"])


def test_an_abort_that_arrives_after_its_victim_finished_changes_nothing(
    context: ScenarioContext,
) -> None:
    """1 slot, every request runs 3 s: batch from 0 s, realtime at 2.4 s is overdue at
    2.9 s and preempts the batch request, but the abort takes 0.5 s and the batch request
    ends at 3.0 s: it succeeds on its one run, the stale abort is ignored, and realtime
    takes the freed slot then."""
    from inferq.sim.deployment import fixed_latency

    route = context.settings.default_model
    reqs = [
        SimRequest("r0000000", 0.0, "batch", "bulk", route, 10, 10, 10),
        SimRequest("r0000001", 2.4, "realtime", "interactive", route, 10, 10, 10),
    ]
    config = SimConfig(
        settings=context.settings,
        fleet={route: 1},
        slots=1,
        max_workers=1,
        latency=fixed_latency(3.0, ttft_s=0.1),
        abort_delay_s=0.5,
        check=True,
    )
    result = simulate(reqs, POLICIES["inferq"], config)
    batch, rt = result.outcomes
    assert (batch.status, batch.runs, batch.preemptions) == ("succeeded", 1, 0)
    assert result.stats.preemptions == 0
    assert rt.dispatched_at == 3.0 and rt.status == "succeeded"
    # the same with an instant abort: the batch request is preempted at 2.9 s and reruns
    instant = simulate(reqs, POLICIES["inferq"], dataclasses.replace(config, abort_delay_s=0.0))
    batch, rt = instant.outcomes
    assert (batch.runs, batch.preemptions, rt.dispatched_at) == (2, 1, pytest.approx(2.9))
