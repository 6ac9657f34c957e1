"""Rate shapes for ``inferq simulate --scenario``: the real request sizes, new arrival times.

Azure's 2023 traces are one hour of nearly flat traffic each; an autoscaler earns
its keep when the rate moves. Each shape keeps the bundled traces' requests (the
conversation trace as ``realtime``, the code trace as ``standard``, their own
token counts and order) and moves their arrivals:

- ``diurnal``: a day compressed into the replay, rate ``1 - a cos(2 pi t / T)`` over
  the span ``T`` with peak/trough ``(1 + a) / (1 - a)`` = :data:`DIURNAL_PEAK_TROUGH`
  (3:1, issue 16's figure; no bundled trace spans a day to measure it from), from the
  night trough through the midday peak mid-replay back to the trough;
- ``sinusoid:PERIOD_S:AMPLITUDE``: rate ``1 + A sin(2 pi t / PERIOD_S)`` (issue 16's
  goals use ``sinusoid:1200:0.5``);
- ``bursts[:SHAPE]``: Gamma-distributed inter-arrival times of shape ``k`` (default
  :data:`BURST_GAMMA_SHAPE`), coefficient of variation ``1 / sqrt(k)``: BurstGPT
  (Wang et al., 2024) fits the inter-arrival times of ChatGPT and GPT-4 requests with
  Gamma distributions whose shape is below 1, i.e. burstier than Poisson.

The mean rate is the trace's own (``--load`` and ``--rate-scale`` then scale it), the
span is unchanged, and every draw derives from ``--seed``: the same arguments give the
same workload. The deterministic shapes place the requests, in their order, at the
quantiles of the cumulative rate ``R(t) = int_0^t r`` (:func:`warp`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from inferq.errors import ConfigError
from inferq.sim.scenarios import ScenarioContext, ScenarioWorkload, expect_args, scenario
from inferq.sim.workload import SimRequest, TraceSource, assemble, request_id

#: Peak over trough rate of ``diurnal`` (issue 16: about 3:1).
DIURNAL_PEAK_TROUGH = 3.0
#: Gamma shape of ``bursts``: CV = 2 (BurstGPT's fits of conversation traffic are below 1).
BURST_GAMMA_SHAPE = 0.25
#: Grid step of the cumulative rate, seconds (the warp is linear between grid points).
_GRID_S = 1.0


def base_requests(ctx: ScenarioContext) -> list[SimRequest]:
    """The bundled traces' requests (conversation = realtime, code = standard), no batch job."""
    sources = [TraceSource.parse("conv"), TraceSource.parse("code")]
    return assemble(
        sources,
        ctx.settings,
        duration_s=ctx.duration_s,
        batch_requests=0,
        tenants=ctx.tenants,
        seed=ctx.seed,
    )


def warp(requests: Sequence[SimRequest], rate: Callable[[float], float]) -> list[SimRequest]:
    """The same requests, in order, arriving at rate ``rate(t)`` (relative, > 0) over their span.

    Request ``i`` of ``n`` arrives at ``R^-1(span x (i + 1/2) / n)``, ``R`` the cumulative
    rate normalised to the span: the shape is followed exactly, whatever the trace's own
    rate did, and the count, the order and the span stay.

    Raises:
        ValueError: ``rate`` is not positive somewhere on the grid.
    """
    if not requests:
        return []
    span = max(r.arrival_s for r in requests) or 1.0
    steps = max(1, math.ceil(span / _GRID_S))
    grid = [span * i / steps for i in range(steps + 1)]
    cum = [0.0]
    for a, b in itertools.pairwise(grid):
        ra, rb = rate(a), rate(b)
        if ra <= 0 or rb <= 0:
            raise ValueError(f"rate shape: must stay > 0, got {min(ra, rb)} at {a:.0f} s")
        cum.append(cum[-1] + (ra + rb) / 2 * (b - a))
    cum = [c * span / cum[-1] for c in cum]
    n = len(requests)
    out = []
    for k, r in enumerate(sorted(requests, key=lambda r: r.arrival_s)):
        target = span * (k + 0.5) / n
        i = min(len(cum) - 2, max(0, bisect.bisect_right(cum, target) - 1))
        lo, hi = cum[i], cum[i + 1]
        frac = 0.0 if hi <= lo else (target - lo) / (hi - lo)
        out.append(replace(r, arrival_s=grid[i] + frac * (grid[i + 1] - grid[i])))
    return out


