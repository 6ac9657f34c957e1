"""Where the added latency goes: each request's path, command by command, from MONITOR.

Issue 17's breakdown of ``bench_e2e.py``'s added latency (submit -> started). On a
private ``redis-server`` it starts a dispatcher and one worker as ``bench_e2e.py``
does (sim backend, ``time_scale=0``), submits ``--requests`` realtime requests one at a
time, ``--gap-ms`` apart (idle capacity), and records every command the server runs
with MONITOR, which stamps each with the server's clock in microseconds. For each
request it finds, after its submit script:

- **wake**: the dispatcher's first command (its BLPOP on the wake list returned and
  a step began);
- **assign**: the dispatcher's claim script (the last script it runs before the
  enqueue); before it, the step's housekeeping (when due) and snapshot;
- **enqueue**: the EXEC of RQ's pipeline that puts the batch job on the worker's queue;
- **dequeued**: the worker's HGETALL of that job (RQ's BLMOVE returned it);
- **start**: the worker's start script (``started_ms`` is written there).

It prints the median and p90 of each milestone (ms after the submit script) and of
each leg between two, the round trips each process made on the way (a MULTI ... EXEC,
or commands pipelined in one write, count once), and the wake -> assign leg apart for
steps that ran the dispatcher's housekeeping first (expiry, promotion, reaping: once
per tick) and steps that did not. MONITOR costs the server time per command, so
absolute figures are higher than ``bench_e2e.py``'s. ``--baseline REV`` traces that
commit's dispatcher and worker instead (a temporary git worktree)::

    python scripts/trace_latency.py --requests 200
    python scripts/trace_latency.py --requests 200 --baseline 06565bd
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import _bench
import redis
from bench_e2e import Stack
from bench_redis_ops import ports_of

from inferq.embedded import EmbeddedRedis

#: One MONITOR line: ``<epoch s.us> [<db> <client addr> | lua] "CMD" "arg" ...``.
LINE = re.compile(r"^(\d+\.\d+) \[\d+ ([^\]]+)\] (.*)$")
WORD = re.compile(r'"((?:[^"\\]|\\.)*)"')
MILESTONES = ("wake", "assign", "enqueue", "dequeued", "start")
#: A traced command: (server time s, role of the sender, its port, words).
Command = tuple[float, str, int, list[str]]
#: Commands of one connection this close together (server clock, s) came in one write
#: (a pipeline): Redis runs a client's pipelined commands back to back.
SAME_WRITE_S = 25e-6


class Monitor:
    """Every command the server runs, with its server timestamp, while open.

    The reader thread only stores the raw lines (parsed after, in :meth:`parsed`): it
    shares the machine with the processes it watches.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.raw: list[bytes | str] = []
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
            read, keep = m.connection.read_response, self.raw.append
            while not self._stop.is_set():
                keep(read())
        client.close()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        poke = redis.Redis.from_url(self.url)  # one more line wakes the reader
        poke.ping()
        poke.close()
        self._thread.join(5)

    def parsed(self) -> list[tuple[float, str, list[str]]]:
        """(server time s, source: client address or ``lua``, command words) per line."""
        lines = []
        for raw in self.raw:
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            match = LINE.match(text)
            if match is not None:
                ts, source, command = match.groups()
                lines.append((float(ts), source, WORD.findall(command)))
        return lines


def path_of(commands: list[Command]) -> dict[str, Any] | None:
    """One request's milestones (ms after its submit script) and round trips per leg;
    None when the path is incomplete (e.g. the trace ended first)."""
    t0 = commands[0][0]
    marks: dict[str, float] = {}
    job = None
    for ts, role, _, words in commands[1:]:
        name = words[0].upper()
        if "wake" not in marks and role == "dispatcher":
            marks["wake"] = ts
        if role == "dispatcher" and name == "RPUSH" and words[1].startswith("rq:queue:"):
            job = words[2]
        if job is not None and "enqueue" not in marks and role == "dispatcher" and name == "EXEC":
            marks["enqueue"] = ts
        if job is not None and role == "worker" and name == "HGETALL" and words[1].endswith(job):
            marks["dequeued"] = ts
        if "dequeued" in marks and role == "worker" and name == "EVALSHA":
            marks["start"] = ts
            break
    if len(marks) < 4 or "start" not in marks:
        return None
    scripts = [
        ts for ts, role, _, w in commands if role == "dispatcher" and w[0].upper() == "EVALSHA"
    ]
    marks["assign"] = max(ts for ts in scripts if ts < marks["enqueue"])
    out: dict[str, Any] = {k: (marks[k] - t0) * 1000 for k in MILESTONES}
    out["housekeeping"] = any(  # the reaper's read of the workers index by last beat
        role == "dispatcher" and w[0].upper() == "ZRANGEBYSCORE" and w[1].endswith(":workers")
        for ts, role, _, w in commands
        if ts < marks["assign"]
    )
    out["round_trips"] = {
        "dispatcher wake -> enqueue": round_trips(commands, "dispatcher", t0, marks["enqueue"]),
        "worker enqueue -> start": round_trips(
            commands, "worker", marks["enqueue"], marks["start"]
        ),
    }
    return out


