"""What the scaler knows of each model: :class:`ModelLoad` built from Redis facts.

Pure functions (no redis, no clock): the daemon reads queues, heartbeats, the
events stream and its own tracking through :class:`~inferq.store.Store` and
passes them here, with ``now`` from the Redis clock.

- **Backlog**: a queue's route (``llama-3.1-8b``, ``>=13b``) is charged to the
  first managed model among :func:`inferq.routes.candidates` (without degrading),
  the one the dispatcher prefers, so no request is counted twice.
- **Arrival rate**: submit events in the window per model, over the window, req/s;
  the **dispatch rate** from dispatch events: the rate the running requests entered
  service at (:func:`entry_rate`), for Little's law in the censoring correction.
- **Service time**: mean of ``e2e_ms - queue_ms`` (dispatch -> finish) of the
  finish events in the window, overall and per class (a queued request counts as its
  class's mean); without any, the caller's fallback.
- **Fleet**: :func:`reconcile` merges heartbeats, the platform's listing and the
  scaler's per-worker tracking (:class:`Tracked`, kept in Redis so any replica
  continues it) into starting / draining counts, idle times, and the workers to
  stop now.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from inferq import defaults
from inferq.config import ModelSpec
from inferq.errors import CorruptRecord, InvalidRequest
from inferq.latency import saturation_factor, service_time
from inferq.models import Event, WorkerState
from inferq.policy.capacity import mean_in_service_s, time_on_test_s, worker_capacity
from inferq.policy.scaling import ModelLoad
from inferq.routes import candidates, parse_route

#: (class, route, queued, oldest wait in seconds or None): one row of ``Store.queue_depths``.
QueueDepth = tuple[str, str, int, float | None]


@dataclass(frozen=True, slots=True)
class LiveWorker:
    """A worker as its heartbeat and its load hash show it.

    Attributes:
        id: worker id.
        model: the model it serves.
        state: ``starting``, ``ready`` or ``draining`` (its own report).
        slots: concurrent requests at most.
        in_flight: requests it runs (heartbeat).
        reserved: slots held by assigned work (``load:<id>``), dispatched but maybe not started.
        kv_cache_mib: KV-cache room it advertises, MiB (0: unknown).
    """

    id: str
    model: str
    state: WorkerState
    slots: int
    in_flight: int = 0
    reserved: int = 0
    kv_cache_mib: int = 0

    @property
    def busy(self) -> int:
        """Requests it holds: the larger of running and reserved."""
        return max(self.in_flight, self.reserved)


@dataclass(frozen=True, slots=True)
class Tracked:
    """The scaler's memory of one worker (a field of ``P scaler:workers``).

    Attributes:
        model: the model it serves.
        last_busy_at: when it was last seen with work (or first seen), epoch s.
        seen_live: it has had a heartbeat.
        absent_since: since when the platform lists it without a heartbeat, epoch s.
        draining_since: when the scaler asked it to drain (or first saw it draining on
            its own), epoch s; None while it serves.
    """

    model: str
    last_busy_at: float
    seen_live: bool = False
    absent_since: float | None = None
    draining_since: float | None = None

    def to_json(self) -> str:
        """Compact JSON of the fields."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, worker_id: str, raw: str, key: str) -> Tracked:
        """Parse :meth:`to_json`.

        Raises:
            CorruptRecord: ``raw`` is not the JSON of a tracking record.
        """
        try:
            value = cls(**json.loads(raw))
            float(value.last_busy_at)
        except (ValueError, TypeError) as exc:
            raise CorruptRecord(key, f"worker {worker_id!r}: {exc}") from None
        return value


@dataclass(frozen=True, slots=True)
class ReconciledFleet:
    """Heartbeats, platform listing and tracking, merged (output of :func:`reconcile`).

    Attributes:
        tracked: the tracking to keep (workers gone from both Redis and the platform dropped).
        starting: model -> workers on their way: listed without a heartbeat yet (or
            briefly absent), within the start timeout; heartbeats saying ``starting``
            are counted by :func:`build_loads`.
        to_stop: worker id -> why: drained and deregistered, left on their own, or
            never registered within the start timeout. None of them has a heartbeat.
    """

    tracked: dict[str, Tracked]
    starting: dict[str, int] = field(default_factory=dict)
    to_stop: dict[str, str] = field(default_factory=dict)


