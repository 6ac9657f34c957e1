"""Submissions per second: ``Client.submit`` and pipelined ``Client.submit_many``, beside RQ.

Issue 2's benchmark. Each round, in a fresh namespace, times:

- inferq single: ``Client.submit`` one request at a time (validation + one Lua call);
- inferq pipelined: ``Client.submit_many`` in chunks (one pipelined round trip each);
- RQ single: ``Queue.enqueue`` of a no-op job (JSON serializer), one at a time;
- RQ pipelined: ``Queue.enqueue_many`` of no-op jobs in the same chunks.

Every request carries the same prompt and max_tokens as the RQ job's kwargs. The
table shows the median rate over the rounds and the ratio to RQ's figure of the
same shape (single vs ``enqueue``, pipelined vs ``enqueue_many``)::

    python scripts/bench_submit.py --requests 10000 --rounds 3 --json submit.json
"""

from __future__ import annotations

import time
from typing import Any

import _bench
from rq import Queue
from rq.serializers import JSONSerializer

from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import rq_connection

PROMPT = "Summarise the following support ticket in two sentences: the customer reports"
MAX_TOKENS = 64
CLASSES = ("realtime", "standard", "batch")
TENANTS = 20


def items(n: int) -> list[dict[str, Any]]:
    """``n`` submissions spread over the three classes and twenty tenants."""
    return [
        {
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "priority": CLASSES[i % len(CLASSES)],
            "tenant": f"tenant{i % TENANTS}",
        }
        for i in range(n)
    ]


def inferq_single(client: Client, n: int) -> float:
    """Seconds to submit ``n`` requests one by one."""
    batch = items(n)
    t0 = time.perf_counter()
    for item in batch:
        client.submit(**item)
    return time.perf_counter() - t0


def inferq_pipelined(client: Client, n: int, chunk: int) -> float:
    """Seconds to submit ``n`` requests with ``submit_many`` in chunks of ``chunk``."""
    batch = items(n)
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        client.submit_many(batch[i : i + chunk])
    return time.perf_counter() - t0


def rq_single(queue: Queue, n: int) -> float:
    """Seconds to enqueue ``n`` no-op jobs one by one."""
    ns = queue.name
    t0 = time.perf_counter()
    for i in range(n):
        queue.enqueue_call(
            "_bench.noop",
            kwargs={"prompt": PROMPT, "max_tokens": MAX_TOKENS},
            job_id=f"{ns}-s{i}",
        )
    return time.perf_counter() - t0


def rq_pipelined(queue: Queue, n: int, chunk: int) -> float:
    """Seconds to enqueue ``n`` no-op jobs with ``enqueue_many`` in chunks of ``chunk``."""
    ns = queue.name
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        queue.enqueue_many(
            [
                Queue.prepare_data(
                    "_bench.noop",
                    kwargs={"prompt": PROMPT, "max_tokens": MAX_TOKENS},
                    job_id=f"{ns}-m{i}",
                )
                for i in range(start, min(n, start + chunk))
            ]
        )
    return time.perf_counter() - t0


def one_round(url: str, n: int, chunk: int) -> dict[str, float]:
    """Submissions per second of each method, in a fresh namespace."""
    with _bench.namespace(url) as ns:
        client = Client(settings=Settings.load(redis_url=url, namespace=ns))
        queue = Queue(ns, connection=rq_connection(url), serializer=JSONSerializer)
        try:
            seconds = {
                "inferq_single": inferq_single(client, n),
                "rq_enqueue": rq_single(queue, n),
                "inferq_submit_many": inferq_pipelined(client, n, chunk),
                "rq_enqueue_many": rq_pipelined(queue, n, chunk),
            }
        finally:
            client.close()
            queue.connection.close()
    return {name: n / s for name, s in seconds.items()}


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=_bench.positive, default=10_000, help="per method per round")
    p.add_argument("--chunk", type=_bench.positive, default=500, help="items per pipelined call")
    p.add_argument("--rounds", type=_bench.positive, default=3, help="the median is reported")
    args = p.parse_args()

    rounds = [one_round(args.redis_url, args.requests, args.chunk) for _ in range(args.rounds)]
    rate = {name: _bench.median([r[name] for r in rounds]) for name in rounds[0]}
    single_ratio = _bench.ratio(rate["inferq_single"], rate["rq_enqueue"])
    many_ratio = _bench.ratio(rate["inferq_submit_many"], rate["rq_enqueue_many"])
    _bench.table(
        f"Submissions per second ({args.requests:,} per method, median of {args.rounds} rounds)",
        ["mode", "inferq /s", "RQ /s", "inferq / RQ"],
        [
            [
                "single (submit vs enqueue)",
                _bench.fmt(rate["inferq_single"]),
                _bench.fmt(rate["rq_enqueue"]),
                _bench.fmt(single_ratio),
            ],
            [
                f"pipelined (submit_many vs enqueue_many, chunks of {args.chunk})",
                _bench.fmt(rate["inferq_submit_many"]),
                _bench.fmt(rate["rq_enqueue_many"]),
                _bench.fmt(many_ratio),
            ],
        ],
    )
    _bench.write_json(
        args.json,
        args.redis_url,
        {
            "requests_per_method": args.requests,
            "chunk": args.chunk,
            "rounds": args.rounds,
            "submissions_per_s": rate,
            "submissions_per_s_by_round": rounds,
            "ratio_single_to_rq_enqueue": single_ratio,
            "ratio_submit_many_to_rq_enqueue_many": many_ratio,
        },
    )


if __name__ == "__main__":
    main()
