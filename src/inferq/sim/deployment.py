"""The simulated deployment: settings, fleet, cards, slots, scaler bounds and latency.

:class:`SimConfig` is everything a run needs besides the requests and the
policy; :func:`initial_fleet` is the warm fleet at time 0 (the configured one,
or the peak-provisioned one of ``static-fifo``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from inferq import defaults
from inferq.config import ModelSpec, Settings
from inferq.latency import ServiceTime, service_time
from inferq.policy.scaling import ModelLimits, ScalingConfig
from inferq.sim.capacity import peak_fleet
from inferq.sim.policies import SimPolicy
from inferq.sim.workload import SimRequest

#: ``(spec, prompt_tokens, output_tokens, concurrency) -> ServiceTime`` of a request:
#: :func:`inferq.latency.service_time` by default (the sim model server's model).
LatencyFn = Callable[[ModelSpec, int, int, int], ServiceTime]


def fixed_latency(seconds: float, ttft_s: float = 0.0) -> LatencyFn:
    """A latency function ignoring the request: every request runs ``seconds`` in all.

    Args:
        seconds: total service time (>= ``ttft_s``).
        ttft_s: time to the first token within it.
    """
    fixed = ServiceTime(ttft_s=ttft_s, decode_s=max(0.0, seconds - ttft_s))

    def latency(
        spec: ModelSpec, prompt_tokens: int, output_tokens: int, concurrency: int
    ) -> ServiceTime:
        return fixed

    return latency


def default_fleet() -> dict[str, int]:
    """``defaults.SIM_FLEET`` (``"model:count,..."``) as a mapping."""
    fleet: dict[str, int] = {}
    for part in defaults.SIM_FLEET.split(","):
        name, _, count = part.partition(":")
        fleet[name.strip()] = int(count or 1)
    return fleet


def scaling_for_fleet(
    settings: Settings, fleet: Mapping[str, int], max_workers: int = defaults.SCALE_MAX_WORKERS
) -> ScalingConfig:
    """The scaler's knobs from ``settings.scaling``, with bounds for a simulated fleet.

    Cooldowns, idle time, interval, trend and backlog constants and the GPU
    budget come from the ``[scaling]`` table (:meth:`ScalingConfig.from_settings`,
    as the daemon reads them). Bounds: the configured pools when any; else the
    models of ``fleet`` keep ``1 <= workers <= max(max_workers, initial)`` and any
    other model may go from 0 to ``max_workers``.
    """
    base = ScalingConfig.from_settings(settings.scaling)
    if settings.scaling.pools:
        return base
    return replace(
        base,
        limits={
            m: ModelLimits(min_workers=min(1, n), max_workers=max(max_workers, n, 1))
            for m, n in fleet.items()
        },
        default_limits=ModelLimits(min_workers=0, max_workers=max(1, max_workers)),
    )


@dataclass(frozen=True)
class SimConfig:
    """The simulated deployment.

    Attributes:
        settings: classes (SLAs, timeouts, weights) and the model registry.
        fleet: model -> warm workers at time 0 (ignored by peak-provisioned policies).
        vram_mib: VRAM of every card, MiB (KV-cache room via ``ModelSpec.kv_cache_mib``).
        slots: concurrent requests per worker.
        scaling: scaler knobs and bounds; None = :func:`scaling_for_fleet` of ``fleet``.
        rate_window_s: seconds of arrivals and finishes the scaler measures.
        max_workers: per-model bound used when ``scaling`` is None.
        queue_head: requests per ``(class, route)`` queue in a snapshot.
        tick_s: dispatcher tick while requests wait beside free slots, seconds.
        latency: service time of a request; default the latency model.
        abort_delay_s: a preemption's abort to the freed room, seconds (the real
            worker reads its control channel every ``defaults.CONTROL_BLOCK_S`` at
            most; 0 models it as instant, like dispatch and hand-off).
        check: verify slots and VRAM limits after every decision (AssertionError).
    """

    settings: Settings = field(default_factory=Settings)
    fleet: Mapping[str, int] = field(default_factory=default_fleet)
    vram_mib: int = defaults.SIM_VRAM_MIB
    slots: int = defaults.SIM_WORKER_SLOTS
    scaling: ScalingConfig | None = None
    max_workers: int = defaults.SCALE_MAX_WORKERS
    rate_window_s: float = defaults.SCALER_RATE_WINDOW_S
    queue_head: int = defaults.QUEUE_HEAD
    tick_s: float = defaults.DISPATCH_TICK_S
    latency: LatencyFn = service_time
    abort_delay_s: float = 0.0
    check: bool = False

    def scaling_config(self) -> ScalingConfig:
        """``scaling``, or the bounds of :func:`scaling_for_fleet`."""
        return self.scaling or scaling_for_fleet(self.settings, self.fleet, self.max_workers)


def initial_fleet(
    policy: SimPolicy, requests: Sequence[SimRequest], config: SimConfig
) -> dict[str, int]:
    """The warm fleet at time 0: ``config.fleet``, or the peak fleet for ``peak_fleet`` policies.

    The peak fleet is :func:`~inferq.sim.capacity.peak_fleet` of the trace's own
    requests (``source != "synthetic"``: a bulk job is not the load a deployment
    is provisioned for), with at least one worker for every model of ``config.fleet``.
    """
    if not policy.peak_fleet:
        return dict(config.fleet)
    real = [r for r in requests if r.source != "synthetic"] or list(requests)
    peak = peak_fleet(real, config.settings, config.slots, vram_mib=config.vram_mib)
    for model in config.fleet:
        peak.setdefault(model, 1)
    return peak
