"""``inferq dashboard`` loaded in a real headless Chromium (Debian's ``chromium``).

The page is served by the command as an operator runs it, against a namespace with
a live worker, queued work, a finished request and a dead letter; Chromium runs the
page's script (live refresh, uPlot charts) and the test asserts on the DOM it ends
with. ``INFERQ_DASHBOARD_SCREENSHOT=docs/dashboard.png`` keeps its screenshot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferq.config import Settings
from inferq.store import Completion, Store

from ..builders import inference_request, worker_info
from ..conftest import REDIS_URL
from ..helpers import KeepAlive
from ..tools import require_tool

WORKER = "gpu-node-07-a100-slot0"


def _fill(store: Store, settings: Settings) -> str:
    """A queued request, a finished one and a dead-lettered one; returns the dead id."""
    done = inference_request(settings, priority="realtime", tenant="acme")
    store.submit(done)
    qkey = store.keys.tenant_queue("realtime", done.route, done.tenant)
    [(rid, attempt)] = store.assign(WORKER, "b0", [(done.id, qkey, 1)])
    store.complete(WORKER, [Completion(rid, attempt, "succeeded", completion_tokens=4)])
    dead = inference_request(settings, priority="batch")
    store.submit(dead)
    for i in range(settings.max_attempts):
        bkey = store.keys.tenant_queue("batch", dead.route, dead.tenant)
        [(_, attempt)] = store.assign(WORKER, f"d{i}", [(dead.id, bkey, 1)])
        store.requeue([(dead.id, attempt, WORKER, "openai: HTTP 503 <from> upstream")])
    for _ in range(3):
        store.submit(inference_request(settings, priority="standard"))
    return dead.id


@pytest.fixture
def dashboard_url(namespace: str) -> Iterator[str]:
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL, "INFERQ_NAMESPACE": namespace}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferq", "dashboard", "--port", "0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("inferq dashboard ready: http://127.0.0.1:"), line
        yield line.split("ready: ", 1)[1].split(",", 1)[0]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_the_dashboard_in_headless_chromium(
    dashboard_url: str, store: Store, settings: Settings, tmp_path: Path
) -> None:
    chromium = require_tool("chromium", "apt-get install chromium")
    with KeepAlive(store, [worker_info(WORKER, slots=4)]):
        dead_id = _fill(store, settings)
        state = json.load(urllib.request.urlopen(dashboard_url + "api/state", timeout=10))
        assert state["sla"]["realtime"]["finished"] == 1
        # Numbers as numbers, names and ids as strings (as `inferq events --json`)
        finish = next(e for e in state["events"] if e["type"] == "finish")
        assert isinstance(finish["fields"]["queue_ms"], int)
        assert isinstance(finish["fields"]["id"], str)
        shot = Path(os.environ.get("INFERQ_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        base += ["--virtual-time-budget=6000", "--window-size=1280,1200"]
        dom = subprocess.run(
            [*base, "--dump-dom", dashboard_url],
            capture_output=True,
            text=True,
            timeout=90,
        ).stdout
        subprocess.run(
            [*base, f"--screenshot={shot.resolve()}", dashboard_url],
            capture_output=True,
            timeout=90,
            check=True,
        )
    # The script ran: the live part was refreshed from /fragment, the charts drawn.
    assert 'data-updated="20' in dom, dom[:2000]
    assert dom.count('class="uplot') == 2
    assert WORKER in dom and "llama-3.1-8b" in dom and ">ok<" in dom
    assert ">standard<" in dom and ">3<" in dom  # three standard requests queued
    assert "100.0 %" in dom  # realtime: one result, within its SLA
    assert "Dead letter (1)" in dom and dead_id in dom
    assert "HTTP 503 &lt;from&gt; upstream" in dom  # escaped, not markup
    assert shot.stat().st_size > 10_000
