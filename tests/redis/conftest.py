"""Fixtures of the tests that run real servers beside the real Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from inferq.client import Client
from inferq.config import Settings
from inferq.store import Store

from ..conftest import REDIS_URL
from .fleet import Fleet
from .llm_server import llama_server_url as llama_server_url  # the real model server


@pytest.fixture
def fast_settings(namespace: str) -> Settings:
    """Heartbeat every 0.2 s (TTL 0.6 s) and 1 s leases: crash recovery in about a second."""
    return Settings.load(
        redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.2, lease_s=1.0
    )


@pytest.fixture
def fleet(fast_settings: Settings, redis_client: redis.Redis) -> Iterator[Fleet]:
    """Worker subprocesses and a dispatcher thread (:class:`~tests.redis.fleet.Fleet`)."""
    f = Fleet(fast_settings, Store(redis_client, fast_settings))
    yield f
    f.discard()


@pytest.fixture
def client(fast_settings: Settings, redis_client: redis.Redis) -> Client:
    return Client(settings=fast_settings, connection=redis_client)
