"""The CLI as an operator meets it (issue 15): one error prefix, honest exit codes,
``--json`` on every action, ids never truncated, hints, progress, ready lines."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from typing import Any

import pytest

from inferq.config import Settings
from inferq.store import Store

from ..builders import inference_request, worker_info
from ..conftest import REDIS_URL
from ..helpers import ready_worker

INFERQ = [sys.executable, "-m", "inferq"]


def inferq(namespace: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``inferq ARGS`` as a process on an 80-column terminal size."""
    full_env = {
        **os.environ,
        "INFERQ_REDIS_URL": REDIS_URL,
        "INFERQ_NAMESPACE": namespace,
        "COLUMNS": "80",
        **env,
    }
    return subprocess.run(
        [*INFERQ, *args], env=full_env, capture_output=True, text=True, timeout=60
    )


def dead_letter(store: Store, settings: Settings) -> str:
    """Submit one request and fail it max_attempts times; returns its id."""
    req = inference_request(settings, priority="realtime")
    store.submit(req)
    qkey = store.keys.tenant_queue("realtime", req.route, req.tenant)
    for i in range(settings.max_attempts):
        [(_, attempt)] = store.assign("w1", f"b{i}", [(req.id, qkey, 1)])
        store.requeue([(req.id, attempt, "w1", "boom")])
    return req.id


def test_click_errors_take_inferqs_one_prefix(namespace: str) -> None:
    out = inferq(namespace, "queues", "--bogus")
    assert out.returncode == 2
    assert "error: No such option: --bogus" in out.stderr or "error: No such option" in out.stderr
    assert "Error:" not in out.stderr and "Traceback" not in out.stderr


def test_a_metrics_port_in_use_is_one_line(namespace: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = inferq(namespace, "dispatcher", "--metrics-port", str(port))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: --metrics-port {port}: 127.0.0.1:{port} is already in use "
        "(another inferq daemon? give each its own port)"
    ]


@pytest.mark.parametrize("command", ["gateway", "dashboard"])
def test_an_http_port_in_use_is_one_line_and_no_ready_line(namespace: str, command: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = inferq(namespace, command, "--port", str(port))
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("warning:")]
    assert lines == [f"error: --port {port}: cannot listen on 127.0.0.1:{port} (in use?)"]


