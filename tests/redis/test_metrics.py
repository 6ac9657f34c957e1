"""Prometheus metrics read from the real Redis and from the events stream."""

from __future__ import annotations

import socket
import subprocess
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from inferq.config import Budget, Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.errors import ConfigError
from inferq.metrics import MetricsLease, build_registry, serve_metrics
from inferq.models import ServerTelemetry
from inferq.store import Completion, Store

from ..builders import inference_request, worker_info
from ..helpers import ready_worker, wait_for
from ..tools import require_tool


def _finish_one(store: Store, settings: Settings, worker: str = "w1", tenant: str = "t") -> None:
    r = inference_request(settings, priority="realtime", tenant=tenant)
    store.submit(r)
    [(rid, attempt)] = store.assign(
        worker, "b", [(r.id, store.keys.tenant_queue("realtime", r.route, r.tenant), 1)]
    )
    store.complete(
        worker,
        [Completion(rid, attempt, "succeeded", prompt_tokens=5, completion_tokens=3)],
    )


def test_deployment_collector_exports_queues_workers_tenants_and_counters(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1", slots=1)
    for i in range(3):
        store.submit(inference_request(settings, priority="realtime", tenant=f"t{i}"))
    store.redis.hset(store.keys.scaler_desired, "llama-3.1-8b", 2)
    Dispatcher(store).step()
    registry, _ = build_registry(store, top_tenants=1)
    text = generate_latest(registry).decode()
    assert 'inferq_queue_depth{priority_class="realtime",route="llama-3.1-8b"} 2.0' in text
    assert 'inferq_workers{model="llama-3.1-8b",state="ready"} 1.0' in text
    assert 'inferq_workers_desired{model="llama-3.1-8b"} 2.0' in text
    assert 'inferq_requests_total{event="dispatched"} 1.0' in text
    assert 'inferq_worker_slots{model="llama-3.1-8b",worker="w1"} 1.0' in text
    assert 'inferq_worker_slots_in_use{model="llama-3.1-8b",worker="w1"} 1.0' in text
    used = [ln for ln in text.splitlines() if ln.startswith("inferq_worker_kv_cache_used_bytes{")]
    assert used and float(used[0].split()[-1]) > 0
    assert "inferq_dead_letter_requests 0.0" in text
    # Two tenants still queued, top 1 by name on a tie, the other folded into "other".
    tenant_lines = [ln for ln in text.splitlines() if ln.startswith("inferq_tenant_queued")]
    assert len(tenant_lines) == 2 and any('tenant="other"' in ln for ln in tenant_lines)


def test_measured_capacity_is_exported_only_for_workers_that_measured_it(
    store: Store, settings: Settings
) -> None:
    measured = worker_info("w1").model_copy(
        update={
            "vram_measured_free_mib": 40_960,
            "vram_measured_used_mib": 102_811,
            "kv_measured_free_mib": 25_640.0,
            "server": ServerTelemetry(running=3, waiting=2),
        }
    )
    store.heartbeat(measured, ttl_s=30)
    ready_worker(store, "w2")  # measured nothing
    registry, _ = build_registry(store)
    found = {
        (sample.name, sample.labels["worker"]): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if family.name.startswith("inferq_worker_")
    }
    assert found["inferq_worker_vram_measured_free_bytes", "w1"] == 40_960 * 2**20
    assert found["inferq_worker_vram_measured_used_bytes", "w1"] == 102_811 * 2**20
    assert found["inferq_worker_kv_measured_free_bytes", "w1"] == 25_640 * 2**20
    assert found["inferq_worker_server_running", "w1"] == 3
    assert found["inferq_worker_server_waiting", "w1"] == 2
    assert ("inferq_worker_vram_free_bytes", "w2") in found  # the bookkeeping: everyone
    measured = [name for name, worker in found if worker == "w2" and "measured" in name]
    assert measured == []
    assert ("inferq_worker_server_running", "w2") not in found


def test_event_observer_fills_latency_token_and_sla_series(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    _finish_one(store, settings)
    registry, observer = build_registry(store)
    for event in store.events():
        observer.observe(event.type, event.fields)
    text = generate_latest(registry).decode()
    assert 'inferq_e2e_latency_seconds_count{priority_class="realtime"} 1.0' in text
    assert 'inferq_queue_wait_seconds_count{priority_class="realtime"} 1.0' in text
    assert 'inferq_ttft_seconds_count{model="llama-3.1-8b",priority_class="realtime"} 1.0' in text
    assert 'inferq_tpot_seconds_count{model="llama-3.1-8b",priority_class="realtime"} 1.0' in text
    assert 'inferq_sla_requests_total{outcome="met",priority_class="realtime"} 1.0' in text
    assert 'inferq_completion_tokens_total{model="llama-3.1-8b"} 3.0' in text
    assert 'inferq_prompt_tokens_total{model="llama-3.1-8b"} 5.0' in text
    assert 'inferq_tenant_requests_total{outcome="succeeded",tenant="t"} 1.0' in text
    observer.observe("finish", {"class": "realtime", "e2e_ms": "5000", "queue_ms": "10"})
    text = generate_latest(registry).decode()
    assert 'inferq_sla_requests_total{outcome="missed",priority_class="realtime"} 1.0' in text


def test_event_observer_counts_errors_retries_preemptions_and_refusals(
    store: Store, settings: Settings
) -> None:
    registry, observer = build_registry(store)
    text = generate_latest(registry).decode()
    # Exported at zero before anything happens (alerts need a series).
    assert "inferq_retries_total 0.0" in text
    assert 'inferq_preemptions_total{priority_class="realtime"} 0.0' in text
    assert 'inferq_rate_limit_refusals_total{tenant="other"} 0.0' in text
    observer.observe("retry", {"id": "r", "error": "openai: request r timed out after 3 s"})
    observer.observe("retry", {"id": "r", "error": "lease expired on worker w1"})
    observer.observe("dead_letter", {"id": "r", "error": "openai: request r: HTTP 503 from x"})
    observer.observe("retry", {"id": "r", "reason": "requeued from dead letter"})
    observer.observe("preempt", {"id": "r", "class": "batch"})
    observer.observe("rate_limited", {"tenant": "acme"})
    text = generate_latest(registry).decode()
    assert "inferq_retries_total 3.0" in text
    assert 'inferq_backend_errors_total{kind="timeout"} 1.0' in text
    assert 'inferq_backend_errors_total{kind="lease_lapsed"} 1.0' in text
    assert 'inferq_backend_errors_total{kind="http_5xx"} 1.0' in text
    assert 'inferq_preemptions_total{priority_class="batch"} 1.0' in text
    assert 'inferq_rate_limit_refusals_total{tenant="acme"} 1.0' in text


def test_failed_attempts_are_counted_by_the_workers_failure_kind(
    store: Store, settings: Settings
) -> None:
    """The scripts' events carry the worker's failure kind (issue 15: the metrics use
    :mod:`inferq.workers.failures`' kinds): a retried outage, a request failed at once
    (a 4xx, which was not counted at all), and a lapsed lease (no worker kind)."""
    ready_worker(store, "w1")
    r = inference_request(settings, priority="realtime")
    store.submit(r)
    queue = store.keys.tenant_queue("realtime", r.route, r.tenant)
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue, 1)])
    error = f"openai: request {rid}: HTTP 503 from http://127.0.0.1:1"
    store.requeue([(rid, attempt, "w1", error)], infra=True, kind="infrastructure")
    [(rid, attempt)] = store.assign("w1", "b2", [(r.id, queue, 1)])
    store.complete(
        "w1", [Completion(rid, attempt, "failed", error=f"openai: request {rid}: HTTP 400")]
    )
    registry, observer = build_registry(store)
    for event in store.events():
        observer.observe(event.type, event.fields)
    observer.observe("retry", {"id": "x", "error": "lease expired on worker w1"})
    text = generate_latest(registry).decode()
    assert 'inferq_failed_attempts_total{failure="infrastructure"} 1.0' in text
    assert 'inferq_failed_attempts_total{failure="request"} 1.0' in text
    assert 'inferq_failed_attempts_total{failure="other"} 1.0' in text
    assert 'inferq_failed_attempts_total{failure="server"} 0.0' in text
    assert 'inferq_backend_errors_total{kind="http_5xx"} 1.0' in text
    assert 'inferq_backend_errors_total{kind="http_4xx"} 1.0' in text


