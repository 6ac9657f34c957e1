"""Hostile mixes for ``inferq simulate --scenario``: each one is a kind of fault a
scheduler must survive, at the smallest size that shows it.

- ``priority-inversion``: lower-class work holds every slot of the only worker
  when a realtime request arrives (issue 12's first example).
- ``tenant-flood``: one tenant's backlog of hundreds of requests, then a quiet
  tenant of the same class (issue 12's second example).
- ``tenant-flood-aged``: the same, the quiet tenant arriving once the flood is past
  its class's aging bound (aging must not undo tenant fairness inside a class).
- ``tenant-crowd``: 200 one-request tenants and a quiet one behind the flood (every
  backlogged tenant is seen, at a cost that does not grow with the backlog).

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


@scenario(
    "tenant-flood-aged",
    "tenant-flood with 'quiet' arriving 6.5 s after the flood, when every 'bulk' request "
    "is past standard's 5 s aging bound: aging must not undo VTC inside the class",
)
def tenant_flood_aged(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 2 past the aging bound: 300 x bulk at 0-1 s, 3 x quiet at 6.5 s."""
    expect_args("tenant-flood-aged", args, 0, "")
    route = ctx.settings.default_model
    cls = ctx.settings.default_priority
    requests = [_request(i, i / 300, cls, "bulk", route, 256, 256) for i in range(300)]
    requests += [_request(300 + i, 6.5, cls, "quiet", route, 256, 256) for i in range(3)]
    return ScenarioWorkload(
        requests=requests,
        fleet={route: 1},
        slots=4,
        vram_mib=SMALL_CARD_MIB,
        max_workers=1,
        watch_tenants=("quiet",),
        note="the flood is overdue; quiet still gets one of the first two slots (VTC)",
    )


@scenario(
    "tenant-crowd",
    "tenant 'bulk' floods (300 requests) while 200 one-request tenants arrive at 1-2 s and "
    "'quiet' at 2 s: every tenant must be seen, whatever the backlog ahead of it",
)
def tenant_crowd(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Many tenants behind one flood: 300 x bulk at 0-1 s, 200 one-off tenants spread
    over 1-2 s, then 3 x quiet at 2 s. VTC serves each newcomer once before bulk again
    (equal counters after the lift; ties by tenant name)."""
    expect_args("tenant-crowd", args, 0, "")
    route = ctx.settings.default_model
    cls = ctx.settings.default_priority
    requests = [_request(i, i / 300, cls, "bulk", route, 256, 256) for i in range(300)]
    requests += [
        _request(300 + i, 1.0 + i / 200, cls, f"crowd-{i:03d}", route, 256, 256) for i in range(200)
    ]
    requests += [_request(500 + i, 2.0, cls, "quiet", route, 256, 256) for i in range(3)]
    return ScenarioWorkload(
        requests=requests,
        fleet={route: 1},
        slots=4,
        vram_mib=SMALL_CARD_MIB,
        max_workers=1,
        watch_tenants=("quiet", "crowd-000", "crowd-199"),
        note="each newcomer is served once before the flood's next request",
    )
