"""What a simulation run produces: per-request outcomes, logs, samples and costs.

Times are virtual seconds from the start of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from inferq.sim.deployment import SimConfig
from inferq.sim.fleet import SimWorker
from inferq.sim.workload import SimRequest

Status = Literal["queued", "running", "succeeded", "expired", "refused"]


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one request (times are virtual seconds).

    Attributes:
        request: the request.
        status: ``succeeded`` or ``expired`` at the end (``queued``/``running`` before);
            ``refused`` when intake refused it at arrival (never queued).
        deadline: submit + the class's ``timeout_s``.
        dispatched_at / first_token_at / finished_at: None when never reached.
        worker / model: where it ran.
        concurrency: the worker's running requests when it started (itself included).
        reason: why it expired, or why intake refused it.
        unschedulable: the first unschedulable report, if any.
        runs: times it was started (1 + preemptions that restarted it).
        preemptions: times it was preempted (aborted and requeued, no attempt spent).
        wasted_tokens: prompt and output tokens its preempted runs had processed and
            lost (a restart recomputes them: vLLM's recompute preemption).
        cached_tokens: leading prompt tokens its (last) run found in its server's prefix
            cache, whose prefill it skipped (:mod:`inferq.sim.caches`).
        forecast_tokens: what the dispatcher's prefix index forecast cached there.
    """

    request: SimRequest
    deadline: float = math.inf
    status: Status = "queued"
    dispatched_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    model: str | None = None
    concurrency: int = 0
    reason: str | None = None
    unschedulable: str | None = None
    runs: int = 0
    preemptions: int = 0
    wasted_tokens: int = 0
    cached_tokens: int = 0
    forecast_tokens: int = 0

    @property
    def queue_wait_s(self) -> float | None:
        """Submit -> dispatch, seconds (None if never dispatched)."""
        if self.dispatched_at is None:
            return None
        return self.dispatched_at - self.request.arrival_s

    @property
    def ttft_s(self) -> float | None:
        """Submit -> first output token, seconds (the class SLA's measure)."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.request.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """Submit -> final result, seconds (None while not final)."""
        if self.finished_at is None:
            return None
        return self.finished_at - self.request.arrival_s


@dataclass(frozen=True, slots=True)
class AssignmentRecord:
    """One dispatch, in order: which request went to which worker (and model) when."""

    seq: int
    at: float
    decision: int
    request_id: str
    priority: str
    worker_id: str
    model: str


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """A decision that dispatched something: its index, when, how many, and the queues after it.

    ``index`` matches :attr:`AssignmentRecord.decision`; ``queued_after`` is per
    class, in :attr:`SimResult.classes` order.
    """

    index: int
    at: float
    dispatched: int
    queued_after: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """A scale action carried out: workers launched (up) or drained (down)."""

    at: float
    model: str
    action: Literal["up", "down"]
    before: int
    after: int
    workers: tuple[str, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """Fleet and queues at one scaler tick."""

    at: float
    starting: int
    ready: int
    draining: int
    running: int
    queued: tuple[int, ...]


@dataclass(slots=True)
class RunStats:
    """Cost of the run itself (wall-clock seconds), and the preemptions it carried out."""

    decisions: int = 0
    decide_s: float = 0.0
    #: queued requests handed to the policy, summed over decisions (the scan cost)
    snapshot_requests: int = 0
    scale_calls: int = 0
    events: int = 0
    wall_s: float = 0.0
    preemptions: int = 0


@dataclass
class SimResult:
    """Everything one run produced.

    Attributes:
        policy: the policy's name.
        config: the deployment simulated.
        classes: class names, highest first (the order of ``queued`` tuples).
        initial_fleet: model -> warm workers at time 0.
        outcomes: per request, in arrival order.
        assignments: every dispatch in order (the faithfulness log).
        decisions: decisions that dispatched, with the queue lengths after.
        scale_events: scale actions in order.
        samples: fleet and queues at each scaler tick.
        workers: every worker that ever ran, in launch order.
        end_s: time of the last arrival or final result.
        stats: wall-clock cost of the run.
    """

    policy: str
    config: SimConfig
    classes: tuple[str, ...]
    initial_fleet: dict[str, int]
    outcomes: list[RequestOutcome]
    assignments: list[AssignmentRecord]
    decisions: list[DecisionRecord]
    scale_events: list[ScaleEvent]
    samples: list[Sample]
    workers: list[SimWorker]
    end_s: float
    stats: RunStats

    def gpu_seconds(self, worker: SimWorker) -> float:
        """Seconds ``worker`` held its GPU: launch (cold start included) to stop or end."""
        stop = worker.stopped_at if worker.stopped_at is not None else self.end_s
        return max(0.0, stop - worker.launched_at)
