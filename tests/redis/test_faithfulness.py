"""The simulator decides like the real stack: same requests, same order, same kind of worker.

A small mixed trace (three classes, six tenants, two routes) goes once through
the real stack — Redis, the dispatcher, worker subprocesses on the sim backend —
and once through ``inferq.sim.replay`` with the same settings. Every request is
queued before the first decision and all take the same time, so the order the
policy imposes (class shares, tenant fairness, routing) is the only order there
is; time-dependent rules (aging, batching delays) are switched off because real
and virtual clocks cannot agree on them.

Scaling (issue 16): the scaler daemon reads its facts from Redis (submit and finish
events, heartbeats, queue depths), the simulator keeps its own (``LoadTracker``); fed
the same facts, both size the fleet with the same capacity model
(:mod:`inferq.policy.capacity`) and take the same decision, a scale-up under a backlog
and a scale-down of idle workers.

Cached prefills (issue 22): multi-turn chats behind a shared system prompt, turn by turn,
go through the real stack (the sim backend keeps a prefix cache as a model server does
and reports the prompt tokens it reused) and through the simulator (its per-worker
caches); both put each chat's turns on the same worker, the index forecasts the same
cached tokens, and the servers report the same reuse.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from inferq.client import Client
from inferq.config import PriorityClass, Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.policy.scaling import ModelLimits, ModelLoad, ScalerState, ScalingConfig, decide_scale
from inferq.prefix import chain_ids
from inferq.scaler.daemon import Scaler
from inferq.scaler.platforms.base import Platform, WorkerHandle
from inferq.sim import SimConfig, SimRequest, fixed_latency, replay, simulate
from inferq.sim.fleet import SimWorker
from inferq.sim.loads import LoadTracker
from inferq.sim.policies import ALL_POLICIES
from inferq.store import Completion, Store, connect
from inferq.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

from ..builders import inference_request
from ..conftest import REDIS_URL
from ..helpers import ready_worker

MODEL = "llama-3.1-8b"

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


@contextlib.contextmanager
def sim_workers(store: Store, fleet: dict[str, int]) -> Iterator[None]:
    """Worker subprocesses on the sim backend (``{model}-{n}``), ready on entry."""
    settings = store.settings
    env = {
        **os.environ,
        "INFERQ_REDIS_URL": REDIS_URL,
        "INFERQ_NAMESPACE": settings.namespace,
        "INFERQ_CLASSES": "[" + ",".join(c.model_dump_json() for c in settings.classes) + "]",
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
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)


def dispatch_all(store: Store, ids: list[str]) -> None:
    """Run a dispatcher until every request of ``ids`` (all queued, every worker ready:
    nothing is decided before the last arrives) has succeeded."""
    client = Client(settings=store.settings, connection=store.redis)
    dispatcher = Dispatcher(store, tick_s=0.02)
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    thread.start()
    try:
        for rid in ids:
            assert client.result(rid, timeout=60).ok
    finally:
        dispatcher.stop()
        thread.join()


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
    with sim_workers(store, fleet):
        dispatch_all(store, [h.id for h in handles])
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
    real_ids, sim_ids = [i for i, _ in real], [i for i, _ in sim]
    # The classes' shares: the same class at every position.
    assert [rows[i].priority for i in real_ids] == [rows[i].priority for i in sim_ids]
    # Within a tenant, FIFO on both sides.
    for tenant in {r.tenant for r in rows}:
        mine = [i for i in real_ids if rows[i].tenant == tenant]
        assert mine == [i for i in sim_ids if rows[i].tenant == tenant], tenant
    # Between tenants, the same fair share to within one request at every point: a tie
    # of two tenants' virtual times goes to the one whose head waited longest, which the
    # real stack's millisecond stamps decide (submit_many's 36 stamps span 0-3 ms, more
    # on a loaded host) and the simulator's single arrival instant cannot (its ties go
    # to the stable hash): t2 and t3 of the standard class swapped places that way
    # (issue 25). The exact order is the same otherwise.
    for k in range(1, len(rows) + 1):
        for cls in {r.priority for r in rows}:
            served = [collections.Counter(), collections.Counter()]
            for side, ids in enumerate((real_ids[:k], sim_ids[:k])):
                served[side].update(rows[i].tenant for i in ids if rows[i].priority == cls)
            gap = max(abs(served[0][t] - served[1][t]) for t in {r.tenant for r in rows})
            assert gap <= 1, (k, cls, real_ids, sim_ids)


def test_same_kind_of_worker_for_every_request(settings: Settings) -> None:
    # Exact and size routes; a route both kinds could serve (">=8b") would go to
    # whichever has a free slot first, which real and virtual clocks need not agree on.
    rows = trace(("llama-3.1-8b", ">=13b"))
    fleet = {"llama-3.1-8b": 1, "llama-3.1-70b-awq": 1}
    real, sim = run_real(settings, rows, fleet), run_sim(settings, rows, fleet)
    assert sorted(real) == sorted(sim)
    assert {m for i, m in real if rows[i].model == ">=13b"} == {"llama-3.1-70b-awq"}


# --- scaling: the daemon reads Redis, the simulator its own facts; same decision -------

SCALE_SLOTS, SCALE_KV_MIB = 64, 8_000
PROMPT_MEAN, OUTPUT_MEAN = 1_800, 240


class _Recording(Platform):
    """Launches nothing: remembers handles and lists them until stopped."""

    name = "recording"

    def __init__(self, running: list[str]) -> None:
        self.running = {w: WorkerHandle(w, MODEL, f"ref-{w}") for w in running}

    def launch(self, model: str, worker_id: str) -> WorkerHandle:
        self.running[worker_id] = handle = WorkerHandle(worker_id, model, f"ref-{worker_id}")
        return handle

    def prepare_scale_down(self, handle: WorkerHandle) -> None:
        pass

    def stop(self, handle: WorkerHandle) -> None:
        self.running.pop(handle.worker_id, None)

    def list(self, model: str | None = None) -> builtins.list[WorkerHandle]:
        return [h for h in self.running.values() if model is None or h.model == model]


def _plant(store: Store, settings: Settings, workers: int, finished: int, queued: int) -> None:
    """Ready workers, ``finished`` requests that ran ~50 ms on the first, ``queued`` waiting."""
    for i in range(workers):
        ready_worker(store, f"w{i}", slots=SCALE_SLOTS, kv_cache_mib=SCALE_KV_MIB)
    done = [inference_request(settings, priority="standard") for _ in range(finished)]
    for r in done:
        store.submit(r)
    items = [(r.id, store.keys.tenant_queue("standard", r.route, r.tenant), 1) for r in done]
    attempts = store.assign("w0", "b", items)
    time.sleep(0.05)
    store.complete(
        "w0",
        [
            Completion(rid, attempt, "succeeded", prompt_tokens=PROMPT_MEAN,
                       completion_tokens=OUTPUT_MEAN)
            for rid, attempt in attempts
        ],
    )  # fmt: skip
    for _ in range(queued):
        store.submit(inference_request(settings, priority="standard"))


def _simulated(store: Store, settings: Settings, config: ScalingConfig, now: float) -> ModelLoad:
    """The simulator's load for the same facts: its LoadTracker fed the events' arrivals and
    finishes, the store's queue depths and the same workers."""
    tracker = LoadTracker(settings, [MODEL], SCALE_SLOTS)
    for e in store.events(count=100_000):
        if e.type == "submit":
            tracker.arrived(e.at, e.fields["route"])
        elif e.type == "finish":
            took = (int(e.fields["e2e_ms"]) - int(e.fields["queue_ms"])) / 1000
            ptokens, tokens = int(e.fields["ptokens"]), int(e.fields["tokens"])
            tracker.finished(e.at, MODEL, took, ptokens, tokens)
    spec = settings.model_by_name[MODEL]
    workers = [
        SimWorker(w.id, spec, SCALE_SLOTS, SCALE_KV_MIB, launched_at=0.0, idle_since=now)
        for w in store.workers()[0]
    ]
    (load,) = tracker.loads(now, store.queue_depths(), workers, store.output_estimates())
    return load


