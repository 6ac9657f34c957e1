"""Real workers on the real model server: llama.cpp (SmolLM2-135M), a dispatcher, the real Redis.

Each test starts ``inferq worker --model smollm2-135m --backend openai`` as a
subprocess against the session's llama.cpp server (``llama_server_url``), a
dispatcher thread, and submits through :class:`~inferq.client.Client`. Token counts
are checked against the server's own tokenizer (``/apply-template`` + ``/tokenize``),
so a count the worker estimated instead of reading it would fail. SmolLM2 often
stops after a few tokens; tests that need a fixed length pass llama.cpp's
``ignore_eos`` through ``params``. Answers are tens of tokens, about a second each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.models import Result, WorkerInfo, WorkerState
from inferq.store import Store
from tests.fakes.standin_openai import StandIn

from ..conftest import REDIS_URL
from ..helpers import wait_for
from .llm_server import MODEL, LlamaServer, require

#: The worker's --slots: the server's 4 slots.
SLOTS = 4
#: --vram-mib that gives the worker the server's KV cache: int(305 x 0.9) - 94 MiB of
#: weights = 180 MiB = 8192 tokens x 23,040 bytes (what llama.cpp allocates).
VRAM_MIB = 305
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


class Stack:
    """A dispatcher thread and worker subprocesses on the real server; stopped at the end."""

    def __init__(self, settings: Settings, store: Store, server_url: str) -> None:
        self.settings = settings
        self.store = store
        self.server_url = server_url
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dispatcher = Dispatcher(Store(store.redis, settings), tick_s=0.05)
        self._thread = threading.Thread(target=self.dispatcher.run, daemon=True)
        self._thread.start()

    def worker(self, wid: str, *options: str, vram_mib: int = VRAM_MIB) -> None:
        """Start a worker with backend options ``options`` (``KEY=VALUE``); wait until ready."""
        env = {
            **os.environ,
            "INFERQ_REDIS_URL": REDIS_URL,
            "INFERQ_NAMESPACE": self.settings.namespace,
        }
        cmd = [sys.executable, "-m", "inferq", "--log-level", "INFO", "worker"]
        cmd += ["--model", MODEL, "--backend", "openai", "-o", f"base_url={self.server_url}"]
        cmd += ["--slots", str(SLOTS), "--vram-mib", str(vram_mib), "--id", wid]
        cmd += ["--heartbeat-interval", "0.2"]
        for option in options:
            cmd += ["-o", option]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        key = self.store.keys.worker(wid)
        wait_for(
            lambda: self.store.redis.hget(key, "state") == WorkerState.READY.value,
            what=f"{wid} ready",
            timeout=60,  # an event wait: a loaded host starts a worker in tens of seconds
        )

    def close(self) -> None:
        self.dispatcher.stop()
        self._thread.join(timeout=5)
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def stack(fast_settings: Settings, redis_client: Any, llama_server_url: str) -> Iterator[Stack]:
    s = Stack(fast_settings, Store(redis_client, fast_settings), llama_server_url)
    yield s
    s.close()


@pytest.fixture
def client(fast_settings: Settings, redis_client: Any) -> Client:
    return Client(settings=fast_settings, connection=redis_client)


@pytest.fixture
def llama(llama_server_url: str) -> Iterator[httpx.Client]:
    """A direct HTTP client of the server, for its tokenizer and /slots."""
    with httpx.Client(base_url=llama_server_url, trust_env=False, timeout=30) as http:
        yield http


def tokens(llama: httpx.Client, text: str) -> int:
    """Tokens of ``text`` by the server's own tokenizer (no BOS: SmolLM2 adds none)."""
    answer = llama.post("/tokenize", json={"content": text, "add_special": False}).json()
    return len(answer["tokens"])


def chat_prompt_tokens(llama: httpx.Client, messages: list[dict[str, str]]) -> int:
    """Prompt tokens of chat ``messages`` after the model's chat template."""
    prompt = llama.post("/apply-template", json={"messages": messages}).json()["prompt"]
    return tokens(llama, prompt)


def assert_succeeded(result: Result) -> str:
    assert result.status == "succeeded", result.error
    assert result.attempt == 1, f"retried: {result}"
    assert result.output, "empty output"
    return result.output


