"""``python -m inferq.llama_server``: the real server it runs (subprocesses; no Redis).

Its options and errors are tested in tests/unit/test_llama_server.py.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from inferq.config import Settings
from inferq.llama_server import BUNDLED_NAME, INSTALL

from .llm_server import LlamaServer, require


def test_the_real_server_tests_skip_without_the_install_and_fail_when_ci_requires_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("INFERQ_REQUIRE_LLM", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require()
    assert str(skipped.value) == f"real model server: xllamacpp is not installed ({INSTALL})"
    monkeypatch.setenv("INFERQ_REQUIRE_LLM", "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        require()
    assert "INFERQ_REQUIRE_LLM=1 but xllamacpp is not installed" in str(failed.value)


# --- the real server ------------------------------------------------------------------


def test_the_server_lists_the_registry_name_and_its_slots_and_stops_cleanly() -> None:
    require()
    server = LlamaServer(parallel=2, ctx_size=1024).start()
    try:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as http:
            [model] = http.get("/v1/models").json()["data"]
            props = http.get("/props").json()
            slots = http.get("/slots").json()
            metrics = http.get("/metrics").text
        assert model["id"] == BUNDLED_NAME
        assert model["meta"]["n_ctx"] == 512  # per slot: 1024 / 2
        spec = {m.name: m for m in Settings.load().models}[BUNDLED_NAME]
        assert round(model["meta"]["n_params"] / 1e9, 3) == spec.params_b
        assert props["total_slots"] == 2
        assert [s["id"] for s in slots] == [0, 1]
        assert not any(s["is_processing"] for s in slots)
        assert "llamacpp:requests_processing 0" in metrics
    finally:
        code = server.stop()
    assert code == 0
    assert server.log[-1] == "llama_server: stopped on SIGTERM"


def test_sigint_stops_it_cleanly_and_a_restart_keeps_the_port() -> None:
    require()
    server = LlamaServer(parallel=1, ctx_size=512).start()
    port = server.port
    try:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=10) == 0
        assert server.log[-1] == "llama_server: stopped on SIGINT"
        server.start()
        assert server.port == port
        assert httpx.get(f"{server.url}/health", trust_env=False).json() == {"status": "ok"}
    finally:
        assert server.stop() == 0


def test_a_busy_port_is_an_error_not_a_hang() -> None:
    require()
    with LlamaServer(parallel=1, ctx_size=512) as first:
        proc = subprocess.run(
            [sys.executable, "-m", "inferq.llama_server", "--port", str(first.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert f"error: llama.cpp did not start on 127.0.0.1:{first.port}" in proc.stderr


def _post_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict[str, object]]:
    """A chat request of ``max_tokens`` (ignore_eos) in a thread; its usage or error."""
    out: dict[str, object] = {}
    body = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": max_tokens}

    def go() -> None:
        try:
            answer = httpx.post(
                f"{url}/v1/chat/completions",
                json={**body, "ignore_eos": True},
                trust_env=False,
                timeout=60,
            )
            out["usage"] = answer.json()["usage"]
        except httpx.HTTPError as exc:
            out["error"] = type(exc).__name__

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def _wait_busy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s["is_processing"] for s in httpx.get(f"{url}/slots", trust_env=False).json()):
            return
        time.sleep(0.01)
    raise AssertionError(f"the request never reached a slot in {timeout_s:.0f} s")


def test_sigterm_lets_the_request_in_flight_finish() -> None:
    """The drain is set well past the request: 40 tokens take ~1 s on an idle host and
    3-5 s beside eight busy loops on 2 cores (measured); two suites running at once on
    such a host made it outlast the default 8 s drain, which cut it."""
    require()
    server = LlamaServer(parallel=1, ctx_size=512, drain_s=60).start()
    thread, out = _post_in_background(server.url, 40)
    _wait_busy(server.url)
    assert server.stop(timeout_s=90) == 0
    thread.join(timeout=30)
    usage = out.get("usage")
    assert isinstance(usage, dict) and usage["completion_tokens"] == 40, (out, server.log[-3:])
    assert server.log[-1] == "llama_server: stopped on SIGTERM"


def test_a_request_longer_than_the_drain_is_cut_and_the_server_still_exits() -> None:
    require()
    server = LlamaServer(parallel=1, ctx_size=2048, drain_s=0.3).start()
    thread, out = _post_in_background(server.url, 1500)  # ~10 s: far beyond the drain
    _wait_busy(server.url)
    started = time.monotonic()
    assert server.stop(timeout_s=10) == 0  # llama.cpp alone would never return here
    assert time.monotonic() - started < 5
    thread.join(timeout=30)
    assert "error" in out
    assert server.log[-1] == "llama_server: stopped on SIGTERM, 1 requests cut"


def test_the_benchmark_script_reports_every_figure(tmp_path: Path) -> None:
    require()
    out = tmp_path / "figures.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_llama_server.py"
    tiny = ["--requests", "1", "--rounds", "1", "--tokens", "4", "--prompt-words", "10"]
    proc = subprocess.run(
        [sys.executable, str(script), *tiny, "--parallel", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s per stream" in proc.stdout
    doc = json.loads(out.read_text())
    assert {"date", "command", "machine", "load", "single_stream", "concurrent"} <= set(doc)
    assert doc["single_stream"]["completion_tokens"] == 4  # ignore_eos: the length asked
    assert doc["concurrent"]["completion_tokens"] == 2 * 4
    assert doc["load"]["rss_loaded_mib"] > 0 and doc["prefill"]["prompt_tokens"] > 10