@pytest.mark.parametrize(
    ("workers", "finished", "queued", "action"),
    [(1, 8, 300, "up"), (4, 2, 0, "down")],
)
def test_scaler_daemon_and_simulator_scale_alike(
    store: Store, settings: Settings, workers: int, finished: int, queued: int, action: str
) -> None:
    # The same capacity model (inferq.policy.capacity) through both load builders: the
    # daemon's from Redis (events, heartbeats, queue depths), the simulator's LoadTracker.
    config = ScalingConfig(
        limits={MODEL: ModelLimits(1, 8, 0)},
        up_cooldown_s=0.0,
        down_cooldown_s=0.0,
        idle_s=0.0,
    )
    _plant(store, settings, workers, finished, queued)
    platform = _Recording([f"w{i}" for i in range(workers)])
    report = Scaler(store, config=config, platform=platform, models=[MODEL]).step()
    (real,) = report.decisions
    sim_load = _simulated(store, settings, config, report.now)
    assert sim_load.capacity_rate is not None  # sized by the capacity model, not by slots
    (sim,), _ = decide_scale([sim_load], ScalerState(), config, settings.classes, report.now)
    assert real.action == sim.action == action
    assert (real.current, real.desired) == (sim.current, sim.desired)
    assert len(real.drain) == len(sim.drain)
    if action == "up":
        assert len(report.launched) == real.desired - real.current
    else:
        assert sorted(report.drained) == sorted(real.drain)


