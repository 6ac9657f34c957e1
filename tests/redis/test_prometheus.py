"""A real Prometheus scrapes a running stack; the series are queried through its HTTP API.

The stack: two dispatcher replicas serving ``/metrics`` and a sim worker, as
processes on the real Redis. Prometheus (Debian's ``prometheus`` package; ``.ci/run``
installs it) scrapes both replicas every second. The deployment-wide series come
from one replica only (the metrics lease), so ``sum()`` counts each worker once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferq.config import Settings
from inferq.embedded import free_port
from inferq.store import Store

from ..builders import inference_request
from ..conftest import REDIS_URL
from ..helpers import wait_for
from ..tools import require_tool

INFERQ = [sys.executable, "-m", "inferq"]


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _value(base: str, expr: str) -> float | None:
    result = _query(base, expr)
    return float(result[0]["value"][1]) if result else None


@pytest.fixture
def stack(namespace: str, tmp_path: Path) -> Iterator[list[int]]:
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": namespace}
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [*INFERQ, "dispatcher", "--metrics-port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"dispatcher{i}.log").open("wb"),
        )
        for i, port in enumerate(ports)
    ]
    procs.append(
        subprocess.Popen(
            [*INFERQ, "worker", "--model", "llama-3.1-8b", "--vram-mib", "24576", "--slots", "4"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "worker.log").open("wb"),
        )
    )
    try:
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def prometheus(stack: list[int], tmp_path: Path) -> Iterator[str]:
    binary = require_tool("prometheus", "apt-get install prometheus")
    port = free_port()
    targets = ", ".join(f"'127.0.0.1:{p}'" for p in stack)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: inferq\n"
        f"    static_configs:\n      - targets: [{targets}]\n"
    )
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_prometheus_scrapes_the_stack_and_counts_the_deployment_once(
    prometheus: str, store: Store, settings: Settings
) -> None:
    def up() -> bool:
        try:
            return _value(prometheus, "sum(up{job='inferq'})") == 2
        except OSError:
            return False

    wait_for(up, timeout=60, what="Prometheus scraping both dispatcher replicas")
    wait_for(
        lambda: _value(prometheus, "sum(inferq_workers{state='ready'})") == 1,
        timeout=60,
        what="one ready worker, counted once over two replicas",
    )
    handles = [store.submit(inference_request(settings, priority="realtime")) for _ in range(3)]
    for h in handles:
        assert store.wait_final(h.id, 60)
    wait_for(
        lambda: (
            _value(prometheus, "sum(inferq_ttft_seconds_count{priority_class='realtime'})") == 3
        ),
        timeout=60,
        what="three TTFT observations, from the lease holder only",
    )
    assert _value(prometheus, "sum(inferq_metrics_lease_held)") == 1
    assert (_value(prometheus, "sum(inferq_completion_tokens_total)") or 0) > 0
    assert _value(prometheus, "sum(inferq_sla_requests_total{outcome='met'})") == 3
    holders = _query(prometheus, "inferq_metrics_lease_held == 1")
    assert len(holders) == 1
