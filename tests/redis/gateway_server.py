"""A running ``inferq gateway`` for tests: uvicorn in a thread on a free port, real Redis."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import uvicorn

from inferq.config import Settings
from inferq.embedded import free_port
from inferq.gateway.app import create_app
from inferq.gateway.tenants import KeyRing


class GatewayServer:
    """The gateway app served by uvicorn in a thread; ``url`` is its ``/v1`` base."""

    def __init__(
        self,
        settings: Settings,
        keys: Path | None,
        *,
        rate_limits: bool = True,
        redis_keys: bool = False,
        **options: Any,
    ) -> None:
        keyring = KeyRing.load(keys, [c.name for c in settings.classes])
        self.app = create_app(
            settings, keyring, rate_limits=rate_limits, redis_keys=redis_keys, **options
        )
        self.port = free_port()
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
