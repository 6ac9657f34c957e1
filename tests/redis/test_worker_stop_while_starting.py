"""A worker still `starting` (its model server not up yet) leaves on SIGTERM at once,
instead of after the server's load timeout (600 s for the openai backend): found by a
new user following the README, whose Ctrl-C did nothing for minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from inferq.embedded import free_port
from inferq.store import Store

from ..helpers import wait_for


def test_sigterm_while_the_model_server_loads_ends_the_worker_promptly(
    namespace: str, store: Store
) -> None:
    env = {**os.environ, "INFERQ_NAMESPACE": namespace}
    cmd = [sys.executable, "-m", "inferq", "worker", "--model", "llama-3.1-8b"]
    cmd += ["--vram-mib", "24576", "--id", "w-start", "--backend", "openai"]
    cmd += ["-o", f"base_url=http://127.0.0.1:{free_port()}"]  # nothing answers
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(
            lambda: store.redis.hget(store.keys.worker("w-start"), "state") == "starting",
            timeout=60,
            what="worker starting",
        )
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 30
        assert proc.stderr is not None
        assert b"stop signal while the model server was loading" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
