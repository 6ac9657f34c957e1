"""Added time to first token of ``inferq gateway`` and of LiteLLM's proxy, in one run.

Issue 14's gateway benchmark (kept out of CI: it starts a model server, LiteLLM and a
whole inferq stack). The same streamed chat request goes, one request at a time and
interleaved so that a noisy machine weighs on every path alike, along:

- ``direct``: straight to the llama.cpp server (``python -m inferq.llama_server``,
  SmolLM2-135M, ``--threads 1``): the baseline;
- ``inferq client``: inferq's Python client (``Client.submit(stream=True)`` and
  ``handle.stream()``) -> Redis -> dispatcher -> worker -> the same server;
- ``inferq gateway``: ``inferq gateway`` (a subprocess) -> the same queue;
- ``LiteLLM``: LiteLLM's proxy (``litellm[proxy]``, run from its own virtual
  environment, ``--litellm-venv``) pointed at the same server. Skipped, saying so,
  when that environment has no ``bin/litellm``.

TTFT is measured in this process from sending the request to the first non-empty text
delta (the HTTP paths share one client, httpx with keep-alive). Printed: TTFT p50/p99
per path and what each adds to ``direct``; the gateway's own share, ``inferq gateway``
- ``inferq client`` (HTTP in and out over the Python client's path), against the goal
of 2 ms p50 and 10 ms p99; inferq's total added TTFT against LiteLLM's. Then the
throughput of each HTTP path with ``--slots`` streams at once.

Last, the cost of the proxies themselves on a zero-latency backend (the stand-in
OpenAI server of the tests, ``tests/fakes/standin_openai.py``, which answers at once):
``--concurrency`` streams at once for ``--zero-requests`` requests per path, reporting
requests/s and CPU milliseconds per request of the gateway process beside LiteLLM's
(and of the whole inferq stack: gateway, dispatcher and worker; Redis not counted)::

    python scripts/bench_gateway.py --litellm-venv /work/venv-litellm --json gateway.json

``--baseline REV`` adds the client and gateway paths of a second stack whose
dispatcher, worker and gateway run that commit (a temporary worktree), interleaved with
the others in the same run, for a before/after on one machine load::

    python scripts/bench_gateway.py --baseline 999aca8 --throughput-requests 0 --zero-requests 0

LiteLLM pins many packages, so it lives in its own environment::

    python3 -m venv /work/venv-litellm
    /work/venv-litellm/bin/pip install 'litellm[proxy]==1.81.13'

(a fixed version: LiteLLM releases 1.82.7, 1.82.8 and 1.107.0 were compromised on PyPI.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _bench
import httpx
import psutil

from inferq.client import Client
from inferq.config import Settings
from inferq.llama_server import BUNDLED_NAME
from inferq.models import StreamChunk
from inferq.store import connect

ROOT = Path(__file__).resolve().parents[1]
MODEL = BUNDLED_NAME
#: LiteLLM's name of the stand-in (the same model name would route to llama.cpp).
STANDIN_MODEL = f"{MODEL}-standin"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
#: The name of the ``--baseline`` stack's paths in the tables.
BASE = "baseline"
#: Seconds each component gets to start (LiteLLM's proxy imports for ~20 s on 2 cores).
START_S = 120.0


@dataclass
class Proc:
    """A subprocess of the benchmark, its log in the run's folder; stopped at the end."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process and its children so far."""
        try:
            proc = psutil.Process(self.popen.pid)
            total = 0.0
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
            return total
        except psutil.Error:
            return 0.0

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


@dataclass
class Run:
    """The processes the run started, in start order (stopped in reverse)."""

    folder: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.folder / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=self.folder,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def wait_until(proc: Proc, check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until true; SystemExit with the process's log when it dies or times out."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise SystemExit(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    raise SystemExit(f"{what}: not ready in {START_S:g} s:\n{proc.tail()}")


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2, trust_env=False).status_code == 200


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --- the components ----------------------------------------------------------------------


