"""Per-batch overhead of the worker path (RQ dequeue + store writes), beside a plain RQ job.

Issue 4's benchmark, run in this process: an inferq worker (``Engine`` + ``InferqWorker``,
the sim backend with ``time_scale=0``, so a request takes no time) and RQ's own
``SimpleWorker`` (no fork), both in burst mode on queues filled beforehand.

For each batch size (default 1, 8 and 32) and round, the bench submits
``--batches`` x size requests, claims them batch by batch with ``Store.assign`` and
enqueues one RQ batch job each, exactly as the dispatcher does (untimed). It then
times the burst: RQ dequeues each job, the batch function marks its requests
running and reads them in one round trip (the start script and the records, pipelined),
the engine runs them and writes the
results (the completion script, coalesced) — until every result is written. The
baseline is the same number of no-op RQ jobs (JSON serializer) through a
``SimpleWorker``. A burst is timed from ``work()`` until the last result is written
(inferq) or the last job has run (RQ: its last job records the time), so RQ's
worker teardown (up to a second joining its pub/sub thread) is left out; its
start-up (a few ms) is in both and spread over ``--batches``::

    python scripts/bench_worker.py --json worker.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import _bench
import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from inferq import delivery
from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import BatchJob, InferqWorker, enqueue_batch, rq_connection, worker_queue
from inferq.delivery.consumer import RQ_WORKER_TTL_S
from inferq.ids import new_id
from inferq.store import Store, connect
from inferq.workers.runtime import Engine
from inferq.workers.worker import WorkerOptions, build_engine

MODEL = "llama-3.1-8b"
WORKER_ID = "bench-worker"
#: Requests' timeout, seconds: nothing expires during a run.
TIMEOUT_S = 3600.0
#: Store calls timed inside the worker path.
STORE_CALLS = ("start_and_read", "complete", "update_estimates")


class Rig:
    """One in-process inferq worker and the RQ connection around it."""

    def __init__(self, url: str, ns: str, slots: int) -> None:
        self.settings = Settings.load(redis_url=url, namespace=ns)
        self.store = Store(connect(url), self.settings)
        self.client = Client(settings=self.settings)
        self.rq = rq_connection(url)
        self.sw = _bench.Stopwatch()
        for name in STORE_CALLS:
            setattr(self.store, name, self.sw.wrap(name, getattr(self.store, name)))
        self.last_write = 0.0
        complete = self.store.complete

        def stamped(*args: Any, **kwargs: Any) -> Any:
            try:
                return complete(*args, **kwargs)
            finally:
                self.last_write = time.perf_counter()

        self.store.complete = stamped  # type: ignore[method-assign]
        opts = WorkerOptions(
            model=MODEL,
            server_options={"time_scale": "0"},
            slots=slots,
            vram_mib=81_920,
            worker_id=WORKER_ID,
        )
        self.engine: Engine = build_engine(self.settings, opts, self.store)
        self.queue = worker_queue(self.rq, self.store.keys, WORKER_ID)
        self.runs = 0

    def prepare(self, batches: int, size: int) -> None:
        """Submit, claim and enqueue ``batches`` batch jobs of ``size`` requests (untimed)."""
        items = [
            {"prompt": "Say hello", "max_tokens": 16, "priority": "realtime", "timeout": TIMEOUT_S}
            for _ in range(batches * size)
        ]
        ids = [
            h.id
            for i in range(0, len(items), 500)
            for h in self.client.submit_many(items[i : i + 500])
        ]
        qkey = self.store.keys.tenant_queue("realtime", MODEL, "default")
        pipe = self.rq.pipeline()
        for b in range(batches):
            batch_id = new_id()
            chunk = ids[b * size : (b + 1) * size]
            claimed = self.store.assign(WORKER_ID, batch_id, [(rid, qkey, 1.0) for rid in chunk])
            enqueue_batch(
                self.queue,
                self.store.keys,
                batch_id=batch_id,
                worker_id=WORKER_ID,
                items=claimed,
                timeout_s=3600,
                pipeline=pipe,
            )
        pipe.execute()

    def burst(self, requests: int) -> float:
        """Seconds from a fresh InferqWorker's start to the last of ``requests`` results written."""
        self.runs += 1
        worker = InferqWorker(
            [self.queue],
            name=f"{self.settings.namespace}-{WORKER_ID}-{self.runs}",
            connection=self.rq,
            serializer=JSONSerializer,
            job_class=BatchJob,
            worker_ttl=RQ_WORKER_TTL_S,
            default_result_ttl=60,
        )
        worker.handler = self.engine
        target = self.engine.finished + requests
        t0 = time.perf_counter()
        worker.work(burst=True, logging_level="WARNING")
        while self.engine.finished < target:
            time.sleep(0.001)
        return self.last_write - t0


