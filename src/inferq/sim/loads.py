"""What the simulated scaler sees: one :class:`~inferq.policy.scaling.ModelLoad` per model.

Built the way the scaler daemon builds it (:mod:`inferq.scaler.daemon`,
:mod:`inferq.policy.scaling_inputs`), from the simulator's own facts instead of Redis:

- managed models: the ``[scaling.pools]`` of the settings when any, else the
  initial fleet's models plus every model a request is routed to;
- backlog: :func:`inferq.policy.scaling_inputs.backlog` over ``(class, route, queued,
  oldest wait)`` rows, so a route is charged to its first managed model;
- arrival rate: requests routed to the model in the last ``window_s`` seconds
  (``defaults.SCALER_RATE_WINDOW_S``), over ``window_s``;
- service time: mean dispatch -> finish of the requests that finished in the
  window, overall and per class; without any, the last such mean, else the latency model's time for
  the model's mean output estimate (``Settings.default_max_tokens`` when none);
- fleet: ready / starting / draining counts; idle seconds of the ready workers
  with nothing running; in-flight counts of the busy ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from inferq import defaults
from inferq.config import Settings
from inferq.latency import saturation_factor
from inferq.models import WorkerState
from inferq.policy.capacity import strictest_tpot, worker_capacity
from inferq.policy.scaling import ModelLoad
from inferq.policy.scaling_inputs import (
    QueueDepth,
    ServiceLog,
    ServiceStats,
    backlog,
    estimated_service_s,
    route_model,
    service_stats,
)
from inferq.sim.fleet import SimWorker


class LoadTracker:
    """Arrivals and service times of the last window, and the loads built from them.

    Args:
        settings: the registry and ``default_max_tokens``.
        managed: the models the scaler manages, in priority order.
        slots: slots per worker.
        window_s: seconds of arrivals and finishes measured.
    """

    def __init__(
        self,
        settings: Settings,
        managed: Sequence[str],
        slots: int,
        window_s: float = defaults.SCALER_RATE_WINDOW_S,
    ) -> None:
        self.settings = settings
        self.managed = tuple(managed)
        self.slots = slots
        self.window_s = window_s
        self._routes: dict[str, str | None] = {}
        self._arrivals: deque[tuple[float, str]] = deque()
        self._dispatches: deque[tuple[float, str, int]] = deque()
        self._finishes: deque[tuple[float, str, str, float, int, int, int]] = deque()
        self._measured: dict[str, float] = {}
        self._tpot_s = strictest_tpot(settings.classes)

    def model_of(self, route: str) -> str | None:
        """The managed model a route's requests are charged to (cached)."""
        if route not in self._routes:
            self._routes[route] = route_model(route, self.settings.models, self.managed)
        return self._routes[route]

    def arrived(self, at: float, route: str) -> None:
        """A request for ``route`` was submitted."""
        model = self.model_of(route)
        if model is not None:
            self._arrivals.append((at, model))

    def dispatched(self, at: float, model: str, n: int) -> None:
        """``n`` requests were taken into service on a worker of ``model``."""
        self._dispatches.append((at, model, n))

    def finished(
        self,
        at: float,
        model: str,
        service_s: float,
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        concurrency: int = 1,
        priority: str = "",
    ) -> None:
        """A request of class ``priority`` finished on ``model`` after ``service_s``
        seconds since dispatch, having run with ``concurrency`` requests on its worker."""
        self._finishes.append(
            (at, model, priority, service_s, prompt_tokens, output_tokens, concurrency)
        )

    def loads(
        self,
        now: float,
        depths: Iterable[QueueDepth],
        workers: Iterable[SimWorker],
        estimates: Mapping[tuple[str, str], float],
        running_since: Mapping[str, float] | None = None,
    ) -> list[ModelLoad]:
        """One load per managed model, in ``managed`` order; ``running_since`` maps a
        running request's id to when it entered service (sim seconds)."""
        running_since = running_since or {}
        start = now - self.window_s
        while self._arrivals and self._arrivals[0][0] < start:
            self._arrivals.popleft()
        while self._finishes and self._finishes[0][0] < start:
            self._finishes.popleft()
        while self._dispatches and self._dispatches[0][0] < start:
            self._dispatches.popleft()
        arrivals: dict[str, int] = {}
        for _, model in self._arrivals:
            arrivals[model] = arrivals.get(model, 0) + 1
        stats = service_stats(f[1:6] for f in self._finishes if f[3] > 0)
        concurrency: dict[str, list[int]] = {}
        for f in self._finishes:
            if f[3] > 0:
                concurrency.setdefault(f[1], []).append(f[6])
        self._measured.update({m: st.service_s for m, st in stats.items()})
        saturation = {
            m: saturation_factor(
                self.settings.model_by_name[m],
                st.prompt_tokens,
                st.output_tokens,
                sum(concurrency[m]) / len(concurrency[m]),
                self.slots,
            )
            for m, st in stats.items()
        }
        queues = backlog(depths, self.settings.models, self.managed)
        by_model: dict[str, list[SimWorker]] = {}
        for w in workers:
            by_model.setdefault(w.model, []).append(w)
        out = []
        for model in self.managed:
            queued, waits = queues.get(model, ({}, {}))
            st = stats.get(model)
            out.append(
                self._load(
                    model,
                    now,
                    queued,
                    waits,
                    arrivals.get(model, 0) / self.window_s,
                    st.service_s if st else self._fallback(model, estimates),
                    saturation.get(model, 1.0),
                    by_model.get(model, []),
                    self._capacity(model, st, by_model.get(model, [])),
                    st.class_service_s if st else {},
                    self._log(model, start, now, by_model.get(model, []), running_since),
                )
            )
        return out

    def _log(
        self,
        model: str,
        start: float,
        now: float,
        workers: Sequence[SimWorker],
        running_since: Mapping[str, float],
    ) -> ServiceLog:
        """The window's service log of ``model``: what the scaler daemon reads from the
        event stream (:func:`inferq.policy.scaling_inputs.service_logs`)."""
        return ServiceLog(
            start,
            now,
            [(at, n) for at, m, n in self._dispatches if m == model],
            [(f[0], f[3]) for f in self._finishes if f[1] == model and f[3] > 0],
            [running_since[rid] for w in workers for rid in w.running if rid in running_since],
        )

    def _capacity(
        self, model: str, stats: ServiceStats | None, workers: Sequence[SimWorker]
    ) -> float | None:
        """One worker's rate at its target occupancy for the window's mean request
        (:func:`inferq.policy.capacity.worker_capacity`, as the scaler daemon computes it)."""
        if stats is None:
            return None
        kv_mib = max((w.kv_cache_mib for w in workers), default=0.0)
        return worker_capacity(
            self.settings.model_by_name[model],
            kv_mib,
            self.slots,
            stats.prompt_tokens,
            stats.output_tokens,
            self._tpot_s,
            defaults.SCALE_TARGET_OCCUPANCY,
        ).rate

    def _fallback(self, model: str, estimates: Mapping[tuple[str, str], float]) -> float:
        if model in self._measured:
            return self._measured[model]
        spec = self.settings.model_by_name[model]
        return estimated_service_s(spec, estimates, self.settings.default_max_tokens)

    def _load(
        self,
        model: str,
        now: float,
        queued: Mapping[str, int],
        waits: Mapping[str, float],
        rate: float,
        mean_service_s: float,
        saturation: float,
        workers: Sequence[SimWorker],
        capacity_rate: float | None,
        class_service_s: Mapping[str, float],
        log: ServiceLog,
    ) -> ModelLoad:
        ready = [w for w in workers if w.state is WorkerState.READY]
        running = sum(len(w.running) for w in ready)
        return ModelLoad(
            model=model,
            queued=dict(queued),
            oldest_wait_s=dict(waits),
            arrival_rate=rate,
            mean_service_s=max(1e-6, mean_service_s),
            slots_per_worker=self.slots,
            cold_start_s=self.settings.model_by_name[model].cold_start_s,
            saturation=saturation,
            ready=len(ready),
            starting=sum(1 for w in workers if w.state is WorkerState.STARTING),
            draining=sum(1 for w in workers if w.state is WorkerState.DRAINING),
            idle_workers={w.id: max(0.0, now - w.idle_since) for w in ready if not w.running},
            busy={w.id: len(w.running) for w in ready if w.running},
            capacity_rate=capacity_rate,
            rate_window_s=self.window_s,
            class_service_s=dict(class_service_s),
            in_service_s=log.in_service_s(running),
        )
