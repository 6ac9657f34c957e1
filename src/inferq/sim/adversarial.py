"""Hostile mixes for ``inferq simulate --scenario``: each one is a kind of fault a
scheduler must survive, at the smallest size that shows it.

- ``priority-inversion``: lower-class work holds every slot of the only worker
  when a realtime request arrives (issue 12's first example).
- ``tenant-flood``: one tenant's backlog of hundreds of requests, then a quiet
  tenant of the same class (issue 12's second example).

Token counts are fixed, not drawn, so a scenario's verdict depends only on the
policy; the one worker is the registry's default model on a 24 GiB card.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferq.sim.scenarios import ScenarioContext, ScenarioWorkload, expect_args, scenario
from inferq.sim.workload import SimRequest, request_id

#: The one worker's card in the single-worker scenarios, MiB (an L4/A10-class 24 GiB card).
SMALL_CARD_MIB = 24_576


def _request(
    index: int, at: float, priority: str, tenant: str, route: str, prompt: int, output: int
) -> SimRequest:
    return SimRequest(
        id=request_id(index),
        arrival_s=at,
        priority=priority,
        tenant=tenant,
        route=route,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=output,
        source="scenario",
    )


@scenario(
    "priority-inversion",
    "4 batch requests (1,100 output tokens) fill a 4-slot worker; 2 s later one realtime "
    "request (16 tokens) must still start within its SLA",
)
def priority_inversion(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 1: 4 x batch (prompt 200, output 1,100) at 0 s, realtime at 2 s."""
    expect_args("priority-inversion", args, 0, "")
    route = ctx.settings.default_model
    top, lowest = ctx.settings.classes[0].name, ctx.settings.classes[-1].name
    requests = [_request(i, 0.0, lowest, "bulk", route, 200, 1_100) for i in range(4)]
    requests.append(_request(4, 2.0, top, "interactive", route, 200, 16))
    return ScenarioWorkload(
        requests=requests,
        fleet={route: 1},
        slots=4,
        vram_mib=SMALL_CARD_MIB,
        max_workers=1,
        watch_tenants=("interactive",),
        note="the realtime request must start within its SLA although batch holds every slot",
    )


@scenario(
    "tenant-flood",
    "tenant 'bulk' queues 300 standard requests on a 4-slot worker; 2 s later tenant "
    "'quiet' submits 3 and must be served among the next slots that free up",
)
def tenant_flood(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 2: 300 x bulk at 0-1 s, 3 x quiet at 2 s, one class (the default)."""
    expect_args("tenant-flood", args, 0, "")
    route = ctx.settings.default_model
    cls = ctx.settings.default_priority
    requests = [_request(i, i / 300, cls, "bulk", route, 256, 256) for i in range(300)]
    requests += [_request(300 + i, 2.0, cls, "quiet", route, 256, 256) for i in range(3)]
    return ScenarioWorkload(
        requests=requests,
        fleet={route: 1},
        slots=4,
        vram_mib=SMALL_CARD_MIB,
        max_workers=1,
        watch_tenants=("quiet",),
        note="a newly active tenant gets one of the first two slots that free up (VTC)",
    )