def start_llama(run: Run, slots: int) -> str:
    """llama.cpp on SmolLM2-135M, one compute thread; its base URL."""
    cmd = [sys.executable, "-m", "inferq.llama_server", "--port", "0"]
    cmd += ["--parallel", str(slots), "--threads", "1", "--ctx-size", str(2048 * slots)]
    proc = run.start("llama", cmd)
    found: list[str] = []

    def listening() -> bool:
        found[:] = re.findall(r"listening on (http://\S+)", proc.log.read_text())
        return bool(found) and http_ok(f"{found[0]}/health")

    wait_until(proc, listening, "llama.cpp")
    return found[0]


STANDIN_CODE = """
import signal, sys
sys.path.insert(0, {root!r})
from tests.fakes.standin_openai import StandIn
s = StandIn(completion_tokens={tokens}, prompt_tokens=9, models=[{model!r}]).start()
print("standin on", s.url, flush=True)
signal.sigwait({{signal.SIGTERM, signal.SIGINT}})
"""


def start_standin(run: Run, tokens: int) -> str:
    """The tests' stand-in OpenAI server (answers at once, ``tokens`` words); its base URL."""
    code = STANDIN_CODE.format(root=str(ROOT), tokens=tokens, model=MODEL)
    proc = run.start("standin", [sys.executable, "-c", code])
    found: list[str] = []

    def listening() -> bool:
        found[:] = re.findall(r"standin on (http://\S+)", proc.log.read_text())
        return bool(found) and http_ok(f"{found[0]}/health")

    wait_until(proc, listening, "stand-in")
    return found[0]


@dataclass
class Stack:
    """One inferq deployment: dispatcher, a worker on ``backend``, a gateway."""

    settings: Settings
    gateway_url: str
    procs: list[Proc]
    gateway: Proc


def start_stack(
    run: Run, redis_url: str, namespace: str, backend: str, slots: int, src: Path | None = None
) -> Stack:
    """A stack on ``backend``; with ``src``, its processes import inferq from that tree
    (first on ``PYTHONPATH``: ``--baseline``)."""
    settings = Settings.load(redis_url=redis_url, namespace=namespace)
    env = {"INFERQ_REDIS_URL": redis_url, "INFERQ_NAMESPACE": namespace}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    inferq = [sys.executable, "-m", "inferq"]
    tag = namespace[-4:]
    dispatcher = run.start(f"dispatcher-{tag}", [*inferq, "dispatcher"], env)
    cmd = [*inferq, "worker", "--model", MODEL, "--backend", "openai", "-o", f"base_url={backend}"]
    cmd += ["--slots", str(slots), "--vram-mib", "24576", "--id", f"bench-{tag}"]
    worker = run.start(f"worker-{tag}", cmd, env)
    redis_client = connect(redis_url)
    key = f"inferq:{namespace}:worker:bench-{tag}"
    wait_until(worker, lambda: redis_client.hget(key, "state") == "ready", "the worker")
    redis_client.close()
    port = free_port()
    gateway = run.start(
        f"gateway-{tag}",
        [*inferq, "gateway", "--host", "127.0.0.1", "--port", str(port)],
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(gateway, lambda: http_ok(f"{url}/health"), "the gateway")
    return Stack(settings, f"{url}/v1", [dispatcher, worker, gateway], gateway)


LITELLM_CONFIG = """
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {llama}/v1
      api_key: none
  - model_name: {standin_model}
    litellm_params:
      model: openai/{model}
      api_base: {standin}/v1
      api_key: none
litellm_settings:
  telemetry: false
"""


def start_litellm(run: Run, venv: Path, llama: str, standin: str) -> tuple[str, Proc, str]:
    """LiteLLM's proxy from its own environment; its ``/v1`` URL, process and version."""
    config = run.folder / "litellm.yaml"
    config.write_text(
        LITELLM_CONFIG.format(
            model=MODEL, standin_model=STANDIN_MODEL, llama=llama, standin=standin
        )
    )
    port = free_port()
    version = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m;print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    cmd = [str(venv / "bin" / "litellm"), "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = run.start("litellm", cmd, {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"})
    url = f"http://127.0.0.1:{port}"
    wait_until(proc, lambda: http_ok(f"{url}/health/liveliness"), "LiteLLM")
    return f"{url}/v1", proc, version


