"""Smoke tests of scripts/bench_*.py: each runs at tiny sizes, prints its table, writes JSON.

Nothing here times anything: the figures' values are not checked, only that each
script runs end to end on the real Redis, reports under its documented keys and
leaves no key behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from ..conftest import REDIS_URL

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _bench  # noqa: E402


def run_script(name: str, tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Run ``scripts/<name>`` with ``--json``; returns its stdout and the parsed JSON."""
    out = tmp_path / "figures.json"
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_BENCH_NAMESPACE": PREFIX}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert {"date", "command", "machine"} <= set(doc)
    assert doc["machine"]["cpus"] == os.cpu_count()
    return proc.stdout, doc


#: Namespace prefix of the scripts these tests run (``_bench.new_namespace``).
PREFIX = f"smoke{os.getpid()}x"


def bench_keys(client: redis.Redis) -> set[str]:
    return {str(k) for k in client.scan_iter(match=f"*{PREFIX}*", count=5000)}


@pytest.fixture
def no_leftovers(redis_client: redis.Redis) -> Any:
    """Fail when a script leaves keys of its namespace behind."""
    yield
    assert bench_keys(redis_client) == set()


@pytest.mark.usefixtures("no_leftovers")
def test_bench_submit(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_submit.py", tmp_path, "--requests", "20", "--chunk", "7", "--rounds", "1"
    )
    assert "Submissions per second" in stdout and "inferq / RQ" in stdout
    rates = doc["submissions_per_s"]
    assert set(rates) == {"inferq_single", "inferq_submit_many", "rq_enqueue", "rq_enqueue_many"}
    assert all(v > 0 for v in rates.values())
    assert doc["ratio_submit_many_to_rq_enqueue_many"] > 0


@pytest.mark.usefixtures("no_leftovers")
def test_bench_dispatch(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_dispatch.py",
        tmp_path,
        *("--queued", "60", "--workers", "6", "9", "--slots", "4", "--idle-steps", "2"),
        *("--busy-steps", "2", "--full-steps", "1", "--free-workers", "2", "--warmup", "0"),
        *("--baseline-jobs", "3"),
    )
    assert "Dispatcher: 60 queued" in stdout and "Where a step's time goes" in stdout
    scenarios = doc["scenarios"]
    assert set(scenarios) == {"idle", "busy", "full"}
    assert scenarios["idle"]["batches"] > 0 and scenarios["idle"]["batch_size_max"] <= 4
    assert scenarios["full"]["batches"] == 0
    assert isinstance(scenarios["busy"]["goal_met"], bool)
    assert doc["rq_enqueue_ms_p50"] > 0
    assert [f["workers"] for f in doc["fleets"]] == [6, 9] and "9 heartbeating workers" in stdout
    assert scenarios["busy"]["heartbeats_read_per_step"] < 6  # only the changed workers


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.usefixtures("no_leftovers")
def test_bench_heartbeat(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_heartbeat.py", tmp_path, "--seconds", "1", "--interval", "0.2", "--held", "4"
    )
    assert "heartbeat process" in stdout
    assert [m["mode"] for m in doc["modes"]] == ["forked", "fresh interpreter"]
    for mode in doc["modes"]:
        assert mode["beats"] > 0 and mode["memory_mib"]["rss"] > 0
    assert doc["baseline_cpu_ms_per_beat"] > 0


def test_bench_worker(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_worker.py", tmp_path, "--sizes", "1,3", "--batches", "4", "--rounds", "1"
    )
    assert "Worker path per batch" in stdout
    assert set(doc["by_batch_size"]) == {"1", "3"}
    three = doc["by_batch_size"]["3"]
    assert three["ms_per_batch"] > 0 and three["ratio_to_rq_job"] > 0
    assert three["store_ms_per_batch"]["start_and_read"] > 0  # the worker's one start call
    assert doc["rq_noop_ms_per_job"] > 0


@pytest.mark.usefixtures("no_leftovers")
def test_bench_e2e(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_e2e.py",
        tmp_path,
        *("--workers", "1", "--requests", "40", "--rq-jobs", "10"),
        *("--latency-requests", "5", "--rate", "100", "--rq-workers", "SimpleWorker"),
    )
    assert "End-to-end throughput" in stdout and "Added latency" in stdout
    assert doc["throughput"]["requests"] == 40 and doc["throughput"]["requests_per_s"] > 0
    assert 1 <= doc["throughput"]["batch_size_mean"] <= 40
    assert set(doc["throughput"]["cpu_ms_per_1000"]) == {"dispatcher", "workers", "redis-server"}
    assert doc["rq_baselines"]["SimpleWorker"]["jobs"] == 10
    assert doc["latency"]["added_ms_p50"] >= 0
    assert isinstance(doc["throughput_goal_met"]["SimpleWorker"], bool)


@pytest.mark.usefixtures("no_leftovers")
def test_bench_e2e_latency_against_a_baseline(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_e2e.py",
        tmp_path,
        *("--workers", "1", "--latency-only", "--latency-requests", "4", "--rate", "50"),
        *("--baseline", "HEAD", "--private-redis"),
    )
    assert "Added latency" in stdout and "baseline HEAD" in stdout
    assert "throughput" not in doc
    assert doc["latency"]["requests"] == 4 and doc["baseline"]["latency"]["requests"] == 4
    assert doc["baseline"]["rev"] == "HEAD" and doc["private_redis"] is True


