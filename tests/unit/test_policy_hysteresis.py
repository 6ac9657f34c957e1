"""The scaling policy cannot flap: at most one direction reversal per dwell, any arrival curve."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from inferq.config import Settings
from inferq.policy.scaling import (
    ModelLimits,
    ModelLoad,
    ModelScaleState,
    ScalerState,
    ScalingConfig,
    decide_scale,
    reversal_wait,
)

CLASSES = Settings.load().classes
MODEL = "llama-3.1-8b"
DWELL = 600.0


def run_curve(
    rates: list[float], queued: list[int], config: ScalingConfig, step_s: float = 5.0
) -> list[tuple[float, str]]:
    """Drive ``decide_scale`` through an arrival curve with a toy fleet (launches are ready
    after the cold start, drains leave at once); the scale actions it took, with times."""
    ready = [f"w{i}" for i in range(2)]
    starting: list[tuple[float, str]] = []
    idle_since: dict[str, float] = dict.fromkeys(ready, 0.0)
    state = ScalerState()
    actions: list[tuple[float, str]] = []
    serial = itertools.count(100)
    for i, (rate, q) in enumerate(zip(rates, queued, strict=True)):
        now = i * step_s
        ready += [w for at, w in starting if at <= now]
        starting = [(at, w) for at, w in starting if at > now]
        load = ModelLoad(
            model=MODEL,
            queued={"realtime": q} if q else {},
            oldest_wait_s={"realtime": min(10.0, q * 0.1)} if q else {},
            arrival_rate=rate,
            mean_service_s=2.0,
            slots_per_worker=8,
            cold_start_s=15.0,
            ready=len(ready),
            starting=len(starting),
            idle_workers={w: now - idle_since.get(w, now) for w in ready} if rate < 1 else {},
            busy={} if rate < 1 else dict.fromkeys(ready, 1),
        )
        (decision,), state = decide_scale([load], state, config, CLASSES, now)
        if decision.action == "up":
            starting += [(now + 15.0, f"w{next(serial)}") for _ in range(decision.launch)]
            actions.append((now, "up"))
        elif decision.action == "down":
            ready = [w for w in ready if w not in decision.drain]
            actions.append((now, "down"))
        for w in ready:
            idle_since.setdefault(w, now)
    return actions


def reversal_times(actions: list[tuple[float, str]]) -> list[float]:
    return [t for (_, a), (t, b) in itertools.pairwise(actions) if a != b]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.0, 40.0), min_size=20, max_size=400),
    st.data(),
)
def test_at_most_one_reversal_per_dwell_on_any_arrival_curve(
    rates: list[float], data: st.DataObject
) -> None:
    queued = data.draw(st.lists(st.integers(0, 200), min_size=len(rates), max_size=len(rates)))
    config = ScalingConfig(
        limits={MODEL: ModelLimits(1, 12, 1)},
        up_cooldown_s=0.0,
        down_cooldown_s=0.0,
        idle_s=0.0,
        reversal_dwell_s=DWELL,
    )
    times = reversal_times(run_curve(rates, queued, config))
    assert all(b - a >= DWELL for a, b in itertools.pairwise(times)), times


def test_without_the_dwell_the_same_curve_flaps() -> None:
    # A square wave of load every 30 s: the guard is what holds it to one reversal.
    rates = [30.0 if (i // 6) % 2 == 0 else 0.0 for i in range(240)]
    queued = [0] * len(rates)
    base = {
        "limits": {MODEL: ModelLimits(1, 12, 1)},
        "up_cooldown_s": 0.0,
        "down_cooldown_s": 0.0,
        "idle_s": 0.0,
    }
    free = reversal_times(run_curve(rates, queued, ScalingConfig(**base, reversal_dwell_s=0.0)))
    held = reversal_times(run_curve(rates, queued, ScalingConfig(**base, reversal_dwell_s=DWELL)))
    assert len(free) >= 10
    assert 1 <= len(held) <= 2  # 1,200 s of run: one reversal, then at most one 600 s later


def test_reversal_wait_counts_from_the_last_reversal_only() -> None:
    ms = ModelScaleState(last_direction="up", last_reversal_at=100.0)
    assert reversal_wait(ms, "up", DWELL, 150.0) == 0.0  # same direction: never waits
    assert reversal_wait(ms, "down", DWELL, 150.0) == 550.0
    assert reversal_wait(ms, "down", DWELL, 700.0) == 0.0
    assert reversal_wait(ModelScaleState(last_direction="up"), "down", DWELL, 5.0) == 0.0


def test_down_needs_headroom_up_does_not() -> None:
    config = ScalingConfig(
        limits={MODEL: ModelLimits(1, 12, 1)}, down_cooldown_s=0.0, idle_s=0.0, down_threshold=0.8
    )

    def decide(rate: float, ready: int) -> tuple[str, int]:
        load = ModelLoad(
            model=MODEL,
            queued={},
            oldest_wait_s={},
            arrival_rate=rate,
            mean_service_s=1.0,
            slots_per_worker=1,
            cold_start_s=0.0,
            ready=ready,
            idle_workers={f"w{i}": 1000.0 for i in range(ready)},
        )
        (d,), _ = decide_scale([load], ScalerState(), config, CLASSES, 1000.0)
        return d.action, d.desired

    assert decide(4.5, 4) == ("up", 5)  # need 4.5 > 4: up at once
    assert decide(3.3, 5)[0] == "hold"  # 3.3 / 0.8 = 4.1: 4 workers would run too full
    assert decide(3.1, 5) == ("down", 4)  # 3.1 / 0.8 = 3.9: one fewer still has headroom
