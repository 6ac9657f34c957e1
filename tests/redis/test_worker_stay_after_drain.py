"""``inferq worker --stay-after-drain``: the Kubernetes worker's drain (issue 15).

Under Kubernetes an exited container is restarted in place and would register
again as a fresh ``ready`` worker, so a worker the scaler drained through Redis
leaves the fleet and then waits for the pod's SIGTERM; a drain that starts with
SIGTERM (the pod deleted, a rollout) still exits as soon as the work is done.
Real Redis, real worker processes.
"""

from __future__ import annotations

import signal
import time

import redis

from inferq.store import Store

from ..conftest import REDIS_URL
from ..fakes.servers import sim_worker, stop_process, wait_ready
from ..helpers import wait_for


def test_a_redis_drain_leaves_the_fleet_and_waits_for_sigterm(
    redis_client: redis.Redis, namespace: str, store: Store
) -> None:
    proc = sim_worker(REDIS_URL, namespace, "k8s-1", "--stay-after-drain")
    try:
        wait_ready(redis_client, namespace, "k8s-1", proc)
        assert store.request_drain("k8s-1")
        wait_for(lambda: not store.worker_registered("k8s-1"), what="k8s-1 deregistered")
        time.sleep(1.5)  # several heartbeat intervals: it neither exits nor registers again
        assert proc.poll() is None
        assert not store.worker_registered("k8s-1")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        out = stop_process(proc)
    assert "waiting for SIGTERM" in out


def test_a_sigterm_drain_exits_at_once_even_with_the_flag(
    redis_client: redis.Redis, namespace: str, store: Store
) -> None:
    proc = sim_worker(REDIS_URL, namespace, "k8s-2", "--stay-after-drain")
    try:
        wait_ready(redis_client, namespace, "k8s-2", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        out = stop_process(proc)
    assert not store.worker_registered("k8s-2")
    assert "waiting for SIGTERM" not in out


def test_without_the_flag_a_redis_drain_exits(
    redis_client: redis.Redis, namespace: str, store: Store
) -> None:
    proc = sim_worker(REDIS_URL, namespace, "plain-1")
    try:
        wait_ready(redis_client, namespace, "plain-1", proc)
        assert store.request_drain("plain-1")
        assert proc.wait(timeout=15) == 0
    finally:
        stop_process(proc)
