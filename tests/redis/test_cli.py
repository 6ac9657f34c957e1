"""Every CLI command through click's runner against the real Redis."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner
from rich.console import Console

from inferq.cli.main import cli
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.store import Chunk, Completion, Store

from ..conftest import REDIS_URL
from ..helpers import ready_worker, wait_for


@pytest.fixture
def run(namespace: str):  # type: ignore[no-untyped-def]
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None) -> object:
        return runner.invoke(
            cli, ["--redis-url", REDIS_URL, "--namespace", namespace, *args], input=input
        )

    return invoke


def test_submit_request_cancel_and_json(run, store: Store) -> None:  # type: ignore[no-untyped-def]
    out = run("submit", "hello", "--priority", "realtime", "--json")
    assert out.exit_code == 0, out.output
    rid = json.loads(out.stdout)["id"]
    # Nothing serves llama-3.1-8b: said on stderr (a queue may hold work before its workers)
    assert "no live worker and no scaler pool serves model 'llama-3.1-8b'" in out.stderr
    assert f"{rid} waits until one does" in out.stderr
    shown = run("request", rid, "--json")
    data = json.loads(shown.output)
    assert data["state"] == "queued" and data["priority"] == "realtime"
    assert "hello" not in shown.output  # the prompt is not echoed back
    assert "queued" in run("request", rid).output
    assert run("cancel", rid).output.strip() == "cancelled"


def test_submit_chat_sends_a_user_message_and_says_nothing_when_served(  # type: ignore[no-untyped-def]
    run, store: Store
) -> None:
    ready_worker(store, "w1")
    out = run("submit", "What is the capital of France?", "--chat", "--json")
    assert out.exit_code == 0, out.output
    assert out.stderr == ""
    payload = store.record(json.loads(out.stdout)["id"]).request.payload
    assert payload.prompt is None
    assert [m.model_dump(exclude_none=True) for m in payload.messages or []] == [
        {"role": "user", "content": "What is the capital of France?"}
    ]


class _Serving(threading.Thread):
    """A thread whose :meth:`join` raises what its target raised (a ``wait_for`` that
    timed out names its wait, instead of the test failing later on the CLI's expiry)."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:  # handed to join
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _serve(store: Store, chunks: tuple[str, ...] = ()) -> _Serving:
    """Serve, from a thread started here, the one request the CLI is about to submit: step
    a dispatcher until it is dispatched to w1 (the in-process CLI can take longer to
    submit than any fixed sleep on a loaded host), start it, publish ``chunks`` and
    complete it with output "pong". The thread's ``join`` raises the serving's error."""

    def serve() -> None:
        dispatcher = Dispatcher(store)
        wait_for(lambda: dispatcher.step().dispatched > 0, 30, "the CLI's request dispatched")
        for rid in store.redis.smembers(store.keys.inflight("w1")):
            attempt = int(store.redis.hget(store.keys.req(rid), "attempts"))
            store.start("w1", [(rid, attempt)])
            store.publish_chunks(
                [Chunk(rid, attempt, i, text, i + 1) for i, text in enumerate(chunks)]
            )
            store.complete("w1", [Completion(rid, attempt, "succeeded", output="pong")])

    thread = _Serving(target=serve)
    thread.start()
    return thread


def test_submit_reads_stdin_and_waits(run, store: Store, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    ready_worker(store, "w1")
    thread = _serve(store)
    out = run("submit", "--priority", "realtime", "--wait", "--json", input="ping\n")
    thread.join()
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["output"] == "pong"
    assert data["e2e_s"] >= 0 and "ttft_s" in data  # no first token reported: ttft_s None


def test_submit_stream_prints_chunks_then_the_result(run, store: Store) -> None:  # type: ignore[no-untyped-def]
    ready_worker(store, "w1")
    thread = _serve(store, ("po", "ng"))
    out = run("submit", "ping", "--priority", "realtime", "--stream", "--json")
    thread.join()
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["delta"] for line in lines[:-1]] == ["po", "ng"]
    assert lines[-1]["output"] == "pong" and lines[-1]["status"] == "succeeded"
    assert lines[-1]["e2e_s"] > 0 and lines[-1]["queue_wait_s"] >= 0
    # As text: the output as it came, then a panel with the timings, not the text again.
    thread = _serve(store, ("po", "ng"))
    out = run("submit", "ping", "--priority", "realtime", "--stream")
    thread.join()
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith("pong\n") and out.stdout.count("pong") == 1
    assert "e2e" in out.stdout and "succeeded" in out.stdout


def test_refusals_are_one_line_with_a_nonzero_exit(run) -> None:  # type: ignore[no-untyped-def]
    out = run("submit", "hi", "--max-tokens", "0")
    assert out.exit_code == 1
    assert out.output.strip() == (
        "error: max_tokens: 0 is outside 1..131072 (max context of llama-3.1-8b)"
    )
    out = run("submit", "hi", "--priority", "urgent")
    assert "unknown class 'urgent'" in out.output and "Traceback" not in out.output
    out = run("request", "nope")
    assert out.exit_code == 1 and "no request 'nope'" in out.output
    out = CliRunner().invoke(cli, ["--redis-url", "redis://u:secret@127.0.0.1:1/0", "queues"])
    assert out.exit_code == 1
    assert "redis://u:***@127.0.0.1:1/0" in out.output and "secret" not in out.output


def test_queues_workers_events_report(run, store: Store, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    ready_worker(store, "w1", slots=2)
    for _ in range(3):
        run("submit", "x", "--priority", "realtime")
    Dispatcher(store).step()
    queues = json.loads(run("queues", "--json").output)
    assert queues == [
        {
            "class": "realtime",
            "route": "llama-3.1-8b",
            "queued": 1,
            "oldest_wait_s": pytest.approx(0, abs=5),
        }
    ]
    assert "realtime" in run("queues").output
    workers = json.loads(run("workers", "--json").output)
    assert workers[0]["id"] == "w1" and workers[0]["slots_used"] == 2
    assert "w1" in run("workers").output
    lines = run("events", "--json", "--count", "10").output.strip().splitlines()
    events = [json.loads(line) for line in lines]
    assert events[-1]["type"] == "dispatch" and events[-1]["n"] == 2  # a number, not "2"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", events[-1]["at"])
    assert isinstance(events[-1]["at_epoch_s"], float)
    submit = next(e for e in events if e["type"] == "submit")
    assert submit["tenant"] == "default" and isinstance(submit["id"], str)
    # id is always the request's; the stream entry is event_id, on every event
    assert all(re.fullmatch(r"\d+-\d+", e["event_id"]) for e in events)
    assert "id" not in events[-1] and not re.fullmatch(r"\d+-\d+", submit["id"])
    assert "dispatch" in run("events").output
    report = json.loads(run("report", "--json").output)
    assert report["queued"] == 1 and report["counters"]["submitted"] == 3
    assert report["workers"][0]["id"] == "w1"
    assert "recent events" in run("report").output


def test_top_renders_until_interrupted(run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    calls = {"n": 0}

    real_sleep, cli_thread = time.sleep, threading.current_thread()

    def fake_sleep(seconds: float) -> None:  # the CLI's sleeps; another thread's are its own
        if threading.current_thread() is not cli_thread:
            return real_sleep(seconds)
        calls["n"] += 1
        if calls["n"] > 1:
            raise KeyboardInterrupt

    monkeypatch.setattr("inferq.cli.main.time.sleep", fake_sleep)
    # Without a terminal (CliRunner's output is none): the view once, no live loop.
    out = run("top", "--interval", "0.01")
    assert out.exit_code == 0 and "queued" in out.output and calls["n"] == 0
    terminal = Console(force_terminal=True)
    monkeypatch.setattr("inferq.cli.main.console", lambda: terminal)
    out = run("top", "--interval", "0.01")
    assert out.exit_code == 0 and "queued" in out.output and calls["n"] == 2


def test_drain_and_dead_letter(run, store: Store, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    ready_worker(store, "w1")
    assert run("drain", "w1").exit_code == 0
    assert store.redis.exists(store.keys.drain("w1"))
    out = run("drain", "ghost")
    assert out.exit_code == 1 and "no live worker 'ghost'" in out.output
    ready_worker(store, "w2")  # w1 takes nothing new once asked to drain
    rid = json.loads(run("submit", "x", "--priority", "realtime", "--json").stdout)["id"]
    for i in range(settings.max_attempts):
        qkey = store.keys.tenant_queue("realtime", "llama-3.1-8b", "default")
        [(_, attempt)] = store.assign("w2", f"b{i}", [(rid, qkey, 1)])
        store.requeue([(rid, attempt, "w2", "boom")])
    listed = json.loads(run("dead-letter", "list", "--json").output)
    assert [r["id"] for r in listed] == [rid] and "boom" in listed[0]["result"]["error"]
    assert "boom" in run("dead-letter", "list").output
    assert run("dead-letter", "requeue").exit_code == 2
    assert run("purge", "--yes").exit_code == 0
    empty = run("dead-letter", "requeue", "--all")
    assert empty.exit_code == 0 and empty.output.strip() == "requeued 0 of 0"
    rid = json.loads(run("submit", "x", "--priority", "realtime", "--json").stdout)["id"]
    ready_worker(store, "w2")
    for i in range(settings.max_attempts):
        qkey = store.keys.tenant_queue("realtime", "llama-3.1-8b", "default")
        [(_, attempt)] = store.assign("w2", f"c{i}", [(rid, qkey, 1)])
        store.requeue([(rid, attempt, "w2", "boom")])
    done = json.loads(run("dead-letter", "requeue", "--all", "--json").output)
    assert done == {"requeued": [rid], "not_in_dead_letter": []}
    assert json.loads(run("request", rid, "--json").output)["state"] == "queued"


def test_purge_asks_first(run, store: Store) -> None:  # type: ignore[no-untyped-def]
    run("submit", "x")
    out = run("purge", input="n\n")
    assert out.exit_code == 1 and "Aborted" in out.output
    assert list(store.redis.scan_iter(match=store.keys.pattern()))
    out = run("purge", input="y\n")
    assert out.exit_code == 0 and "deleted" in out.output
    assert not list(store.redis.scan_iter(match=store.keys.pattern()))


def test_dispatcher_command_runs_and_stops_on_sigterm(namespace: str) -> None:
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": namespace}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferq", "--log-level", "INFO", "dispatcher"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # blocks until the daemon says it is ready
    assert first.startswith(b"inferq dispatcher ready: redis "), first
    assert f"namespace {namespace}, metrics off".encode() in first
    assert b"dispatcher started" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def dead_letter_one(run, store: Store, settings: Settings, tag: str) -> str:  # type: ignore[no-untyped-def]
    """Submit a realtime request and fail it max_attempts times on w2: dead-lettered."""
    rid: str = json.loads(run("submit", "x", "--priority", "realtime", "--json").output)["id"]
    qkey = store.keys.tenant_queue("realtime", "llama-3.1-8b", "default")
    for i in range(settings.max_attempts):
        [(_, attempt)] = store.assign("w2", f"{tag}{i}", [(rid, qkey, 1)])
        store.requeue([(rid, attempt, "w2", "boom")])
    return rid


def test_dead_letter_delete_and_retention(run, store: Store, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    ready_worker(store, "w2")
    first, second, third = (dead_letter_one(run, store, settings, t) for t in "abc")
    assert store.redis.ttl(store.keys.req(first)) == -1  # kept for inspection, not expired
    assert run("dead-letter", "delete").exit_code == 2  # ids or --all
    assert run("dead-letter", "delete", first, "--all").exit_code == 2
    result = run("dead-letter", "delete", first, "nobody", "--json")
    assert result.exit_code == 1 and "not in the dead letter: nobody" in result.output
    out = json.loads(result.output[: result.output.rindex("}") + 1])
    assert out == {"deleted": [first], "not_in_dead_letter": ["nobody"]}
    assert not store.redis.exists(store.keys.req(first), store.keys.done(first))
    assert store.dead_letters() == [second, third]
    # retention: the dispatcher's tick deletes what was dead-lettered too long ago
    store.redis.zadd(store.keys.dead, {second: 0})  # dead-lettered in 1970
    assert store.delete_dead() == [second]
    assert store.dead_letters() == [third] and not store.redis.exists(store.keys.req(second))
    assert run("dead-letter", "delete", "--all").output.strip() == "deleted 1 of 1"
    assert store.dead_letters() == [] and store.stats()["dead_deleted"] == 3