def round_trips(commands: list[Command], role: str, after: float, until: float) -> int:
    """Round trips ``role`` made in (after, until]: a command, a MULTI ... EXEC, or a run
    of pipelined commands (same connection, back to back, see ``SAME_WRITE_S``) each once."""
    count, in_tx, last = 0, False, (0.0, -1)
    for ts, r, port, words in commands:
        if r != role or not after < ts <= until:
            last = (ts, port)
            continue
        name = words[0].upper()
        pipelined = last[1] == port and ts - last[0] < SAME_WRITE_S
        last = (ts, port)
        if name == "MULTI":
            in_tx = True
            count += 1
        elif name == "EXEC":
            in_tx = False
        elif not in_tx and not pipelined:
            count += 1
    return count


def split(lines: list[tuple[float, str, list[str]]], roles: dict[int, str]) -> list[list[Command]]:
    """The commands from each submit script to the next, roles resolved (Lua's dropped)."""
    requests: list[list[Command]] = []
    for ts, source, words in lines:
        if source == "lua" or not words:
            continue
        port = int(source.rsplit(":", 1)[1])
        role = roles.get(port, "other")
        if role == "client" and words[0].upper() == "EVALSHA":
            requests.append([])
        if requests:
            requests[-1].append((ts, role, port, words))
    return requests


def trace(url: str, n: int, gap_s: float, src: Path | None) -> list[dict[str, Any]]:
    """Run the stack and the requests under MONITOR; each complete request's path."""
    with _bench.namespace(url) as ns:
        stack = Stack(url, ns, 1, 64, src=src)
        try:
            pids = {
                "client": [os.getpid()],
                "dispatcher": [stack.procs.procs["dispatcher"][0].pid],
                "worker": [stack.procs.procs[w][0].pid for w in stack.worker_ids],
            }
            for _ in range(5):  # warm: scripts loaded, connections open
                stack.client.submit(prompt="warm", max_tokens=4, priority="realtime").result(30)
            with Monitor(url) as mon:
                roles = ports_of(pids)
                for i in range(n):
                    stack.client.submit(prompt=f"hello {i}", max_tokens=4, priority="realtime")
                    time.sleep(gap_s)
                roles.update(ports_of(pids))
        finally:
            stack.close()
    paths = [path_of(cmds) for cmds in split(mon.parsed(), roles)]
    return [p for p in paths if p is not None]


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=_bench.positive, default=200)
    p.add_argument("--gap-ms", type=float, default=50.0, help="between two submissions")
    p.add_argument("--baseline", metavar="REV", help="trace this commit's processes instead")
    args = p.parse_args()
    with contextlib.ExitStack() as on_exit:
        src = None
        if args.baseline:
            src = on_exit.enter_context(_bench.baseline_tree(args.baseline)) / "src"
        server = on_exit.enter_context(EmbeddedRedis(prefer="redis-server"))
        paths = trace(server.url, args.requests, args.gap_ms / 1000, src)
    if not paths:
        raise SystemExit("no complete request path was traced")
    report(args, paths)


def report(args: Any, paths: list[dict[str, Any]]) -> None:
    rows = []
    figures: dict[str, Any] = {}
    previous = None
    for mark in MILESTONES:
        at = [p[mark] for p in paths]
        leg = [p[mark] - (p[previous] if previous else 0.0) for p in paths]
        figures[mark] = {
            "at_ms_p50": statistics.median(at),
            "at_ms_p90": _bench.percentile(at, 90),
            "leg_ms_p50": statistics.median(leg),
            "leg_ms_p90": _bench.percentile(leg, 90),
        }
        rows.append(
            [
                f"{previous or 'submit'} -> {mark}",
                _bench.fmt(figures[mark]["leg_ms_p50"], 3),
                _bench.fmt(figures[mark]["leg_ms_p90"], 3),
                _bench.fmt(figures[mark]["at_ms_p50"], 3),
                _bench.fmt(figures[mark]["at_ms_p90"], 3),
            ]
        )
        previous = mark
    who = f"baseline {args.baseline}" if args.baseline else "this tree"
    _bench.table(
        f"Path of a realtime request at idle capacity ({who}; {len(paths)} requests "
        f"{args.gap_ms:g} ms apart; MONITOR server timestamps, private redis-server)",
        ["leg", "leg ms p50", "leg ms p90", "since submit p50", "since submit p90"],
        rows,
    )
    trips = {
        leg: statistics.median([p["round_trips"][leg] for p in paths])
        for leg in paths[0]["round_trips"]
    }
    wake_assign = {}
    for label, flag in (("with housekeeping", True), ("without", False)):
        legs = [p["assign"] - p["wake"] for p in paths if p["housekeeping"] is flag]
        wake_assign[label] = {"steps": len(legs), "ms_p50": statistics.median(legs or [0.0])}
    _bench.note(
        "wake -> assign (ms p50): "
        + ", ".join(
            f"{label} {_bench.fmt(f['ms_p50'], 3)} ({f['steps']} steps)"
            for label, f in wake_assign.items()
        )
    )
    _bench.note("round trips (median): " + ", ".join(f"{leg}: {n:g}" for leg, n in trips.items()))
    _bench.write_json(
        args.json,
        args.redis_url,
        {
            "tree": who,
            "requests": len(paths),
            "milestones": figures,
            "round_trips": trips,
            "wake_to_assign": wake_assign,
        },
    )


if __name__ == "__main__":
    main()
