"""An embedded Redis for the demo: a real ``redis-server`` when one is on PATH, else fakeredis.

The real server runs on a free loopback port in a temporary directory (no
persistence) and is stopped on exit. The fallback is fakeredis's TCP server in
a thread, with two fixes measured on fakeredis 2.x: its handler needs
TCP_NODELAY (without it every pipeline stalls ~44 ms on delayed ACKs), and
BLMOVE/BLPOP on an empty list return at once instead of blocking (inferq's
waits pace themselves, so this costs CPU, not correctness).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from types import TracebackType

import redis

from inferq.errors import InferqError
from inferq.extras import import_extra


class EmbeddedRedisError(InferqError):
    """The embedded Redis did not start; the message says why."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis(AbstractContextManager["EmbeddedRedis"]):
    """Start a private Redis; ``url`` points at it while the context is open.

    Args:
        prefer: ``"auto"`` (redis-server if on PATH, else fakeredis),
            ``"redis-server"`` or ``"fakeredis"``.

    Raises:
        EmbeddedRedisError: the chosen server could not start within 10 s.
    """

    def __init__(self, prefer: str = "auto") -> None:
        self.prefer = prefer
        self.kind = ""
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._fake: object | None = None

    def __enter__(self) -> EmbeddedRedis:
        binary = shutil.which("redis-server")
        if self.prefer == "redis-server" or (self.prefer == "auto" and binary):
            if not binary:
                raise EmbeddedRedisError("redis-server is not on PATH")
            self._start_real(binary)
        else:
            self._start_fake()
        self._wait_ready()
        return self

    def _start_real(self, binary: str) -> None:
        port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="inferq-redis-")
        cmd = [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self._dir.name, "--logfile", "redis.log",
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.kind = "redis-server"
        self.url = f"redis://127.0.0.1:{port}/0"

    def _start_fake(self) -> None:
        # An optional extra: imported here, refused with one line naming it when missing.
        import_extra("fakeredis", "demo", "the embedded Redis without redis-server on PATH")
        from fakeredis import TcpFakeServer
        from fakeredis._clients._tcp_server import TCPFakeRequestHandler

        class NoDelayHandler(TCPFakeRequestHandler):
            def setup(self) -> None:
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                super().setup()

        port = free_port()
        server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        server.RequestHandlerClass = NoDelayHandler
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="fakeredis", daemon=True).start()
        self._fake = server
        self.kind = "fakeredis"
        self.url = f"redis://127.0.0.1:{port}/0"

    def _wait_ready(self) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError as exc:
                    if self._proc is not None and self._proc.poll() is not None:
                        raise EmbeddedRedisError(
                            f"redis-server exited with code {self._proc.returncode}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise EmbeddedRedisError(f"{self.kind} did not answer: {exc}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server and remove its directory. Safe to call twice."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._fake is not None:
            self._fake.shutdown()  # type: ignore[attr-defined]
            self._fake.server_close()  # type: ignore[attr-defined]
            self._fake = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
