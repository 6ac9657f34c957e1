"""The scaler daemon and the simulator size a fleet with the same capacity model.

The daemon builds its loads from Redis facts (``build_loads``), the simulator from its
virtual fleet (``LoadTracker``); fed the same facts — arrivals, measured service times
and token means, the workers' KV cache — both must hand ``decide_scale`` the same
per-worker capacity and so take the same decision, up and down.
"""

from __future__ import annotations

import pytest

from inferq.config import Settings
from inferq.models import WorkerState
from inferq.policy.capacity import strictest_tpot
from inferq.policy.scaling import ModelLoad, ScalerState, ScalingConfig, decide_scale
from inferq.policy.scaling_inputs import (
    LiveWorker,
    LoadInputs,
    ReconciledFleet,
    ServiceStats,
    Tracked,
    build_loads,
)
from inferq.sim.fleet import SimWorker
from inferq.sim.loads import LoadTracker

SETTINGS = Settings.load()
MODEL = "llama-3.1-8b"
SPEC = SETTINGS.model_by_name[MODEL]
SLOTS, KV_MIB, WINDOW = 256, 114_074, 10.0
PROMPT, OUTPUT, SERVICE_S = 1_800, 240, 3.0
CONFIG = ScalingConfig(up_cooldown_s=0.0, down_cooldown_s=0.0, idle_s=0.0, tolerance=0.0)


def sim_load(rate: float, now: float, workers: int) -> ModelLoad:
    tracker = LoadTracker(SETTINGS, [MODEL], SLOTS, WINDOW)
    n = round(rate * WINDOW)
    for i in range(n):
        tracker.arrived(now - WINDOW + (i + 0.5) * WINDOW / n, MODEL)
    for i in range(8):
        tracker.finished(now - 1.0 - i, MODEL, SERVICE_S, PROMPT, OUTPUT, concurrency=SLOTS)
    fleet = [
        SimWorker(f"w{i}", SPEC, SLOTS, KV_MIB, launched_at=0.0, idle_since=0.0)
        for i in range(workers)
    ]
    (load,) = tracker.loads(now, [], fleet, {})
    return load


def daemon_load(rate: float, now: float, workers: int) -> ModelLoad:
    ids = [f"w{i}" for i in range(workers)]
    inputs = LoadInputs(
        depths=[],
        live=[LiveWorker(w, MODEL, WorkerState.READY, SLOTS, kv_cache_mib=KV_MIB) for w in ids],
        fleet=ReconciledFleet(tracked={w: Tracked(MODEL, last_busy_at=0.0) for w in ids}),
        arrivals={MODEL: round(rate * WINDOW) / WINDOW},
        service={MODEL: ServiceStats(SERVICE_S, PROMPT, OUTPUT)},
        fallback_service_s={},
        default_slots=SLOTS,
        tpot_s=strictest_tpot(SETTINGS.classes),
    )
    (load,) = build_loads([MODEL], SETTINGS.models, inputs, now)
    return load


@pytest.mark.parametrize(
    ("rate", "workers", "action"),
    [(400.0, 2, "up"), (20.0, 4, "down")],
)
def test_daemon_and_simulator_take_the_same_decision(
    rate: float, workers: int, action: str
) -> None:
    now = 1_000.0
    sim, real = sim_load(rate, now, workers), daemon_load(rate, now, workers)
    assert sim.capacity_rate is not None
    assert sim.capacity_rate == pytest.approx(real.capacity_rate)
    assert sim.arrival_rate == pytest.approx(real.arrival_rate)
    (a,), _ = decide_scale([sim], ScalerState(), CONFIG, SETTINGS.classes, now)
    (b,), _ = decide_scale([real], ScalerState(), CONFIG, SETTINGS.classes, now)
    assert a.action == b.action == action
    assert a.desired == b.desired
