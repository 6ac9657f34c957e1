"""End-to-end throughput and added latency through the real stack, beside plain RQ.

Issue 7's benchmark. In a fresh namespace it starts a dispatcher (``inferq
dispatcher``) and ``--workers`` worker processes (``inferq worker`` with the sim
backend at ``time_scale=0``: a request takes no time, so only scheduling costs
remain). Every timestamp is read from the request hashes, where Redis TIME wrote
it (whole milliseconds).

1. Added latency, idle capacity: ``--latency-requests`` single submissions of
   class ``--priority`` (default realtime, whose batching delay is 0: standard
   and batch requests wait up to their batching delay, 50 and 500 ms, to fill a
   batch, by design) at a fixed ``--rate``; per request ``started_ms -
   submitted_ms`` (submit -> the worker starts it), split into submit -> claimed
   by the dispatcher and claimed -> started (the RQ hand-off). Goals: p50 <= 2
   ms, p99 <= 10 ms.
2. Throughput: with the dispatcher paused (SIGSTOP), ``--requests`` are queued;
   then it resumes and the fleet drains them; requests/s = requests / (last
   ``finished_ms`` - first ``dispatched_ms``).
3. The RQ baselines: as many RQ worker processes as inferq workers are started,
   then ``--rq-jobs`` no-op jobs (JSON serializer) are queued; jobs/s = jobs /
   (last ``ended_at`` - first ``started_at``). Two worker classes by default:
   ``SimpleWorker`` (no fork, what inferq's worker is built on: the harder
   baseline) and RQ's default ``Worker`` (forks a child per job: what ``rq
   worker`` runs). Goal: inferq >= 20x RQ's per-job throughput.

For every throughput run the CPU time each process used (``/proc``) and the
Redis server's (INFO cpu: the whole server, so other clients' work shows too)
is reported per 1,000 items: on a small machine the total is what bounds the
rate::

    python scripts/bench_e2e.py --json e2e.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import _bench
import redis
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FinishedJobRegistry
from rq.serializers import JSONSerializer

from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import rq_connection
from inferq.embedded import EmbeddedRedis
from inferq.store import Store

MODEL = "llama-3.1-8b"
CLASSES = ("realtime", "standard", "batch")
TENANTS = 20
GOAL_THROUGHPUT_RATIO = 20.0
GOAL_P50_MS = 2.0
GOAL_P99_MS = 10.0
#: Longest wait for a phase to finish, seconds.
PHASE_TIMEOUT_S = 600.0
RQ_NOTES = {"SimpleWorker": " (no fork)", "Worker": " (RQ's default: forks per job)"}


class Procs:
    """Child processes with their output in temporary files; all stopped on close."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.procs: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        self.env = env

    def start(self, name: str, cmd: list[str]) -> None:
        log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = (proc, log)

    def signal(self, name: str, signum: int) -> None:
        self.procs[name][0].send_signal(signum)

    def cpu_s(self, names: list[str]) -> float:
        """CPU seconds (user + system) the named children have used so far."""
        return sum(cpu_seconds(self.procs[n][0].pid) for n in names)

    def stop(self, name: str, timeout_s: float = 30.0) -> None:
        """SIGTERM (drain), then SIGKILL past ``timeout_s``."""
        proc, log = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()

    def check(self) -> None:
        """Raise with its output if a child exited early."""
        for name, (proc, log) in self.procs.items():
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and its reaped children (Linux /proc).

    Returns 0.0 where /proc is not there.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime, stime, and cutime, cstime: the forked children it waited for (RQ's Worker).
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def redis_cpu_s(client: redis.Redis) -> float:
    """CPU seconds the Redis server has used (all of it: other clients' work too)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class CpuMeter:
    """CPU seconds of some children and of Redis between :meth:`start` and :meth:`stop`."""

    def __init__(self, procs: Procs, groups: dict[str, list[str]], client: redis.Redis) -> None:
        self.procs, self.groups, self.client = procs, groups, client
        self.used: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {name: self.procs.cpu_s(members) for name, members in self.groups.items()}
        now["redis-server"] = redis_cpu_s(self.client)
        return now

    def start(self) -> None:
        self.used = self._now()

    def stop(self) -> dict[str, float]:
        end = self._now()
        self.used = {name: end[name] - self.used[name] for name in end}
        return self.used


def wait_until(what: str, done: Callable[[], bool], procs: Procs) -> None:
    """Poll ``done`` every 20 ms until true (raises after PHASE_TIMEOUT_S or a child's exit)."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not done():
        procs.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done after {PHASE_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


class Stack:
    """The inferq side: a dispatcher and workers as processes, a client in this one.

    With ``src``, the processes import inferq from that tree (first on ``PYTHONPATH``);
    the client in this process is always this tree's.
    """

    def __init__(
        self, url: str, ns: str, workers: int, slots: int, src: Path | None = None
    ) -> None:
        self.settings = Settings.load(redis_url=url, namespace=ns)
        self.client = Client(settings=self.settings)
        self.store: Store = self.client.store
        self.procs = Procs(None if src is None else {**os.environ, "PYTHONPATH": str(src)})
        base = [sys.executable, "-m", "inferq", "--redis-url", url, "--namespace", ns]
        self.worker_ids = [f"e2e-w{i}" for i in range(workers)]
        try:
            for wid in self.worker_ids:
                self.procs.start(
                    wid,
                    [
                        *base,
                        "worker",
                        "--model",
                        MODEL,
                        "--vram-mib",
                        "81920",
                        "--id",
                        wid,
                        "--slots",
                        str(slots),
                        "-o",
                        "time_scale=0",
                    ],
                )
            self.procs.start("dispatcher", [*base, "dispatcher"])
            wait_until("workers ready", self._ready, self.procs)
            time.sleep(1.0)  # the dispatcher is up and waiting for work
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        states = [
            self.store.redis.hget(self.store.keys.worker(w), "state") for w in self.worker_ids
        ]
        return all(s == "ready" for s in states)

    def wait_finished(self, total: int) -> None:
        wait_until(
            f"{total} requests succeeded",
            lambda: self.store.stats().get("succeeded", 0) >= total,
            self.procs,
        )

    def times(self, ids: list[str], fields: tuple[str, ...]) -> list[list[int]]:
        """Integer ms ``fields`` of each request (one pipelined round trip)."""
        pipe = self.store.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.hmget(self.store.keys.req(rid), fields)
        return [[int(v) for v in row] for row in pipe.execute()]

    def batches(self, ids: list[str]) -> set[str]:
        """The batch ids the requests ran in."""
        pipe = self.store.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.hget(self.store.keys.req(rid), "batch")
        return set(pipe.execute())

    def close(self) -> None:
        self.procs.close()
        self.client.close()


def item(i: int) -> dict[str, Any]:
    return {
        "prompt": "Say hello",
        "max_tokens": 16,
        "priority": CLASSES[i % len(CLASSES)],
        "tenant": f"tenant{i % TENANTS}",
    }


def latency_interleaved(
    stacks: dict[str, Stack], n: int, rate: float, priority: str
) -> dict[str, dict[str, Any]]:
    """Submit ``n`` requests one by one at ``rate``/s to each stack's idle fleet, the
    submissions interleaved (one to each stack in turn) so a loaded machine moves all of
    them alike; ms percentiles by stack name."""
    names = list(stacks)
    before = {name: st.store.stats().get("succeeded", 0) for name, st in stacks.items()}
    ids: dict[str, list[str]] = {name: [] for name in names}
    t0 = time.perf_counter()
    for i in range(n * len(names)):
        pause = t0 + i / (rate * len(names)) - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        name = names[i % len(names)]
        ids[name].append(stacks[name].client.submit(**{**item(i), "priority": priority}).id)
    for name, st in stacks.items():
        st.wait_finished(before[name] + n)
    return {name: latency_figures(stacks[name], ids[name], rate, priority) for name in names}


def latency_figures(stack: Stack, ids: list[str], rate: float, priority: str) -> dict[str, Any]:
    """Percentiles of the added latency and its two parts, from the requests' timestamps."""
    n = len(ids)
    rows = stack.times(ids, ("submitted_ms", "dispatched_ms", "started_ms"))
    added = [float(s - sub) for sub, _, s in rows]
    dispatch = [float(d - sub) for sub, d, _ in rows]
    handoff = [float(s - d) for _, d, s in rows]
    out: dict[str, Any] = {"requests": n, "rate_per_s": rate, "priority": priority}
    for name, values in (("added", added), ("dispatch", dispatch), ("handoff", handoff)):
        out[f"{name}_ms_p50"] = _bench.percentile(values, 50)
        out[f"{name}_ms_p99"] = _bench.percentile(values, 99)
        out[f"{name}_ms_max"] = max(values)
        out[f"{name}_ms_mean"] = sum(values) / len(values)
    out["goal_p50_met"] = out["added_ms_p50"] <= GOAL_P50_MS
    out["goal_p99_met"] = out["added_ms_p99"] <= GOAL_P99_MS
    return out


def throughput(stack: Stack, n: int) -> dict[str, Any]:
    """Queue ``n`` requests with the dispatcher paused (SIGSTOP), resume it, time the drain."""
    before = stack.store.stats().get("succeeded", 0)
    stack.procs.signal("dispatcher", signal.SIGSTOP)
    ids: list[str] = []
    for start in range(0, n, 500):
        batch = [item(i) for i in range(start, min(n, start + 500))]
        ids += [h.id for h in stack.client.submit_many(batch)]
    groups = {"dispatcher": ["dispatcher"], "workers": stack.worker_ids}
    meter = CpuMeter(stack.procs, groups, stack.store.redis)
    meter.start()
    stack.procs.signal("dispatcher", signal.SIGCONT)
    stack.wait_finished(before + n)
    cpu = meter.stop()
    rows = stack.times(ids, ("dispatched_ms", "finished_ms"))
    span_ms = max(f for _, f in rows) - min(d for d, _ in rows)
    batches = len(stack.batches(ids))
    return {
        "requests": n,
        "span_s": span_ms / 1000,
        "requests_per_s": n / span_ms * 1000,
        "batches": batches,
        "batch_size_mean": n / batches,
        "cpu_ms_per_1000": {k: v * 1e6 / n for k, v in cpu.items()},
    }


def rq_baseline(url: str, ns: str, jobs: int, workers: int, worker_class: str) -> dict[str, Any]:
    """``workers`` RQ worker processes of ``worker_class``, started first, run ``jobs`` no-ops."""
    rq = rq_connection(url)
    queue = Queue(f"{ns}-{worker_class}", connection=rq, serializer=JSONSerializer)
    names = [f"{ns}-{worker_class}{i}" for i in range(workers)]
    procs = Procs()
    rq_cli = [sys.executable, "-c", "from rq.cli import main; main()"]
    for name in names:
        procs.start(
            name,
            [
                *rq_cli,
                "worker",
                "--url",
                url,
                "--name",
                name,
                "-w",
                f"rq.worker.{worker_class}",
                "-S",
                "json",
                "-q",
                queue.name,
            ],
        )
    ids = [f"{queue.name}-j{i}" for i in range(jobs)]
    try:
        wait_until("RQ workers up", lambda: len(Worker.all(queue=queue)) == workers, procs)
        meter = CpuMeter(procs, {"workers": names}, rq)
        meter.start()
        for start in range(0, jobs, 500):
            queue.enqueue_many(
                [
                    Queue.prepare_data(_bench.NOOP_FUNC, job_id=jid, result_ttl=600)
                    for jid in ids[start : start + 500]
                ]
            )
        registry = FinishedJobRegistry(queue=queue)
        wait_until(f"{jobs} RQ jobs finished", lambda: registry.count >= jobs, procs)
        cpu = meter.stop()
    finally:
        procs.close()
    done = [j for j in Job.fetch_many(ids, connection=rq, serializer=JSONSerializer) if j]
    first = min(j.started_at for j in done if j.started_at)
    last = max(j.ended_at for j in done if j.ended_at)
    span_s = (last - first).total_seconds()
    rq.close()
    return {
        "worker_class": f"rq.worker.{worker_class}",
        "jobs": jobs,
        "span_s": span_s,
        "jobs_per_s": jobs / span_s,
        "cpu_ms_per_1000": {k: v * 1e6 / jobs for k, v in cpu.items()},
    }


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=_bench.positive, default=2, help="worker processes (each)")
    p.add_argument("--slots", type=_bench.positive, default=64, help="slots per inferq worker")
    p.add_argument("--requests", type=_bench.positive, default=10_000, help="throughput run")
    p.add_argument("--rq-jobs", type=_bench.positive, default=3_000, help="per RQ baseline run")
    p.add_argument(
        "--rq-workers",
        default="SimpleWorker,Worker",
        help="RQ worker classes of the baselines (Worker forks a child per job)",
    )
    p.add_argument("--latency-requests", type=_bench.positive, default=500)
    p.add_argument("--rate", type=float, default=50.0, help="submissions/s in the latency run")
    p.add_argument("--priority", default="realtime", help="class of the latency run's requests")
    p.add_argument(
        "--latency-only",
        action="store_true",
        help="run only the added-latency phase (no throughput run, no RQ baselines)",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the latency phase on this commit's dispatcher and workers (a "
        "temporary git worktree), submissions interleaved with this tree's",
    )
    p.add_argument(
        "--private-redis",
        action="store_true",
        help="run on a private redis-server instead of --redis-url (no other clients)",
    )
    args = p.parse_args()

    thr: dict[str, Any] | None = None
    rq: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as on_exit:
        url = args.redis_url
        if args.private_redis:
            url = on_exit.enter_context(EmbeddedRedis(prefer="redis-server")).url
        stacks: dict[str, Stack] = {}
        if args.baseline:
            src = on_exit.enter_context(_bench.baseline_tree(args.baseline)) / "src"
            base_ns = on_exit.enter_context(_bench.namespace(url))
            stacks["baseline"] = Stack(url, base_ns, args.workers, args.slots, src=src)
            on_exit.callback(stacks["baseline"].close)
        ns = on_exit.enter_context(_bench.namespace(url))
        stack = stacks["this tree"] = Stack(url, ns, args.workers, args.slots)
        on_exit.callback(stack.close)
        lats = latency_interleaved(stacks, args.latency_requests, args.rate, args.priority)
        if not args.latency_only:
            thr = throughput(stack, args.requests)
            for st in stacks.values():
                st.close()
            rq = {
                cls: rq_baseline(url, ns, args.rq_jobs, args.workers, cls)
                for cls in args.rq_workers.split(",")
            }
    report(args, lats, thr, rq)


def report(
    args: argparse.Namespace,
    lats: dict[str, dict[str, Any]],
    thr: dict[str, Any] | None,
    rq: dict[str, dict[str, Any]],
) -> None:
    verdicts = []
    doc: dict[str, Any] = {"workers": args.workers, "slots_per_worker": args.slots}
    if thr is not None:
        met = report_throughput(args, thr, rq, doc)
        verdicts.append(
            f"throughput goal >= {GOAL_THROUGHPUT_RATIO:g}x RQ: "
            + ", ".join(f"vs {cls} {'met' if ok else 'MISSED'}" for cls, ok in met.items())
        )
    lat = lats["this tree"]
    report_latency(args, lats)
    verdicts.append(
        f"latency p50 <= {GOAL_P50_MS:g} ms: {'met' if lat['goal_p50_met'] else 'MISSED'}; "
        f"p99 <= {GOAL_P99_MS:g} ms: {'met' if lat['goal_p99_met'] else 'MISSED'}"
    )
    _bench.note("; ".join(verdicts))
    doc["latency"] = lat
    doc["latency_goal_ms"] = {"p50": GOAL_P50_MS, "p99": GOAL_P99_MS}
    doc["private_redis"] = args.private_redis
    if "baseline" in lats:
        doc["baseline"] = {"rev": args.baseline, "latency": lats["baseline"]}
    _bench.write_json(args.json, args.redis_url, doc)


def report_throughput(
    args: argparse.Namespace,
    thr: dict[str, Any],
    rq: dict[str, dict[str, Any]],
    doc: dict[str, Any],
) -> dict[str, bool]:
    """The throughput and CPU tables; fills ``doc``; returns the goal's verdict per RQ class."""
    ratios = {cls: _bench.ratio(thr["requests_per_s"], r["jobs_per_s"]) for cls, r in rq.items()}
    met = {cls: r is not None and r >= GOAL_THROUGHPUT_RATIO for cls, r in ratios.items()}
    rows = [
        [
            f"inferq (dispatcher + workers, {args.slots} slots; "
            f"batches of {thr['batch_size_mean']:.1f} on average)",
            f"{thr['requests']:,}",
            _bench.fmt(thr["span_s"], 3),
            _bench.fmt(thr["requests_per_s"]),
            "",
        ]
    ]
    for cls, r in rq.items():
        rows.append(
            [
                f"RQ {cls}{RQ_NOTES.get(cls, '')}, no-op jobs",
                f"{r['jobs']:,}",
                _bench.fmt(r["span_s"], 3),
                _bench.fmt(r["jobs_per_s"]),
                f"{_bench.fmt(ratios[cls])}x ({'met' if met[cls] else 'MISSED'})",
            ]
        )
    _bench.table(
        f"End-to-end throughput, zero-latency backend, {args.workers} worker process(es) each",
        ["system", "items", "span s", "per s", f"inferq / RQ (goal >= {GOAL_THROUGHPUT_RATIO:g}x)"],
        rows,
    )
    cpu_rows = []
    runs = [("inferq, per 1,000 requests", thr)]
    runs += [(f"RQ {cls}, per 1,000 jobs", r) for cls, r in rq.items()]
    for label, figures in runs:
        cpu = figures["cpu_ms_per_1000"]
        cpu_rows.append(
            [
                label,
                _bench.fmt(cpu.get("dispatcher"), 0) if "dispatcher" in cpu else "-",
                _bench.fmt(cpu["workers"], 0),
                _bench.fmt(cpu["redis-server"], 0),
                _bench.fmt(sum(cpu.values()), 0),
            ]
        )
    _bench.table(
        "CPU ms used during the throughput runs",
        ["", "dispatcher", "workers", "redis-server", "total"],
        cpu_rows,
    )
    doc.update(
        {
            "throughput": thr,
            "rq_baselines": rq,
            "throughput_ratio_to_rq": ratios,
            "throughput_goal_ratio": GOAL_THROUGHPUT_RATIO,
            "throughput_goal_met": met,
        }
    )
    return met


def report_latency(args: argparse.Namespace, lats: dict[str, dict[str, Any]]) -> None:
    """The added-latency table (with the baseline's figures and the ratios, if any)."""
    lat = lats["this tree"]
    base = lats.get("baseline")
    rows = []
    for name, label, goal in (
        (
            "added",
            "submit -> started (added latency)",
            f"p50 <= {GOAL_P50_MS:g}, p99 <= {GOAL_P99_MS:g}",
        ),
        ("dispatch", "submit -> claimed by the dispatcher", ""),
        ("handoff", "claimed -> started (RQ hand-off)", ""),
    ):
        row = [label]
        for q in ("p50", "mean", "p99", "max"):
            row.append(_bench.fmt(lat[f"{name}_ms_{q}"], 1))
            if base is not None:
                theirs = base[f"{name}_ms_{q}"]
                ratio = _bench.ratio(lat[f"{name}_ms_{q}"], theirs)
                row.append(f"{_bench.fmt(theirs, 1)} ({_bench.fmt(ratio)})")
        rows.append([*row, goal])
    header = ["interval"]
    for q in ("p50", "mean", "p99", "max"):
        header.append(f"{q} ms")
        if base is not None:
            header.append(f"{q} baseline (ratio)")
    where = "private redis-server" if args.private_redis else "--redis-url"
    against = f"; baseline {args.baseline}, interleaved" if base is not None else ""
    _bench.table(
        f"Added latency at {args.rate:g} {args.priority} submissions/s, idle capacity "
        f"({lat['requests']} requests on {where}{against}; Redis ms timestamps, +-1 ms "
        "each, exact on average)",
        [*header, "goal"],
        rows,
    )


if __name__ == "__main__":
    main()