def test_only_the_metrics_lease_holder_exports_deployment_series(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    one, two = MetricsLease(store, "one", ttl_s=30), MetricsLease(store, "two", ttl_s=30)
    assert one.renew() and not two.renew()
    texts = [generate_latest(build_registry(store, lease)[0]).decode() for lease in (one, two)]
    assert "inferq_workers{" in texts[0] and "inferq_ttft_seconds" in texts[0]
    assert "inferq_workers" not in texts[1] and "inferq_ttft_seconds" not in texts[1]
    one.stop()  # gives the lease back: the other takes it at its next renewal
    assert two.renew()
    assert "inferq_workers{" in generate_latest(build_registry(store, two)[0]).decode()
    two.stop()
    assert store.redis.exists(store.keys.metrics_lease) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_endpoint_serves_over_http_on_the_given_host(store: Store) -> None:
    server = serve_metrics(store, 0, host="127.0.0.1")
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        wait_for(lambda: server.lease.held, what="the metrics lease")
        body = urllib.request.urlopen(server.url, timeout=5).read()
    finally:
        server.stop()
    assert b"inferq_requests" in body and b"inferq_metrics_lease_held 1.0" in body


def test_a_metrics_port_in_use_is_one_clear_error(store: Store) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port {port}: .* already in use"):
            serve_metrics(store, port, host="127.0.0.1")


def test_promtool_accepts_every_series(store: Store, settings: Settings) -> None:
    promtool = require_tool("promtool", "apt-get install prometheus")
    ready_worker(store, "w1")
    _finish_one(store, settings)
    registry, observer = build_registry(store)
    for event in store.events():
        observer.observe(event.type, event.fields)
    text = generate_latest(registry)
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert out.returncode == 0, (out.stdout + out.stderr).decode()


def test_prefix_token_counters_come_from_the_workers_heartbeats(store: Store) -> None:
    info = worker_info("w1").model_copy(
        update={
            "prompt_tokens_total": 1000,
            "cached_tokens_total": 640,
            "forecast_tokens_total": 700,
        }
    )
    store.heartbeat(info, ttl_s=30)
    registry, _ = build_registry(store, top_tenants=1)
    text = generate_latest(registry).decode()
    labels = '{model="llama-3.1-8b",worker="w1"}'
    assert f"inferq_worker_prefix_lookup_tokens_total{labels} 1000.0" in text
    assert f"inferq_worker_prefix_hit_tokens_total{labels} 640.0" in text
    assert f"inferq_worker_prefix_forecast_tokens_total{labels} 700.0" in text
    # a heartbeat claiming more reuse than its prompt exports at most the prompt
    store.heartbeat(info.model_copy(update={"cached_tokens_total": 9000}), ttl_s=30)
    text = generate_latest(registry).decode()
    assert f"inferq_worker_prefix_hit_tokens_total{labels} 1000.0" in text


def _value(text: str, sample: str, **labels: str) -> float | None:
    """The value of the sample named ``sample`` with exactly ``labels``; None if absent."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return None


def test_usage_counters_follow_the_metered_final_results(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    _finish_one(store, settings, tenant="acme")
    cancelled = inference_request(settings, priority="batch", tenant="zeta")
    store.submit(cancelled)
    store.cancel(cancelled.id)  # final without a worker: counted under its route
    registry, observer = build_registry(store)
    for event in store.events():
        observer.observe(event.type, event.fields)
    text = generate_latest(registry).decode()
    rt = {"model": "llama-3.1-8b", "priority_class": "realtime"}
    assert _value(text, "inferq_usage_requests_total", **rt, outcome="succeeded") == 1
    assert _value(text, "inferq_usage_tokens_total", **rt, kind="prompt") == 5
    assert _value(text, "inferq_usage_tokens_total", **rt, kind="completion") == 3
    assert _value(text, "inferq_usage_tokens_total", **rt, kind="cached") == 0
    batch = {"model": cancelled.route, "priority_class": "batch"}
    assert _value(text, "inferq_usage_requests_total", **batch, outcome="cancelled") == 1
    assert "tenant=" not in "\n".join(ln for ln in text.splitlines() if "inferq_usage_" in ln)
    # The counters equal the roll-ups: the same figures, from the same script.
    records, _ = store.usage_records(0, 2**45)
    assert sum(r.counts[4] for r in records) == 5  # prompt_tokens
    gpu_s = sum(r.counts[7] for r in records) / 1000
    assert _value(text, "inferq_usage_gpu_seconds_total", **rt) == pytest.approx(gpu_s)


def test_usage_counters_carry_a_tenant_only_behind_the_setting(
    redis_client: Redis, settings: Settings
) -> None:
    settings = settings.model_copy(
        update={
            "usage_metrics_by_tenant": True,
            "budgets": {"acme-day": Budget(tenant="acme", period="day", tokens=10_000, soft=25)},
        }
    )
    store = Store(redis_client, settings)
    ready_worker(store, "w1")
    registry, observer = build_registry(store)
    text = generate_latest(registry).decode()
    assert _value(text, "inferq_budget_soft_crossings_total", budget="acme-day") == 0
    _finish_one(store, settings, tenant="acme")  # held ~3 prompt + 16 max_tokens: under 25
    _finish_one(store, settings, tenant="acme")  # 8 spent + the same estimate: crosses 25
    for event in store.events():
        observer.observe(event.type, event.fields)
    text = generate_latest(registry).decode()
    assert _value(text, "inferq_budget_soft_crossings_total", budget="acme-day") == 1
    labels = {"model": "llama-3.1-8b", "priority_class": "realtime", "tenant": "acme"}
    assert _value(text, "inferq_usage_requests_total", **labels, outcome="succeeded") == 2
