"""The simulator's baselines: strict priority and the seed ratio as class weights, and the
seed's and a KEDA-style scaler, each on the production rules' inputs and outputs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inferq.config import Settings
from inferq.policy.scaling import ScaleDecision, ScalerState, ScalingConfig
from inferq.sim.baselines import (
    keda_zcard_scale,
    seed_ratio_classes,
    seed_scale,
    strict_priority_classes,
)

from ..builders import model_load

CLASSES = tuple(Settings().classes)
NOW = 10_000.0
load = model_load


def has(decision: ScaleDecision, text: str) -> bool:
    return any(text in r for r in decision.reasons)


# --- priority classes ---------------------------------------------------------------


def test_strict_priority_classes_are_1_0_0_without_aging() -> None:
    strict = strict_priority_classes(CLASSES)
    assert [c.weight for c in strict] == [1.0, 0.0, 0.0]
    assert all(c.aging_s is None for c in strict)
    assert [c.name for c in strict] == [c.name for c in CLASSES]
    assert strict[1].sla_s == CLASSES[1].sla_s


def test_seed_ratio_classes_keep_aging() -> None:
    seed = seed_ratio_classes(CLASSES, ratio=5)
    assert [c.weight for c in seed] == [5.0, 1.0, 0.0]
    assert [c.aging_s for c in seed] == [c.aging_s for c in CLASSES]
    assert [c.weight for c in seed_ratio_classes(CLASSES[:1], 3)] == [3.0]
    with pytest.raises(ValueError, match="ratio must be > 0, got 0"):
        seed_ratio_classes(CLASSES, 0)


# --- scalers --------------------------------------------------------------------------


def test_seed_scales_up_one_at_a_time_when_pending_and_all_full() -> None:
    full = load(ready=2, busy={"a": 4, "b": 4}, queued={"standard": 21})
    decisions, state = seed_scale([full], ScalerState(), ScalingConfig(), CLASSES, NOW)
    assert (decisions[0].action, decisions[0].desired) == ("up", 3)
    # Checked every 30 s; a starting worker does not stop the next launch.
    again = replace(full, starting=1)
    held, _ = seed_scale([again], state, ScalingConfig(), CLASSES, NOW + 29)
    assert held[0].action == "hold" and "poll" in held[0].reasons[0]
    later, _ = seed_scale([again], state, ScalingConfig(), CLASSES, NOW + 30)
    assert (later[0].action, later[0].desired) == ("up", 4)


def test_seed_holds_when_a_worker_has_room_and_drains_idle_ones() -> None:
    roomy = load(ready=2, busy={"a": 4, "b": 3}, queued={"standard": 50})
    assert seed_scale([roomy], ScalerState(), ScalingConfig(), CLASSES, NOW)[0][0].action == "hold"
    idle = load(ready=3, idle_workers={"a": 301.0, "b": 299.0}, busy={"c": 1})
    [d], _ = seed_scale([idle], ScalerState(), ScalingConfig(), CLASSES, NOW)
    assert (d.action, d.drain) == ("down", ("a",))


def test_keda_desired_is_queue_length_over_target_with_a_down_cooldown() -> None:
    q = load(ready=1, queued={"batch": 21})
    [d], state = keda_zcard_scale([q], ScalerState(), ScalingConfig(), CLASSES, NOW)
    assert (d.action, d.desired) == ("up", 5)
    empty = load(ready=5, idle_workers={"a": 1.0}, busy={"b": 1, "c": 2, "d": 1, "e": 1})
    [d], _ = keda_zcard_scale([empty], state, ScalingConfig(), CLASSES, NOW + 60)
    assert d.action == "hold" and has(d, "cooldown")
    [d], _ = keda_zcard_scale([empty], state, ScalingConfig(), CLASSES, NOW + 300)
    assert (d.action, d.desired, d.drain) == ("down", 1, ("a", "b", "d", "e"))