# --- cached prefills: the same chats on the same workers, the same reuse ----------------

BLOCK = MOONCAKE_BLOCK_TOKENS
CHATS, TURNS, BLOCKS_PER_TURN = 4, 3, 2
#: the block of a system prompt every chat starts with (outside the chats' own ids)
SYSTEM_BLOCK = 1


def chat_turns() -> list[list[SimRequest]]:
    """Per turn, one request per chat: the system block, then the chat's blocks so far
    (turn ``t`` resends turns ``0..t-1`` and adds ``BLOCKS_PER_TURN`` blocks)."""
    turns = []
    for t in range(TURNS):
        phase = []
        for c in range(CHATS):
            blocks = [SYSTEM_BLOCK] + [1000 * (c + 1) + j for j in range(BLOCKS_PER_TURN * (t + 1))]
            phase.append(
                SimRequest(
                    id=f"r{t * CHATS + c:07d}",
                    arrival_s=100.0 * t,  # each turn after the last one finished
                    priority="standard",
                    # one tenant, one FIFO: a tie of tenants' fair shares breaks on
                    # real millisecond stamps, which the simulator has not (see above)
                    tenant="chats",
                    route=MODEL,
                    prompt_tokens=len(blocks) * BLOCK,
                    output_tokens=OUTPUT_TOKENS,
                    max_tokens=OUTPUT_TOKENS,
                    prefix=chain_ids(blocks, BLOCK),
                    block_tokens=BLOCK,
                )
            )
        turns.append(phase)
    return turns


#: (chat, turn) -> (worker, cached tokens the server reported, cached tokens forecast)
Reuse = dict[tuple[int, int], tuple[str, int, int]]


def reuse_real(settings: Settings, turns: list[list[SimRequest]], workers: int) -> Reuse:
    store = Store(connect(settings.redis_url), settings)
    client = Client(settings=settings, connection=store.redis)
    seen: Reuse = {}
    with sim_workers(store, {MODEL: workers}):
        for t, phase in enumerate(turns):
            handles = client.submit_many(
                {
                    "prompt": "tok " * r.prompt_tokens,
                    "model": MODEL,
                    "priority": r.priority,
                    "tenant": r.tenant,
                    "max_tokens": OUTPUT_TOKENS,
                    "prefix_hashes": list(r.prefix),
                    "params": {"sim_output_tokens": OUTPUT_TOKENS},
                }
                for r in phase
            )
            dispatch_all(store, [h.id for h in handles])  # the turn ends before the next
            for c, record in enumerate(store.records([h.id for h in handles])):
                assert record is not None and record.result is not None
                seen[c, t] = (record.worker, record.result.cached_tokens, record.cached_forecast)
    return seen


def reuse_sim(settings: Settings, turns: list[list[SimRequest]], workers: int) -> Reuse:
    config = SimConfig(
        settings=settings, fleet={MODEL: workers}, vram_mib=81920, slots=2,
        latency=fixed_latency(0.5),
    )  # fmt: skip
    policy = dataclasses.replace(ALL_POLICIES["inferq"], scaler=None, peak_fleet=False)
    result = simulate([r for phase in turns for r in phase], policy, config)
    return {
        (int(o.request.id[1:]) % CHATS, int(o.request.id[1:]) // CHATS): (
            o.worker,
            o.cached_tokens,
            o.forecast_tokens,
        )
        for o in result.outcomes
    }


def partition(seen: Reuse) -> set[frozenset[tuple[int, int]]]:
    """The (chat, turn) pairs each worker served, whatever the workers are named."""
    by_worker: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
    for key, (worker, _, _) in seen.items():
        by_worker[worker].add(key)
    return {frozenset(v) for v in by_worker.values()}


def test_cached_prefills_same_workers_same_reuse(namespace: str) -> None:
    settings = Settings.load(
        redis_url=REDIS_URL, namespace=namespace, classes=CLASSES, heartbeat_interval_s=0.2,
        prefix={"block_tokens": BLOCK},
    )  # fmt: skip
    turns = chat_turns()
    real, sim = reuse_real(settings, turns, 2), reuse_sim(settings, turns, 2)
    assert partition(real) == partition(sim)
    # Every chat stays on its worker, and the fleet is not piled onto one.
    assert all(len({real[c, t][0] for t in range(TURNS)}) == 1 for c in range(CHATS))
    assert len({w for w, _, _ in real.values()}) == 2
    # Reuse, as the servers report it and as the index forecast it, request by request.
    assert {k: v[1:] for k, v in real.items()} == {k: v[1:] for k, v in sim.items()}
    for c in range(CHATS):  # turn t reuses the system block and turns 0..t-1
        for t in range(1, TURNS):
            assert real[c, t][1:] == ((1 + BLOCKS_PER_TURN * t) * BLOCK,) * 2, (c, t, real[c, t])
