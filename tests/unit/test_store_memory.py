"""The Redis eviction check (inferq.store.glance.RedisMemory): pure, no server."""

from __future__ import annotations

import pytest

from inferq.store.glance import RedisMemory

GIB = 2**30


@pytest.mark.parametrize(
    "policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-ttl"]
)
def test_any_evicting_policy_under_a_limit_is_warned_of_with_the_fix(policy: str) -> None:
    warning = RedisMemory(used_bytes=0, max_bytes=GIB, policy=policy).eviction_warning
    assert warning is not None
    assert f"maxmemory-policy {policy}" in warning and "1024 MiB" in warning
    assert warning.endswith("set maxmemory-policy noeviction")


@pytest.mark.parametrize(
    ("max_bytes", "policy"),
    [
        (GIB, "noeviction"),  # a full Redis refuses writes: the submit fails, nothing lost
        (0, "allkeys-lru"),  # no limit: nothing is ever evicted
        (GIB, ""),  # the server does not say (a proxy, fakeredis)
    ],
)
def test_no_warning_where_nothing_can_be_evicted_or_nothing_is_known(
    max_bytes: int, policy: str
) -> None:
    assert RedisMemory(0, max_bytes, policy).eviction_warning is None
