"""The dispatcher-to-worker hand-off alone: through RQ as inferq uses it, through a plain list.

Issue 17's measure of what a transport without RQ would save (the "what would fix it"
of ``bench_e2e.py``'s latency goal). Two processes on a private ``redis-server``: this
one stands for the dispatcher, a child for the worker. Per hand-off, ``--gap-ms``
apart (the worker is idle and blocked, as at idle capacity):

- **rq**: a claim script (a stand-in for ``assign.lua``: one HSET), then
  :meth:`inferq.delivery.BatchSender.send` (the RQ job, one pipelined round trip); the
  worker's RQ ``Queue.dequeue_any`` (BLMOVE, the job's HGETALL) and
  :meth:`~inferq.delivery.BatchJob.run_early`, whose batch function runs a start
  script (a stand-in for ``start.lua``: HMGET + HSET) - the path of
  :class:`inferq.delivery.InferqWorker` up to the start;
- **list**: the claim script also LPUSHes ``batch|id|attempt`` on the worker's list
  (no second round trip); the worker BLPOPs it and runs the start script;
- **floor**: an LPUSH here, the worker's BLPOP returns: one process wake-up through
  Redis, nothing else.

Latency = the worker's ``perf_counter`` once its start script returned minus this
process's before its claim script (``CLOCK_MONOTONIC``: one clock for both
processes). Modes alternate in ``--rounds`` rounds, so a loaded machine moves all::

    python scripts/bench_handoff.py --json handoff.json
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import _bench
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from inferq import delivery
from inferq.delivery import BatchJob, BatchSender, rq_connection, worker_queue
from inferq.embedded import EmbeddedRedis
from inferq.store.keys import Keys

MODES = ("rq", "list", "floor")
NAMESPACE = "handoff"
WORKER = "w1"
LIST_KEY = "handoff:wq:w1"
# Stand-ins for assign.lua and start.lua: the same shape of work per request (a hash
# written on claim, read and written on start); the real scripts cost the same in
# every mode, so they cancel out of the comparison.
CLAIM = "redis.call('HSET', KEYS[1], 'state', 'assigned', 'worker', ARGV[1]) return 1"
CLAIM_AND_PUSH = (
    "redis.call('HSET', KEYS[1], 'state', 'assigned', 'worker', ARGV[1]) "
    "redis.call('LPUSH', KEYS[2], ARGV[2]) return 1"
)
START = (
    "local r = redis.call('HMGET', KEYS[1], 'state', 'worker') "
    "redis.call('HSET', KEYS[1], 'state', 'running') return r[1]"
)


class _Handler:
    """The worker's :class:`~inferq.delivery.BatchHandler`: runs the start script."""

    worker_id = WORKER
    namespace = NAMESPACE
    lease_s = 30.0
    draining = False

    def __init__(self, start: Any) -> None:
        self.start = start

    def accept(self, batch_id: str, items: list[tuple[str, int]]) -> dict[str, int]:
        for rid, _ in items:
            self.start(keys=[f"handoff:req:{rid}"])
        return {"run": len(items), "stale": 0, "expired": 0}

    def begin_drain(self) -> None: ...

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return True

    def unreceived(self) -> set[str]:
        return set()

    def cold_shutdown(self) -> None: ...


def worker(url: str, mode: str, n: int, pipe: Connection) -> None:
    """The worker process: take ``n`` hand-offs; send back when each one started."""
    client = redis.Redis.from_url(url)
    start = client.register_script(START)
    delivery.bind(_Handler(start))
    rq = rq_connection(url)
    queue = worker_queue(rq, Keys(NAMESPACE), WORKER)
    done: list[float] = []
    pipe.send("ready")
    for _ in range(n):
        if mode == "rq":
            got = Queue.dequeue_any(
                [queue], 10, connection=rq, job_class=BatchJob, serializer=JSONSerializer
            )
            assert got is not None
            job = got[0]
            assert isinstance(job, BatchJob)
            job.run_early()
        elif mode == "list":
            popped = client.blpop([LIST_KEY], timeout=10)
            assert popped is not None
            _, rid, _ = popped[1].decode().split("|")
            start(keys=[f"handoff:req:{rid}"])
        else:
            client.blpop([LIST_KEY], timeout=10)
        done.append(time.perf_counter())
    pipe.send(done)


