"""Where a streamed request's added time to first token goes, leg by leg (issue 14).

On a private ``redis-server`` under MONITOR it starts llama.cpp (SmolLM2-135M, one
thread) and an inferq stack on it (dispatcher, worker with the ``openai`` backend,
gateway) whose processes run with timestamp probes (:mod:`_ttft_probe`, a wrapper of
``python -m inferq``), then sends ``--requests`` streamed chats (``max_tokens`` 4), one
at a time, rotating three paths: inferq's Python client, ``inferq gateway`` and llama.cpp
directly. All stamps are the host's wall clock (MONITOR's too). Per path it prints the
median and p90 of each leg, in ms:

- ``send -> submit``: the caller's send to the submit script (the gateway: HTTP in,
  its checks);
- ``submit -> wake -> enqueue -> dequeued -> start``: the dispatcher's wake, its claim
  and RQ enqueue, the worker's RQ dequeue and its start script (as ``trace_latency.py``);
- ``accept -> generate``: the batch's start (the start script and the records) to the
  model-server call;
- ``generate -> sink``: the model server's time to the first token, as the worker sees
  it (the direct path's total is the same wait without inferq);
- ``sink -> XADD``: the worker's first token to its XADD;
- ``XADD -> first``: the chunk's way to the caller (the gateway: XREAD, SSE, HTTP out);
- ``submit -> XREAD``: when the reader's first XREAD went (after the submit; it must
  be there before the XADD).

``--baseline REV`` runs that commit's processes instead (its ``src`` first on their
``PYTHONPATH``; the client path's library stays this tree's): alternate the two for a
before/after::

    python scripts/trace_ttft.py --requests 40
    python scripts/trace_ttft.py --requests 40 --baseline 999aca8
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _bench
import httpx
from bench_gateway import HEADERS, MESSAGES, MODEL, Run, body, start_llama, start_stack
from bench_redis_ops import ports_of
from trace_latency import Monitor

from inferq.client import Client
from inferq.embedded import EmbeddedRedis
from inferq.models import StreamChunk
from inferq.store import connect

PROBE = Path(__file__).resolve().parent / "_ttft_probe.py"
PATHS = ("client", "gateway", "direct")
#: The legs printed, in path order: (name, from milestone, to milestone).
LEGS = [
    ("send -> submit", "send", "submit"),
    ("submit -> wake", "submit", "wake"),
    ("wake -> enqueue", "wake", "enqueue"),
    ("enqueue -> dequeued", "enqueue", "dequeued"),
    ("dequeued -> start", "dequeued", "start"),
    ("accept -> generate", "w.accept:in", "w.generate:in"),
    ("generate -> sink", "w.generate:in", "w.sink"),
    ("sink -> XADD", "w.sink", "xadd"),
    ("XADD -> first", "xadd", "first"),
    ("submit -> XREAD", "submit", "xread"),
    ("total", "send", "first"),
]


def via_client(client: Client) -> tuple[float, float]:
    """(sent, first text delta) of one streamed chat through the Python client."""
    sent = time.time()
    handle = client.submit(
        messages=MESSAGES,
        model=MODEL,
        max_tokens=4,
        stream=True,
        priority="realtime",
        params={"temperature": 0, "ignore_eos": True},
    )
    first = 0.0
    for item in handle.stream(timeout=60):
        if isinstance(item, StreamChunk) and item.delta and not first:
            first = time.time()
    return sent, first


def via_http(http: httpx.Client, url: str) -> tuple[float, float]:
    """(sent, first text delta) of one streamed chat over HTTP."""
    sent = time.time()
    first = 0.0
    payload = body(MODEL, 4)
    with http.stream("POST", f"{url}/chat/completions", json=payload, headers=HEADERS) as r:
        for line in r.iter_lines():
            if first or not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                first = time.time()
    return sent, first


def trace(n: int, src: Path | None) -> tuple[list[Any], list[Any], list[Any], dict[int, str]]:
    """Run the stack and ``n`` rounds of the three paths under MONITOR."""
    env = {"PYTHONPATH": str(src)} if src is not None else {}
    with EmbeddedRedis(prefer="redis-server") as server, tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp))
        probes = Path(tmp) / "probes.log"
        real_start = run.start

        def start(name: str, cmd: list[str], extra: dict[str, str] | None = None) -> Any:
            if cmd[1:3] == ["-m", "inferq"]:  # the stack's processes: with the probes
                cmd = [cmd[0], str(PROBE), *cmd[3:]]
            return real_start(name, cmd, {**(extra or {}), **env, "PROBE_LOG": str(probes)})

        run.start = start  # type: ignore[method-assign]
        try:
            llama = start_llama(run, 4)
            stack = start_stack(run, server.url, "trace", llama, 4)
            client = Client(settings=stack.settings, connection=connect(server.url))
            http = httpx.Client(timeout=60, trust_env=False)
            paths: dict[str, Callable[[], tuple[float, float]]] = {
                "client": lambda: via_client(client),
                "gateway": lambda: via_http(http, stack.gateway_url),
                "direct": lambda: via_http(http, f"{llama}/v1"),
            }
            for _ in range(5):  # warm: connections open, scripts loaded
                for call in paths.values():
                    call()
            pids = {
                "client": [os.getpid()],
                "dispatcher": [stack.procs[0].popen.pid],
                "worker": [stack.procs[1].popen.pid],
                "gateway": [stack.procs[2].popen.pid],
            }
            marks = []
            with Monitor(server.url) as mon:
                roles = ports_of(pids)
                for _ in range(n):
                    for name in PATHS:
                        marks.append((name, *paths[name]()))
                        time.sleep(0.03)
                roles.update(ports_of(pids))
            lines = mon.parsed()
            stamps = [line.split() for line in probes.read_text().splitlines()]
        finally:
            run.stop()
    return marks, lines, [(float(t), name) for t, name in stamps], roles


def milestones(
    kind: str, sent: float, first: float, cmds: list[Any], stamps: list[Any]
) -> dict[str, float]:
    """One request's milestones (epoch s) from the commands and probes in its window."""
    m = {"send": sent, "first": first}
    job = None
    for ts, role, words in cmds:
        if not sent <= ts <= first:
            continue
        name = words[0].upper()
        if "submit" not in m and role == kind and name == "EVALSHA":
            m["submit"] = ts
        elif "submit" in m and "wake" not in m and role == "dispatcher":
            m["wake"] = ts
        if role == "dispatcher" and name == "RPUSH" and words[1].startswith("rq:queue:"):
            job = words[2]
        if job and "enqueue" not in m and role == "dispatcher" and name == "EXEC":
            m["enqueue"] = ts
        ours = role == "worker" and name == "HGETALL" and job and words[1].endswith(job)
        if ours and "dequeued" not in m:
            m["dequeued"] = ts
        if "dequeued" in m and "start" not in m and role == "worker" and name == "EVALSHA":
            m["start"] = ts
        if "xadd" not in m and role == "worker" and name == "XADD" and ":stream:" in words[1]:
            m["xadd"] = ts
        if "submit" in m and "xread" not in m and role == kind and name == "XREAD":
            m["xread"] = ts
    for ts, name in stamps:
        if sent <= ts <= first and name not in m:
            m[name] = ts
    return m


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=_bench.positive, default=40, help="per path")
    p.add_argument("--baseline", metavar="REV", help="trace this commit's processes instead")
    args = p.parse_args()
    with contextlib.ExitStack() as on_exit:
        src = None
        if args.baseline:
            src = on_exit.enter_context(_bench.baseline_tree(args.baseline)) / "src"
        marks, lines, stamps, roles = trace(args.requests, src)
    cmds = []
    for ts, source, words in lines:
        if words and source != "lua":
            cmds.append((ts, roles.get(int(source.rsplit(":", 1)[1]), "other"), words))
    figures: dict[str, Any] = {}
    for kind in PATHS:
        legs: dict[str, list[float]] = {}
        for k, sent, first in marks:
            if k != kind or not first:
                continue
            m = milestones(kind, sent, first, cmds, stamps)
            for leg, a, b in LEGS:
                if a in m and b in m:
                    legs.setdefault(leg, []).append((m[b] - m[a]) * 1000)
        figures[kind] = {
            leg: {"p50": statistics.median(v), "p90": _bench.percentile(v, 90), "n": len(v)}
            for leg, v in legs.items()
        }
        _bench.table(
            f"{kind} path ({args.baseline or 'this tree'}), ms",
            ["leg", "p50", "p90", "n"],
            [
                [leg, _bench.fmt(f["p50"]), _bench.fmt(f["p90"]), str(f["n"])]
                for leg, f in figures[kind].items()
            ],
        )
    _bench.write_json(args.json, args.redis_url, {"tree": args.baseline, "paths": figures})


if __name__ == "__main__":
    main()
