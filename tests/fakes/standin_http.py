"""The serving half of the loopback stand-in API servers (Docker, Kubernetes).

A subclass is a dataclass with ``port``, ``_server`` and ``_thread`` fields and a
``handler`` class attribute; its handler reaches the stand-in as ``server.standin``.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import ClassVar, Self


class LoopbackServer:
    """Serve ``handler`` on 127.0.0.1 (an ephemeral port when ``port`` is 0) in a thread."""

    handler: ClassVar[type[BaseHTTPRequestHandler]]
    port: int
    _server: ThreadingHTTPServer | None
    _thread: threading.Thread | None

    def start(self) -> Self:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        server.daemon_threads = True
        server.standin = self  # type: ignore[attr-defined]
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
