"""A poison request (one that crashes its worker) is dead-lettered alone (issue 13, fault 2).

Four requests run together on one worker; whenever the poison one runs, its worker is
killed with SIGKILL (as a model server crash on that input would) and a fresh worker
started. Before isolation the other three were requeued beside it again and all four
were dead-lettered after three crashes; now a request caught in its second crash becomes a
suspect that runs alone, so the three others succeed (on their third attempt, alone)
and only the poison one fails.
"""

from __future__ import annotations

import time

from inferq.models import RequestState

from .conftest import Deployment, wait_for


def test_only_the_poison_request_is_dead_lettered(deployment: Deployment) -> None:
    d = deployment
    d.settings = d.settings.model_copy(update={"max_attempts": 3})
    d.dispatcher()
    d.worker("w1", slots=4, time_scale=1.0)
    items = [{"prompt": f"x{i}", "priority": "standard", "max_tokens": 64} for i in range(4)]
    ids = [h.id for h in d.client.submit_many(items)]
    poison = ids[0]
    wait_for(
        lambda: all(r is not None and r.worker == "w1" for r in d.store.records(ids)),
        30,
        "the four requests on w1 together",
    )
    kills, n = 0, 1
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        record = d.store.record(poison)
        if record.state.final:
            break
        if record.state is RequestState.RUNNING and record.worker and d.alive(record.worker):
            d.kill(record.worker)
            kills += 1
            n += 1
            d.worker(f"w{n}", slots=4, time_scale=1.0)
        time.sleep(0.02)
    d.wait_final(ids, timeout=90)
    records = d.store.records(ids)
    states = {r.request.id: r.state for r in records if r is not None}
    assert states[poison] is RequestState.FAILED, d.diagnose(ids)
    assert [states[rid] for rid in ids[1:]] == [RequestState.SUCCEEDED] * 3, d.diagnose(ids)
    assert d.store.dead_letters() == [poison]
    assert kills == 3