def test_a_chat_request_succeeds_with_the_models_answer_and_its_token_counts(
    stack: Stack, client: Client, llama: httpx.Client
) -> None:
    stack.worker("w1")
    greedy = {"temperature": 0.0, "seed": 1}
    handle = client.submit(
        messages=CHAT, model=MODEL, priority="realtime", max_tokens=24, params=greedy
    )
    result = handle.result(timeout=60)
    output = assert_succeeded(result)
    assert result.worker == "w1"
    assert result.prompt_tokens == chat_prompt_tokens(llama, CHAT)  # the server's usage
    assert result.completion_tokens is not None and 1 <= result.completion_tokens <= 24
    # The same greedy request sent to the server directly: the result holds its answer
    # and its usage (a re-tokenized answer may merge pieces, so count nothing again).
    direct = llama.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 24, **greedy},
        timeout=60,
    ).json()
    assert output == direct["choices"][0]["message"]["content"]
    assert result.completion_tokens == direct["usage"]["completion_tokens"]


def test_a_completion_request_succeeds_with_the_length_asked(
    stack: Stack, client: Client, llama: httpx.Client
) -> None:
    stack.worker("w1")
    handle = client.submit(
        "Once upon a time", model=MODEL, max_tokens=16, params={"ignore_eos": True}
    )
    result = handle.result(timeout=60)
    output = assert_succeeded(result)
    assert result.prompt_tokens == tokens(llama, "Once upon a time") == 4
    assert result.completion_tokens == 16
    assert abs(tokens(llama, output) - 16) <= 1  # a re-tokenized answer may merge a pair


def test_max_tokens_is_honoured(stack: Stack, client: Client) -> None:
    stack.worker("w1")
    story = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    exact = client.submit(messages=story, model=MODEL, max_tokens=7, params={"ignore_eos": True})
    capped = client.submit(messages=story, model=MODEL, max_tokens=5)
    first, second = exact.result(timeout=60), capped.result(timeout=60)
    assert_succeeded(first)
    assert_succeeded(second)
    assert first.completion_tokens == 7
    assert second.completion_tokens is not None and 1 <= second.completion_tokens <= 5


def test_requests_up_to_the_slots_run_together_on_the_server(
    stack: Stack, client: Client, llama: httpx.Client
) -> None:
    stack.worker("w1")
    busy: list[int] = []
    done = threading.Event()

    def watch_slots() -> None:  # the server's own view: how many slots decode at once
        while not done.is_set():
            slots = llama.get("/slots").json()
            busy.append(sum(1 for s in slots if s["is_processing"]))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_slots, daemon=True)
    watcher.start()
    handles = client.submit_many(
        {
            "messages": [{"role": "user", "content": f"Tell story {i} about a dragon."}],
            "model": MODEL,
            "max_tokens": 40,
            "params": {"ignore_eos": True},
        }
        for i in range(SLOTS)
    )
    results = [h.result(timeout=90) for h in handles]
    done.set()
    watcher.join(timeout=5)
    for result in results:
        assert_succeeded(result)
        assert result.completion_tokens == 40
    assert max(busy) == SLOTS
    started = [r.timings.started_at for r in results]
    finished = [r.timings.finished_at for r in results]
    assert None not in started and None not in finished
    assert max(s for s in started if s) < min(f for f in finished if f)  # all ran at once


def test_a_streaming_worker_records_the_first_token_time(stack: Stack, client: Client) -> None:
    stack.worker("w1", "stream=true")
    handle = client.submit(messages=CHAT, model=MODEL, max_tokens=12, params={"ignore_eos": True})
    result = handle.result(timeout=60)
    assert_succeeded(result)
    assert result.completion_tokens == 12  # from the usage chunk (include_usage)
    t = result.timings
    assert t.started_at is not None and t.first_token_at is not None and t.finished_at
    assert t.started_at < t.first_token_at < t.finished_at


# --- failures of the real server (issue 13) ---------------------------------------------

#: Seconds the server stays down in the outage test (issue 13 describes a 30 s restart;
#: the rule is the same for any length: retries wait, spend no attempt, and go on once
#: the worker's probe passes).
OUTAGE_S = float(os.environ.get("INFERQ_TEST_OUTAGE_S", "8"))


def test_a_server_killed_and_restarted_under_load_loses_nothing(
    fast_settings: Settings, redis_client: Any, client: Client
) -> None:
    require()
    with LlamaServer() as server:
        stack = Stack(fast_settings, Store(redis_client, fast_settings), server.url)
        try:
            stack.worker("w1", "stream=true")
            handles = client.submit_many(
                {
                    "messages": [{"role": "user", "content": f"Tell story {i} about a dragon."}],
                    "model": MODEL,
                    "max_tokens": 24,
                    "params": {"ignore_eos": True},
                    "timeout": 120,
                }
                for i in range(12)
            )
            time.sleep(1.0)  # some run, some wait
            server.kill()
            killed = time.monotonic()
            wait_for(
                lambda: (
                    stack.store.redis.hget(stack.store.keys.worker("w1"), "state") == "unhealthy"
                ),
                what="the worker unhealthy",
                timeout=30,
            )
            unhealthy_after = time.monotonic() - killed
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
            server.start()
            restarted = time.monotonic()
            results = [h.result(timeout=120) for h in handles]
            last = time.monotonic() - restarted
        finally:
            stack.close()
    statuses = [r.status for r in results]
    assert statuses == ["succeeded"] * 12, [r.error for r in results]
    assert all(r.completion_tokens == 24 for r in results)
    assert stack.store.dead_letters() == []
    stats = stack.store.redis.hgetall(stack.store.keys.stats)
    print(  # the figures of docs/reliability.md
        f"\noutage {OUTAGE_S:g} s: 12/12 succeeded, 0 dead; unhealthy {unhealthy_after:.2f} s "
        f"after the kill; last result {last:.2f} s after the restart; retried_infra "
        f"{stats.get('retried_infra', 0)}, retried {stats.get('retried', 0)}, attempts "
        f"max {max(r.attempt for r in results)}"
    )


