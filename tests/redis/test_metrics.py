"""Prometheus metrics read from the real Redis and from the events stream."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.metrics import build_registry, serve_metrics
from inferq.store import Completion, Store

from ..builders import inference_request
from ..helpers import ready_worker


def test_store_collector_exports_queues_workers_and_counters(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1", slots=1)
    for _ in range(3):
        store.submit(inference_request(settings, priority="realtime"))
    store.redis.hset(store.keys.scaler_desired, "llama-3.1-8b", 2)
    Dispatcher(store).step()
    registry, _ = build_registry(store)
    text = generate_latest(registry).decode()
    assert 'inferq_queue_depth{priority_class="realtime",route="llama-3.1-8b"} 2.0' in text
    assert 'inferq_workers{model="llama-3.1-8b",state="ready"} 1.0' in text
    assert 'inferq_workers_desired{model="llama-3.1-8b"} 2.0' in text
    assert 'inferq_requests_total{event="dispatched"} 1.0' in text


def test_event_observer_fills_histograms_and_sla_counters(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    r = inference_request(settings, priority="realtime")
    store.submit(r)
    [(rid, attempt)] = store.assign("w1", "b", [(r.id, store.keys.queue("realtime", r.route), 1)])
    store.complete("w1", [Completion(rid, attempt, "succeeded", completion_tokens=3)])
    registry, observer = build_registry(store)
    for event in store.events():
        observer.observe(event.type, event.fields)
    text = generate_latest(registry).decode()
    assert 'inferq_e2e_latency_seconds_count{priority_class="realtime"} 1.0' in text
    assert 'inferq_queue_wait_seconds_count{priority_class="realtime"} 1.0' in text
    assert 'inferq_sla_total{outcome="met",priority_class="realtime"} 1.0' in text
    observer.observe("finish", {"class": "realtime", "e2e_ms": "5000", "queue_ms": "10"})
    text = generate_latest(registry).decode()
    assert 'inferq_sla_total{outcome="missed",priority_class="realtime"} 1.0' in text


def test_metrics_endpoint_serves_over_http(store: Store) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    observer = serve_metrics(store, port, addr="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        observer.stop()
    assert b"inferq_requests" in body
