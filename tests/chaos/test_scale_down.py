"""Hundreds of scale-downs under load: a drain never kills or re-runs an in-flight request.

The test plays the scaler's part as the scaler does it (``Store.request_drain``
on a chosen worker, a ``scale_down`` event through ``Store.scale_event``), but
picks *busy* workers, while a replacement starts: every drain happens with
requests running and batches on their way. Workers are forked from a zygote
(see ``conftest.zygote_main``) so that hundreds of them fit in a CI run.

Checked: every request succeeded on its first attempt (no hand-back, no
orphan, no retry), every drained worker left (``worker_left``, never
``worker_lost``) and exited with code 0.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from ..helpers import Progress
from .conftest import MODEL, Deployment, Zygote, wait_for
from .test_redis_restart import TrickleSubmitter


@dataclass
class DrainFigures:
    """What a scale-down run did (seconds, counts)."""

    drains: int = 0
    busy_drains: int = 0
    requests: int = 0
    wall_s: float = 0.0
    attempts: dict[int, int] = field(default_factory=dict)
    retries: Counter[str] = field(default_factory=Counter)
    exit_codes: Counter[int] = field(default_factory=Counter)

    def summary(self) -> dict[str, object]:
        return {
            "scale_down_events": self.drains,
            "drains_of_busy_workers": self.busy_drains,
            "requests": self.requests,
            "attempts": dict(sorted(self.attempts.items())),
            "retries": dict(self.retries),
            "drained_exit_codes": dict(self.exit_codes),
            "wall_s": round(self.wall_s, 1),
        }


def run_scale_down(
    d: Deployment,
    zygote: Zygote,
    *,
    drains: int,
    workers: int = 6,
    slots: int = 4,
    at_once: int = 2,
    time_scale: float = 0.7,  # ~the old profile's request lengths on issue 16's faster model
    seed: int = 3,
) -> DrainFigures:
    """Drain ``drains`` workers (``at_once`` at a time, busy ones first) under a steady load,
    replacing each; wait for every request and every drained worker's exit."""
    rng = random.Random(seed)
    figures = DrainFigures()
    started = time.monotonic()
    d.dispatcher()
    live = [f"w{i}" for i in range(workers)]
    for wid in live:
        zygote.spawn(wid, slots=slots, time_scale=time_scale)
    wait_for(lambda: all(d.worker_state(w) == "ready" for w in live), 30, "the first workers")
    submitter = TrickleSubmitter(d, chunk=6, pause_s=0.05)
    submitter.start()
    draining: list[str] = []
    next_id = workers
    progress = Progress(60, "drains and requests succeeded")
    while figures.drains < drains:
        progress.check(figures.drains + d.store.stats().get("succeeded", 0), d.logs)
        draining = [w for w in draining if w not in zygote.exits]
        ready = [w for w in live if d.worker_state(w) == "ready"]
        if len(draining) >= at_once or len(ready) < workers // 2:
            time.sleep(0.02)
            continue
        busy = [w for w, n in d.store.worker_reservations(ready).items() if n > 0]
        victim = rng.choice(busy or ready)
        if not d.store.request_drain(victim):
            continue
        figures.busy_drains += bool(busy)
        d.store.scale_event(
            "scale_down", MODEL, len(ready), len(ready) - 1, ["chaos: drain under load"], [victim]
        )
        figures.drains += 1
        draining.append(victim)
        live.remove(victim)
        live.append(f"w{next_id}")
        zygote.spawn(live[-1], slots=slots, time_scale=time_scale)
        next_id += 1
    submitter.done.set()
    submitter.join()
    drained = [f"w{i}" for i in range(next_id) if f"w{i}" not in live]
    wait_for(lambda: all(w in zygote.exits for w in drained), 60, "every drained worker's exit")
    ids = submitter.acked
    d.wait_final(ids)
    audit = d.audit(ids)
    audit.check_exactly_once(ids)
    figures.requests = len(ids)
    figures.attempts = dict(audit.attempts)
    figures.retries = Counter(e.fields["error"][:40] for e in audit.of_type("retry"))
    figures.exit_codes = Counter(zygote.exits[w] for w in drained)
    figures.wall_s = time.monotonic() - started
    left = {e.fields["worker"] for e in audit.of_type("worker_left")}
    assert set(drained) <= left, "a drained worker did not deregister"
    assert not audit.of_type("worker_lost"), "a drained worker was reaped as dead"
    assert len(audit.of_type("scale_down")) == figures.drains
    return figures


def check(figures: DrainFigures, drains: int) -> None:
    assert figures.drains >= drains
    assert figures.busy_drains >= drains * 3 // 4  # drains met running work
    assert figures.exit_codes == Counter({0: figures.drains}), figures.exit_codes
    assert not figures.retries, f"requests handed back or retried: {figures.retries}"
    assert set(figures.attempts) == {1}, f"a request ran twice: {figures.attempts}"


def test_200_scale_downs_under_load_kill_nothing(deployment: Deployment, zygote: Zygote) -> None:
    figures = run_scale_down(deployment, zygote, drains=200)
    print(figures.summary())
    check(figures, 200)


@pytest.mark.slow
def test_scale_downs_long_run(deployment: Deployment, zygote: Zygote) -> None:
    figures = run_scale_down(deployment, zygote, drains=1000, at_once=3, seed=11)
    print(figures.summary())
    check(figures, 1000)
