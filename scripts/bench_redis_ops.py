"""Redis work per request on the core path (submit -> result), counted with MONITOR.

Issue 17's benchmark. It starts a private ``redis-server`` (so MONITOR and the
server's CPU figures see this run only), a dispatcher and ``--workers`` workers
(``inferq worker``, sim backend at ``time_scale=0``) as ``bench_e2e.py`` does, and
runs three phases:

1. **idle**: nothing queued for ``--idle-s`` seconds. Its background rate
   (heartbeats, the dispatcher's wake-ups, RQ's polls), per process and per
   second, is subtracted from the phases below in proportion to their length.
2. **one by one**: ``--requests`` requests of class ``--priority``, each submitted
   and its result awaited before the next: a batch of one each, the worst case.
3. **burst**: ``--requests`` requests in one ``submit_many``, then every result:
   batches fill, so per-batch work is shared.

Each phase runs twice. With MONITOR, to count commands, attributed to the process
that sent them (this process's client, the dispatcher, the workers: each client
socket is matched to its process with psutil) and split into commands a process
sent and commands run inside its Lua scripts, and into commands on inferq's keys
and on RQ's (``rq:*``). Then without MONITOR (it costs the server CPU), to read the
server's CPU time per request (INFO cpu, user + system). Redis runs commands on one
thread, so the ceiling of one primary is about 1 / (server CPU per request).

    python scripts/bench_redis_ops.py --json redis_ops.json
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import _bench
import psutil
import redis
from bench_e2e import Stack

from inferq.embedded import EmbeddedRedis

#: What a MONITOR line is attributed to: ``(process role, "sent" | "lua", "inferq" | "rq")``.
Bucket = tuple[str, str, str]


class Monitor:
    """Collects every command the server runs as (client port, command words, from Lua).

    Redis logs a script call and then, contiguously, the commands it runs (tagged
    ``lua``): those are attributed to the port of the script call before them.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.lines: list[tuple[int, list[str], bool]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def __enter__(self) -> Monitor:
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("MONITOR did not start")
        return self

    def _run(self) -> None:
        client = redis.Redis.from_url(self.url)
        with client.monitor() as m:
            self._ready.set()
            caller = 0
            while not self._stop.is_set():
                # redis-py's next_command() joins the arguments with spaces; keep them apart.
                raw = m.connection.read_response()
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
                match = m.monitor_re.match(text.split(" ", 1)[1])
                if match is None:
                    continue
                _, source, command = match.groups()
                words = m.command_re.findall(command)
                if not words:
                    continue
                if source == "lua":
                    self.lines.append((caller, words, True))
                elif ":" in source:
                    caller = int(source.rsplit(":", 1)[1])
                    self.lines.append((caller, words, False))
        client.close()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        poke = redis.Redis.from_url(self.url)  # one more line wakes the reader
        poke.ping()
        poke.close()
        self._thread.join(5)


def ports_of(pids: dict[str, list[int]]) -> dict[int, str]:
    """Local TCP port -> role, for every socket the processes of each role hold."""
    out: dict[int, str] = {}
    for role, members in pids.items():
        for pid in members:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.laddr:
                    out[conn.laddr.port] = role
    return out


def is_rq(words: list[str]) -> bool:
    """Whether a command touches RQ's keys (its first key argument starts with ``rq:``)."""
    name = words[0].lower()
    if name in {"evalsha", "eval", "fcall"} and len(words) > 3:
        return words[3].startswith("rq:")
    return len(words) > 1 and words[1].startswith("rq:")


def tally(lines: list[tuple[int, list[str], bool]], roles: dict[int, str]) -> dict[str, Any]:
    """Commands per bucket and per command name."""
    buckets: Counter[Bucket] = Counter()
    names: Counter[str] = Counter()
    for port, words, from_lua in lines:
        role = roles.get(port, "other")
        buckets[(role, "lua" if from_lua else "sent", "rq" if is_rq(words) else "inferq")] += 1
        names[f"{'lua ' if from_lua else ''}{words[0].lower()}"] += 1
    return {"buckets": buckets, "names": names, "total": len(lines)}


def server_cpu_s(client: redis.Redis) -> float:
    """The server's CPU seconds so far (user + system, main thread and children)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def one_by_one(stack: Stack, n: int, priority: str) -> None:
    for i in range(n):
        stack.client.submit(prompt=f"Say hello {i}", max_tokens=16, priority=priority).result(
            timeout=60
        )


def burst(stack: Stack, n: int, priority: str) -> None:
    handles = stack.client.submit_many(
        [{"prompt": f"Say hello {i}", "max_tokens": 16, "priority": priority} for i in range(n)]
    )
    for h in handles:
        h.result(timeout=120)


def measure(
    stack: Stack,
    url: str,
    roles: Callable[[], dict[int, str]],
    run: Callable[[], None],
) -> dict[str, Any]:
    """Run ``run`` under MONITOR, then again without it; counts, seconds and server CPU."""
    with Monitor(url) as mon:
        t0 = time.perf_counter()
        run()
        counted_s = time.perf_counter() - t0
    counts = tally(mon.lines, roles())
    cpu0 = server_cpu_s(stack.store.redis)
    t0 = time.perf_counter()
    run()
    return {
        **counts,
        "counted_s": counted_s,
        "seconds": time.perf_counter() - t0,
        "cpu_s": server_cpu_s(stack.store.redis) - cpu0,
    }


def per_request(phase: dict[str, Any], idle: dict[str, Any], n: int) -> dict[str, Any]:
    """A phase's figures per request, less the idle background over as many seconds."""
    scale = phase["counted_s"] / idle["counted_s"]
    buckets = {
        b: (phase["buckets"].get(b, 0) - idle["buckets"].get(b, 0) * scale) / n
        for b in set(phase["buckets"]) | set(idle["buckets"])
    }
    cpu_us = (phase["cpu_s"] - idle["cpu_s"] * phase["seconds"] / idle["seconds"]) / n * 1e6
    return {
        "commands": sum(buckets.values()),
        "buckets": {" ".join(b): round(v, 2) for b, v in sorted(buckets.items())},
        "top": phase["names"].most_common(12),
        "server_cpu_us": cpu_us,
        "ceiling_per_s": 1e6 / cpu_us if cpu_us > 0 else None,
    }


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=_bench.positive, default=1, help="worker processes")
    p.add_argument("--slots", type=_bench.positive, default=32, help="slots per worker")
    p.add_argument("--requests", type=_bench.positive, default=300, help="per phase")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle phase, seconds")
    p.add_argument("--priority", default="realtime", help="class of the requests")
    args = p.parse_args()

    with EmbeddedRedis(prefer="redis-server") as server:
        url = server.url
        with _bench.namespace(url) as ns:
            stack = Stack(url, ns, args.workers, args.slots)
            try:
                pids = {
                    "client": [os.getpid()],
                    "dispatcher": [stack.procs.procs["dispatcher"][0].pid],
                    "workers": [stack.procs.procs[w][0].pid for w in stack.worker_ids],
                }

                def roles() -> dict[int, str]:
                    return ports_of(pids)

                idle = measure(stack, url, roles, lambda: time.sleep(args.idle_s))
                phases = {
                    "one by one": measure(
                        stack, url, roles, lambda: one_by_one(stack, args.requests, args.priority)
                    ),
                    "burst": measure(
                        stack, url, roles, lambda: burst(stack, args.requests, args.priority)
                    ),
                }
            finally:
                stack.close()
        redis_version = redis.Redis.from_url(url).info("server")["redis_version"]
    figures = {name: per_request(ph, idle, args.requests) for name, ph in phases.items()}
    report(args, idle, figures, redis_version)


