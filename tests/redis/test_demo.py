"""``inferq demo`` end to end (a short window of the real trace) and its pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferq.embedded import EmbeddedRedis


def test_demo_runs_end_to_end_and_loses_nothing(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "inferq", "demo", "--duration", "40", "--speedup", "20",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "inferq-demo-report.json").read_text())
    assert report["requests"] > 50 and report["lost"] == 0 and report["unfinished"] == 0
    assert set(report["classes"]) == {"realtime", "standard", "batch"}
    assert report["classes"]["realtime"]["requests"] > 0
    assert (tmp_path / "inferq-demo.png").stat().st_size > 10_000
    assert "SLA" in out.stdout and "realtime" in out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("kind", ["redis-server", "fakeredis"])
def test_embedded_redis(kind: str) -> None:
    import redis

    with EmbeddedRedis(kind) as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping() and server.kind == kind
        client.close()
