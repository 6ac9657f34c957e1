"""Dispatcher decision time per batch and batches per second, on the real Redis.

Issue 3's benchmark. Setup, in a fresh namespace: ``--workers`` fake workers
(60% llama-3.1-8b on 24 GiB cards, 30% llama-2-13b on 40 GiB, 10% llama-3.1-70b-awq
on 80 GiB; ``--slots`` each) registered with ``Store.heartbeat`` and kept beating
every second by a child process (no worker processes), and ``--queued`` requests
over 3 classes, 20 tenants and three routes (60% llama-3.1-8b, 25% ``>=13b``, 15%
llama-3.1-70b-awq). ``Dispatcher.step()`` is then called directly, timed, in two
scenarios; between steps (untimed) the bench completes claimed requests to free
slots and submits as many new ones, so the backlog stays at ``--queued``:

- ``idle``: every claimed request completes between steps; each step dispatches
  as much as the queue heads allow (the fixed cost of a step is spread over many
  batches);
- ``busy``: the fleet is full; between steps ``--free-workers`` workers finish
  what they hold, so each step hands out a few batches (the steady state of a
  saturated fleet, where the fixed cost of a step weighs on few batches);
- ``full``: the fleet is filled until no slot is free (or nothing more could be
  placed for 2 s); each step reads the snapshot and dispatches nothing: what a
  wake-up by a submission costs when the fleet is full.

With ``--prefix`` every fleet size runs a second time with prefix-cache routing fed
(issue 22): each submission carries a chain of prompt block hashes, ``--conversations``
multi-turn chats behind one shared system prompt of 4 blocks, a chat's prompt 4
blocks longer every turn (up to 36 blocks of 64 tokens, prompt text of that length),
so the dispatcher's prefix index holds real chains and the affinity rule weighs
cached candidates on every decision. The table under the runs gives ms per batch with
chains over ms per batch without, same process.

Decision time per batch = a step's wall time / the batches it dispatched. The
step is split into its pieces (expiry, recovery, snapshot read, policy decision,
claim = the assign Lua call, RQ enqueue, fairness write) so it shows where the
time goes. Steps that find no free slot at all (what each wake-up of a full
fleet's dispatcher costs) are timed too. The baseline, timed in the same process
before and after, is RQ's own hand-off of one job: ``Queue.enqueue`` of a no-op
job (JSON serializer). Goal: <= 2 ms per batch::

    python scripts/bench_dispatch.py --json dispatch.json
    python scripts/bench_dispatch.py --workers 500 --prefix --json dispatch-prefix.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import _bench
from rq import Queue
from rq.serializers import JSONSerializer

from inferq import defaults
from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import rq_connection
from inferq.dispatcher.daemon import Dispatcher, StepReport
from inferq.models import WorkerInfo, WorkerState
from inferq.prefix import chain_ids
from inferq.store import Completion, Store, calls, connect

GOAL_MS_PER_BATCH = 2.0
CLASSES = ("realtime", "standard", "batch")
TENANTS = 20
#: (route, share of requests); (model, params B, card MiB, share of workers).
ROUTES = (("llama-3.1-8b", 0.60), (">=13b", 0.25), ("llama-3.1-70b-awq", 0.15))
FLEET = (
    ("llama-3.1-8b", 8.0, 24_576, 0.6),
    ("llama-2-13b", 13.0, 40_960, 0.3),
    ("llama-3.1-70b-awq", 70.0, 81_920, 0.1),
)
#: A fleet counts as full once no step dispatched anything for this long, seconds:
#: past every class's batching delay (0.5 s) and realtime's degrade delay (1 s).
SETTLE_S = 2.0
#: Seconds between two heartbeats of every worker (the issue's 500 heartbeating workers).
BEAT_EVERY_S = 1.0
PROMPT = "Classify the sentiment of this review and explain why in one line: great"
#: Requests never expire during a run (the bench measures dispatching, not expiry).
TIMEOUT_S = 3600.0
#: Prefix chains (``--prefix``): the shared system prompt's blocks, blocks a turn adds,
#: turns before a chat starts over.
SYSTEM_BLOCKS = 4
TURN_BLOCKS = 4
TURNS = 8
PIECES = ("expire", "recover", "snapshot", "decide", "claim", "enqueue", "fairness", "other")


def bench_settings(url: str, namespace: str) -> Settings:
    """Settings whose heartbeat TTL (3 intervals) tolerates a starved heartbeat process.

    The child beats every BEAT_EVERY_S; with the default 1 s interval a loaded 2-core
    machine sometimes delays a round of 500 beats past the 3 s TTL, and workers would
    drop out of the fleet and rejoin mid-run.
    """
    return Settings.load(redis_url=url, namespace=namespace, heartbeat_interval_s=2 * BEAT_EVERY_S)


def fleet(settings: Settings, n: int, slots: int) -> list[WorkerInfo]:
    """``n`` ready workers in FLEET's proportions (deterministic ids ``w0000``...)."""
    out: list[WorkerInfo] = []
    now = time.time()
    for model, params_b, card, share in FLEET:
        count = round(n * share) if model != FLEET[-1][0] else n - len(out)
        kv = settings.model_by_name[model].kv_cache_mib(card)
        for _ in range(count):
            out.append(
                WorkerInfo(
                    id=f"w{len(out):04d}",
                    model=model,
                    params_b=params_b,
                    vram_total_mib=card,
                    vram_free_mib=kv,
                    kv_cache_mib=kv,
                    slots=slots,
                    state=WorkerState.READY,
                    last_heartbeat=now,
                    started_at=now,
                )
            )
    return out