def reconcile(
    tracked: Mapping[str, Tracked],
    live: Sequence[LiveWorker],
    listed: Mapping[str, str],
    now: float,
    *,
    activity: Mapping[str, float] | None = None,
    start_timeout_s: float,
    lost_grace_s: float,
) -> ReconciledFleet:
    """Merge what Redis, the platform and the scaler's memory say of each worker.

    Args:
        tracked: the tracking carried from the previous decision.
        live: workers with a heartbeat.
        listed: worker id -> model, as the platform lists them (empty without a platform).
        now: epoch seconds (Redis clock).
        activity: worker id -> last dispatch or finish seen in the events stream,
            so work between two decisions still counts as busy.
        start_timeout_s: a listed worker never registered after this long failed to start.
        lost_grace_s: a worker seen live and now absent this long has left (its
            leases lapsed and the dispatcher requeued its work); until then it counts
            as starting (a missed beat comes back).

    Returns:
        The merged :class:`ReconciledFleet`.
    """
    out: dict[str, Tracked] = {}
    starting: dict[str, int] = {}
    to_stop: dict[str, str] = {}
    seen_at = activity or {}
    for w in live:
        t = tracked.get(w.id) or Tracked(model=w.model, last_busy_at=now)
        last = now if w.busy else max(t.last_busy_at, seen_at.get(w.id, t.last_busy_at))
        drain = t.draining_since
        if drain is None and w.state is WorkerState.DRAINING:
            drain = now  # drained by someone else (inferq drain, SIGTERM): stop it once gone
        out[w.id] = replace(
            t,
            model=w.model,
            last_busy_at=last,
            seen_live=True,
            absent_since=None,
            draining_since=drain,
        )
    for wid, model in listed.items():
        if wid in out:
            continue
        t = tracked.get(wid) or Tracked(model=model, last_busy_at=now)
        if t.draining_since is not None:
            to_stop[wid] = "drained and deregistered"
            out[wid] = t
            continue
        t = replace(t, absent_since=now if t.absent_since is None else t.absent_since)
        absent = now - (t.absent_since or now)
        if t.seen_live and absent >= lost_grace_s:
            to_stop[wid] = f"no heartbeat for {absent:.0f} s: left the fleet"
        elif not t.seen_live and absent > start_timeout_s:
            to_stop[wid] = f"not registered {absent:.0f} s after launch: failed to start"
        else:
            starting[t.model] = starting.get(t.model, 0) + 1
        out[wid] = t
    return ReconciledFleet(tracked=out, starting=starting, to_stop=to_stop)


def route_model(route: str, registry: Sequence[ModelSpec], managed: Sequence[str]) -> str | None:
    """The managed model a queue's backlog is charged to (None: no managed model serves it)."""
    try:
        names = candidates(parse_route(route), registry)
    except InvalidRequest:
        return None
    return next((n for n in names if n in managed), None)


def backlog(
    depths: Iterable[QueueDepth], registry: Sequence[ModelSpec], managed: Sequence[str]
) -> dict[str, tuple[dict[str, int], dict[str, float]]]:
    """Model -> (queued per class, oldest wait per class in seconds) from the queues."""
    out: dict[str, tuple[dict[str, int], dict[str, float]]] = {}
    for cls, route, depth, oldest in depths:
        model = route_model(route, registry, managed)
        if model is None or depth <= 0:
            continue
        queued, waits = out.setdefault(model, ({}, {}))
        queued[cls] = queued.get(cls, 0) + depth
        waits[cls] = max(waits.get(cls, 0.0), oldest or 0.0)
    return out


def arrival_rates(
    events: Iterable[Event],
    span_s: float,
    registry: Sequence[ModelSpec],
    managed: Sequence[str],
) -> dict[str, float]:
    """Model -> submitted requests per second over ``span_s`` seconds of events."""
    counts: dict[str, int] = {}
    for e in events:
        if e.type != "submit":
            continue
        model = route_model(e.fields.get("route", ""), registry, managed)
        if model is not None:
            counts[model] = counts.get(model, 0) + 1
    return {m: n / max(span_s, 1e-9) for m, n in counts.items()}


#: Events that end a request's run on its worker (it finished, failed, or went back
#: to the queue).
_RUN_ENDS = frozenset(
    {"finish", "fail", "expire", "cancel", "preempt", "retry", "abort", "dead_letter"}
)


