"""Smoke tests of scripts/bench_*.py: each runs at tiny sizes, prints its table, writes JSON.

Nothing here times anything: the figures' values are not checked, only that each
script runs end to end on the real Redis, reports under its documented keys and
leaves no key behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _bench  # noqa: E402


def test_percentile_interpolates_like_numpy() -> None:
    assert _bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert _bench.percentile([5.0, 1.0, 3.0], 0) == 1.0
    assert _bench.percentile([5.0, 1.0, 3.0], 100) == 5.0
    assert _bench.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert _bench.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        _bench.percentile([], 50)
    with pytest.raises(ValueError, match=r"outside 0\.\.100"):
        _bench.percentile([1.0], 101)


def test_eval_adversarial_reports_the_inversion_and_what_preemption_cost(tmp_path: Path) -> None:
    """scripts/eval_adversarial.py on priority-inversion: inferq meets realtime's SLA by one
    preemption and says what it cost batch against its own no-preemption run;
    strict-priority inverts (no preemption row of its own: it never preempts)."""
    import json
    import subprocess

    out = tmp_path / "adv.json"
    args = ["--scenario", "priority-inversion", "--policy", "inferq", "--policy", "strict-priority"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "eval_adversarial.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["inferq", "inferq (no preemption)", "strict-priority"]
    ours, plain, strict = rows["inferq"], rows["inferq (no preemption)"], rows["strict-priority"]
    assert ours["realtime"]["ttft_p99_s"] <= 2.0 < strict["realtime"]["ttft_p99_s"]
    assert ours["realtime"]["sla_attainment"] == 1.0 and plain["realtime"]["sla_attainment"] == 0
    assert ours["preemptions"] == 1 and ours["wasted_tokens"] > 0
    assert ours["others"]["e2e_p99_delta_s"] > 0  # the requeued batch request finished later
    assert plain["others"]["e2e_p99_delta_s"] == 0 and strict["preemptions"] == 0
    assert "Adversarial workloads" in done.stdout


def test_bench_gateway_parses_its_options_and_reads_sse_streams() -> None:
    """scripts/bench_gateway.py stays out of CI (a model server, LiteLLM and a whole
    stack); this checks its options and its SSE reading on a canned stream."""
    import json
    import subprocess

    import httpx

    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_gateway.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--litellm-venv" in out and "--zero-requests" in out
    import bench_gateway

    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"index": 0, "delta": {"content": "Red"}}]},
        {"choices": [{"index": 0, "delta": {"content": ", blue"}}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    http = httpx.Client(transport=httpx.MockTransport(answer))
    ttft, deltas = bench_gateway.ttft_http(http, "http://x/v1", bench_gateway.body("m", 2))
    assert deltas == 2 and ttft >= 0  # the role-only chunk is not the first token
    assert seen[0]["stream"] is True and seen[0]["ignore_eos"] is True
