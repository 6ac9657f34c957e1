"""Prometheus metrics of a deployment (prometheus-client), for dashboards, KEDA and HPAs.

- :mod:`~inferq.metrics.collector`: deployment-wide gauges read from Redis at scrape
  time (queues, workers' slots and KV cache, tenants' backlogs, the dead letter,
  lifetime counters, the scaler's desired workers).
- :mod:`~inferq.metrics.events`: histograms and counters fed from the events stream
  (queue wait, TTFT, TPOT, end-to-end latency, SLA, tokens, errors by kind, retries,
  preemptions, rate-limit refusals).
- :mod:`~inferq.metrics.server`: the HTTP endpoint and the metrics lease: only the
  lease holder among the replicas exports the deployment-wide series.
- :mod:`~inferq.metrics.labels`: bounded label values (top-N tenants, error kinds).

``docs/operations.md`` lists every series.
"""

from inferq.metrics.events import EventObserver
from inferq.metrics.server import MetricsLease, MetricsServer, build_registry, serve_metrics

__all__ = ["EventObserver", "MetricsLease", "MetricsServer", "build_registry", "serve_metrics"]