@dataclass(frozen=True, slots=True)
class ServiceLog:
    """One model's window of service, what the censoring correction reads.

    Attributes:
        dispatches: ``(epoch s, requests)`` of its dispatches, in time order.
        finishes: ``(epoch s, service seconds)`` of its finishes.
        running_since: epoch s each request dispatched in the window and not ended since
            entered service (a request that went back to the queue unseen stays in; the
            caller keeps the newest ``running``).
        start, end: the interval the events cover, epoch s (``end`` is the newest
            event read where the read was capped, not the decision's ``now``).
    """

    start: float
    end: float
    dispatches: Sequence[tuple[float, int]] = ()
    finishes: Sequence[tuple[float, float]] = ()
    running_since: Sequence[float] = ()

    def in_service_s(self, running: int) -> float:
        """Mean seconds in service with ``running`` requests in service at ``end``
        (:func:`inferq.policy.capacity.mean_in_service_s` of :func:`entry_rate` and
        :func:`inferq.policy.capacity.time_on_test_s`; the running requests not seen
        dispatched count from ``start``)."""
        window = max(self.end - self.start, _MIN_ENTRY_SPAN_S)
        since = sorted(self.running_since)[-running:] if running > 0 else []
        return mean_in_service_s(
            running,
            entry_rate(self.dispatches, running, self.end, window),
            time_on_test_s(
                self.finishes, since, self.start, self.end, running_before=running - len(since)
            ),
        )


def service_logs(
    events: Iterable[Event], worker_model: Mapping[str, str], start: float, end: float
) -> dict[str, ServiceLog]:
    """Model -> :class:`ServiceLog` of its workers' events over ``[start, end]`` (in
    stream order; malformed counts and times skipped). A dispatch counts its ``ids``
    (the ``n`` beside them is the same number, and a count no id backs is not trusted).
    A run-ending event ends its request's run whatever it names: an expiry, a cancel
    before start, a retry and a dead letter carry no ``worker``, and a request id is
    dispatched to one model at a time."""
    dispatches: dict[str, list[tuple[float, int]]] = {}
    finishes: dict[str, list[tuple[float, float]]] = {}
    running: dict[str, tuple[str, float]] = {}  # request id -> (model, dispatched at)
    for e in events:
        model = worker_model.get(e.fields.get("worker", ""))
        if e.type in _RUN_ENDS:
            running.pop(e.fields.get("id", ""), None)
            took = _service_s(e) if e.type == "finish" else None
            if model is not None and took is not None:
                finishes.setdefault(model, []).append((e.at, took))
        elif e.type == "dispatch" and model is not None:
            ids = [i for i in e.fields.get("ids", "").split(",") if i]
            if ids:
                dispatches.setdefault(model, []).append((e.at, len(ids)))
            running.update(dict.fromkeys(ids, (model, e.at)))
    started: dict[str, list[float]] = {}
    for model, at in running.values():
        started.setdefault(model, []).append(at)
    models = dispatches.keys() | finishes.keys() | started.keys()
    return {
        m: ServiceLog(start, end, dispatches.get(m, []), finishes.get(m, []), started.get(m, []))
        for m in models
    }


def entry_rate(
    dispatches: Sequence[tuple[float, int]], running: int, now: float, window_s: float
) -> float:
    """Requests/s at which the ``running`` requests entered service, for Little's law.

    The newest dispatches are the ones still running (exactly so where requests take
    equal times): the rate is the last ``running`` requests dispatched over the seconds
    since the earliest of them. A rate over the whole window would not do: a burst that
    filled the slots a second ago is a tenth of a 10 s window's rate, and the running
    requests would read as ten times their service time (issue 24, item 5). Where the
    window holds fewer than ``running`` (requests running since before it), its count
    over ``window_s``.

    Args:
        dispatches: ``(epoch s, requests)`` in time order, all within the window.
        running: requests in service now.
        now: epoch seconds (the same clock as ``dispatches``).
        window_s: seconds the dispatches were read over (> 0).

    Returns:
        Requests/s, >= 0.
    """
    total = 0
    for at, n in reversed(dispatches):
        total += n
        if running > 0 and total >= running:
            return total / max(now - at, _MIN_ENTRY_SPAN_S)
    return total / window_s


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """Means over a model's finish events: seconds from dispatch to finish, tokens.

    ``class_service_s`` is the service mean per priority class (seconds), what
    :attr:`~inferq.policy.scaling.ModelLoad.queued_work` weighs the queue by.
    """

    service_s: float
    prompt_tokens: float
    output_tokens: float
    class_service_s: Mapping[str, float] = field(default_factory=dict)


