"""The client library against the real Redis: submit, wait, cancel, refusals, async twin."""

from __future__ import annotations

import pytest

from inferq.client import Client
from inferq.config import Settings
from inferq.errors import RedisUnavailable


@pytest.fixture
def client(settings: Settings) -> Client:
    c = Client(settings=settings)
    yield c  # type: ignore[misc]
    c.close()


def test_unreachable_redis_names_the_url_without_the_password() -> None:
    with pytest.raises(RedisUnavailable) as info:
        Client("redis://bob:hunter2@127.0.0.1:1/0")
    assert "redis://bob:***@127.0.0.1:1/0" in str(info.value)
    assert "hunter2" not in str(info.value)
