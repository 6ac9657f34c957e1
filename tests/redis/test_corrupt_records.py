"""Garbage planted directly in Redis while a dispatcher, a scaler and a worker run.

Each kind of garbage is quarantined (moved aside, the reason in the
``quarantine`` hash, which ``inferq report`` shows), and no daemon crashes or
stalls: requests submitted afterwards still finish.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from inferq.cli.main import cli
from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import job_id, rq_connection, worker_queue
from inferq.dispatcher.daemon import Dispatcher
from inferq.ids import new_id
from inferq.models import WorkerState
from inferq.policy.scaling import ModelLimits, ScalingConfig
from inferq.scaler.daemon import Mode, Scaler, ScalerReport
from inferq.store import Store

from ..builders import inference_request, worker_info
from ..conftest import REDIS_URL
from ..helpers import plant_queued, queued_ids, wait_for

MODEL = "llama-3.1-8b"


@dataclass
class System:
    """A worker subprocess, a dispatcher thread and a scaler thread (metrics mode)."""

    settings: Settings
    store: Store
    client: Client
    worker: subprocess.Popen[bytes]
    worker_log: Path
    dispatcher: Dispatcher | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    scaler_steps: list[ScalerReport] = field(default_factory=list)

    def start_dispatcher(self) -> None:
        self.dispatcher = Dispatcher(Store(self.store.redis, self.settings), tick_s=0.05)
        thread = threading.Thread(target=self.dispatcher.run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop_dispatcher(self) -> None:
        assert self.dispatcher is not None
        self.dispatcher.stop()
        self.threads.pop().join(timeout=10)

    def start_scaler(self) -> None:
        config = ScalingConfig(limits={MODEL: ModelLimits(1, 2, 0)}, interval_s=0.1)
        scaler = Scaler(Store(self.store.redis, self.settings), config=config, mode=Mode.METRICS)
        step = scaler.step

        def counted() -> ScalerReport:
            report = step()
            self.scaler_steps.append(report)
            return report

        scaler.step = counted  # type: ignore[method-assign]
        thread = threading.Thread(target=scaler.run, daemon=True)
        thread.start()
        self.threads.insert(0, thread)
        self.stop_scaler = scaler.stop

    def alive(self) -> None:
        """Every daemon still runs (the worker's output is shown when it died)."""
        assert all(t.is_alive() for t in self.threads), "a daemon thread died"
        assert self.worker.poll() is None, self.worker_log.read_text()

    def finishes(self, n: int) -> None:
        """``n`` fresh requests all succeed: nothing stalls."""
        handles = self.client.submit_many(
            {"prompt": f"after {i}", "priority": "realtime", "max_tokens": 8} for i in range(n)
        )
        assert all(h.result(timeout=30).status == "succeeded" for h in handles)


@pytest.fixture
def system(namespace: str, redis_client, tmp_path: Path) -> Iterator[System]:  # type: ignore[no-untyped-def]
    settings = Settings.load(
        redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.2, lease_s=1.0
    )
    store = Store(redis_client, settings)
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": namespace}
    env.update(INFERQ_HEARTBEAT_INTERVAL_S="0.2", INFERQ_LEASE_S="1.0")
    cmd = [sys.executable, "-m", "inferq", "--log-level", "info", "worker", "--model", MODEL]
    cmd += ["--vram-mib", "24576", "--id", "w1", "--heartbeat-interval", "0.2"]
    cmd += ["-o", "time_scale=0.05"]
    log = tmp_path / "w1.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = Client(settings=settings, connection=redis_client)
    sys_ = System(settings, store, client, worker, log)
    wait_for(
        lambda: store.redis.hget(store.keys.worker("w1"), "state") == WorkerState.READY.value,
        what="worker w1 ready",
    )
    sys_.start_scaler()
    sys_.start_dispatcher()
    yield sys_
    sys_.stop_scaler()
    if sys_.dispatcher is not None:
        sys_.dispatcher.stop()
    for t in sys_.threads:
        t.join(timeout=10)
    if worker.poll() is None:
        worker.kill()
    worker.wait(timeout=10)


def plant_request(store: Store, settings: Settings, **overrides: str) -> str:
    """A request hash written by hand (``overrides`` replace fields; '' deletes one), queued."""
    req = inference_request(settings, priority="realtime", max_tokens=8)
    fields = {**req.to_fields(), "state": "queued", **overrides}
    fields = {k: v for k, v in fields.items() if v != ""}
    store.redis.hset(store.keys.req(req.id), mapping=fields)
    plant_queued(store, "realtime", MODEL, req.tenant, req.id, req.submitted_at * 1000)
    store.redis.zadd(store.keys.deadlines, {req.id: req.deadline * 1000})
    return req.id


def plant_truncated_job(system: System, data: bytes | None) -> tuple[str, list[str]]:
    """Claim two queued requests for w1 as a dispatcher would, then enqueue a broken RQ job.

    ``data`` None leaves the job hash without ``data``; otherwise it is the raw value.
    The dispatcher is paused meanwhile so it does not dispatch them itself. Returns the
    job's key and the two request ids.
    """
    store, keys = system.store, system.store.keys
    system.stop_dispatcher()
    handles = system.client.submit_many(
        {"prompt": "held", "priority": "realtime", "max_tokens": 8} for _ in range(2)
    )
    batch = new_id()
    qkey = keys.tenant_queue("realtime", MODEL, "default")
    claimed = store.assign("w1", batch, [(h.id, qkey, 1.0) for h in handles])
    assert len(claimed) == 2
    rq = rq_connection(system.settings.redis_url)
    queue = worker_queue(rq, keys, "w1")
    jid = job_id(keys, batch)
    mapping: dict[Any, Any] = {"origin": queue.name, "status": "queued"}
    if data is not None:
        mapping["data"] = data
    rq.hset(f"rq:job:{jid}", mapping=mapping)
    rq.rpush(queue.key, jid)
    system.start_dispatcher()
    return f"rq:job:{jid}", [h.id for h in handles]


def test_garbage_is_quarantined_and_no_daemon_stalls(system: System, namespace: str) -> None:
    store, keys, settings = system.store, system.store.keys, system.settings
    system.finishes(5)
    now_ms = store.now() * 1000
    missing = plant_request(store, settings, tenant="", submitted_ms="")
    mistyped = plant_request(store, settings, prompt_tokens="many")
    bad_payload = plant_request(store, settings, payload="{not json")
    plant_queued(store, "realtime", MODEL, "default", "ghost", now_ms)  # an id with no record
    store.redis.set(keys.req("stringy"), "not a hash")  # a non-hash value at a request key
    plant_queued(store, "realtime", MODEL, "default", "stringy", now_ms)
    store.redis.zadd(keys.deadlines, {"stringy": now_ms - 1000})  # due: the expiry meets it
    nonsense = worker_info("bogus").to_fields() | {"vram_total_mib": "-12", "kv_cache_mib": "lots"}
    store.redis.hset(keys.worker("bogus"), mapping=nonsense)
    store.redis.zadd(keys.workers, {"bogus": now_ms})
    store.redis.sadd(keys.queues, "garbage", "realtime")  # members without '|'
    no_data_job, no_data = plant_truncated_job(system, data=None)
    bad_data_job, bad_data = plant_truncated_job(system, data=zlib.compress(b"[not json"))

    expected = {
        keys.req(missing): "missing field",
        keys.req(mistyped): "'many'",
        keys.req(bad_payload): "Invalid JSON",
        keys.req("ghost"): "missing field",
        keys.req("stringy"): "not a hash",
        keys.worker("bogus"): "heartbeat: ",
        f"{keys.queues}:garbage": "not <class>|<route>",
        f"{keys.queues}:realtime": "not <class>|<route>",
        no_data_job: "without a data field",
        bad_data_job: "failed before accepting its batch",
    }
    wait_for(lambda: set(expected) <= set(store.quarantined()), what="every record quarantined")
    quarantined = store.quarantined()
    for key, reason in expected.items():
        assert reason in quarantined[key], (key, quarantined[key])
    # The held requests of both broken jobs were recovered and ran.
    for rid in no_data + bad_data:
        result = system.client.result(rid, timeout=30)
        assert result.status == "succeeded", result
    steps_before = len(system.scaler_steps)
    system.finishes(20)
    system.alive()
    wait_for(lambda: len(system.scaler_steps) > steps_before + 2, what="scaler decisions")
    assert store.redis.smembers(keys.queues) == {f"realtime|{MODEL}"}
    assert queued_ids(store, "realtime", MODEL) == []

    out = CliRunner().invoke(
        cli, ["--redis-url", REDIS_URL, "--namespace", namespace, "report", "--json"]
    )
    assert out.exit_code == 0, out.output
    reported = json.loads(out.output)["quarantined"]
    assert set(expected) <= set(reported)


def test_a_corrupt_payload_fails_its_request_and_the_worker_goes_on(system: System) -> None:
    store = system.store
    rid = plant_request(store, system.settings, payload='{"prompt": 42}')
    key = store.keys.req(rid)
    wait_for(lambda: key in store.quarantined(), what="the record quarantined")
    assert "request record: " in store.quarantined()[key]
    aside = store.redis.hgetall(store.keys.quarantined(key))
    assert aside["state"] == "failed" and aside["error"].startswith("corrupt request record: ")
    assert [e.fields["id"] for e in store.events(count=10_000) if e.type == "fail"] == [rid]
    assert store.redis.scard(store.keys.inflight("w1")) == 0  # its slot was given back
    system.finishes(3)
    system.alive()


def test_a_heartbeat_key_of_another_type_is_quarantined_and_dispatch_goes_on(
    system: System,
) -> None:
    """A worker id in the index whose heartbeat key is not a hash (and one whose in-flight
    set is not a set) failed every snapshot's HMGET and the reaper's script, and the repair
    did not look at workers: every step failed, and nothing was dispatched again."""
    store, keys = system.store, system.store.keys
    system.finishes(2)
    now_ms = store.now() * 1000
    store.redis.set(keys.worker("stringy-w"), "not a hash")
    store.redis.hset(keys.worker("listy-w"), mapping=worker_info("listy-w").to_fields())
    store.redis.rpush(keys.inflight("listy-w"), "not a set")
    store.redis.zadd(keys.workers, {"stringy-w": now_ms, "listy-w": now_ms})
    wait_for(
        lambda: {keys.worker("stringy-w"), keys.inflight("listy-w")} <= set(store.quarantined()),
        what="the mistyped worker keys quarantined",
    )
    assert "heartbeat is a string" in store.quarantined()[keys.worker("stringy-w")]
    assert store.redis.zscore(keys.workers, "stringy-w") is None
    system.finishes(5)
    system.alive()