# --- measuring ---------------------------------------------------------------------------


def body(model: str, max_tokens: int) -> dict[str, Any]:
    """The streamed chat every path gets: greedy (the same text on every path), exactly
    ``max_tokens`` tokens (``ignore_eos``, a llama.cpp field every proxy forwards), usage
    in the last chunk."""
    return {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


HEADERS = {"Authorization": "Bearer unused", "X-Inferq-Priority": "realtime"}


def ttft_http(http: httpx.Client, url: str, payload: dict[str, Any]) -> tuple[float, int]:
    """Seconds to the first non-empty text delta of a streamed chat, and the deltas read."""
    started = time.perf_counter()
    first = None
    deltas = 0
    with http.stream("POST", f"{url}/chat/completions", json=payload, headers=HEADERS) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                deltas += 1
                if first is None:
                    first = time.perf_counter() - started
    if first is None:
        raise SystemExit(f"{url}: a stream with no text")
    return first, deltas


def ttft_client(client: Client, max_tokens: int) -> tuple[float, int]:
    """The same through inferq's Python client: submit -> first non-empty delta."""
    started = time.perf_counter()
    handle = client.submit(
        messages=MESSAGES,
        model=MODEL,
        max_tokens=max_tokens,
        stream=True,
        priority="realtime",
        params={"temperature": 0, "ignore_eos": True},
    )
    first = None
    deltas = 0
    for item in handle.stream(timeout=120):
        if isinstance(item, StreamChunk) and item.delta:
            deltas += 1
            if first is None:
                first = time.perf_counter() - started
        elif not isinstance(item, StreamChunk) and not item.ok:
            raise SystemExit(f"inferq client: {item.status}: {item.error}")
    if first is None:
        raise SystemExit("inferq client: a stream with no text")
    return first, deltas


def sequential_ttft(
    paths: dict[str, Callable[[], tuple[float, int]]], n: int, warmup: int
) -> dict[str, list[float]]:
    """``n`` requests per path, one at a time, the paths' order rotating each round."""
    names = list(paths)
    for _ in range(warmup):
        for name in names:
            paths[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            out[name].append(paths[name]()[0])
    return out


async def concurrent(
    url: str, model: str, n: int, concurrency: int, max_tokens: int
) -> tuple[float, int, list[float], int]:
    """``n`` streamed requests, ``concurrency`` at a time: wall seconds, completion tokens
    (from the usage chunks), TTFTs, and
    how many were sent again because the server had closed a kept-alive connection
    (llama.cpp's HTTP server closes one after a few requests; no answer had begun)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    payload = body(model, max_tokens)
    ttfts: list[float] = []
    tokens = 0
    resent = 0
    failed: list[str] = []
    todo = iter(range(n))

    async def once(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        started = time.perf_counter()
        first = None
        usage = False
        async with http.stream(
            "POST", f"{url}/chat/completions", json=payload, headers=HEADERS
        ) as r:
            if r.status_code != 200:
                raise SystemExit(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                text = choices and (choices[0].get("delta") or {}).get("content")
                if text and first is None:
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens += int(chunk["usage"].get("completion_tokens") or 0)
                    usage = True
                if "error" in chunk:
                    failed.append(str(chunk["error"])[:300])
        if first is None:
            raise SystemExit(f"{url}: a stream with no text")
        if not usage and not failed:
            failed.append("a stream without its usage chunk")
        ttfts.append(first)

    async def loop(http: httpx.AsyncClient) -> None:
        nonlocal resent
        for _ in todo:
            for attempt in range(3):
                try:
                    await once(http)
                    break
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    if attempt == 2:
                        raise
                    resent += 1

    async with httpx.AsyncClient(limits=limits, timeout=120, trust_env=False) as http:
        started = time.perf_counter()
        await asyncio.gather(*(loop(http) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    if failed:
        _bench.note(f"{url}: {len(failed)} streams ended badly, e.g. {failed[0]}")
    return wall, tokens, ttfts, resent


def ms(values: list[float], p: float) -> float:
    return _bench.percentile(values, p) * 1000


# --- the run -----------------------------------------------------------------------------


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=_bench.positive, default=200, help="TTFT samples per path")
    p.add_argument("--warmup", type=int, default=5, help="requests per path not counted")
    p.add_argument("--max-tokens", type=_bench.positive, default=4, help="per TTFT request")
    p.add_argument("--slots", type=_bench.positive, default=4, help="llama.cpp slots")
    p.add_argument(
        "--throughput-requests", type=int, default=40, help="per path, --slots at once (0: skip)"
    )
    p.add_argument("--throughput-tokens", type=_bench.positive, default=32, help="max_tokens")
    p.add_argument("--zero-requests", type=int, default=1000, help="per path (0: skip)")
    p.add_argument("--concurrency", type=_bench.positive, default=16, help="zero-latency phase")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also time the client and gateway paths of a stack running this commit "
        "(dispatcher, worker and gateway from a temporary worktree; same run, interleaved)",
    )
    p.add_argument(
        "--litellm-venv",
        type=Path,
        default=Path(os.environ.get("LITELLM_VENV", "/work/venv-litellm")),
        help="virtual environment with litellm[proxy] (LITELLM_VENV)",
    )
    args = p.parse_args()
    figures: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    litellm_bin = args.litellm_venv / "bin" / "litellm"
    if not litellm_bin.exists():
        _bench.note(
            f"LiteLLM skipped: {litellm_bin} does not exist (python3 -m venv "
            f"{args.litellm_venv} && {args.litellm_venv}/bin/pip install "
            "'litellm[proxy]==1.81.13')"
        )
    with (
        tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp,
        _bench.namespace(args.redis_url) as ns_llm,
        _bench.namespace(args.redis_url) as ns_zero,
        _bench.namespace(args.redis_url) as ns_base,
        contextlib.ExitStack() as on_exit,
    ):
        base: tuple[str, Path] | None = None
        if args.baseline:
            tree = on_exit.enter_context(_bench.baseline_tree(args.baseline))
            base = (ns_base, tree / "src")
        run = Run(Path(tmp))
        try:
            measure(run, args, figures, ns_llm, ns_zero, litellm_bin, base)
        finally:
            run.stop()
    _bench.write_json(args.json, args.redis_url, figures)


def measure(
    run: Run,
    args: Any,
    figures: dict[str, Any],
    ns_llm: str,
    ns_zero: str,
    litellm_bin: Path,
    base: tuple[str, Path] | None = None,
) -> None:
    llama = start_llama(run, args.slots)
    standin = start_standin(run, tokens=5)
    stack = start_stack(run, args.redis_url, ns_llm, llama, args.slots)
    base_stack = None
    if base is not None:
        base_stack = start_stack(run, args.redis_url, base[0], llama, args.slots, src=base[1])
    zero_stack = start_stack(run, args.redis_url, ns_zero, standin, 64)
    litellm: tuple[str, Proc, str] | None = None
    if litellm_bin.exists():
        litellm = start_litellm(run, args.litellm_venv, llama, standin)
        figures["litellm_version"] = litellm[2]
    http = httpx.Client(timeout=120, trust_env=False)
    client = Client(settings=stack.settings, connection=connect(args.redis_url))
    urls = {"direct": f"{llama}/v1", "inferq gateway": stack.gateway_url}
    if litellm is not None:
        urls["LiteLLM"] = litellm[0]
    payload = body(MODEL, args.max_tokens)
    paths: dict[str, Callable[[], tuple[float, int]]] = {
        name: (lambda url=url: ttft_http(http, url, payload)) for name, url in urls.items()
    }
    paths["inferq client"] = lambda: ttft_client(client, args.max_tokens)
    base_client = None
    if base_stack is not None:
        # The baseline's client path reads with this tree's client library (in-process);
        # its dispatcher, worker and gateway are the baseline's.
        base_client = Client(settings=base_stack.settings, connection=connect(args.redis_url))
        paths[f"{BASE} client"] = lambda: ttft_client(base_client, args.max_tokens)
        paths[f"{BASE} gateway"] = lambda: ttft_http(http, base_stack.gateway_url, payload)
    samples = sequential_ttft(paths, args.requests, args.warmup)
    client.close()
    if base_client is not None:
        base_client.close()
    http.close()

    # --- TTFT on llama.cpp
    direct = samples["direct"]
    rows = []
    ttft: dict[str, Any] = {}
    names = ("direct", "inferq client", "inferq gateway", "LiteLLM")
    for name in (*names, f"{BASE} client", f"{BASE} gateway"):
        if name not in samples:
            continue
        values = samples[name]
        p50, p99 = ms(values, 50), ms(values, 99)
        add50, add99 = p50 - ms(direct, 50), p99 - ms(direct, 99)
        ttft[name] = {"p50_ms": p50, "p99_ms": p99, "added_p50_ms": add50, "added_p99_ms": add99}
        rows.append(
            [name, _bench.fmt(p50), _bench.fmt(p99)]
            + (["-", "-"] if name == "direct" else [_bench.fmt(add50), _bench.fmt(add99)])
        )
    figures["ttft"] = ttft
    _bench.table(
        f"TTFT of one streamed chat on llama.cpp (SmolLM2-135M, 1 thread), ms: "
        f"{args.requests} requests per path, one at a time, interleaved",
        ["path", "p50", "p99", "added p50", "added p99"],
        rows,
    )
    share50 = ttft["inferq gateway"]["p50_ms"] - ttft["inferq client"]["p50_ms"]
    share99 = ttft["inferq gateway"]["p99_ms"] - ttft["inferq client"]["p99_ms"]
    met = share50 <= 2 and share99 <= 10
    figures["gateway_share_ms"] = {"p50": share50, "p99": share99, "goal_met": met}
    _bench.note(
        f"the gateway's own share (gateway - Python client): p50 {share50:.2f} ms, "
        f"p99 {share99:.2f} ms (goal <= 2 / <= 10 ms: {'met' if met else 'NOT met'})"
    )
    if f"{BASE} gateway" in ttft:
        was = ttft[f"{BASE} gateway"]["p50_ms"] - ttft[f"{BASE} client"]["p50_ms"]
        figures["baseline"] = {"rev": args.baseline, "gateway_share_p50_ms": was}
        _bench.note(
            f"baseline {args.baseline}: gateway share p50 {was:.2f} ms; added TTFT p50 "
            f"client {ttft[f'{BASE} client']['added_p50_ms']:.2f} ms, gateway "
            f"{ttft[f'{BASE} gateway']['added_p50_ms']:.2f} ms (this tree: "
            f"{ttft['inferq client']['added_p50_ms']:.2f}, "
            f"{ttft['inferq gateway']['added_p50_ms']:.2f})"
        )
    if "LiteLLM" in ttft:
        ours, theirs = ttft["inferq gateway"], ttft["LiteLLM"]
        lower = ours["added_p50_ms"] < theirs["added_p50_ms"]
        figures["vs_litellm"] = {"inferq_lower_p50": lower}
        _bench.note(
            f"added TTFT over direct: inferq gateway p50 {ours['added_p50_ms']:.2f} / p99 "
            f"{ours['added_p99_ms']:.2f} ms, LiteLLM p50 {theirs['added_p50_ms']:.2f} / p99 "
            f"{theirs['added_p99_ms']:.2f} ms (inferq lower at p50: {'yes' if lower else 'NO'})"
        )

    # --- throughput on llama.cpp
    if args.throughput_requests > 0:
        rows = []
        through: dict[str, Any] = {}
        for url in urls.values():  # warm-up: every slot busy once on every path
            asyncio.run(concurrent(url, MODEL, args.slots, args.slots, args.throughput_tokens))
        half = max(1, args.throughput_requests // 2)
        spent: dict[str, list[float]] = {name: [0.0, 0.0] for name in urls}
        for order in (list(urls), list(reversed(urls))):  # A B C, then C B A: drift evens out
            for name in order:
                wall, tokens, _, resent = asyncio.run(
                    concurrent(urls[name], MODEL, half, args.slots, args.throughput_tokens)
                )
                if resent:
                    _bench.note(f"{name}: {resent} requests sent again on a closed connection")
                spent[name][0] += wall
                spent[name][1] += tokens
        for name, (wall, tokens) in spent.items():
            through[name] = {"requests_per_s": 2 * half / wall, "tokens_per_s": tokens / wall}
        base = through["direct"]["requests_per_s"]
        for name, row in through.items():
            rows.append(
                [
                    name,
                    _bench.fmt(row["requests_per_s"]),
                    _bench.fmt(row["tokens_per_s"], 1),
                    _bench.fmt(row["requests_per_s"] / base),
                ]
            )
        figures["throughput"] = through
        _bench.table(
            f"Throughput on llama.cpp: {args.throughput_requests} requests per path, "
            f"{args.slots} at once, max_tokens {args.throughput_tokens}",
            ["path", "requests/s", "tokens/s", "vs direct"],
            rows,
        )

    # --- the proxies' own cost on a zero-latency backend
    if args.zero_requests > 0:
        zero_urls = {"direct (stand-in)": (f"{standin}/v1", MODEL, [])}
        zero_urls["inferq gateway"] = (zero_stack.gateway_url, MODEL, zero_stack.procs)
        if litellm is not None:
            zero_urls["LiteLLM"] = (litellm[0], STANDIN_MODEL, [litellm[1]])
        rows = []
        zero: dict[str, Any] = {}
        for name, (url, model, procs) in zero_urls.items():
            asyncio.run(concurrent(url, model, 50, args.concurrency, 5))  # warm-up
            own = procs[-1] if procs else None
            cpu0 = [p.cpu_s() for p in procs]
            wall, _, ttfts, resent = asyncio.run(
                concurrent(url, model, args.zero_requests, args.concurrency, 5)
            )
            if resent:
                _bench.note(f"{name}: {resent} requests sent again on a closed connection")
            cpu = [p.cpu_s() - c for p, c in zip(procs, cpu0, strict=True)]
            n = args.zero_requests
            entry = {
                "requests_per_s": n / wall,
                "ttft_p50_ms": ms(ttfts, 50),
                "ttft_p99_ms": ms(ttfts, 99),
            }
            if own is not None:
                entry["cpu_ms_per_request"] = cpu[-1] / n * 1000
                entry["stack_cpu_ms_per_request"] = sum(cpu) / n * 1000
            zero[name] = entry
            rows.append(
                [
                    name,
                    _bench.fmt(entry["requests_per_s"], 0),
                    _bench.fmt(entry.get("cpu_ms_per_request")),
                    _bench.fmt(entry.get("stack_cpu_ms_per_request")),
                    _bench.fmt(entry["ttft_p50_ms"]),
                    _bench.fmt(entry["ttft_p99_ms"]),
                ]
            )
        figures["zero_latency"] = zero
        _bench.table(
            f"On a zero-latency backend (stand-in, 5 deltas a request): {args.zero_requests} "
            f"streamed requests per path, {args.concurrency} at once",
            [
                "path",
                "requests/s",
                "CPU ms/req (proxy)",
                "CPU ms/req (all)",
                "TTFT p50",
                "TTFT p99",
            ],
            rows,
        )
        _bench.note(
            "CPU (proxy): the gateway's or LiteLLM's process; (all): inferq's gateway, "
            "dispatcher and worker (Redis not counted), LiteLLM's process"
        )


if __name__ == "__main__":
    main()
