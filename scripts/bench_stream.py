"""Added latency per streamed chunk through Redis: worker publish -> ``handle.stream()``.

Issue 14's streaming benchmark. A streamed request is submitted and made running (as a
worker would), then a producer thread publishes ``--chunks`` chunks one at a time,
``--interval-ms`` apart (a token cadence), through ``Store.publish_chunks`` (the worker's
write: XADD MAXLEN ~ + EXPIRE in one pipeline), while the main thread reads them with
``Client.stream()`` (XREAD BLOCK). Latency per chunk = arrival in the reader - the moment
the producer started the write (same process, ``perf_counter``). The baseline, in the
same run, is the same two threads handing the chunks over through a ``queue.Queue``:
what any streaming path costs without Redis. Also printed: a PING round trip::

    python scripts/bench_stream.py --chunks 500 --rounds 3 --json stream.json
"""

from __future__ import annotations

import queue
import threading
import time

import _bench

from inferq.client import Client
from inferq.config import Settings
from inferq.models import StreamChunk
from inferq.store import Chunk, Completion, Store, connect


def through_redis(url: str, n: int, interval_s: float) -> list[float]:
    """Per-chunk latency, seconds, publish -> the reader's ``stream()``, in a fresh namespace."""
    with _bench.namespace(url) as ns:
        settings = Settings.load(redis_url=url, namespace=ns)
        store = Store(connect(url), settings)
        client = Client(settings=settings, connection=connect(url))
        handle = client.submit("bench", stream=True, timeout=600)
        rid = handle.id
        store.redis.hset(  # running under attempt 1 on worker "w" (what assign + start write)
            store.keys.req(rid),
            mapping={"attempts": "1", "state": "running", "worker": "w", "need_mib": "0"},
        )
        store.redis.hset(store.keys.req(rid), "dispatched_ms", str(int(time.time() * 1000)))
        sent: list[float] = [0.0] * n

        def produce() -> None:
            time.sleep(0.05)  # the reader is blocked in XREAD first
            for i in range(n):
                sent[i] = time.perf_counter()
                store.publish_chunks([Chunk(rid, 1, i, "tok ", i + 1)])
                time.sleep(interval_s)
            store.complete("w", [Completion(rid, 1, "succeeded", output="tok " * n)])

        producer = threading.Thread(target=produce)
        producer.start()
        arrived: list[float] = []
        for item in handle.stream(timeout=60):
            if isinstance(item, StreamChunk) and not item.reset:
                arrived.append(time.perf_counter())
        producer.join()
        client.close()
        store.close()
    if len(arrived) != n:
        raise SystemExit(f"read {len(arrived)} chunks of {n}")
    return [a - s for a, s in zip(arrived, sent, strict=True)]


def through_queue(n: int, interval_s: float) -> list[float]:
    """The same handoff between two threads through ``queue.Queue`` (no Redis)."""
    q: queue.Queue[float | None] = queue.Queue()

    def produce() -> None:
        time.sleep(0.05)
        for _ in range(n):
            q.put(time.perf_counter())
            time.sleep(interval_s)
        q.put(None)

    producer = threading.Thread(target=produce)
    producer.start()
    out: list[float] = []
    while (sent := q.get()) is not None:
        out.append(time.perf_counter() - sent)
    producer.join()
    return out


def ping_s(url: str, n: int) -> list[float]:
    client = connect(url)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.ping()
        out.append(time.perf_counter() - t0)
    client.close()
    return out


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=_bench.positive, default=500, help="chunks per round")
    p.add_argument("--interval-ms", type=float, default=5.0, help="pause between two chunks")
    p.add_argument("--rounds", type=_bench.positive, default=3, help="chunks of all rounds pooled")
    args = p.parse_args()
    interval = args.interval_ms / 1000
    redis_ms: list[float] = []
    queue_ms: list[float] = []
    for _ in range(args.rounds):
        redis_ms += [s * 1000 for s in through_redis(args.redis_url, args.chunks, interval)]
        queue_ms += [s * 1000 for s in through_queue(args.chunks, interval)]
    ping_ms = [s * 1000 for s in ping_s(args.redis_url, args.chunks)]
    figures: dict[str, dict[str, float]] = {}
    rows = []
    for name, values in (
        ("through Redis (publish_chunks -> stream())", redis_ms),
        ("baseline: queue.Queue between threads", queue_ms),
        ("Redis PING round trip", ping_ms),
    ):
        p50, p99 = _bench.percentile(values, 50), _bench.percentile(values, 99)
        figures[name] = {"p50_ms": p50, "p99_ms": p99, "n": len(values)}
        rows.append([name, _bench.fmt(p50, 3), _bench.fmt(p99, 3), str(len(values))])
    _bench.table(
        f"Latency per chunk, ms ({args.chunks} chunks x {args.rounds} rounds, "
        f"{args.interval_ms:g} ms apart)",
        ["path", "p50 ms", "p99 ms", "chunks"],
        rows,
    )
    added50 = _bench.percentile(redis_ms, 50) - _bench.percentile(queue_ms, 50)
    added99 = _bench.percentile(redis_ms, 99) - _bench.percentile(queue_ms, 99)
    _bench.note(
        f"added by Redis over the in-process handoff: p50 {added50:.3f} ms, p99 {added99:.3f} ms"
    )
    figures["added_ms"] = {"p50": added50, "p99": added99}
    _bench.write_json(args.json, args.redis_url, figures)


if __name__ == "__main__":
    main()