def rq_burst(rq: redis.Redis, ns: str, jobs: int, run: int) -> float:
    """Seconds from a fresh SimpleWorker's start to the end of the last of ``jobs`` no-op jobs.

    The jobs are enqueued first (untimed); the last one is ``_bench.stamp``.
    """
    queue = Queue(f"{ns}-noop", connection=rq, serializer=JSONSerializer)
    for start in range(0, jobs, 500):
        queue.enqueue_many(
            [
                Queue.prepare_data(
                    "_bench.stamp" if i == jobs - 1 else _bench.NOOP_FUNC,
                    job_id=f"{ns}-r{run}-{i}",
                    result_ttl=60,
                    failure_ttl=3600,
                )
                for i in range(start, min(jobs, start + 500))
            ]
        )
    worker = SimpleWorker(
        [queue], name=f"{ns}-noop-{run}", connection=rq, serializer=JSONSerializer
    )
    t0 = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    return _bench.STAMP[0] - t0


def one_round(rig: Rig, ns: str, sizes: list[int], batches: int, run: int) -> dict[str, Any]:
    """Per-batch ms for each size, per-job ms of RQ, and the store-call ms per batch."""
    out: dict[str, Any] = {"inferq_ms_per_batch": {}, "store_ms_per_batch": {}}
    for size in sizes:
        rig.prepare(batches, size)
        rig.sw.reset()
        seconds = rig.burst(batches * size)
        out["inferq_ms_per_batch"][size] = seconds / batches * 1000
        out["store_ms_per_batch"][size] = {
            name: rig.sw.total(name) / batches * 1000 for name in STORE_CALLS
        }
    out["rq_ms_per_job"] = rq_burst(rig.rq, ns, batches, run) / batches * 1000
    return out


def summarise(rounds: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    rq_ms = _bench.median([r["rq_ms_per_job"] for r in rounds])
    per_size: dict[str, Any] = {}
    for size in sizes:
        ms = _bench.median([r["inferq_ms_per_batch"][size] for r in rounds])
        store = {
            name: _bench.median([r["store_ms_per_batch"][size][name] for r in rounds])
            for name in STORE_CALLS
        }
        per_size[str(size)] = {
            "ms_per_batch": ms,
            "ms_per_request": ms / size,
            "ratio_to_rq_job": _bench.ratio(ms, rq_ms),
            "requests_per_s": size / ms * 1000 if ms > 0 else None,
            "store_ms_per_batch": store,
        }
    return {"rq_noop_ms_per_job": rq_ms, "by_batch_size": per_size}


def report(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    rq_ms = summary["rq_noop_ms_per_job"]
    rows = []
    for size, s in summary["by_batch_size"].items():
        st = s["store_ms_per_batch"]
        rows.append(
            [
                size,
                _bench.fmt(s["ms_per_batch"], 3),
                _bench.fmt(s["ms_per_request"], 3),
                _bench.fmt(s["requests_per_s"]),
                _bench.fmt(st["start_and_read"], 3),
                _bench.fmt(st["complete"] + st["update_estimates"], 3),
                _bench.fmt(rq_ms, 3),
                _bench.fmt(s["ratio_to_rq_job"]),
            ]
        )
    _bench.table(
        f"Worker path per batch ({args.batches} batches per size, median of {args.rounds} rounds)",
        [
            "batch size",
            "ms/batch",
            "ms/request",
            "requests/s",
            "start+read ms",
            "complete ms",
            "RQ no-op ms/job",
            "batch / RQ job",
        ],
        rows,
    )
    _bench.note(
        "start+read = the start script and the records read, pipelined in one round trip "
        "(Store.start_and_read), in the RQ job (main thread); "
        "complete = the completion script and the output estimates, written from the "
        "engine's thread while RQ fetches the next job."
    )


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,8,32", help="batch sizes, comma-separated")
    p.add_argument("--batches", type=_bench.positive, default=200, help="batches per size")
    p.add_argument("--rounds", type=_bench.positive, default=3, help="the median is reported")
    p.add_argument(
        "--profile", type=int, metavar="N", default=0, help="print the top N by cProfile"
    )
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    profile = cProfile.Profile() if args.profile else None
    with _bench.namespace(args.redis_url) as ns:
        rig = Rig(args.redis_url, ns, slots=max(sizes))
        delivery.bind(rig.engine)
        rig.engine.start()
        try:
            if profile:
                profile.enable()
            rounds = [one_round(rig, ns, sizes, args.batches, r) for r in range(args.rounds)]
            if profile:
                profile.disable()
        finally:
            rig.engine.stop()
            delivery.bind(None)
            rig.client.close()
    summary = summarise(rounds, sizes)
    report(args, summary)
    if profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
        _bench.note("cProfile of the rounds (timings above include its overhead):")
        _bench.note(out.getvalue())
    _bench.write_json(
        args.json,
        args.redis_url,
        {
            "batches_per_size": args.batches,
            "rounds": args.rounds,
            "backend": "sim, time_scale=0",
            **summary,
            "rounds_raw": rounds,
        },
    )


if __name__ == "__main__":
    main()