def report(
    args: argparse.Namespace,
    idle: dict[str, Any],
    figures: dict[str, dict[str, Any]],
    redis_version: str,
) -> None:
    buckets = sorted({b for f in figures.values() for b in f["buckets"]})
    _bench.table(
        f"Redis commands per request (private redis-server {redis_version}, "
        f"{args.requests} {args.priority} requests per phase, idle background subtracted)",
        ["process  source  keys", *figures],
        [[b, *(_bench.fmt(f["buckets"].get(b, 0.0), 2) for f in figures.values())] for b in buckets]
        + [["total", *(_bench.fmt(f["commands"], 1) for f in figures.values())]],
    )
    _bench.table(
        "Redis server CPU per request and the ceiling of one primary",
        ["phase", "server CPU us/request", "requests/s per primary (1 / CPU)"],
        [
            [name, _bench.fmt(f["server_cpu_us"], 1), _bench.fmt(f["ceiling_per_s"], 0)]
            for name, f in figures.items()
        ],
    )
    for name, f in figures.items():
        _bench.note(
            f"{name}: most frequent commands (raw counts, background included): "
            + ", ".join(f"{c} {k}" for k, c in f["top"])
        )
    idle_rate = idle["total"] / idle["counted_s"]
    _bench.note(f"idle background: {idle_rate:,.0f} commands/s")
    _bench.write_json(
        args.json,
        args.redis_url,  # only for the machine record: the run used a private server
        {
            "requests_per_phase": args.requests,
            "workers": args.workers,
            "slots": args.slots,
            "priority": args.priority,
            "idle_commands_per_s": idle_rate,
            "redis_version": redis_version,
            "phases": figures,
        },
    )


if __name__ == "__main__":
    main()
