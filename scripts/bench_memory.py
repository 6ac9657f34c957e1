"""Redis memory per queued request beyond the prompt, beside an RQ job of the same prompt.

Issue 7's benchmark. In a fresh namespace it queues ``--queued`` requests (3
classes, 20 tenants, one route, a prompt of ``--prompt-bytes`` random letters
and digits, so RQ's zlib compression of job data gains little) and measures:

- the server's ``used_memory`` (INFO memory) before and after, per request;
- ``MEMORY USAGE <key> SAMPLES 0`` summed over every key of the namespace, per
  request, split into the request hashes, the queues, the deadlines index, the
  events stream (capped at ``events_maxlen``: it holds the last events whatever
  the backlog) and the rest. MEMORY USAGE leaves out the keyspace's own entry
  per key (tens of bytes), which the INFO delta includes; the INFO delta also
  sees anything else writing to the same server meanwhile.

The prompt's length is subtracted. The baseline is the same number of RQ jobs
(JSON serializer) carrying the same prompt and max_tokens as kwargs, queued after
the inferq keys are deleted, measured the same two ways. Goal: <= 1 KiB::

    python scripts/bench_memory.py --json memory.json
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Iterable
from typing import Any

import _bench
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import rq_connection
from inferq.store import connect
from inferq.store.keys import Keys

GOAL_BYTES = 1024
CLASSES = ("realtime", "standard", "batch")
TENANTS = 20
MAX_TOKENS = 64


def make_prompt(size: int) -> str:
    """``size`` bytes of seeded random letters and digits."""
    rng = random.Random(size)
    return "".join(rng.choices(string.ascii_letters + string.digits, k=size))


def used_memory(client: redis.Redis) -> int:
    """The server's used_memory after a short settle (lazy frees finish first)."""
    time.sleep(0.5)
    return int(client.info("memory")["used_memory"])


def key_usage(client: redis.Redis, keys: Iterable[str]) -> dict[str, int]:
    """Exact ``MEMORY USAGE`` of each key, bytes (pipelined in chunks of 1000)."""
    keys = list(keys)
    out: dict[str, int] = {}
    for i in range(0, len(keys), 1000):
        chunk = keys[i : i + 1000]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            pipe.memory_usage(key, samples=0)
        out.update(zip(chunk, (int(v or 0) for v in pipe.execute()), strict=True))
    return out


def scan(client: redis.Redis, pattern: str) -> list[str]:
    return [str(k) for k in client.scan_iter(match=pattern, count=5000)]


KINDS = ("request hashes", "payloads", "queues", "deadlines index", "events stream", "other")


def kind_of(keys: Keys, key: str) -> str:
    """Which of KINDS an inferq key is."""
    if key.startswith(keys.req("")):
        return "request hashes"
    if key.startswith(keys.payload("")):
        return "payloads"
    if key.startswith((keys.prefix + "tq:", keys.prefix + "tix:")):
        return "queues"  # the tenants' sub-queues and the tenant indexes (issue 17)
    if key == keys.deadlines:
        return "deadlines index"
    return "events stream" if key == keys.events else "other"


def inferq_usage(url: str, ns: str, n: int, prompt: str) -> dict[str, Any]:
    """Queue ``n`` requests; bytes per request by INFO delta and by key, by kind of key."""
    settings = Settings.load(redis_url=url, namespace=ns)
    client = Client(settings=settings)
    r = connect(url)
    try:
        before = used_memory(r)
        for start in range(0, n, 500):
            client.submit_many(
                {
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "priority": CLASSES[i % len(CLASSES)],
                    "tenant": f"tenant{i % TENANTS}",
                }
                for i in range(start, min(n, start + 500))
            )
        after = used_memory(r)
        keys = client.store.keys
        usage = key_usage(r, scan(r, keys.pattern()))
        by_kind = dict.fromkeys(KINDS, 0)
        for key, size in usage.items():
            by_kind[kind_of(keys, key)] += size
        return {
            "info_delta_bytes": after - before,
            "key_bytes": sum(usage.values()),
            "by_kind_bytes": by_kind,
            "keys": len(usage),
        }
    finally:
        client.close()
        _bench.purge(r, ns)
        r.close()


