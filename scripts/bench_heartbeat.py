"""What the heartbeat process costs: start-up, CPU per beat, memory, beside beating in-process.

Issue 13, fault 5: ``inferq worker`` beats from a child process
(``inferq.workers.pulse``) so a stall of the worker does not get it reaped. This bench
runs that child the two ways the worker starts it, forked (the worker has no thread
yet: the usual case) and as a fresh interpreter (``python -m inferq.workers.pulse``:
a worker that already runs threads), feeds it a heartbeat every ``--interval`` for
``--seconds`` with ``--held`` (request, attempt) pairs, and reads its CPU time
(``/proc/<pid>/stat``) and memory (``/proc/<pid>/smaps_rollup``: RSS, PSS, private).
The baseline, in this process and run, is the same number of beats written directly
(``Store.heartbeat_fields``, what ``--heartbeat-thread`` does), timed with
``time.process_time``::

    python scripts/bench_heartbeat.py --json heartbeat.json
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import _bench

from inferq.config import Settings
from inferq.models import WorkerInfo, WorkerState
from inferq.store import Beat, Store, connect
from inferq.workers.pulse import HeartbeatProcess

WORKER_ID = "bench-heartbeat"
TICKS = os.sysconf("SC_CLK_TCK")


def fields() -> dict[str, str]:
    now = time.time()
    info = WorkerInfo(
        id=WORKER_ID,
        model="llama-3.1-8b",
        params_b=8.0,
        vram_total_mib=24_576,
        vram_free_mib=9_000,
        kv_cache_mib=6_800,
        slots=32,
        state=WorkerState.READY,
        last_heartbeat=now,
        started_at=now,
    )
    return info.to_fields()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / TICKS


def memory_mib(pid: int) -> dict[str, float]:
    """RSS, PSS and private (clean + dirty) memory of ``pid``, MiB."""
    out = {"rss": 0.0, "pss": 0.0, "private": 0.0}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            kib = rest.split()[0] if rest.split() else "0"
            if name == "Rss":
                out["rss"] = int(kib) / 1024
            elif name == "Pss":
                out["pss"] = int(kib) / 1024
            elif name in ("Private_Clean", "Private_Dirty"):
                out["private"] += int(kib) / 1024
    return out


def run_child(
    settings: Settings, held: list[tuple[str, int]], seconds: float, interval: float, fork: bool
) -> dict[str, Any]:
    """Start the heartbeat process (forked or fresh), feed it, measure it."""
    blocker = threading.Event()
    extra: threading.Thread | None = None
    if not fork:  # a second thread makes the worker start a fresh interpreter
        extra = threading.Thread(target=blocker.wait, daemon=True)
        extra.start()
    replies: list[Beat] = []
    first = threading.Event()

    def on_beat(beat: Beat) -> None:
        replies.append(beat)
        first.set()

    t0 = time.monotonic()
    child = HeartbeatProcess(
        settings, WORKER_ID, ttl_s=3 * interval, interval_s=interval, on_beat=on_beat
    )
    payload = fields()
    child.send(payload, held, now=True)
    first.wait(60)
    startup_s = time.monotonic() - t0
    cpu_start = cpu_s(child.pid)
    beats_start = len(replies)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        child.send(payload, held)
        time.sleep(interval)
    cpu = cpu_s(child.pid) - cpu_start
    beats = len(replies) - beats_start
    memory = memory_mib(child.pid)
    child.close()
    blocker.set()
    if extra is not None:
        extra.join()
    return {
        "mode": "forked" if fork else "fresh interpreter",
        "startup_s": startup_s,
        "beats": beats,
        "cpu_ms_per_beat": 1000 * cpu / max(1, beats),
        "cpu_percent": 100 * cpu / seconds,
        "memory_mib": memory,
    }


def in_process(store: Store, held: list[tuple[str, int]], beats: int) -> float:
    """CPU ms per beat written from this process (the baseline)."""
    payload = fields()
    c0 = time.process_time()
    for _ in range(beats):
        store.heartbeat_fields(WORKER_ID, payload, 3.0, held)
    return 1000 * (time.process_time() - c0) / max(1, beats)


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="beating time per mode")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s")
    p.add_argument("--held", type=int, default=32, help="(request, attempt) pairs held")
    args = p.parse_args()
    held = [(f"r{i:024d}", 1) for i in range(args.held)]
    with _bench.namespace(args.redis_url) as ns:
        settings = Settings.load(redis_url=args.redis_url, namespace=ns)
        store = Store(connect(args.redis_url), settings)
        modes = [
            run_child(settings, held, args.seconds, args.interval, fork=True),
            run_child(settings, held, args.seconds, args.interval, fork=False),
        ]
        beats = max(m["beats"] for m in modes) or 1
        baseline_ms = in_process(store, held, beats)
        store.close()
    rows = [
        [
            m["mode"],
            _bench.fmt(m["startup_s"], 3),
            str(m["beats"]),
            _bench.fmt(m["cpu_ms_per_beat"]),
            _bench.fmt(_bench.ratio(m["cpu_ms_per_beat"], baseline_ms)),
            _bench.fmt(m["cpu_percent"]),
            _bench.fmt(m["memory_mib"]["rss"], 1),
            _bench.fmt(m["memory_mib"]["pss"], 1),
            _bench.fmt(m["memory_mib"]["private"], 1),
        ]
        for m in modes
    ]
    rows.append(
        ["in-process (baseline)", "-", str(beats), _bench.fmt(baseline_ms), "1.00"] + ["-"] * 4
    )
    _bench.table(
        f"heartbeat process, {args.interval:g} s interval, {args.held} held attempts",
        [
            "mode",
            "start-up s",
            "beats",
            "CPU ms/beat",
            "x baseline",
            "CPU %",
            "RSS MiB",
            "PSS MiB",
            "private MiB",
        ],
        rows,
    )
    _bench.write_json(
        args.json,
        args.redis_url,
        {
            "interval_s": args.interval,
            "seconds": args.seconds,
            "held": args.held,
            "modes": modes,
            "baseline_cpu_ms_per_beat": baseline_ms,
        },
    )


if __name__ == "__main__":
    main()
