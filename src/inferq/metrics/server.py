"""Serve ``/metrics``: one registry, a lease for the deployment-wide series.

Any number of replicas (dispatchers, scalers) may serve metrics. What they read
from Redis is the same for all of them, so exactly one exports it: the holder of
the metrics lease (``metrics:lease``, taken and renewed by ``lease.lua`` every
third of its TTL, like the scaler's). The others export only their own process's
series (``inferq_metrics_lease_held`` 0, the Python process collectors). When the
holder stops, it gives the lease back; when it dies, another replica takes over
within one TTL. A ``sum()`` or a ``max()`` over replicas then counts each queued
request once.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from inferq.errors import ConfigError
from inferq.metrics.collector import DeploymentCollector
from inferq.metrics.events import DEFAULT_TOP_TENANTS, EventObserver
from inferq.store import REDIS_ERRORS, Store

log = logging.getLogger(__name__)

#: Seconds a metrics lease lasts without renewal (renewed every third of it).
LEASE_TTL_S = 15.0


class _Gated(Collector):
    """Yields another registry's metrics only while ``exporting()`` is true."""

    def __init__(self, inner: CollectorRegistry, lease: MetricsLease | None) -> None:
        self.inner = inner
        self.lease = lease

    def collect(self) -> Iterator[Metric]:
        if self.lease is None or self.lease.held:
            yield from self.inner.collect()


class MetricsLease:
    """Holds the deployment's metrics lease from a daemon thread.

    Args:
        store: the deployment's store.
        replica_id: this replica's name in the lease (default host-pid-random).
        ttl_s: lease lifetime, seconds; renewed every ``ttl_s / 3``.
    """

    def __init__(self, store: Store, replica_id: str | None = None, ttl_s: float = LEASE_TTL_S):
        self.store = store
        self.replica_id = (
            replica_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.ttl_s = ttl_s
        self.held = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-lease", daemon=True)

    def renew(self) -> bool:
        """Take or renew the lease once; returns (and records) whether this replica holds it."""
        try:
            held = self.store.hold_metrics_lease(self.replica_id, self.ttl_s)
        except REDIS_ERRORS as exc:
            log.warning("metrics: lease unavailable (%s)", exc)
            held = False
        if held != self.held:
            log.info("metrics: %s the metrics lease", "took" if held else "lost")
        self.held = held
        return held

    def start(self) -> None:
        self.renew()
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and give the lease back (another replica takes over at once)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=3)
        if self.held:
            try:
                self.store.release_metrics_lease(self.replica_id)
            except REDIS_ERRORS as exc:
                log.warning("metrics: could not give the lease back (%s)", exc)
            self.held = False

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.renew()


def build_registry(
    store: Store, lease: MetricsLease | None = None, top_tenants: int = DEFAULT_TOP_TENANTS
) -> tuple[CollectorRegistry, EventObserver]:
    """A registry with the deployment collector and a (not yet started) event observer.

    Args:
        store: the deployment's store.
        lease: gates the deployment-wide series (None: always exported, one process).
        top_tenants: tenants with their own label value.
    """
    registry = CollectorRegistry()
    registry.register(DeploymentCollector(store, lambda: lease is None or lease.held, top_tenants))
    events = CollectorRegistry(auto_describe=True)
    classes = {c.name: c for c in store.settings.classes}
    observer = EventObserver(
        store,
        events,
        classes,
        top_tenants=top_tenants,
        usage_by_tenant=store.settings.usage_metrics_by_tenant,
        soft_budgets=[n for n, b in store.settings.budgets.items() if b.soft is not None],
    )
    registry.register(_Gated(events, lease))
    return registry, observer


class MetricsServer:
    """A running ``/metrics`` endpoint: HTTP thread, events observer, lease.

    Attributes:
        host / port: where it listens (the real port when 0 was asked).
        lease: the metrics lease this replica takes part in.
    """

    def __init__(self, httpd: Any, observer: EventObserver, lease: MetricsLease, host: str) -> None:
        self._httpd = httpd
        self.observer = observer
        self.lease = lease
        self.host = host
        self.port: int = httpd.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving, tailing and leasing (gives the lease back)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self.observer.stop()
        self.lease.stop()


def serve_metrics(
    store: Store,
    port: int,
    host: str = "127.0.0.1",
    *,
    top_tenants: int = DEFAULT_TOP_TENANTS,
    lease_ttl_s: float = LEASE_TTL_S,
) -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` from background threads.

    Args:
        store: the deployment's store.
        port: TCP port (0: any free one, see :attr:`MetricsServer.port`).
        host: address to bind (``0.0.0.0`` for every interface, e.g. in a container).
        top_tenants: tenants with their own label value.
        lease_ttl_s: metrics lease lifetime, seconds.

    Raises:
        ConfigError: the port is in use, or the address cannot be bound.
    """
    lease = MetricsLease(store, ttl_s=lease_ttl_s)
    registry, observer = build_registry(store, lease, top_tenants)
    held = Gauge(
        "inferq_metrics_lease_held",
        "1 when this replica exports the deployment-wide series (holds the metrics lease)",
        registry=registry,
    )
    held.set_function(lambda: 1.0 if lease.held else 0.0)
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--metrics-port {port}: {host}:{port} is already in use "
                "(another inferq daemon? give each its own port)"
            ) from None
        raise ConfigError(f"--metrics-host {host!r}: cannot listen on port {port}: {exc}") from None
    lease.start()
    observer.start()
    server = MetricsServer(httpd, observer, lease, host)
    log.info("metrics on %s", server.url)
    return server
