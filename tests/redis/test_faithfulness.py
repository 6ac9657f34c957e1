"""The simulator decides like the real stack: same requests, same order, same kind of worker.

A small mixed trace (three classes, six tenants, two routes) goes once through
the real stack — Redis, the dispatcher, worker subprocesses on the sim backend —
and once through ``inferq.sim.replay`` with the same settings. Every request is
queued before the first decision and all take the same time, so the order the
policy imposes (class shares, tenant fairness, routing) is the only order there
is; time-dependent rules (aging, batching delays) are switched off because real
and virtual clocks cannot agree on them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from inferq.client import Client
from inferq.config import PriorityClass, Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.sim import SimConfig, fixed_latency, replay
from inferq.store import Store, connect
from inferq.traces import TraceRequest

from ..conftest import REDIS_URL

CLASSES = [
    PriorityClass(name=n, sla_s=s, timeout_s=600, weight=w, batch_delay_s=0.0, aging_s=None)
    for n, s, w in (("realtime", 2, 8), ("standard", 10, 3), ("batch", 60, 1))
]
PROMPT_TOKENS, OUTPUT_TOKENS = 100, 20


def trace(routes: tuple[str, ...]) -> list[TraceRequest]:
    rows = []
    for i in range(36):
        rows.append(
            TraceRequest(
                arrival_s=0.0,
                prompt_tokens=PROMPT_TOKENS,
                output_tokens=OUTPUT_TOKENS,
                model=routes[i % len(routes)],
                priority=("realtime", "standard", "batch")[(i // 2) % 3],
                tenant=f"t{(i * 7) % 6}",
            )
        )
    return rows


@pytest.fixture
def settings(namespace: str) -> Settings:
    return Settings.load(
        redis_url=REDIS_URL, namespace=namespace, classes=CLASSES, heartbeat_interval_s=0.2
    )


def run_real(
    settings: Settings, rows: list[TraceRequest], fleet: dict[str, int]
) -> list[tuple[int, str]]:
    """(index of the request in ``rows``, model of its worker), in dispatch order."""
    store = Store(connect(settings.redis_url), settings)
    client = Client(settings=settings, connection=store.redis)
    handles = client.submit_many(
        {
            "prompt": "tok " * PROMPT_TOKENS,
            "model": r.model,
            "priority": r.priority,
            "tenant": r.tenant,
            "max_tokens": OUTPUT_TOKENS,
            "params": {"sim_output_tokens": OUTPUT_TOKENS},
        }
        for r in rows
    )
    index = {h.id: i for i, h in enumerate(handles)}
    env = {
        **os.environ,
        "INFERQ_REDIS_URL": REDIS_URL,
        "INFERQ_NAMESPACE": settings.namespace,
        "INFERQ_CLASSES": "[" + ",".join(c.model_dump_json() for c in CLASSES) + "]",
    }
    procs = []
    for model, count in fleet.items():
        for n in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "inferq", "worker", "--model", model, "--id", f"{model}-{n}",
                 "--vram-mib", "81920", "--slots", "2", "--heartbeat-interval", "0.2",
                 "-o", "time_scale=0.1"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while sum(w.state.value == "ready" for w in store.workers()[0]) < len(procs):
            assert time.monotonic() < deadline, "workers did not become ready"
            time.sleep(0.05)
        dispatcher = Dispatcher(store, tick_s=0.02)
        thread = threading.Thread(target=dispatcher.run, daemon=True)
        thread.start()  # only now: every request is queued and every worker ready
        for h in handles:
            assert client.result(h.id, timeout=60).ok
        dispatcher.stop()
        thread.join()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
    model_of = {
        w: w.rsplit("-", 1)[0] for w in (f"{m}-{n}" for m, c in fleet.items() for n in range(c))
    }
    order = []
    for event in store.events(count=100_000):
        if event.type == "dispatch":
            for rid in event.fields["ids"].split(","):
                order.append((index[rid], model_of[event.fields["worker"]]))
    return order


def run_sim(
    settings: Settings, rows: list[TraceRequest], fleet: dict[str, int]
) -> list[tuple[int, str]]:
    config = SimConfig(
        settings=settings, fleet=fleet, vram_mib=81920, slots=2, max_workers=1,
        latency=fixed_latency(0.5),
    )  # fmt: skip
    result = replay(rows, "inferq", config)
    return [(int(a.request_id[1:]), a.model) for a in result.assignments]


def test_same_requests_in_the_same_order(settings: Settings) -> None:
    rows = trace(("llama-3.1-8b",))
    fleet = {"llama-3.1-8b": 1}
    real, sim = run_real(settings, rows, fleet), run_sim(settings, rows, fleet)
    assert len(real) == len(sim) == len(rows)
    assert [i for i, _ in real] == [i for i, _ in sim]


def test_same_kind_of_worker_for_every_request(settings: Settings) -> None:
    # Exact and size routes; a route both kinds could serve (">=8b") would go to
    # whichever has a free slot first, which real and virtual clocks need not agree on.
    rows = trace(("llama-3.1-8b", ">=13b"))
    fleet = {"llama-3.1-8b": 1, "llama-3.1-70b-awq": 1}
    real, sim = run_real(settings, rows, fleet), run_sim(settings, rows, fleet)
    assert sorted(real) == sorted(sim)
    assert {m for i, m in real if rows[i].model == ">=13b"} == {"llama-3.1-70b-awq"}
