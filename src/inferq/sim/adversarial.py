"""Hostile mixes for ``inferq simulate --scenario``: each one is a kind of fault a
scheduler must survive, at the smallest size that shows it.

- ``priority-inversion``: lower-class work holds every slot of the only worker
  when a realtime request arrives (issue 12's first example).
- ``kv-hog``: a stream of small batch requests keeps the KV cache of the only
  worker full, so a large realtime request, then a large standard one, never fit
  unless room is held back or taken for them (the same fault through KV room).
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

from collections.abc import Iterable, Sequence

from inferq.sim.scenarios import ScenarioContext, ScenarioWorkload, expect_args, scenario
from inferq.sim.workload import SimRequest, request_id

#: The one worker's card in the single-worker scenarios, MiB (an L4/A10-class 24 GiB card).
SMALL_CARD_MIB = 24_576
#: Slots of the one worker in ``kv-hog``: more than its KV cache holds of the stream
#: (27 x 250 MiB in 6,798 MiB), so KV room, not a slot, is what the large requests lack.
KV_HOG_SLOTS = 32

#: A request of a scenario: (arrival s, class, tenant, prompt tokens, output tokens).
Row = tuple[float, str, str, int, int]


def _requests(route: str, rows: Iterable[Row]) -> list[SimRequest]:
    """``rows`` as requests to ``route``, sorted by arrival (stable) and numbered in that
    order; ``max_tokens`` is the output (token counts fixed, not drawn)."""
    ordered = sorted(rows, key=lambda row: row[0])
    return [
        SimRequest(
            id=request_id(i),
            arrival_s=at,
            priority=priority,
            tenant=tenant,
            route=route,
            prompt_tokens=prompt,
            output_tokens=output,
            max_tokens=output,
            source="scenario",
        )
        for i, (at, priority, tenant, prompt, output) in enumerate(ordered)
    ]


def _one_worker(
    ctx: ScenarioContext,
    rows: Iterable[Row],
    watch: tuple[str, ...],
    note: str,
    slots: int = 4,
) -> ScenarioWorkload:
    """The workload of ``rows`` on one worker of the default model on a 24 GiB card."""
    route = ctx.settings.default_model
    return ScenarioWorkload(
        requests=_requests(route, rows),
        fleet={route: 1},
        slots=slots,
        vram_mib=SMALL_CARD_MIB,
        max_workers=1,
        watch_tenants=watch,
        note=note,
    )


def _flood(ctx: ScenarioContext, n: int = 300) -> list[Row]:
    """Tenant ``bulk``'s flood: ``n`` default-class requests (256 + 256 tokens) over 0-1 s."""
    cls = ctx.settings.default_priority
    return [(i / n, cls, "bulk", 256, 256) for i in range(n)]


def _quiet(ctx: ScenarioContext, at: float) -> list[Row]:
    """Tenant ``quiet``'s 3 default-class requests at ``at`` seconds."""
    return [(at, ctx.settings.default_priority, "quiet", 256, 256)] * 3