def gamma_arrivals(requests: Sequence[SimRequest], shape: float, seed: int) -> list[SimRequest]:
    """Arrivals with Gamma(``shape``) inter-arrival times, rescaled to the same span."""
    if not requests:
        return []
    span = max(r.arrival_s for r in requests) or 1.0
    rng = random.Random(f"bursts:{seed}")
    gaps = [rng.gammavariate(shape, 1.0) for _ in requests]
    total = sum(gaps) or 1.0
    t, out = 0.0, []
    for r, g in zip(requests, gaps, strict=True):
        out.append(replace(r, arrival_s=t))
        t += g * span / total
    return out


def _renumbered(requests: Sequence[SimRequest]) -> list[SimRequest]:
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return [replace(r, id=request_id(i)) for i, r in enumerate(ordered)]


def _float(name: str, text: str, what: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"scenario {name}: {what} must be a number, got {text!r}") from None
    if not (math.isfinite(value) and low < value <= high):
        raise ConfigError(f"scenario {name}: {what} must be in ({low:g}, {high:g}], got {text!r}")
    return value


@scenario(
    "diurnal",
    f"both traces' requests on a day compressed into the replay: peak/trough "
    f"{DIURNAL_PEAK_TROUGH:g}:1, trough at the ends, peak mid-replay",
)
def diurnal(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """Rate ``1 - a cos(2 pi t / span)``, ``a`` from :data:`DIURNAL_PEAK_TROUGH`."""
    expect_args("diurnal", args, 0, "")
    base = base_requests(ctx)
    span = max((r.arrival_s for r in base), default=1.0) or 1.0
    a = (DIURNAL_PEAK_TROUGH - 1) / (DIURNAL_PEAK_TROUGH + 1)
    shaped = warp(base, lambda t: 1 - a * math.cos(2 * math.pi * t / span))
    return ScenarioWorkload(
        requests=_renumbered(shaped),
        note="a fleet sized for the peak idles through the trough: the scaler should follow",
    )


@scenario(
    "sinusoid",
    "both traces' requests at rate 1 + AMPLITUDE sin(2 pi t / PERIOD_S)",
    params="PERIOD_S:AMPLITUDE",
)
def sinusoid(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """``sinusoid:PERIOD_S:AMPLITUDE``, period in seconds (> 0), amplitude in (0, 1)."""
    expect_args("sinusoid", args, 2, "PERIOD_S:AMPLITUDE")
    period = _float("sinusoid", args[0], "PERIOD_S", 0.0, math.inf)
    amp = _float("sinusoid", args[1], "AMPLITUDE", 0.0, 0.99)
    shaped = warp(base_requests(ctx), lambda t: 1 + amp * math.sin(2 * math.pi * t / period))
    return ScenarioWorkload(
        requests=_renumbered(shaped),
        note=f"a wave every {period:g} s: follow it, reversing at most once per 600 s",
    )


@scenario(
    "bursts",
    "both traces' requests with Gamma-distributed inter-arrival times (BurstGPT): "
    f"shape SHAPE, default {BURST_GAMMA_SHAPE:g} (CV {1 / math.sqrt(BURST_GAMMA_SHAPE):g})",
    params="[SHAPE]",
)
def bursts(ctx: ScenarioContext, args: Sequence[str]) -> ScenarioWorkload:
    """``bursts`` or ``bursts:SHAPE`` (0 < SHAPE <= 10; below 1 is burstier than Poisson)."""
    if len(args) > 1:
        expect_args("bursts", args, 1, "[SHAPE]")
    shape = _float("bursts", args[0], "SHAPE", 0.0, 10.0) if args else BURST_GAMMA_SHAPE
    return ScenarioWorkload(
        requests=_renumbered(gamma_arrivals(base_requests(ctx), shape, ctx.seed)),
        note="bursts well above the mean rate: queue briefly, do not chase each one",
    )
