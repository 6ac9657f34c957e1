"""The gateway's Redis commands on a streamed request's way to its first token (issue 14).

A private ``redis-server`` under MONITOR, an in-process gateway, a live worker's
heartbeat and no dispatcher: the request stays queued and the gateway waits on its
stream, so every command it sent from its submit to its first XREAD can be counted.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from inferq.config import Settings
from inferq.store import Store, connect

from ..fakes.servers import needs_redis_server, start_server
from ..helpers import ready_worker, wait_for
from .gateway_server import GatewayServer

MODEL = "llama-3.1-8b"


class Commands:
    """Every command the server runs, as (client port or ``lua``, command text), in order."""

    def __init__(self, client: redis.Redis) -> None:
        self.seen: list[tuple[str, str]] = []
        self._client = client
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        try:
            with self._client.monitor() as monitor:
                ready.set()
                for cmd in monitor.listen():
                    source = "lua" if cmd.get("client_type") == "lua" else cmd["client_port"]
                    self.seen.append((str(source), str(cmd["command"])))
        except redis.ConnectionError:
            return  # the server was stopped


def _post(url: str) -> None:
    """A streamed chat that the test abandons (the read times out)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"X-Inferq-Priority": "realtime"}
    try:
        with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=3):
            pass
    except httpx.HTTPError:
        pass


def _submits(store: Store) -> int:
    """Requests submitted so far (the events stream's ``submit`` entries)."""
    return sum(1 for e in store.events() if e.type == "submit")


def _reads_stream(seen: tuple[str, str]) -> bool:
    """An XREAD of a request's output stream (not the events stream)."""
    return seen[1].startswith("XREAD") and ":stream:" in seen[1]


@needs_redis_server
def test_the_gateway_reads_the_stream_right_after_its_submit(tmp_path: Path) -> None:
    """From its submit to its first XREAD of the request's stream the gateway sends no
    other command: the read of the request's record it made first (HGETALL + GET) was
    on the way to every streamed request's first chunk."""
    server = start_server(tmp_path, "gateway-path")
    url = f"redis://127.0.0.1:{server.port}/0"
    settings = Settings.load(redis_url=url, namespace="gp")
    ready_worker(Store(connect(url), settings), "w1", model=MODEL)  # the model is served
    commands = Commands(server.client(decode_responses=True))
    try:
        with GatewayServer(settings, None, rate_limits=False) as gateway:
            caller = threading.Thread(target=_post, args=(gateway.url,), daemon=True)
            caller.start()
            wait_for(lambda: any(map(_reads_stream, commands.seen)), 10, "the XREAD")
            seen = list(commands.seen)
            caller.join(10)
    finally:
        server.kill()
    xread = next(i for i, seen_at in enumerate(seen) if _reads_stream(seen_at))
    port = seen[xread][0]
    submit = max(
        i for i, (p, c) in enumerate(seen[:xread]) if p == port and c.startswith("EVALSHA")
    )
    between = [c.split(" ", 1)[0] for p, c in seen[submit + 1 : xread] if p == port]
    assert between == [], between


def test_the_view_of_the_fleet_is_kept_fresh_off_the_requests_way(
    settings: Settings, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While requests come, the gateway reads the fleet's models again in the background
    (every FLEET_REFRESH_S), so a request finds its view fresh instead of reading it on its
    way to the submit (two round trips in every FLEET_CACHE_S); a worker gone still turns
    the next request into a 503 within FLEET_CACHE_S (``test_gateway_keys.py``)."""
    ready_worker(store, "w1", model=MODEL)
    with GatewayServer(settings, None, rate_limits=False) as gateway:
        fleet = gateway.app.state.gateway.aclient.cells.get(None)
        reads: list[float] = []
        real = fleet.live_models

        async def counted() -> dict[str, int]:
            reads.append(time.monotonic())
            return await real()  # type: ignore[no-any-return]

        monkeypatch.setattr(fleet, "live_models", counted)
        _post(gateway.url)  # reads the view (no view yet)
        assert _submits(store) == 1
        wait_for(lambda: len(reads) >= 3, 10, "reads of the fleet with no request waiting")
