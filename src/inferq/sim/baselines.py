"""The simulator's baselines: the policies inferq is compared against (issue 7).

Each takes the production rules' own inputs and returns their outputs, so the
simulator swaps them in without knowing which it runs (:mod:`inferq.sim.policies`):

- class transforms for :func:`~inferq.policy.dispatch.decide`: strict priority
  (:func:`strict_priority_classes`, how Triton and vLLM order requests) and the
  seed's fixed ratio (:func:`seed_ratio_classes`), both configurations of the one
  fairness mechanism of :mod:`inferq.policy.fairness`;
- scalers with :func:`~inferq.policy.scaling.decide_scale`'s signature: the seed
  text's autoscaler (:func:`seed_scale`) and a KEDA-style queue-length scaler
  (:func:`keda_zcard_scale`);
- prefix-cache affinity rules for :func:`~inferq.policy.dispatch.decide`
  (:mod:`inferq.policy.affinity`, issue 22): none at all (:func:`no_affinity`, today's
  least-utilised routing) and the naive "longest cached prefix wins"
  (:func:`naive_affinity`), both settings of the one rule.

Production code never calls these; only the simulator and its comparison do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from inferq import defaults
from inferq.config import PriorityClass
from inferq.policy.affinity import AffinityRule
from inferq.policy.scaling import (
    Action,
    ModelLimits,
    ModelLoad,
    ModelScaleState,
    ScaleDecision,
    ScalerState,
    ScalingConfig,
    bounded,
    check_unique_models,
    cooldown_left,
    drain_order,
    grant_budget,
    stamp_decisions,
)

# --- priority classes --------------------------------------------------------------


def strict_priority_classes(classes: Sequence[PriorityClass]) -> tuple[PriorityClass, ...]:
    """The classes turned into strict priority: weights (1, 0, 0, ...), aging and
    preemption off.

    The first class takes every slot it can use; each lower class only what no
    class above it can use. Running work is never preempted (the textbook
    non-preemptive priority queue).
    """
    return tuple(
        c.model_copy(
            update={
                "weight": 1.0 if i == 0 else 0.0,
                "aging_s": None,
                "may_preempt_after_s": None,
            }
        )
        for i, c in enumerate(classes)
    )


def seed_ratio_classes(
    classes: Sequence[PriorityClass], ratio: float = 5
) -> tuple[PriorityClass, ...]:
    """The seed's rule: every ``ratio`` dispatches of the first class serve one of the second.

    Weights become (ratio, 1, 0, ...); the aging bounds are kept, so classes
    below the second progress when idle capacity or their aging bound lets them.
    The seed had no preemption or reservations: ``may_preempt_after_s`` is cleared.

    Raises:
        ValueError: ``ratio`` is not positive.
    """
    if ratio <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    weights = [float(ratio), 1.0]
    return tuple(
        c.model_copy(
            update={
                "weight": weights[i] if i < len(weights) else 0.0,
                "may_preempt_after_s": None,
            }
        )
        for i, c in enumerate(classes)
    )


# --- prefix-cache affinity ---------------------------------------------------------


def no_affinity(rule: AffinityRule) -> AffinityRule:
    """The rule turned off: every request goes to the least-utilised worker with room
    (routing before issue 22; SGLang's and Dynamo's round-robin / load baselines)."""
    return replace(rule, enabled=False)


def naive_affinity(rule: AffinityRule) -> AffinityRule:
    """ "Longest cached prefix wins": load weighs nothing and no balance margin holds
    (only a worker's free slots and KV room still bound it). On a trace whose
    requests share a first block (a system prompt) it piles the fleet onto one worker,
    the trap issue 22 measures."""
    return replace(rule, load_weight=0.0, balance_abs_tokens=math.inf)


# --- scalers ----------------------------------------------------------------------

_Rule = Callable[[ModelLoad, ModelScaleState, ModelLimits, list[str]], ScaleDecision]


def seed_scale(
    loads: Sequence[ModelLoad],
    state: ScalerState,
    config: ScalingConfig,
    classes: Sequence[PriorityClass],
    now: float,
    *,
    pending_threshold: int = defaults.SEED_PENDING_THRESHOLD,
    idle_s: float = defaults.SEED_IDLE_S,
    check_s: float = defaults.SEED_CHECK_S,
) -> tuple[list[ScaleDecision], ScalerState]:
    """Baseline ``seed``: the seed text's autoscaler.

    Every ``check_s`` seconds per model: one more worker when more than
    ``pending_threshold`` requests are queued and every ready worker is full
    (starting workers are not looked at, so a long cold start launches again);
    every worker idle ``>= idle_s`` is drained. Bounds and the GPU budget of
    ``config`` apply; cooldowns, trend and SLAs do not (``classes`` is unused).
    """
    del classes

    def rule(
        load: ModelLoad, ms: ModelScaleState, limits: ModelLimits, reasons: list[str]
    ) -> ScaleDecision:
        current = load.current
        if current < limits.min_workers or current > limits.max_workers:
            return _to_bounds(load, limits, reasons)
        full = not load.idle_workers and all(n >= load.slots_per_worker for n in load.busy.values())
        if load.total_queued > pending_threshold and full:
            reasons.append(f"{load.total_queued} pending > {pending_threshold}, all full")
            target = bounded(current + 1, limits, reasons)
            action: Action = "up" if target > current else "hold"
            return ScaleDecision(load.model, current, target, action, tuple(reasons))
        idle = [w for w in drain_order(load) if load.idle_workers[w] >= idle_s]
        drain = tuple(idle[: max(0, current - limits.min_workers)])
        if drain:
            reasons.append(f"{len(drain)} idle >= {idle_s:.0f} s")
            return ScaleDecision(
                load.model, current, current - len(drain), "down", tuple(reasons), drain
            )
        return ScaleDecision(load.model, current, current, "hold", tuple(reasons))

    return _run_baseline(loads, state, config, now, check_s, rule)


def keda_zcard_scale(
    loads: Sequence[ModelLoad],
    state: ScalerState,
    config: ScalingConfig,
    classes: Sequence[PriorityClass],
    now: float,
    *,
    list_length: int = defaults.KEDA_LIST_LENGTH,
    poll_s: float = defaults.KEDA_POLL_S,
    cooldown_s: float = defaults.KEDA_COOLDOWN_S,
) -> tuple[list[ScaleDecision], ScalerState]:
    """Baseline ``keda-zcard``: a KEDA-style scaler on the total queue length.

    Every ``poll_s`` seconds: ``desired = ceil(total queued / list_length)``
    within the bounds; up at once, down only ``cooldown_s`` after the model's
    last scale action. Scale-down drains idle workers first, then the least busy
    ones (like a ReplicaSet, it does not wait for idleness; draining still kills
    nothing). The GPU budget of ``config`` applies; ``classes`` is unused.

    Raises:
        ValueError: ``list_length`` is not positive.
    """
    del classes
    if list_length < 1:
        raise ValueError(f"list_length must be >= 1, got {list_length}")

    def rule(
        load: ModelLoad, ms: ModelScaleState, limits: ModelLimits, reasons: list[str]
    ) -> ScaleDecision:
        current = load.current
        want = math.ceil(load.total_queued / list_length)
        reasons.append(f"ceil({load.total_queued} queued / {list_length}) = {want}")
        target = bounded(want, limits, reasons)
        if target > current:
            return ScaleDecision(load.model, current, target, "up", tuple(reasons))
        left = cooldown_left(ms, cooldown_s, now)
        if target == current or left > 0:
            if target < current:
                reasons.append(f"cooldown: no scale-down for {left:.1f} s")
            return ScaleDecision(load.model, current, current, "hold", tuple(reasons))
        ranked = drain_order(load) + sorted(load.busy, key=lambda w: (load.busy[w], w))
        drain = tuple(ranked[: current - target])
        if not drain:
            return ScaleDecision(load.model, current, current, "hold", tuple(reasons))
        return ScaleDecision(
            load.model, current, current - len(drain), "down", tuple(reasons), drain
        )

    return _run_baseline(loads, state, config, now, poll_s, rule)


def _to_bounds(load: ModelLoad, limits: ModelLimits, reasons: list[str]) -> ScaleDecision:
    """Move a pool that is outside its bounds back inside (draining never takes busy workers)."""
    current = load.current
    target = bounded(current, limits, reasons)
    if target > current:
        return ScaleDecision(load.model, current, target, "up", tuple(reasons))
    drain = tuple(drain_order(load)[: current - target])
    if not drain:
        return ScaleDecision(load.model, current, current, "hold", tuple(reasons))
    return ScaleDecision(load.model, current, current - len(drain), "down", tuple(reasons), drain)


def _run_baseline(
    loads: Sequence[ModelLoad],
    state: ScalerState,
    config: ScalingConfig,
    now: float,
    period_s: float,
    rule: _Rule,
) -> tuple[list[ScaleDecision], ScalerState]:
    """Apply ``rule`` to each model whose poll period has passed, then the GPU budget."""
    check_unique_models(loads)
    plans: list[ScaleDecision] = []
    polled: list[ScaleDecision] = []
    for load in loads:
        ms = state.model(load.model)
        if ms.checked_at is not None and now - ms.checked_at < period_s:
            wait = ms.checked_at + period_s - now
            reason = f"poll: next check in {wait:.1f} s"
            plans.append(ScaleDecision(load.model, load.current, load.current, "hold", (reason,)))
            continue
        plan = rule(load, ms, config.limits_for(load.model), [])
        plans.append(plan)
        polled.append(plan)
    decisions = grant_budget(plans, loads, config)
    checked = {d.model for d in polled}
    stamped = stamp_decisions([d for d in decisions if d.model in checked], dict(state.models), now)
    return decisions, stamped