def test_bench_handoff(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_handoff.py", tmp_path, "--handoffs", "5", "--rounds", "1", "--gap-ms", "10"
    )
    assert "Hand-off" in stdout
    assert set(doc["transports"]) == {"rq", "list", "floor"}
    assert all(t["handoffs"] == 5 and t["ms_p50"] > 0 for t in doc["transports"].values())


def test_trace_latency(tmp_path: Path) -> None:
    stdout, doc = run_script("trace_latency.py", tmp_path, "--requests", "6", "--gap-ms", "40")
    assert "Path of a realtime request" in stdout
    assert doc["requests"] >= 3  # a path cut by the end of the trace is left out
    marks = doc["milestones"]
    assert 0 < marks["wake"]["at_ms_p50"] < marks["assign"]["at_ms_p50"]
    assert marks["assign"]["at_ms_p50"] < marks["start"]["at_ms_p50"]
    # The worker's way from the enqueue to the start: RQ's dequeue of the job and the
    # start script (a dequeue that timed out meanwhile adds its own round trip).
    assert 2 <= doc["round_trips"]["worker enqueue -> start"] <= 3


@pytest.mark.usefixtures("no_leftovers")
def test_bench_memory(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_memory.py", tmp_path, "--queued", "200", "--prompt-bytes", "100"
    )
    assert "Redis memory per queued item" in stdout
    ours = doc["inferq"]
    assert ours["keys"] > 200  # a hash per request plus the shared keys
    assert ours["by_kind_bytes_per_item"]["request hashes"] > 100  # the prompt is in it
    assert doc["rq_baseline"]["key_bytes_per_item"] > 100


def test_bench_redis_ops(tmp_path: Path) -> None:
    stdout, doc = run_script("bench_redis_ops.py", tmp_path, "--requests", "20", "--idle-s", "0.5")
    assert "Redis commands per request" in stdout and "ceiling of one primary" in stdout
    for phase in ("one by one", "burst"):
        figures = doc["phases"][phase]
        # Every request runs at least the submit script and the worker's complete script.
        assert figures["buckets"]["client lua inferq"] >= 1
        assert figures["buckets"]["workers lua inferq"] >= 1
        assert figures["commands"] > 10 and figures["server_cpu_us"] > 0
    # Batches of one cost more per request than full batches.
    assert doc["phases"]["one by one"]["commands"] > doc["phases"]["burst"]["commands"]


def test_help_names_the_size_options() -> None:
    for name, option in (
        ("bench_submit.py", "--requests"),
        ("bench_dispatch.py", "--queued"),
        ("bench_worker.py", "--sizes"),
        ("bench_e2e.py", "--rate"),
        ("bench_memory.py", "--prompt-bytes"),
        ("bench_redis_ops.py", "--requests"),
        ("trace_latency.py", "--gap-ms"),
        ("bench_handoff.py", "--handoffs"),
        ("bench_prefix_llama.py", "--conversations"),
    ):
        proc = subprocess.run(
            [sys.executable, str(SCRIPTS / name), "--help"], capture_output=True, text=True
        )
        assert proc.returncode == 0 and option in proc.stdout and "--json" in proc.stdout


def test_purge_removes_inferq_and_rq_keys_of_the_namespace_only(
    redis_client: redis.Redis,
) -> None:
    ns, other = _bench.new_namespace(), _bench.new_namespace()
    for n in (ns, other):
        redis_client.set(f"inferq:{n}:req:x", "1")
        redis_client.set(f"rq:job:{n}-1", "1")
        redis_client.sadd("rq:queues", f"rq:queue:inferq:{n}:w:w1")
    try:
        assert _bench.purge(redis_client, ns) == 2
        assert not redis_client.exists(f"inferq:{ns}:req:x", f"rq:job:{ns}-1")
        assert not redis_client.sismember("rq:queues", f"rq:queue:inferq:{ns}:w:w1")
        assert redis_client.exists(f"inferq:{other}:req:x", f"rq:job:{other}-1") == 2
        assert redis_client.sismember("rq:queues", f"rq:queue:inferq:{other}:w:w1")
    finally:
        _bench.purge(redis_client, other)


def test_bench_sim_script_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    script = SCRIPTS / "bench_sim.py"
    args = [sys.executable, str(script), "--duration", "30", "--policy", "inferq", "--mix"]
    done = subprocess.run([*args, "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["workload"], r["policy"]) for r in rows] == [
        ("conv", "inferq"),
        ("unservable", "inferq"),
        ("mix", "inferq"),
    ]
    assert all(r["requests"] > 0 and r["decisions"] > 0 for r in rows)
    assert rows[1]["requests"] > rows[0]["requests"]  # the unservable twins
    assert all(r["cpu_s"] > 0 and r["wall_s_per_hour"] > 0 for r in rows)
    assert rows[0]["within_budget"] is None  # only judged on the full trace


@pytest.mark.usefixtures("no_leftovers")
def test_bench_stream(tmp_path: Path) -> None:
    stdout, doc = run_script(
        "bench_stream.py", tmp_path, "--chunks", "20", "--rounds", "1", "--interval-ms", "1"
    )
    assert "Latency per chunk" in stdout
    assert doc["through Redis (publish_chunks -> stream())"]["n"] == 20
    assert "p50" in doc["added_ms"]
