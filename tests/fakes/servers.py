"""Redis servers a test starts itself: free ports, a temp directory, TLS files, ACL users, Sentinel.

Plain functions (not fixtures) shared by the connection, security and Sentinel tests.
Every server runs without persistence in its own directory and is killed by ``stop``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from inferq.embedded import free_port
from inferq.models import WorkerState

from ..helpers import wait_for

REDIS_SERVER = shutil.which("redis-server")
OPENSSL = shutil.which("openssl")

needs_redis_server = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not on PATH")


@dataclass
class Server:
    """A redis-server (or sentinel) process the test owns."""

    name: str
    port: int
    directory: Path
    proc: subprocess.Popen[bytes]
    #: redis.Redis options of a client allowed to do anything (the test's own inspection).
    admin: dict[str, object] = field(default_factory=dict)

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **{**self.admin, **kwargs})  # type: ignore[arg-type]

    def log(self) -> str:
        path = self.directory / f"{self.name}.log"
        return path.read_text() if path.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_server(
    directory: Path,
    name: str,
    lines: Iterable[str] = (),
    *,
    port: int | None = None,
    tls_port: int | None = None,
    sentinel: bool = False,
    admin: dict[str, object] | None = None,
) -> Server:
    """Write ``<name>.conf`` (the given config lines after the basics) and start the server.

    ``port`` is the plain TCP port (default: a free one; 0 = none), ``tls_port`` the TLS
    one; ``admin`` holds the client options the readiness check and :meth:`Server.client`
    use (for TLS: ``ssl=True`` and the CA).
    """
    assert REDIS_SERVER is not None
    port = free_port() if port is None else port
    conf = directory / f"{name}.conf"
    basics = [
        "bind 127.0.0.1",
        f"port {port}",
        f"dir {directory}",
        f"logfile {directory / f'{name}.log'}",
        f"pidfile {directory / f'{name}.pid'}",
        *([f"tls-port {tls_port}"] if tls_port else []),
    ]
    if not sentinel:
        basics += ['save ""', "appendonly no"]
    conf.write_text("\n".join([*basics, *lines]) + "\n")
    cmd = [REDIS_SERVER, str(conf), *(["--sentinel"] if sentinel else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(name, tls_port or port, directory, proc, admin or {})
    wait_for(lambda: _answers(server), timeout=10, what=f"{name} to answer")
    return server


def _answers(server: Server) -> bool:
    if server.proc.poll() is not None:
        raise AssertionError(f"{server.name} exited:\n{server.log()}")
    try:
        return bool(server.client(socket_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost (openssl CLI)."""
    assert OPENSSL is not None
    d = directory
    ext = d / "server.ext"
    ext.write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"]
    ca = ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test CA"]
    csr = ["req", *ec[:-2], "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]
    sign = ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key"]
    sign += ["-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", str(ext)]
    for cmd in (ca, csr, sign):
        subprocess.run([OPENSSL, *cmd], cwd=d, check=True, capture_output=True)
    return TlsFiles(ca=d / "ca.crt", cert=d / "server.crt", key=d / "server.key")


def inferq_process(
    url: str, namespace: str, *args: str, log_level: str = "INFO"
) -> subprocess.Popen[bytes]:
    """``python -m inferq <args>`` against ``url``, output captured (stdout + stderr)."""
    env = {**os.environ, "INFERQ_REDIS_URL": url, "INFERQ_NAMESPACE": namespace}
    cmd = [sys.executable, "-m", "inferq", "--log-level", log_level, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def sim_worker(
    url: str, namespace: str, wid: str, *extra: str, log_level: str = "INFO"
) -> subprocess.Popen[bytes]:
    """A simulated llama-3.1-8b worker process (no sleeping, 0.2 s heartbeats)."""
    return inferq_process(
        url,
        namespace,
        "worker",
        "--model",
        "llama-3.1-8b",
        "--vram-mib",
        "24576",
        "--id",
        wid,
        "--heartbeat-interval",
        "0.2",
        "-o",
        "time_scale=0",
        *extra,
        log_level=log_level,
    )


def wait_ready(
    client: redis.Redis, namespace: str, wid: str, proc: subprocess.Popen[bytes]
) -> None:
    """Block until worker ``wid`` heartbeats ``ready`` (fails early if it exited)."""

    def ready() -> bool:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"worker {wid} exited {proc.returncode}:\n{out}")
        state = client.hget(f"inferq:{namespace}:worker:{wid}", "state")
        return state in (WorkerState.READY.value, WorkerState.READY.value.encode())

    wait_for(ready, what=f"worker {wid} ready")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> str:
    """SIGTERM (then SIGKILL) a process; returns its captured output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.stdout.read().decode(errors="replace") if proc.stdout else ""
