"""Prometheus metrics of a deployment (prometheus-client), for dashboards, KEDA and HPAs.

Two sources, one registry:

- :class:`StoreCollector` reads Redis on every scrape: queue depth and oldest
  wait per (class, route), workers by state and model, lifetime counters
  (dispatched, retried, expired, ...), and the scaler's desired workers per model.
- :class:`EventObserver` tails the events stream in a thread and fills the
  queue-wait and end-to-end latency histograms per class and the SLA met/missed
  counters (finish events carry class, queue_ms and e2e_ms).

Every replica that serves metrics exports the same deployment-wide figures:
scrape one, or aggregate with ``max``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferq.store import REDIS_ERRORS, Store

log = logging.getLogger(__name__)

#: Latency buckets, seconds: from a fast realtime answer to a slow batch one.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
#: What tailing the events stream may raise and survive (Redis away, a malformed reply).
_TAIL_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, OSError, ValueError)


class StoreCollector(Collector):
    """Reads the deployment's state from Redis at scrape time."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "inferq_queue_depth", "Queued requests", labels=["priority_class", "route"]
        )
        oldest = GaugeMetricFamily(
            "inferq_queue_oldest_wait_seconds",
            "Wait of the oldest queued request",
            labels=["priority_class", "route"],
        )
        for cls, route, n, wait in self.store.queue_depths():
            depth.add_metric([cls, route], n)
            oldest.add_metric([cls, route], wait or 0.0)
        yield depth
        yield oldest

        workers, _ = self.store.workers()
        by_state = GaugeMetricFamily("inferq_workers", "Live workers", labels=["model", "state"])
        counts: dict[tuple[str, str], int] = {}
        for w in workers:
            counts[(w.model, w.state.value)] = counts.get((w.model, w.state.value), 0) + 1
        for (model, state), n in sorted(counts.items()):
            by_state.add_metric([model, state], n)
        yield by_state

        desired = GaugeMetricFamily(
            "inferq_workers_desired", "Workers the scaler wants per model", labels=["model"]
        )
        for model, n in sorted(self.store.desired_workers().items()):
            desired.add_metric([model], n)
        yield desired

        totals = CounterMetricFamily(
            "inferq_requests", "Lifetime request counters by event", labels=["event"]
        )
        for event, n in sorted(self.store.stats().items()):
            totals.add_metric([event], n)
        yield totals


class EventObserver:
    """Tails the events stream and observes latencies per class (a daemon thread).

    Args:
        store: the deployment's store.
        registry: where the histograms and SLA counters are registered.
        sla_s: class -> SLA, seconds (a finish within it counts as met).
    """

    def __init__(self, store: Store, registry: CollectorRegistry, sla_s: dict[str, float]) -> None:
        self.store = store
        self.sla_s = sla_s
        self.queue_wait = Histogram(
            "inferq_queue_wait_seconds",
            "Submit to dispatch",
            ["priority_class"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "inferq_e2e_latency_seconds",
            "Submit to final result",
            ["priority_class"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.sla = Counter(
            "inferq_sla",
            "Final results against the class SLA (time to first token)",
            ["priority_class", "outcome"],
            registry=registry,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop tailing and wait for the thread (at most one blocking read, 1 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=3)

    def observe(self, etype: str, fields: dict[str, str]) -> None:
        """Account one event (finish, fail or expire); others are ignored."""
        cls = fields.get("class")
        if not cls or etype not in ("finish", "fail", "expire"):
            return
        e2e = int(fields.get("e2e_ms", "0")) / 1000
        ttft = int(fields.get("ttft_ms", fields.get("e2e_ms", "0"))) / 1000
        if "queue_ms" in fields:
            self.queue_wait.labels(cls).observe(int(fields["queue_ms"]) / 1000)
        self.e2e.labels(cls).observe(e2e)
        met = etype == "finish" and ttft <= self.sla_s.get(cls, float("inf"))
        self.sla.labels(cls, "met" if met else "missed").inc()

    def _run(self) -> None:
        last = "$"
        while not self._stop.is_set():
            try:
                entries = self.store.tail_events(last, count=1000, block_s=1.0)
            except _TAIL_ERRORS as exc:
                if self._stop.is_set():
                    return
                log.warning("metrics: events stream unavailable (%s)", exc)
                self._stop.wait(1.0)
                continue
            for eid, fields in entries:
                last = eid
                try:
                    self.observe(fields.get("type", ""), fields)
                except ValueError:
                    log.warning("metrics: malformed event %s", eid)


def build_registry(store: Store) -> tuple[CollectorRegistry, EventObserver]:
    """A registry with the store collector and a (not yet started) event observer."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    sla = {c.name: c.sla_s for c in store.settings.classes}
    return registry, EventObserver(store, registry, sla)


def serve_metrics(store: Store, port: int, addr: str = "0.0.0.0") -> EventObserver:
    """Serve ``/metrics`` on ``addr:port`` from a background thread; returns the observer."""
    registry, observer = build_registry(store)
    start_http_server(port, addr=addr, registry=registry)
    observer.start()
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return observer