def service_stats(finishes: Iterable[tuple[str, str, float, int, int]]) -> dict[str, ServiceStats]:
    """Model -> means over its finishes: ``(model, class, service seconds, prompt
    tokens, output tokens)`` rows, service > 0 (the scaler's events and the simulator's
    finishes both reduce to these). A class with fewer than ``_MIN_CLASS_FINISHES``
    (5) has no service mean of its own."""
    sums: dict[str, list[float]] = {}
    by_class: dict[str, dict[str, list[float]]] = {}
    for model, cls, service, prompt, output in finishes:
        acc = sums.setdefault(model, [0.0, 0.0, 0.0, 0.0])
        acc[0] += service
        acc[1] += prompt
        acc[2] += output
        acc[3] += 1
        mine = by_class.setdefault(model, {}).setdefault(cls, [0.0, 0.0])
        mine[0] += service
        mine[1] += 1
    return {
        m: ServiceStats(
            s / n,
            p / n,
            o / n,
            {c: t / k for c, (t, k) in by_class[m].items() if c and k >= _MIN_CLASS_FINISHES},
        )
        for m, (s, p, o, n) in sums.items()
    }


def _service_s(e: Event) -> float | None:
    """A finish event's seconds from dispatch to finish; None when malformed, <= 0 or
    past :data:`_MAX_SERVICE_S`."""
    try:
        took = (int(e.fields["e2e_ms"]) - int(e.fields["queue_ms"])) / 1000
    except (KeyError, ValueError, OverflowError):
        return None
    return took if 0 < took <= _MAX_SERVICE_S else None


def _tokens(e: Event, name: str) -> int | None:
    """A finish event's token count (0 when absent); None when malformed, negative or
    past :data:`_MAX_TOKENS`."""
    try:
        n = int(e.fields.get(name) or 0)
    except ValueError:
        return None
    return n if 0 <= n <= _MAX_TOKENS else None


def service_times(
    events: Iterable[Event], worker_model: Mapping[str, str]
) -> dict[str, ServiceStats]:
    """Model -> means over its finish events (malformed ones skipped)."""
    rows = []
    for e in events:
        model = worker_model.get(e.fields.get("worker", ""))
        if e.type != "finish" or model is None:
            continue
        service, prompt, output = _service_s(e), _tokens(e, "ptokens"), _tokens(e, "tokens")
        if service is not None and prompt is not None and output is not None:
            rows.append((model, e.fields.get("class", ""), service, prompt, output))
    return service_stats(rows)


def worker_activity(events: Iterable[Event]) -> dict[str, float]:
    """Worker id -> time of its last dispatch or finish event, epoch s."""
    out: dict[str, float] = {}
    for e in events:
        if e.type in ("dispatch", "finish", "fail", "expire", "start"):
            wid = e.fields.get("worker")
            if wid:
                out[wid] = max(out.get(wid, 0.0), e.at)
    return out


@dataclass(frozen=True, slots=True)
class LoadInputs:
    """Everything :func:`build_loads` combines, per decision.

    Attributes:
        depths: ``Store.queue_depths()`` rows.
        live: workers with a heartbeat.
        fleet: output of :func:`reconcile`.
        arrivals: model -> req/s (missing: 0).
        service: model -> measured means (missing: ``fallback_service_s``, no saturation).
        fallback_service_s: model -> seconds to assume without measurements.
        default_slots: slots of a worker when none of the model is live.
        tpot_s: the strictest class TPOT target (:func:`~inferq.policy.capacity.strictest_tpot`).
        occupancy: share of the KV cache the capacity model fills.
        rate_window_s: seconds of submits ``arrivals`` counts (None: not known; see
            :func:`inferq.policy.scaling.burst_rate`).
        service_logs: model -> :func:`service_logs` of the same window (missing: none
            seen; None: not known, and the censoring correction reads the arrivals).
    """

    depths: Sequence[QueueDepth]
    live: Sequence[LiveWorker]
    fleet: ReconciledFleet
    arrivals: Mapping[str, float]
    service: Mapping[str, ServiceStats]
    fallback_service_s: Mapping[str, float]
    default_slots: int
    tpot_s: float | None = None
    occupancy: float = defaults.SCALE_TARGET_OCCUPANCY
    rate_window_s: float | None = None
    service_logs: Mapping[str, ServiceLog] | None = None


def estimated_service_s(
    spec: ModelSpec, estimates: Mapping[tuple[str, str], float], default_tokens: int
) -> float:
    """Service seconds to assume for a model never measured: the latency model at
    concurrency 1 for the mean of its output-token estimates (``default_tokens`` if none)."""
    seen = [v for (m, _), v in estimates.items() if m == spec.name]
    tokens = sum(seen) / len(seen) if seen else default_tokens
    return max(1e-3, service_time(spec, 0, round(tokens)).total_s)


def _saturation(
    spec: ModelSpec, stats: ServiceStats | None, busy: Sequence[int], slots: int
) -> float:
    """Saturated over measured service time for the measured token mix and concurrency."""
    if stats is None:
        return 1.0
    observed = sum(busy) / len(busy) if busy else 1.0
    return saturation_factor(spec, stats.prompt_tokens, stats.output_tokens, observed, slots)


