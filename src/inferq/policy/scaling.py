"""How many workers each model should have: a pure function of load, state and time.

The scaler daemon builds one :class:`ModelLoad` per model from Redis, the
simulator from its virtual fleet; both call :func:`decide_scale` with the
:class:`ScalerState` the previous call returned, and carry out the
:class:`ScaleDecision` list (launch ``desired - current`` workers, or drain the
workers named in ``drain``). Nothing here reads a clock: ``now`` is an argument.

The rule, per model (units: requests, seconds, workers)::

    mu   = capacity_rate, or slots_per_worker / mean_service_s   one worker's rate
    h    = cold_start_s + interval_s                    until a worker launched now is useful
    lam  = max(arrival_rate, level + slope * h)         arrivals when it is ready
    age  = 1 + min(1, oldest_c / sla_c) * (age_max - 1) per class c
    w_c  = service_c / mean_service_s                   a class's requests, in mean requests
    B    = sum_c queued_c * w_c * weight_c * age_c      weighted backlog
    need = (lam + B / max(backlog_drain_s, h)) / mu     workers needed

``capacity_rate`` is what one worker carries with its class targets still met
(:mod:`inferq.policy.capacity`: KV cache at the target occupancy, the TPOT limit,
slots), lowered where the finishes it rests on miss long requests still running
(:func:`inferq.policy.capacity.censoring_factor`: Little's law over the in-flight
count and the window's time on test, the smaller); without it the rule falls back
to Little's law over the slots. A backlog is cleared over ``h`` at the soonest: a
worker launched for it is useful no sooner.
``level`` and ``slope`` are Holt's double exponential smoothing of the arrival
rate (Holt 1957; irregular steps as in Wright 1986), kept in the state, so a
rising wave is met by workers launched one cold start ahead of it. ``current``
is ``ready + starting``: capacity on its way counts, so a burst never cascades
launches. A backlog the ready workers clear (beyond the arrivals) within ``h``
adds nothing, and rule 2 below does not apply to it (:func:`ready_drain_s`): a worker
launched for it would come up after the work is gone. A burst that arrived within the
rate's window is in ``arrival_rate`` too; for that test, and for ``lam`` when it passes,
the queued part of the rate is taken out (:func:`burst_rate`), so a burst counts once,
as backlog. Then, in order:

1. tolerance band: hold while ``|need / current - 1| <= tolerance`` (the HPA rule),
   except upwards while the trend will leave the band within ``h + trend_slope_s``;
   below it, scale down only to ``ceil(need_avg / down_threshold)`` (asymmetric: up at
   the moment's ``need``, down on ``need_avg``, the need averaged over ``down_window_s``,
   with ``1 / down_threshold`` of headroom); ``mu`` is smoothed like the service time;
2. SLA: when a class's oldest wait passes ``target_wait_fraction x SLA``, want
   at least ``ready + 1`` (a worker already starting satisfies it);
3. bounds: ``min_workers <= desired <= max_workers`` (these override cooldowns);
4. cooldowns: no scale-up within ``up_cooldown_s`` and no scale-down within
   ``down_cooldown_s`` of the model's last scale action;
5. hysteresis: a direction reversal (down after up, or up after down) waits until
   ``reversal_dwell_s`` have passed since the model's previous reversal, so any
   ``reversal_dwell_s`` window holds at most one reversal, on any workload; only the
   bounds (``min_workers``, ``max_workers``) override it (a lost worker is replaced);
6. scale-down drains workers with nothing in flight, idle ``>= idle_s`` (longest
   idle first), else, once the surplus has lasted ``down_window_s``, the least busy;
7. GPU budget: scale-ups are granted in model priority order, minimum pools
   first, while ``sum (ready + starting + draining) x gpus_per_worker <= gpu_budget``.

:mod:`inferq.sim.baselines` holds the baselines the simulator compares this rule
against (issue 7), with the same inputs and outputs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from inferq import defaults
from inferq.config import PriorityClass, ScalingSettings
from inferq.errors import ConfigError, CorruptRecord
from inferq.policy.capacity import censoring_factor, mean_in_service_s

Action = Literal["up", "down", "hold"]

#: Float slack when rounding a fractional need up to whole workers.
_EPS = 1e-9


# --- configuration ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """Bounds of one model's pool.

    Attributes:
        min_workers: never fewer (default 1; 0 lets an idle model scale to zero).
        max_workers: never more (>= 1 and >= ``min_workers``).
        gpus_per_worker: GPUs one worker holds, counted against the GPU budget
            (0 for CPU-only or simulated workers).

    Raises:
        ConfigError: a bound is negative or ``min_workers > max_workers``.
    """

    min_workers: int = defaults.SCALE_MIN_WORKERS
    max_workers: int = defaults.SCALE_MAX_WORKERS
    gpus_per_worker: int = defaults.SCALE_GPUS_PER_WORKER

    def __post_init__(self) -> None:
        if self.min_workers < 0:
            raise ConfigError(f"min_workers must be >= 0, got {self.min_workers}")
        if self.max_workers < max(1, self.min_workers):
            raise ConfigError(
                f"max_workers must be >= 1 and >= min_workers ({self.min_workers}), "
                f"got {self.max_workers}"
            )
        if self.gpus_per_worker < 0:
            raise ConfigError(f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """Knobs of the scaling policy; every default is in :mod:`inferq.defaults`.

    Attributes:
        limits: model -> its bounds; models not listed use ``default_limits``.
        default_limits: bounds of unlisted models.
        gpu_budget: GPUs all models share (None = unlimited).
        model_priority: model names, highest priority first: the order in which
            scale-ups get GPUs. Unlisted models follow, by name.
        up_cooldown_s: seconds after a model's last scale action before it scales up.
        down_cooldown_s: seconds after a model's last scale action before it scales down.
        idle_s: a worker is drained only after this many seconds with nothing in flight.
        tolerance: relative band around the current count inside which nothing changes.
        down_threshold: scale down only to ``ceil(need / down_threshold)`` (0 < x <= 1).
        reversal_dwell_s: seconds after a direction reversal before the next one.
        down_window_s: a scale-down is judged on the need averaged over this many
            seconds (and only once that much has been seen), and a busy worker is
            drained once the surplus has lasted that long.
        target_wait_fraction: fraction of a class's SLA its oldest wait may reach
            before a worker is added.
        backlog_drain_s: seconds in which extra capacity should clear the weighted backlog.
        class_weights: class -> weight of one queued request (unlisted classes: 1).
        age_factor_max: a class's backlog counts up to this many times more as its
            oldest request ages to its SLA.
        trend_level_s / trend_slope_s: time constants of the rate's level and slope, s.
        service_smoothing_s: time constant of the smoothed service time, s.
        censoring_margin: slack before running requests lower a capacity sized on
            finished ones (:func:`inferq.policy.capacity.censoring_factor`), >= 0.
        interval_s: seconds between two decisions (the daemon's loop period); a
            worker launched at the next decision is ready ``interval_s`` later.

    Raises:
        ConfigError: a value is out of range (the message names it).
    """

    limits: Mapping[str, ModelLimits] = field(default_factory=dict)
    default_limits: ModelLimits = field(default_factory=ModelLimits)
    gpu_budget: int | None = None
    model_priority: tuple[str, ...] = ()
    up_cooldown_s: float = defaults.SCALE_UP_COOLDOWN_S
    down_cooldown_s: float = defaults.SCALE_DOWN_COOLDOWN_S
    idle_s: float = defaults.SCALE_IDLE_S
    tolerance: float = defaults.SCALE_TOLERANCE
    down_threshold: float = defaults.SCALE_DOWN_THRESHOLD
    reversal_dwell_s: float = defaults.SCALE_REVERSAL_DWELL_S
    down_window_s: float = defaults.SCALE_DOWN_WINDOW_S
    target_wait_fraction: float = defaults.SCALE_TARGET_WAIT_FRACTION
    backlog_drain_s: float = defaults.SCALE_BACKLOG_DRAIN_S
    class_weights: Mapping[str, float] = field(
        default_factory=lambda: dict(defaults.SCALE_BACKLOG_WEIGHTS)
    )
    age_factor_max: float = defaults.SCALE_AGE_FACTOR_MAX
    trend_level_s: float = defaults.SCALE_TREND_LEVEL_S
    trend_slope_s: float = defaults.SCALE_TREND_SLOPE_S
    service_smoothing_s: float = defaults.SCALE_SERVICE_SMOOTHING_S
    censoring_margin: float = defaults.SCALE_CENSORING_MARGIN
    interval_s: float = defaults.SCALER_INTERVAL_S

    def __post_init__(self) -> None:
        if self.gpu_budget is not None and self.gpu_budget < 0:
            raise ConfigError(f"gpu_budget must be >= 0 or None, got {self.gpu_budget}")
        if not 0 < self.down_threshold <= 1:
            raise ConfigError(f"down_threshold must be in (0, 1], got {self.down_threshold}")
        for name in (
            "up_cooldown_s",
            "down_cooldown_s",
            "idle_s",
            "interval_s",
            "reversal_dwell_s",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in (
            "backlog_drain_s",
            "trend_level_s",
            "trend_slope_s",
            "service_smoothing_s",
            "down_window_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.tolerance < 1:
            raise ConfigError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if not 0 < self.target_wait_fraction <= 1:
            raise ConfigError(
                f"target_wait_fraction must be in (0, 1], got {self.target_wait_fraction}"
            )
        if self.censoring_margin < 0:
            raise ConfigError(f"censoring_margin must be >= 0, got {self.censoring_margin}")
        if self.age_factor_max < 1:
            raise ConfigError(f"age_factor_max must be >= 1, got {self.age_factor_max}")
        for cls, weight in self.class_weights.items():
            if weight < 0:
                raise ConfigError(f"class_weights[{cls!r}] must be >= 0, got {weight}")

    @classmethod
    def from_settings(cls, scaling: ScalingSettings) -> ScalingConfig:
        """The knobs of the ``[scaling]`` settings table (its pools in priority order).

        Raises:
            ConfigError: a pool's bounds are inconsistent.
        """
        limits = {
            m: ModelLimits(p.min_workers, p.max_workers, p.gpus_per_worker)
            for m, p in scaling.pools.items()
        }
        return cls(
            limits=limits,
            gpu_budget=scaling.gpu_budget,
            model_priority=tuple(scaling.pools),
            up_cooldown_s=scaling.up_cooldown_s,
            down_cooldown_s=scaling.down_cooldown_s,
            idle_s=scaling.idle_s,
            interval_s=scaling.interval_s,
            backlog_drain_s=scaling.backlog_drain_s,
            trend_level_s=scaling.trend_level_s,
            trend_slope_s=scaling.trend_slope_s,
            service_smoothing_s=scaling.service_smoothing_s,
            down_window_s=scaling.down_window_s,
        )

    def limits_for(self, model: str) -> ModelLimits:
        """The bounds of ``model`` (its own, else ``default_limits``)."""
        return self.limits.get(model, self.default_limits)

    def priority_key(self, model: str) -> tuple[int, str]:
        """Sort key: listed models in ``model_priority`` order, then the rest by name."""
        try:
            return (self.model_priority.index(model), model)
        except ValueError:
            return (len(self.model_priority), model)


# --- inputs, state, outputs ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's load and fleet at decision time.

    Attributes:
        model: registry name.
        queued: class -> requests queued for this model.
        oldest_wait_s: class -> seconds the oldest queued request has waited.
        arrival_rate: requests/s, a moving estimate (the policy adds its own trend).
        mean_service_s: seconds one request occupies a slot (moving mean).
        slots_per_worker: concurrent requests one worker serves.
        cold_start_s: seconds from launch to ``ready`` (model load).
        ready / starting / draining: workers in each state (every live worker counts).
        idle_workers: ready worker id -> seconds since it last had work in flight
            (only workers with nothing in flight). These and ``busy`` are the drain
            candidates: the scaler leaves out workers it did not launch.
        busy: ready worker id -> requests in flight (only workers with some).
        saturation: service time with every slot busy over ``mean_service_s``, as
            measured (:func:`inferq.latency.saturation_factor`); 1.0 = no change.
        capacity_rate: requests/s one worker carries at its target occupancy with the
            class targets met (:func:`inferq.policy.capacity.worker_capacity`); None:
            size on ``worker_rate``.
        rate_window_s: seconds of submits ``arrival_rate`` is measured over (None: not
            known; a burst still queued is then taken for a sustained rate, see
            :func:`burst_rate`).
        class_service_s: class -> mean seconds from dispatch to finish of that class's
            requests (the same window as ``mean_service_s``); a class missing is taken
            at ``mean_service_s``. It weighs each class's queued requests by the work
            they hold (:attr:`queued_work`).
        in_service_s: mean seconds a request spends in service, the running ones
            counted (:func:`inferq.policy.capacity.mean_in_service_s` over the window's
            :class:`~inferq.policy.scaling_inputs.ServiceLog`); None: not known, and
            Little's law over ``busy`` and the smoothed arrivals stands in.

    Raises:
        ValueError: a count or time is negative, or ``slots_per_worker`` /
            ``mean_service_s`` is not positive.
    """

    model: str
    queued: Mapping[str, int]
    oldest_wait_s: Mapping[str, float]
    arrival_rate: float
    mean_service_s: float
    slots_per_worker: int
    cold_start_s: float
    ready: int
    starting: int = 0
    draining: int = 0
    idle_workers: Mapping[str, float] = field(default_factory=dict)
    busy: Mapping[str, int] = field(default_factory=dict)
    saturation: float = 1.0
    capacity_rate: float | None = None
    rate_window_s: float | None = None
    class_service_s: Mapping[str, float] = field(default_factory=dict)
    in_service_s: float | None = None

    def __post_init__(self) -> None:
        if self.slots_per_worker < 1:
            raise ValueError(f"{self.model}: slots_per_worker must be >= 1")
        if self.saturation < 1:
            raise ValueError(f"{self.model}: saturation must be >= 1, got {self.saturation}")
        if self.mean_service_s <= 0:
            raise ValueError(f"{self.model}: mean_service_s must be > 0 seconds")
        if self.capacity_rate is not None and not self.capacity_rate > 0:
            raise ValueError(f"{self.model}: capacity_rate must be > 0, got {self.capacity_rate}")
        if self.in_service_s is not None and not self.in_service_s >= 0:
            raise ValueError(f"{self.model}: in_service_s must be >= 0, got {self.in_service_s}")
        if self.rate_window_s is not None and not self.rate_window_s > 0:
            raise ValueError(f"{self.model}: rate_window_s must be > 0, got {self.rate_window_s}")
        for name in ("arrival_rate", "cold_start_s", "ready", "starting", "draining"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.model}: {name} must be >= 0, got {getattr(self, name)}")
        if any(n < 0 for n in self.queued.values()):
            raise ValueError(f"{self.model}: queued counts must be >= 0")
        for cls, took in self.class_service_s.items():
            if not (took > 0 and math.isfinite(took)):
                raise ValueError(
                    f"{self.model}: class_service_s[{cls!r}] must be finite and > 0, got {took}"
                )

    @property
    def current(self) -> int:
        """Workers counted as capacity: ``ready + starting``."""
        return self.ready + self.starting

    @property
    def total_queued(self) -> int:
        """Queued requests over all classes."""
        return sum(self.queued.values())

    def relative_service(self, cls: str) -> float:
        """One queued request of class ``cls`` in mean requests: its class's measured
        service time over ``mean_service_s`` (1.0 when the class has none)."""
        took = self.class_service_s.get(cls)
        return took / self.mean_service_s if took else 1.0

    @property
    def queued_work(self) -> float:
        """The queue in mean requests: ``sum_c queued_c x relative_service(c)``.

        ``mu`` (requests/s a worker carries) is a rate of the window's mean request, so
        a backlog must be counted in the same unit: a burst of batch requests twice as
        long as the mix drains in twice the time its count says (issue 24, item 5).
        """
        return sum(n * self.relative_service(cls) for cls, n in self.queued.items() if n > 0)

    @property
    def saturated_service_s(self) -> float:
        """Service time with every slot busy, seconds: ``mean_service_s x saturation``.

        ``mean_service_s`` is measured at the concurrency the workers ran at; decode
        slows as sequences are added, so a lightly loaded fleet measures a service
        time its saturated workers will not keep. Sizing on the measured figure
        shrinks the fleet, service time then grows, a queue forms and the scaler
        adds workers back: it oscillates.
        """
        return self.mean_service_s * self.saturation

    @property
    def worker_rate(self) -> float:
        """Requests/s one saturated worker completes: ``slots / saturated_service_s`` (Little)."""
        return self.slots_per_worker / self.saturated_service_s


@dataclass(frozen=True, slots=True)
class ModelScaleState:
    """What one model carries from one decision to the next.

    Attributes:
        last_up_at / last_down_at: time of the last scale-up / scale-down, s.
        last_direction: ``"up"`` or ``"down"`` (None before the first action).
        last_reversal_at: time of the last action opposite to the one before it, s.
        level: smoothed arrival rate, requests/s (None before the first observation).
        slope: smoothed change of the rate, requests/s per s.
        observed_at: time of the last trend update, s.
        checked_at: time of the last evaluation (the baselines poll on it), s.
        surplus_since: since when the model has had more workers than it needs,
            without a break, s (None while it has not).
        service_s: smoothed service time, s (None before the first observation).
        capacity: smoothed ``capacity_rate``, requests/s per worker (None before the first).
        capacity_since: time of the first ``capacity_rate`` seen, s (None before it).
        need_avg: the need averaged over ``down_window_s`` (an exponential moving
            average), workers (None before the first decision).
        need_since: time of the first need in ``need_avg``, s.
    """

    last_up_at: float | None = None
    last_down_at: float | None = None
    last_direction: str | None = None
    last_reversal_at: float | None = None
    level: float | None = None
    slope: float = 0.0
    observed_at: float | None = None
    checked_at: float | None = None
    surplus_since: float | None = None
    service_s: float | None = None
    capacity: float | None = None
    capacity_since: float | None = None
    need_avg: float | None = None
    need_since: float | None = None

    @property
    def last_action_at(self) -> float | None:
        """Time of the last scale action in either direction."""
        times = [t for t in (self.last_up_at, self.last_down_at) if t is not None]
        return max(times) if times else None

    def forecast(self, horizon_s: float) -> float:
        """Arrival rate expected ``horizon_s`` from now, requests/s (>= 0)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.slope * horizon_s)


@dataclass(frozen=True, slots=True)
class ScalerState:
    """Everything carried between decisions, per model (the daemon keeps it in Redis)."""

    models: Mapping[str, ModelScaleState] = field(default_factory=dict)

    def model(self, name: str) -> ModelScaleState:
        """The state of ``name`` (empty when never seen)."""
        return self.models.get(name, ModelScaleState())

    def to_fields(self) -> dict[str, str]:
        """Flat string hash for Redis: model -> JSON of its state."""
        return {m: json.dumps(asdict(s), sort_keys=True) for m, s in self.models.items()}

    @classmethod
    def from_fields(cls, fields: Mapping[str, str], key: str = "scaler:state") -> ScalerState:
        """Parse a hash written by :meth:`to_fields`.

        Raises:
            CorruptRecord: a model's entry is not the JSON of a state.
        """
        models: dict[str, ModelScaleState] = {}
        for model, raw in fields.items():
            try:
                models[model] = ModelScaleState(**json.loads(raw))
            except (ValueError, TypeError) as exc:
                raise CorruptRecord(key, f"model {model!r}: {exc}") from None
        return cls(models=models)


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What to do with one model now.

    Attributes:
        model: registry name.
        current: ``ready + starting`` at decision time.
        desired: workers after this decision (``current`` + launches - drains).
        action: ``"up"``, ``"down"`` or ``"hold"``.
        reasons: human-readable reasons, most important first.
        drain: worker ids to drain now (scale-down), idle longest first.
    """

    model: str
    current: int
    desired: int
    action: Action
    reasons: tuple[str, ...]
    drain: tuple[str, ...] = ()

    @property
    def launch(self) -> int:
        """Workers to start now."""
        return self.desired - self.current if self.action == "up" else 0


# --- the inferq policy --------------------------------------------------------


def decide_scale(
    loads: Sequence[ModelLoad],
    state: ScalerState,
    config: ScalingConfig,
    classes: Sequence[PriorityClass],
    now: float,
) -> tuple[list[ScaleDecision], ScalerState]:
    """Desired workers per model (see the module docstring for the rule).

    Args:
        loads: one entry per model; every model holding GPUs must be listed for
            the GPU budget to be exact.
        state: the state returned by the previous call (``ScalerState()`` at first).
        config: the policy's knobs.
        classes: the priority classes (their ``sla_s``).
        now: current (or virtual) time, seconds.

    Returns:
        Decisions in the order of ``loads``, and the state for the next call.

    Raises:
        ValueError: a model appears twice in ``loads``.
    """
    check_unique_models(loads)
    sla = {c.name: c.sla_s for c in classes}
    models = dict(state.models)
    plans: list[ScaleDecision] = []
    for load in loads:
        ms = _update_trend(state.model(load.model), load.arrival_rate, now, config)
        ms = _smooth_service(ms, load.mean_service_s, _uncensored(load, ms, config), now, config)
        assert ms.service_s is not None
        smoothed = replace(
            load,
            mean_service_s=ms.service_s,
            capacity_rate=ms.capacity if load.capacity_rate else None,
        )
        plan, ms = _plan(smoothed, ms, config, sla, now)
        models[load.model] = ms
        plans.append(plan)
    decisions = grant_budget(plans, loads, config)
    return decisions, stamp_decisions(decisions, models, now)


def _uncensored(load: ModelLoad, ms: ModelScaleState, config: ScalingConfig) -> float | None:
    """The load's capacity rate, lowered where its finishes miss the long requests still
    running (:func:`inferq.policy.capacity.censoring_factor` over ``in_service_s``;
    where it is not known, Little's law over the in-flight count and the smoothed
    arrivals)."""
    if load.capacity_rate is None:
        return None
    served = load.in_service_s
    if served is None:
        served = mean_in_service_s(sum(load.busy.values()), ms.level or load.arrival_rate)
    return load.capacity_rate * censoring_factor(
        load.mean_service_s, served, config.censoring_margin
    )


def _rising(load: ModelLoad, ms: ModelScaleState, config: ScalingConfig) -> bool:
    """The arrival trend will carry the need out of the tolerance band upwards within a
    cold start, a decision and the slope's own time constant (``trend_slope_s``).

    The band holds a fleet at up to ``1 + tolerance`` of the need, and a worker launched
    once the need leaves it is useful a cold start and a decision later: on a wave that
    rises faster than that (issue 16's sinusoid, second rise: +0.45 workers a minute),
    the queue forms before the worker arrives. A rise the trend has held for a slope time
    constant is not the noise the band is there for, so it does not hold a scale-up.
    """
    if ms.level is None or ms.level <= 0:
        return False
    lead = load.cold_start_s + config.interval_s + config.trend_slope_s
    return ms.forecast(lead) > ms.level * (1.0 + config.tolerance)


def _plan(
    load: ModelLoad,
    ms: ModelScaleState,
    config: ScalingConfig,
    sla: Mapping[str, float],
    now: float,
) -> tuple[ScaleDecision, ModelScaleState]:
    limits = config.limits_for(load.model)
    current = load.current
    need, reasons = _need(load, ms, config, sla)
    first = ms.need_since is None  # no history at all: the moment is all there is
    ms = _average_need(ms, need, now, config)
    settled = first or (ms.need_since is not None and now - ms.need_since >= config.down_window_s)
    rising = _rising(load, ms, config)
    want = _within_tolerance(
        need, ms.need_avg if settled else None, current, config, reasons, rising
    )
    mu = load.capacity_rate or load.worker_rate
    horizon = load.cold_start_s + config.interval_s
    rate = burst_rate(load, max(load.arrival_rate, ms.forecast(horizon)))
    if ready_drain_s(load, mu, rate, horizon, sla) is None:  # else a launch comes too late
        want = max(want, _sla_floor(load, config, sla, reasons))
    target = bounded(want, limits, reasons)
    surplus = target < current and load.starting == 0 and settled
    ms = replace(ms, surplus_since=(ms.surplus_since or now) if surplus else None)
    forced = current < limits.min_workers or current > limits.max_workers
    if target != current and not forced:
        direction = "up" if target > current else "down"
        wait = reversal_wait(ms, direction, config.reversal_dwell_s, now)
        if wait > 0:
            reasons.append(
                f"hysteresis: {direction} would reverse the last {ms.last_direction}; "
                f"no reversal for {wait:.0f} s (one per {config.reversal_dwell_s:.0f} s)"
            )
            return ScaleDecision(load.model, current, current, "hold", tuple(reasons)), ms
    if target > current:
        decision = _scale_up(load, ms, config, limits, target, now, reasons)
        if decision.action == "up":  # a new regime: the window's mean starts afresh
            ms = replace(ms, need_avg=need, need_since=now)
        return decision, ms
    if target < current:
        return _scale_down(load, ms, config, limits, target, now, reasons, settled), ms
    return ScaleDecision(load.model, current, current, "hold", tuple(reasons)), ms


def _need(
    load: ModelLoad, ms: ModelScaleState, config: ScalingConfig, sla: Mapping[str, float]
) -> tuple[float, list[str]]:
    """Fractional workers needed, and the reasons behind the number."""
    mu = load.capacity_rate or load.worker_rate
    horizon = load.cold_start_s + config.interval_s
    predicted = ms.forecast(horizon)
    rate = max(load.arrival_rate, predicted)
    backlog = _weighted_backlog(load, config, sla)
    drain_s = max(config.backlog_drain_s, horizon)
    after = burst_rate(load, rate)
    gone_in = ready_drain_s(load, mu, after, horizon, sla)
    if gone_in is not None:
        reasons_gone = (
            f"backlog of {load.total_queued} drains in {gone_in:.0f} s with the "
            f"{load.ready} ready, before a worker launched now is ready "
            f"({horizon:.0f} s): none launched for it"
        )
        if after < rate - _EPS:
            reasons_gone += (
                f"; it arrived within the {load.rate_window_s:.0f} s the rate is measured "
                f"over, so {rate:.2f} req/s counts it once, as backlog: {after:.2f} req/s"
            )
        backlog, rate = 0.0, after
    need = (rate + backlog / drain_s) / mu
    if load.capacity_rate:
        reasons = [
            f"need {need:.2f}: arrivals {rate:.2f} req/s / {mu:.2f} req/s per worker "
            "at its target occupancy"
        ]
    else:
        reasons = [
            f"need {need:.2f}: arrivals {rate:.2f} req/s x {load.saturated_service_s:.2f} s "
            f"/ {load.slots_per_worker} slots"
        ]
    if predicted > load.arrival_rate + _EPS:
        reasons.append(
            f"trend: {load.arrival_rate:.2f} -> {predicted:.2f} req/s within {horizon:.0f} s "
            f"(cold start {load.cold_start_s:.0f} s)"
        )
    if backlog > 0:
        reasons.append(
            f"backlog {backlog:.0f} weighted ({load.total_queued} queued) "
            f"> capacity: +{backlog / drain_s / mu:.2f} workers "
            f"to clear it in {drain_s:.0f} s"
        )
    if gone_in is not None:
        reasons.append(reasons_gone)
    if load.starting:
        reasons.append(f"{load.starting} starting counted as capacity")
    return need, reasons


def burst_rate(load: ModelLoad, rate: float) -> float:
    """The arrival rate ``rate`` (requests/s) less the part of it still queued: the
    arrivals after a burst, when the burst is in the queue.

    ``arrival_rate`` counts the submits of the last ``rate_window_s`` seconds. A class whose
    oldest queued request has waited less than that window holds only requests that
    arrived within it, so they are in the rate *and* in the backlog: a burst of 400 batch
    requests read as 8.7 req/s of sustained arrivals (issue 24: ``inferq demo``'s burst at
    t~150 s launched a 70B worker that came up after the burst was gone and idled ~300 s).
    Those requests are taken out of the rate (``queued_c / rate_window_s`` each); a class
    queued for longer than the window is left in (its queue predates the window: it may
    be a sustained overload, and what of it arrived within the window is not known).

    Returns:
        requests/s, ``0 <= result <= rate``; ``rate`` itself when ``rate_window_s`` is
        None or nothing recent is queued.
    """
    window = load.rate_window_s
    if window is None:
        return rate
    recent = sum(
        n for cls, n in load.queued.items() if n > 0 and load.oldest_wait_s.get(cls, 0.0) < window
    )
    return max(0.0, rate - recent / window)


def ready_drain_s(
    load: ModelLoad,
    mu: float,
    rate: float,
    horizon_s: float,
    sla: Mapping[str, float] | None = None,
) -> float | None:
    """Seconds the ready fleet takes to clear the queue, when that is sooner than
    ``horizon_s`` (a worker launched now is ready no sooner) and every queued class's
    oldest request still ends its wait within its SLA; else None.

    The ready workers serve ``ready x mu`` requests/s; what they have beyond the
    arrivals (``rate``) drains the queue's :attr:`~ModelLoad.queued_work` (the queued
    requests counted in mean requests, by their class's service time). A burst the fleet clears
    within a cold start needs no launch: the worker would come up after the work is
    gone and idle (issue 24: ``inferq demo``'s batch burst at t~150 s started two 70B
    workers that came up at t~220 s, after the fleet had drained it). None too when
    nothing is queued or the ready fleet does not outrun the arrivals, and when a class
    would wait past its SLA meanwhile (a realtime burst: the launch is for the arrivals
    behind it, and dropping it cost the shaped-load test's realtime 0.4 points).

    Args:
        load: the model's load (``ready``, ``total_queued``).
        mu: one worker's rate, requests/s.
        rate: the arrivals expected, requests/s.
        horizon_s: seconds until a worker launched now is useful.
        sla: class -> SLA seconds (a class missing has none).
    """
    spare = load.ready * mu - rate
    if load.total_queued <= 0 or spare <= _EPS:
        return None
    drain = load.queued_work / spare
    if not drain < horizon_s:  # nan too: what cannot be measured is not drained
        return None
    for cls, count in load.queued.items():
        if count > 0 and sla and cls in sla and load.oldest_wait_s.get(cls, 0.0) + drain > sla[cls]:
            return None
    return drain


def _weighted_backlog(load: ModelLoad, config: ScalingConfig, sla: Mapping[str, float]) -> float:
    """Queued work (mean requests, :attr:`ModelLoad.queued_work`) weighted by class and
    by the age of the class's oldest request."""
    total = 0.0
    for cls, count in load.queued.items():
        if count <= 0:
            continue
        weight = config.class_weights.get(cls, 1.0)
        age = 0.0
        if cls in sla:
            age = min(1.0, load.oldest_wait_s.get(cls, 0.0) / sla[cls])
        work = count * load.relative_service(cls)
        total += work * weight * (1.0 + age * (config.age_factor_max - 1.0))
    return total


def _average_need(
    ms: ModelScaleState, need: float, now: float, config: ScalingConfig
) -> ModelScaleState:
    """Fold ``need`` into the exponential moving average of time constant ``down_window_s``."""
    if ms.need_avg is None or ms.need_since is None or ms.checked_at is None:
        return replace(ms, need_avg=need, need_since=now)
    dt = max(0.0, now - ms.checked_at)
    a = 1.0 - math.exp(-dt / config.down_window_s) if dt > 0 else 0.0
    return replace(ms, need_avg=a * need + (1.0 - a) * ms.need_avg)


def _within_tolerance(
    need: float,
    need_avg: float | None,
    current: int,
    config: ScalingConfig,
    reasons: list[str],
    rising: bool = False,
) -> int:
    """Up to ``ceil(need)`` at once (the band does not hold it while ``rising``:
    :func:`_rising`); down only to what the need averaged over the down
    window asks, with ``1 / down_threshold`` of headroom (None: less than a window seen
    since the first decision or the last scale-up: the moment's need, and
    :func:`_scale_down` drains only idle workers then; the first minutes' finishes are
    the short requests, so their need is biased low).

    Up follows the moment (an arrival burst, a backlog: growing late misses the SLA);
    down follows the window's load, as the issue asks ("when the fleet could carry the
    last window's load with one worker fewer at the target occupancy"): on bursty
    traffic (the Azure code trace: 1-16 req/s from one minute to the next) a down rule
    on the moment is reset by every burst and never gives a worker back.
    """
    tolerance = config.tolerance
    band = current > 0 and abs(need / current - 1.0) <= tolerance
    if band and rising and need > current + _EPS:
        reasons.append(f"rising: the trend leaves the {tolerance:.0%} band within its horizon")
    elif band:
        reasons.append(f"within tolerance {tolerance:.0%} of {current}")
        return current
    up = max(0, math.ceil(need - _EPS))
    if up >= current:
        return up
    basis, window = need, "now; too little seen for its mean: only idle workers may go"
    if need_avg is not None:
        basis, window = need_avg, f"mean of {config.down_window_s:.0f} s"
    down = max(up, math.ceil(basis / config.down_threshold - _EPS))
    if down >= current:
        reasons.append(
            f"need {basis:.2f} ({window}) fits {current - 1} workers only above "
            f"{config.down_threshold:.0%} of their capacity: hold {current}"
        )
        return current
    reasons.append(
        f"need {basis:.2f} ({window}) fits {down} workers at "
        f"{config.down_threshold:.0%} of their capacity"
    )
    return down


def reversal_wait(ms: ModelScaleState, direction: str, dwell_s: float, now: float) -> float:
    """Seconds before an action in ``direction`` may reverse the model's last one (0: now).

    Only a reversal waits, and only for ``dwell_s`` after the previous reversal: two
    reversals are then always ``dwell_s`` apart, so any window of ``dwell_s`` holds one.
    """
    if ms.last_direction is None or ms.last_direction == direction:
        return 0.0
    if ms.last_reversal_at is None:
        return 0.0
    return max(0.0, ms.last_reversal_at + dwell_s - now)


def _sla_floor(
    load: ModelLoad, config: ScalingConfig, sla: Mapping[str, float], reasons: list[str]
) -> int:
    """``ready + 1`` when a class waits past its threshold and nothing is starting."""
    worst: tuple[float, str] | None = None
    for cls, count in load.queued.items():
        if count <= 0 or cls not in sla:
            continue
        ratio = load.oldest_wait_s.get(cls, 0.0) / (config.target_wait_fraction * sla[cls])
        if ratio > 1.0 and (worst is None or ratio > worst[0]):
            worst = (ratio, cls)
    if worst is None:
        return 0
    cls = worst[1]
    reasons.append(
        f"oldest {cls} wait {load.oldest_wait_s[cls]:.1f} s > "
        f"{config.target_wait_fraction * sla[cls]:.1f} s "
        f"({config.target_wait_fraction:g} x SLA {sla[cls]:g} s)"
    )
    return load.ready + 1


def bounded(want: int, limits: ModelLimits, reasons: list[str]) -> int:
    """``want`` workers within ``limits`` (min, max); the bound that applied joins ``reasons``."""
    if want < limits.min_workers:
        reasons.append(f"bounds: min {limits.min_workers}")
        return limits.min_workers
    if want > limits.max_workers:
        reasons.append(f"bounds: max {limits.max_workers}")
        return limits.max_workers
    return want


def cooldown_left(ms: ModelScaleState, cooldown_s: float, now: float) -> float:
    """Seconds until ``cooldown_s`` after the model's last scale action has passed (0: past)."""
    last = ms.last_action_at
    return 0.0 if last is None else max(0.0, last + cooldown_s - now)


def _scale_up(
    load: ModelLoad,
    ms: ModelScaleState,
    config: ScalingConfig,
    limits: ModelLimits,
    target: int,
    now: float,
    reasons: list[str],
) -> ScaleDecision:
    current = load.current
    left = cooldown_left(ms, config.up_cooldown_s, now)
    if left > 0:
        reasons.append(f"cooldown: no scale-up for {left:.1f} s")
        if current >= limits.min_workers:
            return ScaleDecision(load.model, current, current, "hold", tuple(reasons))
        target = limits.min_workers
        reasons.append(f"bounds: min {limits.min_workers} overrides the cooldown")
    return ScaleDecision(load.model, current, target, "up", tuple(reasons))


def _scale_down(
    load: ModelLoad,
    ms: ModelScaleState,
    config: ScalingConfig,
    limits: ModelLimits,
    target: int,
    now: float,
    reasons: list[str],
    settled: bool = True,
) -> ScaleDecision:
    current = load.current
    idle = drain_order(load)
    forced = max(0, current - limits.max_workers)  # over max: any idle worker may go
    wanted = 0
    left = cooldown_left(ms, config.down_cooldown_s, now)
    if left > 0:
        reasons.append(f"cooldown: no scale-down for {left:.1f} s")
    else:
        long_idle = sum(1 for w in idle if load.idle_workers[w] >= config.idle_s)
        wanted = min(current - target, long_idle)
        if wanted < current - target:
            reasons.append(
                f"idle: {long_idle} of {current - target} surplus workers idle "
                f">= {config.idle_s:.0f} s"
            )
    drain = tuple(idle[: max(forced, wanted)])
    if not drain and left <= 0 and current - target > 0 and settled:
        drain = _least_busy_after_surplus(load, ms, config, now, reasons)
    if not drain:
        return ScaleDecision(load.model, current, current, "hold", tuple(reasons))
    return ScaleDecision(load.model, current, current - len(drain), "down", tuple(reasons), drain)


def _least_busy_after_surplus(
    load: ModelLoad, ms: ModelScaleState, config: ScalingConfig, now: float, reasons: list[str]
) -> tuple[str, ...]:
    """One busy worker to drain once the surplus has lasted ``down_window_s``.

    The dispatcher spreads work over the least-loaded workers (the design's
    routing rule), so under steady moderate load no worker ever sits idle and
    an idle-only rule would never give GPUs back. A drain finishes the
    worker's in-flight requests before it leaves, so the least busy one may go.
    """
    if ms.surplus_since is None or now - ms.surplus_since < config.down_window_s or not load.busy:
        return ()
    worker = min(load.busy, key=lambda w: (load.busy[w], w))
    reasons.append(
        f"surplus for {now - ms.surplus_since:.0f} s >= {config.down_window_s:.0f} s and no "
        f"idle worker: draining the least busy ({worker}, {load.busy[worker]} in flight, "
        "finished before it leaves)"
    )
    return (worker,)


def drain_order(load: ModelLoad) -> list[str]:
    """Workers that may be drained, best first: idle longest, then least busy, then id.

    A worker with anything in flight is never a candidate.
    """
    candidates = [w for w in load.idle_workers if load.busy.get(w, 0) == 0]
    return sorted(candidates, key=lambda w: (-load.idle_workers[w], load.busy.get(w, 0), w))


def grant_budget(
    plans: Sequence[ScaleDecision], loads: Sequence[ModelLoad], config: ScalingConfig
) -> list[ScaleDecision]:
    """Trim scale-ups to the GPU budget: minimum pools first, then by model priority."""
    if config.gpu_budget is None:
        return list(plans)
    by_model = {load.model: load for load in loads}
    gpus = {m: config.limits_for(m).gpus_per_worker for m in by_model}
    used = sum((ld.current + ld.draining) * gpus[ld.model] for ld in loads)
    granted = {p.model: 0 for p in plans}
    ups = sorted((p for p in plans if p.action == "up"), key=lambda p: config.priority_key(p.model))
    for stage in ("min", "rest"):
        for p in ups:
            cap = p.desired
            if stage == "min":
                cap = min(cap, max(p.current, config.limits_for(p.model).min_workers))
            want = cap - p.current - granted[p.model]
            room = want if gpus[p.model] == 0 else (config.gpu_budget - used) // gpus[p.model]
            grant = max(0, min(want, room))
            granted[p.model] += grant
            used += grant * gpus[p.model]
    return [_trimmed(p, granted[p.model], used, config.gpu_budget) for p in plans]


def _trimmed(plan: ScaleDecision, granted: int, used: int, budget: int) -> ScaleDecision:
    if plan.action != "up" or plan.current + granted == plan.desired:
        return plan
    reasons = (*plan.reasons, f"gpu budget: {used} of {budget} GPUs in use")
    if granted == 0:
        return replace(plan, desired=plan.current, action="hold", reasons=reasons)
    return replace(plan, desired=plan.current + granted, reasons=reasons)


def _update_trend(
    ms: ModelScaleState, rate: float, now: float, config: ScalingConfig
) -> ModelScaleState:
    """Holt's linear trend with irregular steps: level and slope of the arrival rate."""
    if ms.level is None or ms.observed_at is None:
        return replace(ms, level=rate, slope=0.0, observed_at=now)
    dt = now - ms.observed_at
    if dt <= 0:
        return ms
    a = 1.0 - math.exp(-dt / config.trend_level_s)
    b = 1.0 - math.exp(-dt / config.trend_slope_s)
    level = a * rate + (1.0 - a) * (ms.level + ms.slope * dt)
    slope = b * (level - ms.level) / dt + (1.0 - b) * ms.slope
    return replace(ms, level=max(0.0, level), slope=slope, observed_at=now)


def _smooth_service(
    ms: ModelScaleState,
    measured_s: float,
    capacity: float | None,
    now: float,
    config: ScalingConfig,
) -> ModelScaleState:
    """Exponential smoothing of the measured service time and of the per-worker capacity
    (time constant ``service_smoothing_s``).

    A 10 s window of finishes holds a handful of requests on a light or bursty
    trace; one 7,000-token prompt then doubles the mean, and sizing on it launches
    workers for a load that is not there (seen on the Azure code trace). The capacity
    rate rests on the same window's mean request (its KV tokens and service time): on
    the conversation trace it swung 1.3-3.8 req/s per worker between 10 s windows, and
    the need with it (2.3-5.3 workers for a steady load), so one high window launched
    workers and a high window every few minutes kept the surplus from ever lasting.

    The first ``service_smoothing_s`` of capacities are not averaged: the latest stands.
    Finishes are censored by the history's length (a request longer than the time
    served so far cannot have finished), so the earliest windows are the most biased
    (the shortest requests only) and averaging them in would keep their bias for a
    smoothing constant; each later window is less censored than the one before.
    """
    since = ms.capacity_since
    if since is None and capacity is not None:
        since = now
    if ms.service_s is None or ms.observed_at is None:
        return replace(ms, service_s=measured_s, capacity=capacity, capacity_since=since)
    dt = max(0.0, now - (ms.checked_at or ms.observed_at))
    a = 1.0 - math.exp(-dt / config.service_smoothing_s) if dt > 0 else 0.0
    if capacity is None:
        smoothed = ms.capacity
    elif ms.capacity is None or now - (since or now) < config.service_smoothing_s:
        smoothed = capacity
    else:
        smoothed = a * capacity + (1.0 - a) * ms.capacity
    service_s = a * measured_s + (1.0 - a) * ms.service_s
    return replace(ms, service_s=service_s, capacity=smoothed, capacity_since=since)


def stamp_decisions(
    decisions: Iterable[ScaleDecision], models: dict[str, ModelScaleState], now: float
) -> ScalerState:
    """Stamp each model's state with this decision (time checked, action taken)."""
    for d in decisions:
        ms = replace(models.get(d.model, ModelScaleState()), checked_at=now)
        if d.action in ("up", "down") and ms.last_direction not in (None, d.action):
            ms = replace(ms, last_reversal_at=now)
        if d.action == "up":
            ms = replace(ms, last_up_at=now, last_direction="up")
        elif d.action == "down":
            ms = replace(ms, last_down_at=now, last_direction="down")
        models[d.model] = ms
    return ScalerState(models=models)


def check_unique_models(loads: Sequence[ModelLoad]) -> None:
    """Raises ValueError when a model appears twice in ``loads``."""
    seen: set[str] = set()
    for load in loads:
        if load.model in seen:
            raise ValueError(f"model {load.model!r} appears twice in loads")
        seen.add(load.model)
