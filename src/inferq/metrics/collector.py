"""Deployment-wide gauges read from Redis at scrape time.

:class:`DeploymentCollector` reads the queues, the workers, the scaler's desired
counts and the lifetime counters on every scrape. Every replica could read them,
and every replica would then export the same totals (a ``sum()`` over replicas
double counts): only the holder of the metrics lease yields them (see
:mod:`inferq.metrics.server`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferq.metrics.labels import top_n
from inferq.store import Store


class DeploymentCollector(Collector):
    """Queues, workers, tenants' backlogs, the dead letter and lifetime counters from Redis.

    Args:
        store: the deployment's store.
        exporting: True while this replica holds the metrics lease (checked per scrape).
        top_tenants: tenants whose queued requests get their own label; the rest: ``other``.
    """

    def __init__(self, store: Store, exporting: Callable[[], bool], top_tenants: int) -> None:
        self.store = store
        self.exporting = exporting
        self.top_tenants = top_tenants

    def collect(self) -> Iterator[Metric]:
        if not self.exporting():
            return
        yield from self._queues()
        yield from self._workers()
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
        yield GaugeMetricFamily(
            "inferq_dead_letter_requests",
            "Requests in the dead letter",
            value=self.store.dead_letter_count(),
        )
        yield GaugeMetricFamily(
            "inferq_gateway_api_keys",
            "API keys stored in Redis for the gateways (inferq keys add/revoke)",
            value=self.store.api_key_count(),
        )

    def _queues(self) -> Iterator[Metric]:
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
        per_tenant: dict[str, dict[str, float]] = {}
        for field, n in self.store.queued_counts().items():
            kind, _, rest = field.partition(":")
            cls, _, tenant = rest.partition(":")
            if kind == "t" and tenant and n > 0:
                per_tenant.setdefault(cls, {})[tenant] = float(n)
        tenants = GaugeMetricFamily(
            "inferq_tenant_queued_requests",
            "Queued requests per tenant (the top tenants by backlog, the rest as other)",
            labels=["priority_class", "tenant"],
        )
        for cls, counts in sorted(per_tenant.items()):
            for tenant, queued in sorted(top_n(counts, self.top_tenants).items()):
                tenants.add_metric([cls, tenant], queued)
        yield tenants

    def _workers(self) -> Iterator[Metric]:
        infos, _ = self.store.workers()
        loads = self.store.worker_loads([w.id for w in infos])
        now = self.store.now()
        by_state = GaugeMetricFamily("inferq_workers", "Live workers", labels=["model", "state"])
        labels = ["worker", "model"]
        slots = GaugeMetricFamily(
            "inferq_worker_slots", "Concurrent requests at most", labels=labels
        )
        busy = GaugeMetricFamily(
            "inferq_worker_slots_in_use",
            "Slots held by assigned and running requests",
            labels=labels,
        )
        kv = GaugeMetricFamily(
            "inferq_worker_kv_cache_bytes", "VRAM the worker may fill with KV cache", labels=labels
        )
        kv_used = GaugeMetricFamily(
            "inferq_worker_kv_cache_used_bytes",
            "KV cache reserved by the worker's assigned and running requests",
            labels=labels,
        )
        vram_free = GaugeMetricFamily(
            "inferq_worker_vram_free_bytes", "Free VRAM the worker reports", labels=labels
        )
        measured = {  # only for workers that measured them (issue 13)
            name: GaugeMetricFamily(f"inferq_worker_{name}", text, labels=labels)
            for name, text in (
                ("vram_measured_free_bytes", "Free VRAM of the worker's GPUs, NVML at its beat"),
                ("vram_measured_used_bytes", "Used VRAM of the worker's GPUs, NVML at its beat"),
                ("kv_measured_free_bytes", "KV room for new work the worker measured"),
                ("server_running", "Requests the model server says it runs"),
                ("server_waiting", "Requests waiting inside the model server"),
            )
        }
        age = GaugeMetricFamily(
            "inferq_worker_heartbeat_age_seconds",
            "Since the worker's last heartbeat",
            labels=labels,
        )
        prefix = {  # issue 22: the prompt tokens the worker served, and the cached part
            name: CounterMetricFamily(f"inferq_worker_{name}", text, labels=labels)
            for name, text in (
                ("prefix_lookup_tokens", "Prompt tokens of the requests the worker served"),
                (
                    "prefix_hit_tokens",
                    "Of those, prompt tokens its model server reported reusing from its cache",
                ),
                (
                    "prefix_forecast_tokens",
                    "Of those, prompt tokens the dispatcher's prefix index forecast cached",
                ),
            )
        }
        counts: dict[tuple[str, str], int] = {}
        for w in infos:
            counts[(w.model, w.state.value)] = counts.get((w.model, w.state.value), 0) + 1
            key = [w.id, w.model]
            slots.add_metric(key, w.slots)
            held, mib = loads.get(w.id, (0, 0.0))
            busy.add_metric(key, max(held, w.in_flight))
            kv.add_metric(key, w.kv_cache_mib * 2**20)
            kv_used.add_metric(key, mib * 2**20)
            vram_free.add_metric(key, w.vram_free_mib * 2**20)
            for name, value in (
                ("vram_measured_free_bytes", _bytes(w.vram_measured_free_mib)),
                ("vram_measured_used_bytes", _bytes(w.vram_measured_used_mib)),
                ("kv_measured_free_bytes", _bytes(w.kv_measured_free_mib)),
                ("server_running", w.server.running),
                ("server_waiting", w.server.waiting),
            ):
                if value is not None:
                    measured[name].add_metric(key, value)
            age.add_metric(key, max(0.0, now - w.last_heartbeat))
            prefix["prefix_lookup_tokens"].add_metric(key, w.prompt_tokens_total)
            prefix["prefix_hit_tokens"].add_metric(key, w.cached_tokens_capped)
            prefix["prefix_forecast_tokens"].add_metric(key, w.forecast_tokens_total)
        for (model, state), n in sorted(counts.items()):
            by_state.add_metric([model, state], n)
        yield by_state
        yield slots
        yield busy
        yield kv
        yield kv_used
        yield vram_free
        yield from measured.values()
        yield from prefix.values()
        yield age


def _bytes(mib: float | None) -> float | None:
    """MiB as bytes; None stays None (not measured)."""
    return None if mib is None else mib * 2**20
