"""Latency histograms and request counters fed from the events stream.

:class:`EventObserver` tails the deployment's events stream in a thread and
accounts every event it knows (the fields are the Lua scripts', see
``docs/architecture.md``, "Events"):

============================================  ===========================================
``finish`` / ``fail`` / ``expire``            queue wait, TTFT, TPOT, end-to-end latency,
                                              SLA met or missed, prompt/completion tokens,
                                              requests per tenant (top N, then ``other``)
``retry`` / ``dead_letter`` / ``fail``        failed attempts by error kind and by failure
                                              kind (the retry rule applied), retries
``preempt``                                   preemptions per class (a running request
                                              paused for a more urgent one)
``rate_limited``                              requests a gateway refused by a tenant's
                                              rate limit (any replica writes the event)
every final event's ``usage`` field           the usage metered (``meter.lua``): requests
                                              by outcome, prompt, cached and completion
                                              tokens, GPU-seconds, per class and served
                                              model (and tenant, behind
                                              ``usage_metrics_by_tenant``)
``budget_soft``                               requests that crossed a budget's soft limit
============================================  ===========================================

Event types that may not have happened yet (``preempt``, ``rate_limited``,
``budget_soft`` of each budget with a soft limit) are
exported at zero until one does, so dashboards and
alerts can be written against them now. Models are the serving worker's (a
request's ``model`` field may be a size requirement), looked up from the workers'
heartbeats and ``worker_joined`` events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from inferq import usage
from inferq.config import PriorityClass
from inferq.metrics.labels import ERROR_KINDS, FAILURES, OTHER, StickyLabels, error_kind
from inferq.models import FailureKind
from inferq.sla import event_meets_slo
from inferq.store import REDIS_ERRORS, Store

log = logging.getLogger(__name__)

#: Latency buckets, seconds: from a fast realtime answer to a slow batch one.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
#: Time per output token buckets, seconds: 2 ms (a small model on a big card) to 1 s.
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
#: Tenants with their own label value; every other tenant counts under ``other``.
DEFAULT_TOP_TENANTS = 20
#: What tailing the events stream may raise and survive (Redis away, a malformed reply).
_TAIL_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, OSError, ValueError)
#: Seconds between two reads of the workers' models when an event names an unknown one.
_MODEL_REFRESH_S = 5.0


def _num(fields: Mapping[str, str], name: str) -> float | None:
    raw = fields.get(name, "")
    if raw == "":
        return None
    return float(raw)


class EventObserver:
    """Tails the events stream and fills the request histograms and counters (a thread).

    Args:
        store: the deployment's store.
        registry: where the histograms and counters are registered.
        classes: class name -> its settings: a final result is ``met`` when it meets the
            class's SLO (:func:`inferq.sla.event_meets_slo`: the length-aware TTFT target
            and the TPOT target), else ``missed``.
        top_tenants: tenants with their own label value (the first seen); others: ``other``.
        usage_by_tenant: give the usage counters a ``tenant`` label (top ``top_tenants``).
        soft_budgets: names of the budgets with a soft limit (their counters start at 0).
    """

    def __init__(
        self,
        store: Store,
        registry: CollectorRegistry,
        classes: Mapping[str, PriorityClass],
        top_tenants: int = DEFAULT_TOP_TENANTS,
        *,
        usage_by_tenant: bool = False,
        soft_budgets: Iterable[str] = (),
    ) -> None:
        self.store = store
        self.usage_by_tenant = usage_by_tenant
        self.classes = classes
        self.tenant_label = StickyLabels(top_tenants)
        self._models: dict[str, str] = {}
        self._models_read_at = 0.0
        cls_model = ["priority_class", "model"]
        self.queue_wait = Histogram(
            "inferq_queue_wait_seconds",
            "Submit to dispatch",
            ["priority_class"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "inferq_ttft_seconds",
            "Time to first token: submit to the first generated token (finish when unknown)",
            cls_model,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "inferq_tpot_seconds",
            "Time per output token after the first: (finish - first token) / (tokens - 1)",
            cls_model,
            buckets=TPOT_BUCKETS,
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
            "inferq_sla_requests",
            "Final results against the class SLO: length-aware TTFT and TPOT (inferq.sla)",
            ["priority_class", "outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "inferq_prompt_tokens",
            "Prompt tokens of finished requests",
            ["model"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "inferq_completion_tokens",
            "Generated tokens of finished requests",
            ["model"],
            registry=registry,
        )
        self.finished = Counter(
            "inferq_tenant_requests",
            "Final results per tenant (the first tenants seen by name, the rest as other)",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.errors = Counter(
            "inferq_backend_errors",
            "Failed attempts by error kind (timeout, connection, http_5xx, lease_lapsed, ...)",
            ["kind"],
            registry=registry,
        )
        self.failures = Counter(
            "inferq_failed_attempts",
            "Failed attempts by failure kind: infrastructure (no attempt spent), server, "
            "truncated, request (failed at once), other (lapsed lease, hand-back)",
            ["failure"],
            registry=registry,
        )
        self.retries = Counter(
            "inferq_retries", "Requests queued again after a failed attempt", registry=registry
        )
        self.preemptions = Counter(
            "inferq_preemptions",
            "Running requests paused for a more urgent one",
            ["priority_class"],
            registry=registry,
        )
        self.rate_limited = Counter(
            "inferq_rate_limit_refusals",
            "Submits refused by a tenant rate limit",
            ["tenant"],
            registry=registry,
        )
        usage_labels = ["priority_class", "model", *(["tenant"] if usage_by_tenant else [])]
        self.usage_requests = Counter(
            "inferq_usage_requests",
            "Requests made final, as metered into the usage roll-ups (inferq usage), by "
            "outcome; model: the one that served it (the route when none did)",
            [*usage_labels, "outcome"],
            registry=registry,
        )
        self.usage_tokens = Counter(
            "inferq_usage_tokens",
            "Tokens metered of final results: prompt (all of it), cached (the part of the "
            "prompt the model server reused), completion",
            [*usage_labels, "kind"],
            registry=registry,
        )
        self.usage_gpu = Counter(
            "inferq_usage_gpu_seconds",
            "GPU-seconds metered of final results: each request's share of its worker's "
            "busy time (docs/architecture.md, Usage metering)",
            usage_labels,
            registry=registry,
        )
        self.budget_soft = Counter(
            "inferq_budget_soft_crossings",
            "Requests admitted across a budget's soft limit (budget_soft events)",
            ["budget"],
            registry=registry,
        )
        # Exported at zero from the start, so rates and alerts have a series to read.
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        for failure in FAILURES:
            self.failures.labels(failure)
        for cls in classes:
            self.preemptions.labels(cls)
        self.rate_limited.labels(OTHER)
        for name in soft_budgets:
            self.budget_soft.labels(name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop tailing and wait for the thread (at most one blocking read, 1 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=3)

    def model_of(self, worker: str) -> str:
        """The model ``worker`` serves (from its heartbeat), or ``unknown``."""
        if worker and worker not in self._models:
            now = time.monotonic()
            if now - self._models_read_at >= _MODEL_REFRESH_S:
                self._models_read_at = now
                try:
                    infos, _ = self.store.workers()
                except _TAIL_ERRORS as exc:
                    log.warning("metrics: workers unreadable (%s)", exc)
                    infos = []
                for info in infos:
                    self._models[info.id] = info.model
        return self._models.get(worker, "unknown")

    def observe(self, etype: str, fields: dict[str, str]) -> None:
        """Account one event; types this observer does not count are ignored.

        Raises:
            ValueError: a numeric field is not a number.
        """
        if etype == "worker_joined":
            self._models[fields.get("worker", "")] = fields.get("model", "unknown")
        elif etype in ("retry", "dead_letter"):
            if "error" in fields:  # a failed attempt (a requeue from the dead letter has none)
                self._failed_attempt(fields["error"], fields.get("kind", ""))
            if etype == "retry":
                self.retries.inc()
        elif etype == "preempt":
            self.preemptions.labels(fields.get("class", "unknown")).inc()
        elif etype == "rate_limited":
            self.rate_limited.labels(self.tenant_label(fields.get("tenant", "default"))).inc()
        elif etype == "budget_soft":
            self.budget_soft.labels(fields.get("budget", "unknown")).inc()
        elif etype in ("finish", "fail", "expire") and fields.get("class"):
            if etype == "fail" and fields.get("error"):  # failed at once: the request's own
                self._failed_attempt(fields["error"], FailureKind.REQUEST.value)
            self._final(etype, fields)
        if fields.get("usage"):  # any final event (finish, fail, cancel, dead_letter, ...)
            self._usage(usage.parse_event_usage(fields["usage"]))

    def _usage(self, u: usage.EventUsage) -> None:
        """One final result's usage, as ``meter.lua`` added it to the roll-ups."""
        labels = [u.klass, u.model]
        if self.usage_by_tenant:
            labels.append(self.tenant_label(u.tenant))
        self.usage_requests.labels(*labels, u.outcome).inc()
        for kind, n in (
            ("prompt", u.prompt_tokens),
            ("cached", u.cached_tokens),
            ("completion", u.completion_tokens),
        ):
            self.usage_tokens.labels(*labels, kind).inc(n)
        self.usage_gpu.labels(*labels).inc(u.gpu_ms / 1000)

    def _failed_attempt(self, error: str, kind: str) -> None:
        """One failed attempt: by its message's kind, and by the worker's failure kind
        (:mod:`inferq.workers.failures`; empty for the scripts' own requeues)."""
        self.errors.labels(error_kind(error)).inc()
        self.failures.labels(kind if kind in FAILURES else OTHER).inc()

    def _final(self, etype: str, fields: dict[str, str]) -> None:
        cls = fields["class"]
        e2e = (_num(fields, "e2e_ms") or 0.0) / 1000
        ttft = _num(fields, "ttft_ms")
        queue = _num(fields, "queue_ms")
        if queue is not None:
            self.queue_wait.labels(cls).observe(queue / 1000)
        self.e2e.labels(cls).observe(e2e)
        outcome = {"finish": "succeeded", "fail": "failed", "expire": "expired"}[etype]
        self.finished.labels(self.tenant_label(fields.get("tenant", "default")), outcome).inc()
        first = (ttft if ttft is not None else e2e * 1000) / 1000
        met = event_meets_slo(self.classes.get(cls), etype, fields)
        self.sla.labels(cls, "met" if met else "missed").inc()
        if etype != "finish":
            return
        model = self.model_of(fields.get("worker", ""))
        self.ttft.labels(cls, model).observe(first)
        tokens = int(_num(fields, "tokens") or 0)
        ptokens = int(_num(fields, "ptokens") or 0)
        self.completion_tokens.labels(model).inc(tokens)
        self.prompt_tokens.labels(model).inc(ptokens)
        if tokens > 1 and ttft is not None:
            self.tpot.labels(cls, model).observe(max(0.0, e2e - first) / (tokens - 1))

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
                except (ValueError, KeyError):
                    log.warning("metrics: malformed event %s", eid)