def run(url: str, mode: str, n: int, gap_s: float) -> list[float]:
    """``n`` hand-offs of ``mode`` to a fresh worker process; ms each."""
    client = redis.Redis.from_url(url)
    claim, claim_and_push = client.register_script(CLAIM), client.register_script(CLAIM_AND_PUSH)
    sender = BatchSender(url, Keys(NAMESPACE))
    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=worker, args=(url, mode, n, theirs))
    proc.start()
    try:
        if not ours.poll(60) or ours.recv() != "ready":
            raise RuntimeError("the worker process did not start")
        time.sleep(0.2)  # blocked in its dequeue
        sent = []
        for i in range(n):
            time.sleep(gap_s)
            batch, rid = f"{mode}{i:022x}", f"{mode}{i}"
            t0 = time.perf_counter()
            if mode == "rq":
                claim(keys=[f"handoff:req:{rid}"], args=[WORKER])
                sender.send(WORKER, batch, [(rid, 1)], timeout_s=3600)
            elif mode == "list":
                claim_and_push(
                    keys=[f"handoff:req:{rid}", LIST_KEY], args=[WORKER, f"{batch}|{rid}|1"]
                )
            else:
                client.lpush(LIST_KEY, rid)
            sent.append(t0)
        if not ours.poll(60):
            raise RuntimeError("the worker process did not take every hand-off")
        started: list[float] = ours.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        client.close()
    return [(s - t) * 1000 for t, s in zip(sent, started, strict=True)]


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--handoffs", type=_bench.positive, default=150, help="per mode and round")
    p.add_argument("--rounds", type=_bench.positive, default=4)
    p.add_argument("--gap-ms", type=float, default=20.0, help="between two hand-offs")
    args = p.parse_args()
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    with EmbeddedRedis(prefer="redis-server") as server:
        for _ in range(args.rounds):
            for mode in MODES:
                samples[mode] += run(server.url, mode, args.handoffs, args.gap_ms / 1000)
    report(args, samples)


def report(args: Any, samples: dict[str, list[float]]) -> None:
    labels = {
        "rq": "RQ: BatchSender.send -> dequeue_any + run_early",
        "list": "plain list: the claim script LPUSHes, the worker BLPOPs",
        "floor": "floor: LPUSH -> BLPOP returns (one wake-up)",
    }
    figures: dict[str, Any] = {}
    for mode, values in samples.items():
        figures[mode] = {
            "handoffs": len(values),
            "ms_p50": statistics.median(values),
            "ms_mean": statistics.mean(values),
            "ms_p90": _bench.percentile(values, 90),
            "ms_p99": _bench.percentile(values, 99),
        }
    rq_p50 = figures["rq"]["ms_p50"]
    _bench.table(
        f"Hand-off, claim script sent -> start script returned in the worker process "
        f"({args.rounds} alternating rounds of {args.handoffs}, {args.gap_ms:g} ms apart; "
        "private redis-server)",
        ["transport", "p50 ms", "mean ms", "p90 ms", "p99 ms", "p50 / RQ's"],
        [
            [
                labels[mode],
                _bench.fmt(f["ms_p50"], 3),
                _bench.fmt(f["ms_mean"], 3),
                _bench.fmt(f["ms_p90"], 3),
                _bench.fmt(f["ms_p99"], 3),
                _bench.fmt(_bench.ratio(f["ms_p50"], rq_p50)),
            ]
            for mode, f in figures.items()
        ],
    )
    _bench.write_json(
        args.json,
        args.redis_url,
        {"rounds": args.rounds, "gap_ms": args.gap_ms, "transports": figures},
    )


if __name__ == "__main__":
    main()
