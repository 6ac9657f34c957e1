"""Unit tests: no Redis, no processes. Asking for the Redis fixtures here is a mistake."""

from __future__ import annotations

import pytest


@pytest.fixture
def redis_client() -> None:
    """Refuses: a unit test needs no Redis (put it under ``tests/redis`` if it does)."""
    pytest.fail("tests/unit must not use Redis: move this test under tests/redis")