def rq_usage(url: str, ns: str, n: int, prompt: str) -> dict[str, Any]:
    """Queue ``n`` RQ jobs of the same prompt; bytes per job by INFO delta and by key."""
    rq = rq_connection(url)
    queue = Queue(f"{ns}-rq", connection=rq, serializer=JSONSerializer)
    r = connect(url)
    try:
        before = used_memory(r)
        for start in range(0, n, 500):
            queue.enqueue_many(
                [
                    Queue.prepare_data(
                        "_bench.noop",
                        kwargs={"prompt": prompt, "max_tokens": MAX_TOKENS},
                        job_id=f"{ns}-j{i}",
                    )
                    for i in range(start, min(n, start + 500))
                ]
            )
        after = used_memory(r)
        usage = key_usage(r, scan(r, f"rq:*{ns}*"))
        jobs = sum(v for k, v in usage.items() if k.startswith("rq:job:"))
        return {
            "info_delta_bytes": after - before,
            "key_bytes": sum(usage.values()),
            "by_kind_bytes": {
                "job hashes": jobs,
                "queue list and other": sum(usage.values()) - jobs,
            },
            "keys": len(usage),
        }
    finally:
        rq.close()
        r.close()


def per_item(figures: dict[str, Any], n: int, prompt_bytes: int) -> dict[str, Any]:
    """Bytes per queued item, total and beyond the prompt, both ways of measuring."""
    info = figures["info_delta_bytes"] / n
    keys = figures["key_bytes"] / n
    return {
        "info_bytes_per_item": info,
        "info_bytes_beyond_prompt": info - prompt_bytes,
        "key_bytes_per_item": keys,
        "key_bytes_beyond_prompt": keys - prompt_bytes,
        "by_kind_bytes_per_item": {k: v / n for k, v in figures["by_kind_bytes"].items()},
        **figures,
    }


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--queued", type=_bench.positive, default=100_000, help="requests and jobs")
    p.add_argument("--prompt-bytes", type=_bench.positive, default=500, help="prompt length")
    args = p.parse_args()
    prompt = make_prompt(args.prompt_bytes)
    n, size = args.queued, args.prompt_bytes

    with _bench.namespace(args.redis_url) as ns:
        ours = per_item(inferq_usage(args.redis_url, ns, n, prompt), n, size)
        rq = per_item(rq_usage(args.redis_url, ns, n, prompt), n, size)
    goal_met = ours["info_bytes_beyond_prompt"] <= GOAL_BYTES
    rows = []
    for label, key in (
        ("INFO used_memory delta", "info"),
        ("sum of MEMORY USAGE", "key"),
    ):
        mine, theirs = ours[f"{key}_bytes_beyond_prompt"], rq[f"{key}_bytes_beyond_prompt"]
        rows.append(
            [
                label,
                _bench.fmt(ours[f"{key}_bytes_per_item"], 0),
                _bench.fmt(mine, 0),
                _bench.fmt(theirs, 0),
                _bench.fmt(_bench.ratio(mine, theirs)),
            ]
        )
    _bench.table(
        f"Redis memory per queued item, {n:,} queued, {size}-byte prompt (bytes)",
        ["measure", "inferq total", "inferq beyond prompt", "RQ beyond prompt", "inferq / RQ"],
        rows,
    )
    _bench.table(
        "Where inferq's bytes go (MEMORY USAGE per queued request)",
        ["keys", "bytes per request"],
        [[k, _bench.fmt(v, 0)] for k, v in ours["by_kind_bytes_per_item"].items()],
    )
    _bench.note(
        f"goal <= {GOAL_BYTES} bytes beyond the prompt (INFO delta): "
        f"{'met' if goal_met else 'MISSED'} ({ours['info_bytes_beyond_prompt']:.0f} bytes)"
    )
    _bench.write_json(
        args.json,
        args.redis_url,
        {
            "queued": n,
            "prompt_bytes": size,
            "inferq": ours,
            "rq_baseline": rq,
            "ratio_beyond_prompt_info": _bench.ratio(
                ours["info_bytes_beyond_prompt"], rq["info_bytes_beyond_prompt"]
            ),
            "goal_bytes_beyond_prompt": GOAL_BYTES,
            "goal_met": goal_met,
        },
    )


if __name__ == "__main__":
    main()
