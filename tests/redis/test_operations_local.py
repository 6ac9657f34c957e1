"""docs/operations.md's "One machine, no containers" block, run line by line (issue 15).

The block is read from the document, so the test breaks when the document changes
in a way the commands no longer follow. Each line is run as the operator would run
it, with three substitutions: the test's Redis and namespace instead of the
defaults, free ports instead of 9100/9101/8300, and httpx instead of ``curl``. The
``pip install`` and ``redis-server`` lines are checked for shape only (the package is
installed and the test's Redis runs).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from inferq.embedded import free_port

from ..conftest import REDIS_URL
from ..helpers import wait_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
MARKER = "<!-- run by tests/redis/test_operations_local.py -->"


def doc_lines() -> list[str]:
    """The commands of the block after :data:`MARKER`, comments stripped."""
    text = DOC.read_text()
    block = text.split(MARKER, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


@dataclass
class Operator:
    """Runs the block's lines in a shell-like way, in its own working directory."""

    cwd: Path
    namespace: str
    env: dict[str, str]
    ports: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, line: str) -> list[str]:
        for old, new in self.ports.items():
            line = line.replace(old, new)
        words = shlex.split(line)
        assert words[0] == "inferq", line
        return [sys.executable, "-m", "inferq", *words[1:]]

    def background(self, line: str) -> None:
        log = (self.cwd / f"daemon{len(self.daemons)}.log").open("wb")
        self.daemons.append(
            subprocess.Popen(
                self.argv(line.removesuffix("&").strip()),
                cwd=self.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def run(self, line: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(line), cwd=self.cwd, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def stop(self) -> None:
        for proc in reversed(self.daemons):  # the scaler drains its workers on SIGTERM
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.cwd.glob("*.log")))


@pytest.fixture
def operator(tmp_path: Path, namespace: str) -> Iterator[Operator]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env["INFERQ_REDIS_URL"] = REDIS_URL
    op = Operator(tmp_path, namespace, env, {p: str(free_port()) for p in ("9100", "9101", "8300")})
    yield op
    op.stop()


def test_the_one_machine_path_of_operations_md_runs_as_written(operator: Operator) -> None:
    lines = doc_lines()
    assert len(lines) == 9, lines
    install, redis_line, export, *rest = lines
    assert install.startswith("pip install 'inferq[dashboard]'")
    assert redis_line.startswith("redis-server")
    name, value = export.removeprefix("export ").split("=", 1)
    assert name == "INFERQ_NAMESPACE" and value
    operator.env[name] = operator.namespace

    daemons = [line for line in rest if line.endswith("&")]
    assert [shlex.split(d)[1] for d in daemons] == ["dispatcher", "scaler", "dashboard"]
    for line in daemons:
        operator.background(line)

    workers, submit, curl = (line for line in rest if not line.endswith("&"))

    def one_ready() -> bool:
        out = operator.run(workers + " --json")
        assert out.returncode == 0, out.stderr
        return '"ready"' in out.stdout

    wait_for(one_ready, timeout=90, what="the scaler's worker ready (" + operator.logs()[-2000:])
    table = operator.run(workers)
    assert table.returncode == 0 and "llama-3.1-8b" in table.stdout and "ready" in table.stdout

    done = operator.run(submit, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "succeeded" in done.stdout, done.stdout

    fetch, grep = curl.split("|")
    urls = [u for u in shlex.split(fetch) if u.startswith("http")]
    for old, new in operator.ports.items():
        urls = [u.replace(old, new) for u in urls]
    wanted = shlex.split(grep)[1]

    def exported() -> bool:
        return any(wanted in httpx.get(u, timeout=5).text for u in urls)

    wait_for(exported, timeout=30, what=f"{wanted} at {urls}")

    page = f"http://127.0.0.1:{operator.ports['8300']}/api/state"
    wait_for(lambda: httpx.get(page, timeout=5).status_code == 200, what="the dashboard")
    state = httpx.get(page, timeout=5).json()
    assert any(w.get("model") == "llama-3.1-8b" for w in state["workers"]), state

    operator.stop()
    assert (operator.cwd / "worker-logs").is_dir()
    assert "Traceback" not in operator.logs()
