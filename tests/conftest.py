"""Shared fixtures: every test gets its own key namespace on the real Redis, cleaned up after.

The server is ``INFERQ_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); CI starts
one when nothing answers there.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from inferq.config import Settings
from inferq.store import Store, connect
from tests.llm_server import llama_server_url as llama_server_url  # the real model server

REDIS_URL = os.environ.get("INFERQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long chaos/soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long run: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def purge_namespace(client: redis.Redis, namespace: str) -> None:
    """Delete every key of a namespace, RQ's included."""
    for pattern in (f"inferq:{namespace}:*", f"rq:*inferq:{namespace}:*", f"rq:job:{namespace}-*"):
        keys = list(client.scan_iter(match=pattern, count=1000))
        for i in range(0, len(keys), 500):
            client.unlink(*keys[i : i + 500])


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = connect(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    ns = f"t{uuid.uuid4().hex[:12]}"
    yield ns
    purge_namespace(redis_client, ns)


@pytest.fixture
def settings(namespace: str) -> Settings:
    return Settings.load(redis_url=REDIS_URL, namespace=namespace)


@pytest.fixture
def store(redis_client: redis.Redis, settings: Settings) -> Store:
    return Store(redis_client, settings)