@scenario(
    "priority-inversion",
    "4 batch requests (1,100 output tokens) fill a 4-slot worker; 2 s later one realtime "
    "request (16 tokens) must still start within its SLA",
)
def priority_inversion(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 1: 4 x batch (prompt 200, output 1,100) at 0 s, realtime at 2 s."""
    expect_args("priority-inversion", args, 0, "")
    top, lowest = ctx.settings.classes[0].name, ctx.settings.classes[-1].name
    rows: list[Row] = [(0.0, lowest, "bulk", 200, 1_100)] * 4
    rows.append((2.0, top, "interactive", 200, 16))
    return _one_worker(
        ctx,
        rows,
        ("interactive",),
        "the realtime request must start within its SLA although batch holds every slot",
    )


@scenario(
    "kv-hog",
    "a stream of small batch requests (6/s for 60 s, 250 MiB each) keeps a 32-slot worker's "
    "KV cache full; a large realtime request (1 GiB) at 10 s and a large standard one (3 GiB) "
    "at 20 s must still start within their SLAs",
)
def kv_hog(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 1 through KV room: tenant ``bulk`` sends 360 lowest-class requests
    (prompt 1,000, output 1,000: 250 MiB of an 8B model's KV cache each; 27 fill the
    6,798 MiB of a 24 GiB card) at 6 per second, faster than the ~4.5 per second the
    worker finishes, so a freed 250 MiB is always wanted again. ``interactive`` sends a
    top-class request with an 8,000-token prompt (1,008 MiB) at 10 s, ``analyst`` a
    second-class one with 24,000 (3,064 MiB) at 20 s: neither fits until several stream
    requests end at once, which a scheduler that admits the stream into every freed
    room never lets happen."""
    expect_args("kv-hog", args, 0, "")
    classes = [c.name for c in ctx.settings.classes]
    top, second, lowest = classes[0], classes[min(1, len(classes) - 1)], classes[-1]
    rows: list[Row] = [(i / 6, lowest, "bulk", 1_000, 1_000) for i in range(360)]
    rows.append((10.0, top, "interactive", 8_000, 64))
    rows.append((20.0, second, "analyst", 24_000, 512))
    return _one_worker(
        ctx,
        rows,
        ("interactive", "analyst"),
        "the large requests must start within their SLAs although the stream holds the KV cache",
        slots=KV_HOG_SLOTS,
    )


@scenario(
    "tenant-flood",
    "tenant 'bulk' queues 300 standard requests on a 4-slot worker; 2 s later tenant "
    "'quiet' submits 3 and must be served among the next slots that free up",
)
def tenant_flood(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 2: 300 x bulk at 0-1 s, 3 x quiet at 2 s, one class (the default)."""
    expect_args("tenant-flood", args, 0, "")
    return _one_worker(
        ctx,
        _flood(ctx) + _quiet(ctx, 2.0),
        ("quiet",),
        "a newly active tenant gets one of the first two slots that free up (VTC)",
    )


@scenario(
    "tenant-flood-aged",
    "tenant-flood with 'quiet' arriving 6.5 s after the flood, when every 'bulk' request "
    "is past standard's 5 s aging bound: aging must not undo VTC inside the class",
)
def tenant_flood_aged(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Issue 12, fault 2 past the aging bound: 300 x bulk at 0-1 s, 3 x quiet at 6.5 s."""
    expect_args("tenant-flood-aged", args, 0, "")
    return _one_worker(
        ctx,
        _flood(ctx) + _quiet(ctx, 6.5),
        ("quiet",),
        "the flood is overdue; quiet still gets one of the first two slots (VTC)",
    )


@scenario(
    "tenant-crowd",
    "tenant 'bulk' floods (300 requests) while 200 one-request tenants arrive at 1-2 s and "
    "'quiet', seen once at 0 s, returns at 2 s: the crowd must not push it to the back",
)
def tenant_crowd(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Many one-off tenants behind one flood (issue 24): 300 x bulk at 0-1 s, one quiet
    request at 0 s, 200 one-off tenants spread over 1-2 s, then 3 x quiet at 2 s. The
    newcomers advance as one group (:func:`~inferq.policy.fairness.lift_tenants`), so the
    returning quiet tenant waits behind a few of them, not all 200."""
    expect_args("tenant-crowd", args, 0, "")
    cls = ctx.settings.default_priority
    crowd: list[Row] = [(1.0 + i / 200, cls, f"crowd-{i:03d}", 256, 256) for i in range(200)]
    seen: list[Row] = [(0.0, cls, "quiet", 256, 256)]
    return _one_worker(
        ctx,
        _flood(ctx) + seen + crowd + _quiet(ctx, 2.0),
        ("quiet", "crowd-000", "crowd-199"),
        "the crowd advances as one tenant: quiet's return is served within its SLA",
    )