def test_dead_letter_requeue_of_an_unknown_id_fails(
    namespace: str, store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    rid = dead_letter(store, settings)
    out = inferq(namespace, "dead-letter", "requeue", "bogus", rid, "--json")
    assert out.returncode == 1
    assert json.loads(out.stdout) == {"requeued": [rid], "not_in_dead_letter": ["bogus"]}
    assert "error: not in the dead letter: bogus" in out.stderr
    assert inferq(namespace, "dead-letter", "requeue", "bogus").returncode == 1


def test_cancel_and_drain_answer_json(namespace: str, store: Store, settings: Settings) -> None:
    req = inference_request(settings)
    store.submit(req)
    out = inferq(namespace, "cancel", req.id, "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == {"id": req.id, "state": "cancelled"}
    ready_worker(store, "w1")
    out = inferq(namespace, "drain", "w1", "--json")
    assert json.loads(out.stdout) == {"worker": "w1", "drain_requested": True}
    out = inferq(namespace, "drain", "ghost", "--json")
    assert out.returncode == 1 and "error: no live worker 'ghost'" in out.stderr


def test_drain_wait_reports_when_the_worker_left(namespace: str, store: Store) -> None:
    ready_worker(store, "w2")
    out = inferq(namespace, "drain", "w2", "--wait", "--timeout", "0.5", "--json")
    assert out.returncode == 1  # still registered (nothing drains a fake worker)
    assert json.loads(out.stdout) == {"worker": "w2", "drain_requested": True, "left": False}


def test_ids_are_never_truncated_on_80_columns(
    namespace: str, store: Store, settings: Settings
) -> None:
    long_worker = "gpu-node-a100-80gb-rack12-slot3-" + "x" * 20
    store.heartbeat(worker_info(long_worker, model="llama-3.1-70b-awq"), ttl_s=30)
    ready_worker(store, "w1")
    rid = dead_letter(store, settings)
    listed = inferq(namespace, "dead-letter", "list")
    assert rid in listed.stdout, listed.stdout
    for command in ("workers", "report"):
        out = inferq(namespace, command).stdout
        assert long_worker in out and "llama-3.1-70b-awq" in out, out
        assert max(len(line) for line in out.splitlines()) <= 80 or long_worker in out


def test_piped_tables_cut_no_cell(namespace: str, store: Store, settings: Settings) -> None:
    """Off a terminal (a pipe, CI) rich fitted tables to 80 columns: the workers table
    lost its last columns and the dead letter's cells ended in "…". Now each row is one
    whole line (for grep), up to views' PIPE_WIDTH."""
    long_worker = "gpu-node-a100-80gb-rack12-slot3-" + "x" * 30
    store.heartbeat(worker_info(long_worker, model="llama-3.1-70b-awq"), ttl_s=30)
    out = inferq(namespace, "workers")
    assert out.returncode == 0 and "…" not in out.stdout, out.stdout
    row = next(line for line in out.stdout.splitlines() if long_worker in line)
    for cell in ("llama-3.1-70b-awq", "ready", "s ago"):
        assert cell in row, out.stdout
    ready_worker(store, "w1")
    rid = dead_letter(store, settings)
    out = inferq(namespace, "dead-letter", "list")
    assert out.returncode == 0 and "…" not in out.stdout, out.stdout
    row = next(line for line in out.stdout.splitlines() if rid in line)
    assert "realtime" in row and "default" in row, out.stdout


def test_an_unused_namespace_gets_a_hint(namespace: str) -> None:
    for args in (["queues"], ["workers", "--json"], ["dead-letter", "list"]):
        out = inferq(namespace, *args)
        assert out.returncode == 0
        assert f"namespace '{namespace}' has no keys" in out.stderr, out.stderr


def test_purge_removes_the_namespaces_rq_keys_and_only_those(namespace: str, store: Store) -> None:
    from inferq.delivery import rq_connection

    conn = rq_connection(REDIS_URL)
    hexid = "0" * 26
    ours = [
        f"rq:queue:inferq:{namespace}:w:w1",
        f"rq:wip:inferq:{namespace}:w:w1",
        f"rq:job:{namespace}-{hexid}",
        f"rq:worker:{namespace}-w1",
    ]
    theirs = [f"rq:job:{namespace}-x-{hexid}", f"rq:queue:inferq:{namespace}-x:w:w1"]
    for key in ours + theirs:
        conn.hset(key, "queues", key.replace("rq:worker:", "inferq:").replace("-w1", ":w:w1"))
    conn.hset(f"rq:worker:{namespace}-w1", "queues", f"inferq:{namespace}:w:w1")
    conn.sadd("rq:queues", ours[0])
    store.submit(inference_request(store.settings))
    try:
        out = inferq(namespace, "purge", "--yes", "--json")
        assert out.returncode == 0, out.stderr
        data: dict[str, Any] = json.loads(out.stdout)
        assert data["rq_deleted"] == len(ours) and data["deleted"] > 0
        assert not any(conn.exists(k) for k in ours)
        assert all(conn.exists(k) for k in theirs)
        assert not conn.sismember("rq:queues", ours[0])
    finally:
        conn.delete(*theirs, *ours)


def test_requeue_all_shows_progress_on_a_terminal(
    namespace: str, store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    for _ in range(100):
        dead_letter(store, settings)
    out = inferq(namespace, "dead-letter", "requeue", "--all", FORCE_COLOR="1", TTY_COMPATIBLE="1")
    assert out.returncode == 0, out.stderr
    assert re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip() == "requeued 100 of 100"
    assert "requeueing" in out.stderr


@pytest.mark.parametrize("command", ["dispatcher", "scaler"])
def test_daemons_print_one_ready_line(namespace: str, command: str) -> None:
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": namespace}
    args = [command, "--metrics-port", "0"]
    if command == "scaler":
        args += ["--metrics-only"]
    proc = subprocess.Popen([*INFERQ, *args], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert line.startswith(f"inferq {command} ready: "), line
    assert f"namespace {namespace}" in line and "metrics http://127.0.0.1:" in line


def test_piped_free_text_folds_within_the_width(
    namespace: str, store: Store, settings: Settings
) -> None:
    """A fresh user's ``inferq submit "Hello" --wait > out.txt`` printed the whole output
    on one 1,406-character line: rich measures a panel by its text's full length, and
    show() widened to it. Free text (the output, a long error) folds at the width used
    (COLUMNS=80 here); the request view shows "-" for unknown tokens, the submit panel's
    labels, and the queues footer is its own line, never broken mid-phrase."""
    from inferq.client import Client
    from inferq.dispatcher.daemon import Dispatcher
    from inferq.store import Completion

    ready_worker(store, "w1")
    client = Client(settings=settings, store=store)
    rid = client.submit("Hello", priority="realtime", idempotency_key="k1").id
    Dispatcher(store).step()
    attempt = int(store.redis.hget(store.keys.req(rid), "attempts"))
    store.start("w1", [(rid, attempt)])
    text = " ".join(f"word{i}" for i in range(280))
    store.complete("w1", [Completion(rid, attempt, "succeeded", output=text)])
    out = inferq(
        namespace, "submit", "Hello", "--priority", "realtime", "--idempotency-key", "k1", "--wait"
    )
    assert out.returncode == 0, out.stderr
    assert "word279" in out.stdout and "queue wait" in out.stdout, out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout
    out = inferq(namespace, "request", rid)
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout
    assert "queue wait" in out.stdout and "e2e" in out.stdout, out.stdout
    assert "queue_wait_s" not in out.stdout and "e2e_s" not in out.stdout, out.stdout

    failed = dead_letter(store, settings)
    store.redis.hset(store.keys.req(failed), "error", "boom " * 100)
    out = inferq(namespace, "request", failed)
    assert out.returncode == 0, out.stderr
    assert "None" not in out.stdout and "tokens" in out.stdout, out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout

    out = inferq(namespace, "queues")
    footer = [line for line in out.stdout.splitlines() if "per second" in line]
    assert len(footer) == 1 and footer[0].rstrip().endswith(
        ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9")
    ), out.stdout
    assert not any(line.rstrip().endswith(",") for line in out.stdout.splitlines()), out.stdout


def test_an_unknown_task_type_gets_a_note(namespace: str, settings: Settings) -> None:
    """``--task-type foo`` was accepted silently. Task types are free-form by design (the
    classifier gives an unknown one the default class and model, and the output-token
    estimates learn any task type), so the CLI says so on stderr instead of refusing."""
    out = inferq(namespace, "submit", "hi", "--task-type", "foo")
    assert out.returncode == 0, out.stderr
    note = [line for line in out.stderr.splitlines() if "task_type" in line]
    assert len(note) == 1, out.stderr
    assert "'foo'" in note[0] and "default class" in note[0], note
    assert all(t in note[0] for t in settings.classifier), note
    out = inferq(namespace, "submit", "hi", "--task-type", next(iter(settings.classifier)))
    assert out.returncode == 0 and "task_type" not in out.stderr, out.stderr
