"""Prefix-cache affinity on two real llama.cpp servers (issue 22, part 5).

Runs ``scripts/bench_prefix_llama.py`` at a CI size: six conversations of four turns at
once on two SmolLM2-135M servers behind a dispatcher and two workers, one round with
affinity and one without, and reads its JSON. The reuse asserted is the servers' own
count (llama.cpp's ``timings.cache_n`` per response, summed in the workers' heartbeats),
not the dispatcher's forecast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..conftest import REDIS_URL
from .llm_server import require

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_prefix_llama.py"


def test_later_turns_reuse_their_conversations_cache_with_affinity(tmp_path: Path) -> None:
    require()
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--conversations", "6", "--turns", "4"]
    cmd += ["--words", "150", "--rounds", "1", "--ctx-size", "16384"]
    cmd += ["--log-dir", str(tmp_path), "--json", str(out)]
    env = {**os.environ, "INFERQ_REDIS_URL": REDIS_URL}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("w*.log")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    modes = json.loads(out.read_text())["modes"]
    on, off = modes["affinity on"], modes["affinity off"]
    assert on["failed"] == off["failed"] == 0, proc.stdout
    assert on["later_turns"] == 18, proc.stdout
    # With affinity a later turn goes where its conversation ran unless that worker is
    # busier by more than the prefill it saves (measured: 78% stayed, 86% of what could
    # be reused was, TTFT p50 0.52x; without: 33% stayed by chance), and the servers
    # reuse most of what they could: the turn before's prompt and answer.
    assert on["same_worker_share"] >= 0.6, proc.stdout
    assert on["reused_share_of_reusable"] >= 0.7, proc.stdout + logs
    print(proc.stdout)
