"""A Redis that may evict inferq's keys is reported: the dispatcher warns at start and
``inferq info`` shows it (a private redis-server, so the shared one keeps its policy)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from inferq.cli.main import cli
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.embedded import EmbeddedRedis
from inferq.store import Store, connect

from ..fakes.servers import needs_redis_server

pytestmark = needs_redis_server


@pytest.fixture
def evicting() -> Iterator[Store]:
    """A private redis-server with a 1 GiB limit and ``allkeys-lru``."""
    with EmbeddedRedis(prefer="redis-server") as server:
        client = connect(server.url)
        client.config_set("maxmemory", str(2**30))
        client.config_set("maxmemory-policy", "allkeys-lru")
        yield Store(client, Settings.load(redis_url=server.url, namespace="evict"))
        client.close()


def test_the_dispatcher_warns_at_start_of_a_redis_that_may_evict_its_keys(
    evicting: Store, caplog: pytest.LogCaptureFixture
) -> None:
    dispatcher = Dispatcher(evicting)
    with caplog.at_level(logging.WARNING, logger="inferq"):
        thread = threading.Thread(target=dispatcher.run, daemon=True)
        thread.start()
        dispatcher.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    [warning] = [r.getMessage() for r in caplog.records if "evict" in r.getMessage()]
    assert "maxmemory-policy allkeys-lru" in warning and "noeviction" in warning


def test_info_shows_the_policy_and_the_warning(evicting: Store) -> None:
    base = ["--redis-url", evicting.settings.redis_url, "--namespace", "evict"]
    data = json.loads(CliRunner().invoke(cli, [*base, "info", "--json"]).output)
    assert data["redis_maxmemory_policy"] == "allkeys-lru"
    assert data["redis_maxmemory_bytes"] == 2**30
    [warning] = data["warnings"]
    assert "requests can be lost" in warning
    table = CliRunner().invoke(cli, [*base, "info"]).output
    assert "allkeys-lru, limit 1024 MiB" in table and "noeviction" in table
    evicting.redis.config_set("maxmemory-policy", "noeviction")
    data = json.loads(CliRunner().invoke(cli, [*base, "info", "--json"]).output)
    assert data["warnings"] == []