def build_loads(
    managed: Sequence[str], registry: Sequence[ModelSpec], inputs: LoadInputs, now: float
) -> list[ModelLoad]:
    """One :class:`ModelLoad` per managed model, in ``managed`` order.

    Ready workers the scaler asked to drain count as draining even before their
    heartbeat says so, so the policy never picks them twice.

    Raises:
        KeyError: a managed model is not in ``registry``.
    """
    specs = {m.name: m for m in registry}
    queues = backlog(inputs.depths, registry, managed)
    tracked = inputs.fleet.tracked
    loads = []
    for model in managed:
        spec = specs[model]
        mine = [w for w in inputs.live if w.model == model]
        asked = {w.id for w in mine if tracked.get(w.id, _NEVER).draining_since is not None}
        ready = [w for w in mine if w.state is WorkerState.READY and w.id not in asked]
        draining = [w for w in mine if w.state is WorkerState.DRAINING or w.id in asked]
        queued, waits = queues.get(model, ({}, {}))
        stats = inputs.service.get(model)
        slots = max((w.slots for w in mine), default=inputs.default_slots)
        busy = [w.in_flight for w in ready if w.in_flight > 0]
        kv_mib = max((w.kv_cache_mib for w in mine), default=0)
        loads.append(
            ModelLoad(
                model=model,
                queued=queued,
                oldest_wait_s=waits,
                arrival_rate=inputs.arrivals.get(model, 0.0),
                mean_service_s=stats.service_s if stats else inputs.fallback_service_s[model],
                saturation=_saturation(spec, stats, busy, slots),
                slots_per_worker=slots,
                cold_start_s=spec.cold_start_s,
                ready=len(ready),
                starting=sum(1 for w in mine if w.state is WorkerState.STARTING)
                + inputs.fleet.starting.get(model, 0),
                draining=len(draining),
                idle_workers={
                    w.id: max(0.0, now - tracked[w.id].last_busy_at if w.id in tracked else 0.0)
                    for w in ready
                    if not w.busy
                },
                busy={w.id: w.busy for w in ready if w.busy},
                capacity_rate=capacity_rate(spec, kv_mib, slots, stats, inputs),
                rate_window_s=inputs.rate_window_s,
                class_service_s=stats.class_service_s if stats else {},
                in_service_s=_in_service_s(inputs, model, ready, now),
            )
        )
    return loads


def _in_service_s(
    inputs: LoadInputs, model: str, ready: Sequence[LiveWorker], now: float
) -> float | None:
    """:meth:`ServiceLog.in_service_s` of a model's ready workers (None: no log).

    Their running requests are the load hashes' ``reserved`` counts, which the
    dispatch and completion scripts keep exact, not the heartbeats' ``in_flight``: a
    heartbeat a second old still counts a finished burst, and those phantom requests
    read as running since the window's start (issue 24, item 5: ``inferq demo``'s
    70B pool, 15 in flight after its 435 batch requests had all finished).
    """
    if inputs.service_logs is None:
        return None
    log = inputs.service_logs.get(model)
    if log is None:  # nothing seen in the window: what runs entered before it
        window = inputs.rate_window_s or defaults.SCALER_RATE_WINDOW_S
        log = ServiceLog(now - window, now)
    return log.in_service_s(sum(w.reserved for w in ready))


def capacity_rate(
    spec: ModelSpec, kv_cache_mib: float, slots: int, stats: ServiceStats | None, inputs: LoadInputs
) -> float | None:
    """Requests/s one worker carries for the measured mix (None before any measurement)."""
    if stats is None:
        return None
    return worker_capacity(
        spec,
        kv_cache_mib,
        slots,
        stats.prompt_tokens,
        stats.output_tokens,
        inputs.tpot_s,
        inputs.occupancy,
    ).rate


_NEVER = Tracked(model="", last_busy_at=0.0)
#: Shortest span :func:`entry_rate` divides by, seconds (dispatches of the same instant).
_MIN_ENTRY_SPAN_S = 1e-3
#: A finish event's service time or token count past these is corrupt, not measured (a
#: day of service; ten million tokens, past any model's context), and is skipped.
_MAX_SERVICE_S = 86_400.0
_MAX_TOKENS = 10_000_000
#: Finishes a class needs in the window before its own service mean weighs its queue
#: (fewer: the model's mean); one long request must not set a class's weight.
_MIN_CLASS_FINISHES = 5