def beat_forever(url: str, namespace: str, workers: int, slots: int) -> None:
    """Heartbeat every worker every BEAT_EVERY_S until SIGTERM (the child process's job)."""
    settings = bench_settings(url, namespace)
    store = Store(connect(url), settings)
    infos = fleet(settings, workers, slots)
    ttl = settings.heartbeat_interval_s * defaults.HEARTBEAT_TTL_INTERVALS
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The beats of a round go in pipelined chunks (as many processes would send them
    # at once): one by one, 5,000 beats took longer than the TTL on a loaded machine.
    beats = [
        calls.heartbeat_call(store.keys, settings, info.id, info.to_fields(), ttl, ())
        for info in infos
    ]
    while True:
        started = time.monotonic()
        for i in range(0, len(beats), 250):
            pipe = store.redis.pipeline(transaction=False)
            for call in beats[i : i + 250]:
                store._call(call, client=pipe)
            pipe.execute()
        time.sleep(max(0.0, BEAT_EVERY_S - (time.monotonic() - started)))


def submissions(n: int, offset: int = 0, conversations: int = 0) -> list[dict[str, Any]]:
    """``n`` submissions over the classes, tenants and ROUTES (``offset`` varies the mix);
    with ``conversations`` > 0, prompts of those chats with their prefix chains."""
    routes = [route for route, share in ROUTES for _ in range(round(share * 20))]
    out = []
    for i in range(n):
        k = offset + i
        sub: dict[str, Any] = {
            "prompt": PROMPT,
            "max_tokens": 64,
            "priority": CLASSES[k % len(CLASSES)],
            "tenant": f"tenant{k % TENANTS}",
            "model": routes[k % len(routes)],
            "timeout": TIMEOUT_S,
        }
        if conversations:
            sub |= conversation_turn(k % conversations, (k // conversations) % TURNS)
        out.append(sub)
    return out


def conversation_turn(chat: int, turn: int) -> dict[str, Any]:
    """Chat ``chat``'s prompt at ``turn`` (0-based): the shared system blocks, then the
    chat's own, TURN_BLOCKS more a turn; its chain given as ``prefix_hashes``."""
    ids = [
        *range(SYSTEM_BLOCKS),
        *(1_000_000 * (chat + 1) + j for j in range(TURN_BLOCKS * (turn + 1))),
    ]
    chars = int(len(ids) * defaults.PREFIX_BLOCK_TOKENS * defaults.CHARS_PER_TOKEN)
    return {
        "prompt": (PROMPT + " ") * (chars // (len(PROMPT) + 1)),
        "prefix_hashes": list(chain_ids(ids, defaults.PREFIX_BLOCK_TOKENS)),
    }


def submit(client: Client, n: int, offset: int = 0, conversations: int = 0) -> None:
    """Submit ``n`` requests in pipelined chunks of 500."""
    batch = submissions(n, offset, conversations)
    for i in range(0, n, 500):
        client.submit_many(batch[i : i + 500])


@dataclass
class Held:
    """Claimed requests per worker, in the order workers were handed batches."""

    by_worker: OrderedDict[str, list[tuple[str, int]]] = field(default_factory=OrderedDict)

    def add(self, worker_id: str, claimed: list[tuple[str, int]]) -> None:
        self.by_worker.setdefault(worker_id, []).extend(claimed)
        self.by_worker.move_to_end(worker_id)

    def take(self, workers: int | None) -> list[tuple[str, list[tuple[str, int]]]]:
        """Remove and return what the first ``workers`` workers hold (None = all)."""
        n = len(self.by_worker) if workers is None else min(workers, len(self.by_worker))
        return [self.by_worker.popitem(last=False) for _ in range(n)]


class Bench:
    """A dispatcher whose store calls are timed, and the untimed worker stand-in around it."""

    def __init__(
        self, settings: Settings, client: Client, full_fleet: bool = False, conversations: int = 0
    ) -> None:
        self.client = client
        self.conversations = conversations
        self.store = Store(connect(settings.redis_url), settings)
        if full_fleet:
            self.store.fleet.full_every_s = 0.0  # every step reads every heartbeat
        self.dispatcher = Dispatcher(self.store)
        self.sw = _bench.Stopwatch()
        self.held = Held()
        self.submitted = 0
        s, d = self.store, self.dispatcher
        s.expire_due = self.sw.wrap("expire", s.expire_due)  # type: ignore[method-assign]
        d._recover = self.sw.wrap("recover", d._recover)  # type: ignore[method-assign]
        s.dispatch_view = self.sw.wrap("snapshot", s.dispatch_view)  # type: ignore[method-assign]
        s.assign = self.sw.wrap("claim", self._assign(s.assign))  # type: ignore[method-assign]
        d._dispatch = self.sw.wrap("dispatch", d._dispatch)  # type: ignore[method-assign]
        s.write_fairness = self.sw.wrap("fairness", s.write_fairness)  # type: ignore[method-assign]

    def _assign(self, assign: Any) -> Any:
        def recording(worker_id: str, batch_id: str, items: Any) -> list[tuple[str, int]]:
            claimed: list[tuple[str, int]] = assign(worker_id, batch_id, items)
            self.held.add(worker_id, claimed)
            return claimed

        return recording

    def free(self, workers: int | None) -> int:
        """Complete what the first ``workers`` workers hold (None = all); refill the queue."""
        done = 0
        for worker_id, claimed in self.held.take(workers):
            outcomes = [
                Completion(rid, attempt, "succeeded", output="ok") for rid, attempt in claimed
            ]
            self.store.complete(worker_id, outcomes)
            done += len(outcomes)
        self.top_up(done)
        return done

    def top_up(self, n: int) -> None:
        """Submit ``n`` more requests (the next of the mix)."""
        submit(self.client, n, self.submitted, self.conversations)
        self.submitted += n

    def free_slots(self, slots: int) -> int:
        """Slots of the fleet not reserved by assigned work (one pipelined round trip)."""
        ids = self.store.redis.zrange(self.store.keys.workers, 0, -1)
        pipe = self.store.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hget(self.store.keys.load(wid), "slots")
        return sum(max(0, slots - int(used or 0)) for used in pipe.execute())

    def step(self) -> tuple[StepReport, dict[str, float]]:
        """One timed dispatcher step and its pieces, seconds."""
        self.sw.reset()
        report = self.dispatcher.step()
        dispatch = self.sw.total("dispatch")
        pieces = {name: self.sw.total(name) for name in ("expire", "recover", "snapshot")}
        pieces["decide"] = report.decide_s
        pieces["claim"] = self.sw.total("claim")
        pieces["enqueue"] = dispatch - pieces["claim"]
        pieces["fairness"] = self.sw.total("fairness")
        pieces["other"] = max(0.0, report.step_s - sum(pieces.values()))
        return report, pieces


@dataclass
class Scenario:
    """Figures of one scenario's measured steps."""

    name: str
    steps: list[tuple[StepReport, dict[str, float]]] = field(default_factory=list)
    #: how the fleet was filled first (busy and full): seconds, slots left free.
    fill: dict[str, float] = field(default_factory=dict)
    per_batch_dispatch_s: list[float] = field(default_factory=list)
    #: heartbeats read (HMGET) and full fleet reads over the measured steps.
    workers_read: int = 0
    full_reads: int = 0

    def summary(self) -> dict[str, Any]:
        working = [r for r, _ in self.steps if r.batches]
        step_ms = [r.step_s * 1000 for r, _ in self.steps]
        sizes = [n for r in working for n in r.batch_sizes]
        total_s = sum(r.step_s for r, _ in self.steps)
        batches = sum(r.batches for r in working)
        out: dict[str, Any] = {
            "steps": len(self.steps),
            "steps_with_batches": len(working),
            "batches": batches,
            "requests_dispatched": sum(sizes),
            "fill_before": self.fill,
            "workers_lost": sum(r.workers_lost for r, _ in self.steps),
            "requeued": sum(r.requeued for r, _ in self.steps),
            "batches_per_s": batches / total_s if total_s else 0.0,
            "requests_per_s": sum(sizes) / total_s if total_s else 0.0,
            "step_ms_p50": _bench.percentile(step_ms, 50),
            "step_ms_p99": _bench.percentile(step_ms, 99),
            "heartbeats_read_per_step": self.workers_read / max(1, len(self.steps)),
            "full_fleet_reads": self.full_reads,
            "piece_ms_per_step_mean": {
                name: sum(p[name] for _, p in self.steps) / len(self.steps) * 1000
                for name in PIECES
            },
        }
        if not working:
            return out
        per_batch_ms = [r.step_s / r.batches * 1000 for r in working]
        dispatch_ms = [s * 1000 for s in self.per_batch_dispatch_s]
        out |= {
            "ms_per_batch_p50": _bench.percentile(per_batch_ms, 50),
            "ms_per_batch_p99": _bench.percentile(per_batch_ms, 99),
            "batches_per_step_mean": batches / len(working),
            "batch_size_mean": sum(sizes) / len(sizes),
            "batch_size_p50": _bench.percentile(sizes, 50),
            "batch_size_max": max(sizes),
            "claim_enqueue_ms_per_batch_p50": _bench.percentile(dispatch_ms, 50),
            "claim_enqueue_ms_per_batch_p99": _bench.percentile(dispatch_ms, 99),
            "goal_ms_per_batch": GOAL_MS_PER_BATCH,
        }
        out["goal_met"] = out["ms_per_batch_p50"] <= GOAL_MS_PER_BATCH
        return out


def run(bench: Bench, name: str, steps: int, free_workers: int | None) -> Scenario:
    """``steps`` measured steps, freeing ``free_workers`` workers (None = all) before each."""
    scenario = Scenario(name)
    cache = bench.store.fleet
    for _ in range(steps):
        bench.free(free_workers)
        read, full = cache.workers_read, cache.full_reads
        report, pieces = bench.step()
        scenario.steps.append((report, pieces))
        scenario.per_batch_dispatch_s += bench.sw.samples["dispatch"]
        scenario.workers_read += cache.workers_read - read
        scenario.full_reads += cache.full_reads - full
    return scenario


def fill(bench: Bench, slots: int) -> dict[str, float]:
    """Step until the fleet is full, topping the backlog up after each step (untimed).

    The backlog's mix drifts towards the busiest route (its requests leave slowest),
    so the top-ups are what bring requests for the other models' free slots. A step
    may also dispatch nothing while slots are free: a class holds requests back up to
    its batching delay (batch: 0.5 s). So it steps until no slot is free, or until no
    step dispatched anything for SETTLE_S.

    Returns:
        ``fill_s`` (seconds it took) and ``free_slots`` left (reservations vs slots).
    """
    started = last = time.monotonic()
    while bench.free_slots(slots) and time.monotonic() - last < SETTLE_S:
        n = bench.dispatcher.step().dispatched
        if n:
            bench.top_up(n)
            last = time.monotonic()
        else:
            time.sleep(0.05)
    return {"fill_s": time.monotonic() - started, "free_slots": bench.free_slots(slots)}


def rq_enqueue_s(url: str, ns: str, n: int, tag: str) -> list[float]:
    """Seconds of each of ``n`` RQ ``Queue.enqueue`` calls of a no-op job."""
    queue = Queue(f"{ns}-rq", connection=rq_connection(url), serializer=JSONSerializer)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        queue.enqueue_call(_bench.NOOP_FUNC, job_id=f"{ns}-{tag}{i}")
        out.append(time.perf_counter() - t0)
    queue.connection.close()
    return out


def measure(
    args: argparse.Namespace,
    ns: str,
    profile: cProfile.Profile | None,
    workers: int,
    conversations: int = 0,
) -> tuple[list[Scenario], list[float]]:
    settings = bench_settings(args.redis_url, ns)
    client = Client(settings=settings)
    bench = Bench(settings, client, full_fleet=args.full_fleet, conversations=conversations)
    ttl = settings.heartbeat_interval_s * defaults.HEARTBEAT_TTL_INTERVALS
    for info in fleet(settings, workers, args.slots):
        bench.store.heartbeat(info, ttl_s=ttl)
    beater = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--redis-url",
            args.redis_url,
            "--beat",
            ns,
            "--workers",
            str(workers),
            "--slots",
            str(args.slots),
        ]
    )
    try:
        baseline = rq_enqueue_s(args.redis_url, ns, args.baseline_jobs, "a")
        bench.top_up(args.queued)
        for _ in range(args.warmup):
            bench.free(None)
            bench.step()
        if profile:
            profile.enable()
        idle = run(bench, "idle", args.idle_steps, None)
        if profile:
            profile.disable()
        bench.free(None)
        before_busy = fill(bench, args.slots)
        if profile:
            profile.enable()
        busy = run(bench, "busy", args.busy_steps, args.free_workers)
        if profile:
            profile.disable()
        bench.free(None)
        before_full = fill(bench, args.slots)
        full = run(bench, "full", args.full_steps, 0)
        busy.fill, full.fill = before_busy, before_full
        baseline += rq_enqueue_s(args.redis_url, ns, args.baseline_jobs, "b")
        return [idle, busy, full], baseline
    finally:
        beater.terminate()
        beater.wait(timeout=10)
        client.close()


def report(
    args: argparse.Namespace,
    scenarios: list[Scenario],
    baseline_s: list[float],
    workers: int,
    conversations: int = 0,
) -> dict[str, Any]:
    summaries = {s.name: s.summary() for s in scenarios}
    rq_ms = _bench.median(baseline_s) * 1000
    rows = []
    for name, s in summaries.items():
        step = f"{s['step_ms_p50']:.1f} / {s['step_ms_p99']:.1f}"
        if "ms_per_batch_p50" not in s:
            reads = _bench.fmt(s["heartbeats_read_per_step"], 1)
            rows.append([name, "-", "-", "-", "-", "-", "-", step, reads, "-", "no batch"])
            continue
        rows.append(
            [
                name,
                _bench.fmt(s["ms_per_batch_p50"], 3),
                _bench.fmt(s["ms_per_batch_p99"], 3),
                _bench.fmt(s["batches_per_s"]),
                _bench.fmt(s["requests_per_s"]),
                _bench.fmt(s["batches_per_step_mean"], 1),
                f"{s['batch_size_mean']:.1f} / {s['batch_size_max']}",
                step,
                _bench.fmt(s["heartbeats_read_per_step"], 1),
                _bench.fmt(_bench.ratio(s["ms_per_batch_p50"], rq_ms)),
                "yes" if s["goal_met"] else "NO",
            ]
        )
    _bench.table(
        f"Dispatcher: {args.queued:,} queued, 3 classes, {TENANTS} tenants, "
        f"{workers:,} heartbeating workers x {args.slots} slots"
        + (" (every heartbeat read every step)" if args.full_fleet else "")
        + (f", prefix chains of {conversations:,} chats" if conversations else ""),
        [
            "scenario",
            "ms/batch p50",
            "ms/batch p99",
            "batches/s",
            "requests/s",
            "batches/step",
            "batch size mean/max",
            "step ms p50 / p99",
            "heartbeats read/step",
            f"p50 / RQ enqueue ({rq_ms:.3f} ms)",
            f"<= {GOAL_MS_PER_BATCH:g} ms",
        ],
        rows,
    )
    piece_rows = []
    for name, s in summaries.items():
        ms = s["piece_ms_per_step_mean"]
        total = sum(ms.values()) or 1.0
        piece_rows.append([name, *(f"{ms[p]:.2f} ({ms[p] / total:.0%})" for p in PIECES)])
    _bench.table(
        f"Where a step's time goes (mean ms per step, share), {workers:,} workers",
        ["scenario", *PIECES],
        piece_rows,
    )
    return {
        "workers": workers,
        "prefix_conversations": conversations,
        "rq_enqueue_ms_p50": rq_ms,
        "scenarios": summaries,
    }


def prefix_ratios(plain: dict[str, Any], chained: dict[str, Any]) -> dict[str, Any]:
    """Per scenario: ms per batch p50 and decide ms per step, with chains / without."""
    out: dict[str, Any] = {}
    for name, a in plain["scenarios"].items():
        b = chained["scenarios"][name]
        if "ms_per_batch_p50" not in a or "ms_per_batch_p50" not in b:
            continue
        decide = (a["piece_ms_per_step_mean"]["decide"], b["piece_ms_per_step_mean"]["decide"])
        out[name] = {
            "ms_per_batch_p50": (a["ms_per_batch_p50"], b["ms_per_batch_p50"]),
            "ratio": _bench.ratio(b["ms_per_batch_p50"], a["ms_per_batch_p50"]),
            "decide_ms_per_step": decide,
            "decide_ratio": _bench.ratio(decide[1], decide[0]),
        }
    _bench.table(
        f"Prefix-cache routing's cost, {plain['workers']:,} workers (same process)",
        ["scenario", "ms/batch p50 without", "with chains", "ratio", "decide ms/step ratio"],
        [
            [
                name,
                _bench.fmt(r["ms_per_batch_p50"][0], 3),
                _bench.fmt(r["ms_per_batch_p50"][1], 3),
                _bench.fmt(r["ratio"]),
                _bench.fmt(r["decide_ratio"]),
            ]
            for name, r in out.items()
        ],
    )
    return out


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--queued", type=_bench.positive, default=10_000, help="backlog kept queued")
    p.add_argument(
        "--workers",
        type=_bench.positive,
        nargs="+",
        default=[500, 5000],
        help="heartbeating workers: one run per fleet size",
    )
    p.add_argument(
        "--full-fleet",
        action="store_true",
        help="read every heartbeat every step (before issue 17) instead of the changed ones",
    )
    p.add_argument("--slots", type=_bench.positive, default=8, help="slots per worker")
    p.add_argument("--idle-steps", type=_bench.positive, default=30, help="measured, idle fleet")
    p.add_argument("--busy-steps", type=_bench.positive, default=200, help="measured, full fleet")
    p.add_argument(
        "--free-workers", type=_bench.positive, default=16, help="workers freed per busy step"
    )
    p.add_argument("--full-steps", type=_bench.positive, default=20, help="measured, no slot free")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured idle steps first")
    p.add_argument(
        "--baseline-jobs", type=_bench.positive, default=300, help="RQ enqueues, before and after"
    )
    p.add_argument(
        "--profile", type=int, metavar="N", default=0, help="print the top N by cProfile"
    )
    p.add_argument(
        "--prefix",
        action="store_true",
        help="also run every fleet size with prefix chains (issue 22) and compare",
    )
    p.add_argument("--conversations", type=_bench.positive, default=500, help="chats of --prefix")
    p.add_argument("--beat", metavar="NAMESPACE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.beat:
        beat_forever(args.redis_url, args.beat, args.workers[0], args.slots)
        return

    profile = cProfile.Profile() if args.profile else None
    fleets = []
    prefix: dict[int, Any] = {}
    for workers in args.workers:
        with _bench.namespace(args.redis_url) as ns:
            scenarios, baseline = measure(args, ns, profile, workers)
        fleets.append(report(args, scenarios, baseline, workers))
        if not args.prefix:
            continue
        with _bench.namespace(args.redis_url) as ns:
            scenarios, baseline = measure(args, ns, profile, workers, args.conversations)
        fleets.append(report(args, scenarios, baseline, workers, args.conversations))
        prefix[workers] = prefix_ratios(fleets[-2], fleets[-1])
    for figures in fleets:
        for name, s in figures["scenarios"].items():
            if "goal_met" in s:
                p50 = s["ms_per_batch_p50"]
                verdict = (
                    "met"
                    if s["goal_met"]
                    else f"MISSED by {p50 - GOAL_MS_PER_BATCH:.3f} ms "
                    f"({p50 / GOAL_MS_PER_BATCH:.1f}x the goal)"
                )
                chains = " with prefix chains" if figures["prefix_conversations"] else ""
                _bench.note(
                    f"{figures['workers']:,} workers{chains}, {name}: "
                    f"goal <= {GOAL_MS_PER_BATCH:g} ms per batch {verdict} (p50 {p50:.3f} ms)"
                )
    if profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
        _bench.note("cProfile of the measured steps (timings above include its overhead):")
        _bench.note(out.getvalue())
    _bench.write_json(
        args.json,
        args.redis_url,
        {
            "queued": args.queued,
            "slots_per_worker": args.slots,
            "classes": len(CLASSES),
            "tenants": TENANTS,
            "free_workers_per_busy_step": args.free_workers,
            "full_fleet": args.full_fleet,
            "prefix_vs_plain": prefix,
            # The first fleet size at the top level, as before; every size under "fleets".
            **fleets[0],
            "fleets": fleets,
        },
    )


if __name__ == "__main__":
    main()
