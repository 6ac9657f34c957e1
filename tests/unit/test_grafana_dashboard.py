"""deploy/grafana/inferq.json: valid JSON whose every query names series inferq exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "inferq.json"
METRICS = ROOT / "src" / "inferq" / "metrics"


def _exported() -> set[str]:
    """Every series name the metrics package defines, with Prometheus' suffixes."""
    names = set()
    for path in METRICS.glob("*.py"):
        names |= set(re.findall(r'"(inferq_[a-z_]+)"', path.read_text()))
    out = set(names)
    for name in names:
        out |= {f"{name}_total", f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return out


def test_every_panel_queries_series_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = {name for expr in exprs for name in re.findall(r"\binferq_[a-z_]+", expr)}
    assert used <= exported, sorted(used - exported)
    # What operators look at first is on the board.
    for name in (
        "inferq_ttft_seconds_bucket",
        "inferq_sla_requests_total",
        "inferq_queue_depth",
        "inferq_worker_kv_cache_used_bytes",
        "inferq_backend_errors_total",
    ):
        assert name in used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
