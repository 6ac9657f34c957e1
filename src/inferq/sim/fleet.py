"""Simulated workers: slots, KV-cache VRAM, cold start and drain, with usage accounting.

A :class:`SimWorker` is the simulator's stand-in for one worker process next
to one loaded model (the design brief's lifecycle):

- ``starting``: launched by the scaler, loading the model for ``cold_start_s``;
  it holds its GPU (GPU-seconds count) but takes no work;
- ``ready``: takes requests up to ``slots`` at once and up to its KV-cache room
  ``ModelSpec.kv_cache_mib(vram_total_mib)`` (the worker's own rule), each
  request reserving ``need_mib`` (``inferq.policy.routing.need_mib``) until it ends;
- ``draining``: chosen for scale-down; takes no new work and stops when idle.

Time integrals (seconds) are kept exactly, event to event: ``busy_s`` (time
with at least one request running) and ``slot_s`` (running requests x time).
Peaks of slots and MiB in use are recorded so tests can check the limits held.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from inferq.config import ModelSpec
from inferq.errors import ConfigError
from inferq.models import WorkerState
from inferq.policy.routing import kv_mib
from inferq.policy.snapshot import WorkerView

#: Float slack when checking reserved MiB against the KV-cache room.
MIB_EPS = 1e-6


@dataclass(slots=True, eq=False)
class SimWorker:
    """One simulated worker (mutable; times are virtual seconds).

    Attributes:
        id: ``w0001``... in launch order.
        spec: the model it serves.
        slots: concurrent requests at most.
        kv_cache_mib: KV-cache room, MiB.
        launched_at: when it was started (holds a GPU from then).
        state: starting, ready or draining.
        running: request id -> MiB it reserved.
        reserved_mib: sum of ``running``'s MiB.
        idle_since: when it last became idle (launch or ready time at first).
        ready_at: when it became ready (its launch time when warm), None while starting.
        stopped_at: when it left the fleet, or None while live.
        busy_s / slot_s / ready_s: seconds with work running, running x seconds,
            seconds not starting (integrated up to ``accounted_at``).
        kv_mib_s: KV cache reserved x seconds, MiB-s (same integral).
        accounted_at: the time the integrals above are exact up to.
        served: requests it finished (or timed out).
        peak_slots / peak_mib: the most it ever held at once.
    """

    id: str
    spec: ModelSpec
    slots: int
    kv_cache_mib: float
    launched_at: float
    state: WorkerState = WorkerState.READY
    running: dict[str, float] = field(default_factory=dict)
    reserved_mib: float = 0.0
    idle_since: float = 0.0
    ready_at: float | None = None
    stopped_at: float | None = None
    busy_s: float = 0.0
    slot_s: float = 0.0
    kv_mib_s: float = 0.0
    ready_s: float = 0.0
    served: int = 0
    peak_slots: int = 0
    peak_mib: float = 0.0
    accounted_at: float = 0.0

    @property
    def model(self) -> str:
        return self.spec.name

    @property
    def in_flight(self) -> int:
        return len(self.running)

    @property
    def has_slot(self) -> bool:
        """True when ready with a free slot."""
        return self.state is WorkerState.READY and len(self.running) < self.slots

    def view(self) -> WorkerView:
        """The worker as the dispatch policy sees it (reservations = what runs)."""
        return WorkerView(
            id=self.id,
            model=self.spec.name,
            params_b=self.spec.params_b,
            ready=self.state is WorkerState.READY,
            slots=self.slots,
            kv_cache_mib=self.kv_cache_mib,
            reserved_slots=len(self.running),
            reserved_mib=self.reserved_mib,
        )

    def advance(self, now: float) -> None:
        """Integrate usage up to ``now``."""
        dt = now - self.accounted_at
        if dt > 0:
            n = len(self.running)
            if n:
                self.busy_s += dt
                self.slot_s += n * dt
                self.kv_mib_s += self.reserved_mib * dt
            if self.state is not WorkerState.STARTING:
                self.ready_s += dt
            self.accounted_at = now

    def admit(self, request_id: str, need_mib: float, now: float) -> None:
        """Start running a request that reserves ``need_mib`` MiB."""
        self.advance(now)
        self.running[request_id] = need_mib
        self.reserved_mib += need_mib
        self.peak_slots = max(self.peak_slots, len(self.running))
        self.peak_mib = max(self.peak_mib, self.reserved_mib)

    def release(self, request_id: str, now: float, *, served: bool = True) -> None:
        """A request ended (``served``) or was aborted: free its slot and MiB."""
        self.advance(now)
        self.reserved_mib -= self.running.pop(request_id)
        if not self.running:
            self.reserved_mib = 0.0  # no float residue once idle
            self.idle_since = now
        if served:
            self.served += 1

    def over_limits(self) -> str | None:
        """Why the worker holds more than it has, or None when within its limits."""
        if len(self.running) > self.slots:
            return f"worker {self.id}: {len(self.running)} running > {self.slots} slots"
        if self.reserved_mib > self.kv_cache_mib + MIB_EPS:
            return (
                f"worker {self.id}: {self.reserved_mib:.1f} MiB reserved > "
                f"{self.kv_cache_mib:.1f} MiB KV cache"
            )
        return None


class Fleet:
    """The live and stopped workers of one simulation.

    Args:
        vram_mib: VRAM of every card, MiB.
        slots: slots of every worker.
    """

    def __init__(self, vram_mib: int, slots: int) -> None:
        self.vram_mib = vram_mib
        self.slots = slots
        self.live: dict[str, SimWorker] = {}
        self.stopped: list[SimWorker] = []
        self._launched = 0

    def __iter__(self) -> Iterator[SimWorker]:
        return iter(self.live.values())

    def launch(self, spec: ModelSpec, now: float, *, warm: bool = False) -> SimWorker:
        """Start a worker of ``spec``: ``ready`` at once when ``warm``, else ``starting``.

        Raises:
            ConfigError: the model's weights do not fit the card.
        """
        self._launched += 1
        state = WorkerState.READY if warm else WorkerState.STARTING
        worker = SimWorker(
            id=f"w{self._launched:04d}",
            spec=spec,
            slots=self.slots,
            kv_cache_mib=float(spec.kv_cache_mib(self.vram_mib)),
            launched_at=now,
            state=state,
            idle_since=now,
            ready_at=now if warm else None,
            accounted_at=now,
        )
        self.live[worker.id] = worker
        return worker

    def make_ready(self, worker_id: str, now: float) -> bool:
        """A starting worker finished loading; False when it is no longer starting."""
        worker = self.live.get(worker_id)
        if worker is None or worker.state is not WorkerState.STARTING:
            return False
        worker.advance(now)
        worker.state = WorkerState.READY
        worker.idle_since = now
        worker.ready_at = now
        return True

    def drain(self, worker_id: str, now: float) -> bool:
        """Take the worker out of dispatch; it stops now if idle. False if unknown."""
        worker = self.live.get(worker_id)
        if worker is None or worker.state is WorkerState.DRAINING:
            return False
        worker.advance(now)
        worker.state = WorkerState.DRAINING
        if not worker.running:
            self.stop(worker_id, now)
        return True

    def stop(self, worker_id: str, now: float) -> None:
        """The worker leaves the fleet (its GPU is released)."""
        worker = self.live.pop(worker_id)
        worker.advance(now)
        worker.stopped_at = now
        self.stopped.append(worker)

    def has_room(self, tokens: int = 0) -> bool:
        """True when some ready worker has a free slot and KV-cache room for ``tokens``.

        ``tokens`` is the smallest ``prompt + max_tokens`` queued: a decision places a
        request only where its :func:`~inferq.policy.routing.need_mib` fits
        (``OpenBatch.has_room``), so without such a worker it could dispatch nothing.
        """
        return any(
            w.has_slot and kv_mib(tokens, w.spec) <= w.kv_cache_mib - w.reserved_mib + MIB_EPS
            for w in self.live.values()
        )

    def all_workers(self) -> list[SimWorker]:
        """Stopped then live workers, in launch order."""
        return sorted([*self.stopped, *self.live.values()], key=lambda w: w.id)


def parse_fleet(text: str, models: Mapping[str, ModelSpec], vram_mib: int) -> dict[str, int]:
    """Parse ``"llama-3.1-8b:4,llama-3.1-70b-awq:1"`` (a missing count means 1).

    Args:
        text: comma-separated ``model[:count]``.
        models: the registry by name.
        vram_mib: the card every worker gets (the weights must fit).

    Raises:
        ConfigError: a part is malformed, names an unknown model, repeats one,
            has a negative count, or its weights do not fit the card.
    """
    fleet: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition(":")
        name = name.strip()
        try:
            n = int(count) if count.strip() else 1
        except ValueError:
            raise ConfigError(f"fleet: {part!r} is not model:count") from None
        if name not in models:
            raise ConfigError(f"fleet: unknown model {name!r} (registry: {', '.join(models)})")
        if name in fleet:
            raise ConfigError(f"fleet: {name!r} appears twice")
        if n < 0:
            raise ConfigError(f"fleet: {part!r} has a negative count")
        models[name].kv_cache_mib(vram_mib)
        fleet[name] = n
    if not fleet:
        raise ConfigError("fleet: empty; give e.g. llama-3.1-8b:4")
    return fleet