def test_a_frozen_server_hands_its_requests_to_a_healthy_worker(
    fast_settings: Settings, redis_client: Any, client: Client
) -> None:
    """The model server stops answering without closing anything (SIGSTOP: a hung GPU, a
    paused VM): no byte and no error ever comes. Its worker's requests waited until
    their deadlines and expired while a healthy worker stood idle, and the worker stayed
    ``ready``. A stream silent for ``stall_s`` has the server's ``/health`` checked; when
    that does not answer either, the requests go back (no attempt spent) and the worker
    turns ``unhealthy``."""
    require()
    with LlamaServer() as server, StandIn() as spare:
        stack = Stack(fast_settings, Store(redis_client, fast_settings), server.url)
        assert server.proc is not None
        try:
            stack.worker("frozen", "stream=true", "stall_s=3")
            handles = [
                client.submit(
                    messages=[{"role": "user", "content": f"Tell story {i} about a dragon."}],
                    model=MODEL,
                    max_tokens=400,
                    params={"ignore_eos": True},
                    timeout=90,
                )
                for i in range(SLOTS)
            ]
            key = stack.store.keys.req(handles[0].id)
            wait_for(
                lambda: stack.store.redis.hget(key, "state") == "running",
                what="the requests running",
            )
            time.sleep(1.0)
            os.kill(server.proc.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            stack.server_url = spare.url
            stack.worker("spare", "stream=true")
            results = [h.result(timeout=85) for h in handles]
            moved_after = time.monotonic() - frozen
            # unhealthy at once, not after a probe's 5 s timeout
            wait_for(
                lambda: (
                    stack.store.redis.hget(stack.store.keys.worker("frozen"), "state")
                    == "unhealthy"
                ),
                what="the frozen worker unhealthy",
                timeout=3,
            )
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            stack.close()
    assert [r.status for r in results] == ["succeeded"] * SLOTS, [r.error for r in results]
    assert {r.worker for r in results} == {"spare"}
    assert stack.store.dead_letters() == []
    print(f"\nfrozen server: {SLOTS}/{SLOTS} moved and succeeded {moved_after:.1f} s after SIGSTOP")


def test_a_deadline_stops_the_generation_on_the_server(
    stack: Stack, client: Client, llama: httpx.Client
) -> None:
    """The expired request's generation stops on the server: the server decodes far fewer
    than its ``max_tokens`` (llama.cpp's own count, which includes an abandoned
    generation), whatever the host's speed; a fixed wait for idle slots failed on a
    loaded host, where the server reaches the next token slowly."""
    stack.worker("w1", "stream=true")
    wait_for(lambda: not busy_slots(llama), what="the server idle before the test")
    before = tokens_predicted(llama)
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    handle = client.submit(
        messages=story, model=MODEL, max_tokens=1500, params={"ignore_eos": True}, timeout=2.0
    )
    result = handle.result(timeout=30)
    assert result.status == "expired"
    wait_for(lambda: not busy_slots(llama), what="every server slot idle", timeout=60)
    decoded = tokens_predicted(llama) - before
    assert decoded < 1500 // 2, f"the server decoded {decoded} of 1,500 tokens after the deadline"


def busy_slots(llama: httpx.Client) -> int:
    """Slots of the llama.cpp server processing a request now."""
    return sum(1 for s in llama.get("/slots").json() if s["is_processing"])


def tokens_predicted(llama: httpx.Client) -> float:
    """llama.cpp's ``llamacpp:tokens_predicted_total`` (tokens it generated, an abandoned
    generation's included)."""
    for line in llama.get("/metrics").text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return float(line.split()[1])
    raise AssertionError("the server's /metrics has no llamacpp:tokens_predicted_total")


def test_a_streamed_request_reaches_the_caller_chunk_by_chunk(stack: Stack, client: Client) -> None:
    """handle.stream() on the real server: the first chunk arrives before the request ends,
    the chunks add up to the result, and the first chunk carries the first-token time."""
    from inferq.models import StreamChunk

    stack.worker("w1")  # not stream=true: a streamed request streams on its own
    handle = client.submit(
        "Once upon a time", model=MODEL, max_tokens=48, params={"ignore_eos": True}, stream=True
    )
    arrivals: list[tuple[float, StreamChunk]] = []
    result: Result | None = None
    for item in handle.stream(timeout=60):
        if isinstance(item, StreamChunk):
            arrivals.append((time.time(), item))
        else:
            result = item
    assert result is not None
    assert_succeeded(result)
    chunks = [c for _, c in arrivals]
    assert not any(c.reset for c in chunks)
    assert "".join(c.delta for c in chunks) == result.output
    assert chunks[-1].finish_reason == "length"
    assert len(chunks) > 5  # llama.cpp sends a token per event; the worker may coalesce some
    finished = result.timings.finished_at
    assert finished is not None and arrivals[0][0] < finished  # before the request finished
    assert chunks[0].first_token_at is not None
    assert result.timings.first_token_at is not None
    assert abs(chunks[0].first_token_at - result.timings.first_token_at) < 0.05


# --- measured capacity: the server's own figures in the heartbeat (issue 13) -------------


def test_the_heartbeat_carries_the_servers_own_slots_and_kv_figures(
    stack: Stack, client: Client, llama: httpx.Client
) -> None:
    """What the worker advertises of the server equals what /props and /slots say: its
    slot count, its KV tokens (the slots' n_ctx), the tokens its running slot holds, and
    the KV room that leaves (x 23,040 bytes a token of SmolLM2)."""
    stack.worker("w1")
    spec = stack.settings.model_by_name[MODEL]
    key = stack.store.keys.worker("w1")

    def beat() -> WorkerInfo:
        return WorkerInfo.from_fields(stack.store.redis.hgetall(key))

    def idle() -> bool:
        server = beat().server
        return server.running == 0 and not any(
            s["is_processing"] for s in llama.get("/slots").json()
        )

    wait_for(idle, what="the server idle in the heartbeat and in /slots", timeout=30)
    props, slots, info = llama.get("/props").json(), llama.get("/slots").json(), beat()
    assert info.server.slots == props["total_slots"] == len(slots) == SLOTS
    assert info.server.kv_tokens == sum(s["n_ctx"] for s in slots) == 8192
    assert (info.server.kv_used_tokens, info.server.running, info.server.waiting) == (0, 0, 0)
    assert info.kv_measured_free_mib == 8192 * spec.kv_bytes_per_token / 2**20 == 180.0
    assert info.vram_measured_free_mib is None  # no NVML on this machine: nothing invented

    prompt = tokens(llama, "Once upon a time")
    handle = client.submit(
        "Once upon a time", model=MODEL, max_tokens=400, params={"ignore_eos": True}
    )
    wait_for(lambda: beat().server.running == 1, what="a running slot in the heartbeat", timeout=30)
    info = beat()
    held = [s["n_prompt_tokens"] for s in llama.get("/slots").json() if s["is_processing"]]
    used = info.server.kv_used_tokens
    assert used is not None and prompt <= used <= prompt + 400  # prompt only: not decoding yet
    assert held and held[0] >= used  # the slot holds as many or more tokens a moment later
    assert info.kv_measured_free_mib == (8192 - used) * spec.kv_bytes_per_token / 2**20
    assert_succeeded(handle.result(timeout=90))
    wait_for(idle, what="the slot released in the heartbeat", timeout=30)
    assert beat().server.kv_used_tokens == 0


def test_routing_takes_the_servers_kv_room_when_the_bookkeeping_promises_more(
    stack: Stack, llama: httpx.Client
) -> None:
    """A worker told of a card 10x too large books 2,651 MiB of KV cache; the server it
    runs on holds 8,192 tokens (180 MiB): the dispatcher's view of it is the smaller."""
    stack.worker("w1", vram_mib=10 * VRAM_MIB)
    spec = stack.settings.model_by_name[MODEL]
    booked = spec.kv_cache_mib(10 * VRAM_MIB)
    assert booked == 2651
    server_mib = sum(s["n_ctx"] for s in llama.get("/slots").json()) * spec.kv_bytes_per_token
    classes = [c.name for c in stack.settings.classes]

    def view() -> Any:
        (worker,) = stack.store.dispatch_view(classes, 8, 3.0).snapshot.workers
        return worker

    wait_for(lambda: view().free_mib < booked, what="the measured room in the view", timeout=30)
    worker = view()
    assert worker.kv_cache_mib == booked
    assert worker.measured_free_mib == worker.free_mib == server_mib / 2**20 == 180.0
