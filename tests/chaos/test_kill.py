"""SIGKILL random workers and one of two dispatchers, again and again, under load.

The promise checked: 0 requests lost, exactly one final event per request (a
stale result fenced off is counted in ``stats.stale_results`` and is fine),
every request succeeded; and a killed worker's requests are back in their queue
within two heartbeat intervals plus the lease margin of the kill.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from ..helpers import Progress, paused_within
from .conftest import HEARTBEAT_S, LEASE_S, Audit, Deployment, wait_for

#: A dead worker's requests must be requeued within this long of the kill, s, plus the
#: longest the host itself woke a thread late meanwhile (:class:`LagProbe`): on a host
#: starved by other processes (CI beside another run) the dispatcher's step waits for a
#: CPU too, which is the host's lateness, not the reaper's.
REQUEUE_BOUND_S = 2 * HEARTBEAT_S + LEASE_S
#: A dispatcher whose own loop stalled longer than a heartbeat TTL (starved of CPU, or
#: Redis slow to answer) takes it for an outage and pauses reaping for a grace, by
#: design, and says so (``reap_paused`` events): the part of such a stall and grace that
#: falls between a kill and its reap is added to the bound (:func:`paused_within`). A
#: pause that began before the kill counts too: on a loaded host the other dispatcher
#: can be the one the run just killed and is still starting, so the paused one reaps.


@dataclass
class KillFigures:
    """What a kill run did and measured (times in seconds)."""

    requests: int = 0
    wall_s: float = 0.0
    workers_killed: int = 0
    dispatchers_killed: int = 0
    requeue_s: list[float] = field(default_factory=list)
    #: Per kill: the host's worst lateness between the kill and the reap (LagProbe), s.
    host_lag_s: list[float] = field(default_factory=list)
    #: Per kill: how much of the time between the kill and the reap the dispatchers'
    #: recorded reap pauses (stalls and graces) cover, s (:func:`paused_within`).
    paused_s: list[float] = field(default_factory=list)
    requeued_requests: int = 0
    stale_results: int = 0
    retried: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    attempts: dict[int, int] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        lat = sorted(self.requeue_s) or [0.0]
        return {
            "requests": self.requests,
            "wall_s": round(self.wall_s, 1),
            "workers_killed": self.workers_killed,
            "dispatchers_killed": self.dispatchers_killed,
            "requests_requeued_from_killed_workers": self.requeued_requests,
            "kill_to_requeue_median_s": round(lat[len(lat) // 2], 3),
            "kill_to_requeue_max_s": round(lat[-1], 3),
            "host_lag_max_s": round(max(self.host_lag_s, default=0.0), 3),
            "kills_during_reap_pauses": sum(1 for p in self.paused_s if p),
            "stale_results": self.stale_results,
            "retried": self.retried,
            "retries_by_reason": dict(self.retries),
            "attempts": dict(sorted(self.attempts.items())),
        }


class Submitter(threading.Thread):
    """Submits ``total`` requests in chunks of ``chunk`` every ``pause_s``, the i-th for
    tenant ``tenants[i % len(tenants)]`` in class ``classes[i % len(classes)]``; keeps
    their ids."""

    def __init__(
        self,
        deployment: Deployment,
        total: int,
        chunk: int,
        pause_s: float,
        tenants: Sequence[str] = ("default",),
        classes: Sequence[str] = ("standard",),
    ) -> None:
        super().__init__(daemon=True)
        self.d, self.total, self.chunk, self.pause_s = deployment, total, chunk, pause_s
        self.tenants, self.classes = tenants, classes
        self.ids: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while len(self.ids) < self.total:
                n = min(self.chunk, self.total - len(self.ids))
                items = [
                    {
                        "prompt": f"p{len(self.ids) + i}",
                        "priority": self.classes[(len(self.ids) + i) % len(self.classes)],
                        "max_tokens": 32,
                        "tenant": self.tenants[(len(self.ids) + i) % len(self.tenants)],
                    }
                    for i in range(n)
                ]
                self.ids += [h.id for h in self.d.client.submit_many(items)]
                time.sleep(self.pause_s)
        except BaseException as exc:  # reported by the test
            self.error = exc


def run_kills(
    d: Deployment,
    *,
    requests: int,
    workers: int = 4,
    every_s: float = 1.0,
    dispatcher_every: int = 3,
    time_scale: float = 0.25,
    seed: int = 1,
    tenants: Sequence[str] = ("default",),
    classes: Sequence[str] = ("standard",),
) -> tuple[KillFigures, Audit, list[str]]:
    """Run ``requests`` requests (of ``tenants`` and ``classes``, in turn) while killing a
    worker every ``every_s`` (and a dispatcher every ``dispatcher_every`` kills), replacing
    each; returns the figures, audit and ids."""
    rng = random.Random(seed)
    figures = KillFigures(requests=requests)
    started = time.monotonic()
    progress = Progress(60, "requests succeeded")
    for name in ("d1", "d2"):
        d.dispatcher(name)
    live = [f"w{i}" for i in range(workers)]
    for wid in live:
        d.worker(wid, time_scale=time_scale, ready=False)
    d.wait_ready(live)
    submitter = Submitter(d, requests, chunk=40, pause_s=0.1, tenants=tenants, classes=classes)
    submitter.start()
    kills: dict[str, float] = {}
    next_id = workers
    while d.store.stats().get("succeeded", 0) < requests or submitter.is_alive():
        time.sleep(every_s)
        assert submitter.error is None, submitter.error
        succeeded = d.store.stats().get("succeeded", 0)
        progress.check(succeeded, d.logs)
        if succeeded >= requests:
            break
        ready = [w for w in live if d.worker_state(w) == "ready"]
        if not ready:
            continue
        victim = rng.choice(ready)
        kills[victim] = d.store.now()
        d.kill(victim)
        live.remove(victim)
        figures.workers_killed += 1
        live.append(f"w{next_id}")
        d.worker(live[-1], time_scale=time_scale, ready=False)
        next_id += 1
        if figures.workers_killed % dispatcher_every == 0:
            name = rng.choice(("d1", "d2"))
            d.kill(name)
            d.dispatcher(name)
            figures.dispatchers_killed += 1
    submitter.join()
    d.wait_final(submitter.ids)

    def reaped() -> bool:  # a kill just before the last result is reaped after it
        lost = {e.fields.get("worker") for e in d.events() if e.type == "worker_lost"}
        return set(kills) <= lost

    wait_for(reaped, 30, "every killed worker reaped", d.logs)
    figures.wall_s = time.monotonic() - started
    audit = d.audit(submitter.ids)
    lost = {e.fields["worker"]: e for e in audit.of_type("worker_lost")}
    pauses = audit.of_type("reap_paused")
    for wid, killed_at in kills.items():
        assert wid in lost, f"killed worker {wid} never reaped:\n{d.logs()}"
        figures.requeue_s.append(lost[wid].at - killed_at)
        figures.host_lag_s.append(d.probe.max_lag(killed_at, lost[wid].at))
        figures.paused_s.append(paused_within(killed_at, lost[wid].at, pauses))
        figures.requeued_requests += int(lost[wid].fields["requeued"])
    figures.stale_results = audit.stats.get("stale_results", 0)
    figures.retried = audit.stats.get("retried", 0)
    figures.attempts = dict(audit.attempts)
    figures.retries = Counter(e.fields["error"][:40] for e in audit.of_type("retry"))
    return figures, audit, submitter.ids


def check(
    figures: KillFigures,
    audit: Audit,
    ids: list[str],
    min_kills: int = 5,
    requeue_bound: bool = True,
) -> None:
    """Nothing lost, exactly once, all succeeded, the kills hit running work; with
    ``requeue_bound``, every kill requeued within ``REQUEUE_BOUND_S`` (plus the host's lag
    and recorded reap pauses): the promise while a dispatcher runs."""
    assert len(ids) == figures.requests
    audit.check_exactly_once(ids)
    assert audit.stats["succeeded"] == figures.requests
    assert figures.workers_killed >= min_kills and figures.dispatchers_killed >= 1
    assert figures.requeued_requests > 0  # the kills did hit running work
    if not requeue_bound:
        return
    late = [
        (round(s, 3), round(lag, 3), round(paused, 3))
        for s, lag, paused in zip(
            figures.requeue_s, figures.host_lag_s, figures.paused_s, strict=True
        )
        if s > REQUEUE_BOUND_S + lag + paused
    ]
    assert not late, (
        f"requeued later than {REQUEUE_BOUND_S} s + the host's lag + recorded reap pauses "
        f"after the kill (requeue s, host lag s, paused s): {late}"
    )


def test_kill_workers_and_a_dispatcher_loses_nothing(deployment: Deployment) -> None:
    figures, audit, ids = run_kills(deployment, requests=2000)
    print(figures.summary())
    check(figures, audit, ids)


@pytest.mark.slow
def test_kill_long_run(deployment: Deployment) -> None:
    figures, audit, ids = run_kills(deployment, requests=10_000, seed=7)
    print(figures.summary())
    check(figures, audit, ids)


def test_a_claim_whose_batch_job_never_came_is_handed_back(deployment: Deployment) -> None:
    """A dispatcher killed between its claim (assign.lua) and the RQ enqueue: the worker
    holds the requests in Redis but never gets their batch; it hands them back."""
    d = deployment
    d.worker("w1", time_scale=0.05)
    handles = d.client.submit_many(
        {"prompt": "x", "priority": "realtime", "max_tokens": 8} for _ in range(3)
    )
    qkey = d.store.keys.tenant_queue("realtime", "llama-3.1-8b", "default")
    claimed = d.store.assign("w1", "lost-batch", [(h.id, qkey, 1.0) for h in handles])
    assert len(claimed) == 3  # ... and the dispatcher "dies" before enqueueing the job
    d.dispatcher()
    results = [h.result(timeout=30) for h in handles]
    assert all(r.status == "succeeded" and r.attempt == 2 for r in results)
    retries = [e for e in d.events() if e.type == "retry"]
    assert sorted(e.fields["id"] for e in retries) == sorted(h.id for h in handles)
    assert all("never reached the worker" in e.fields["error"] for e in retries)
