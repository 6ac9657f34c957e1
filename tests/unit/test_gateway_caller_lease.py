"""The gateway's liveness lease loop: a failed renewal is retried within the reaping grace."""

from __future__ import annotations

from typing import Any

import pytest

from inferq.config import Settings
from inferq.dispatcher.daemon import OUTAGE_GRACE_MIN_S
from inferq.gateway import app as gateway_app
from inferq.gateway.tenants import KeyRing


class Stop(Exception):
    """Ends the loop under test."""


class FlakyStore:
    """A cell store whose first renewal fails (Redis unreachable)."""

    def __init__(self) -> None:
        self.renewals: list[tuple[str, float]] = []

    async def renew_caller(self, caller_id: str, ttl_s: float) -> None:
        self.renewals.append((caller_id, ttl_s))
        if len(self.renewals) == 1:
            raise ConnectionError("redis away")


class NoCells:
    def others(self) -> list[Any]:
        return []


def test_a_failed_renewal_is_retried_before_the_dispatchers_grace_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a Redis outage longer than the lease, the renewal waited a whole third of it
    (3.3 s) to try again, past the dispatcher's 3 s reaping grace: the live gateway's
    streams could be cancelled as a dead one's."""
    settings = Settings.load(namespace="unit-lease")
    gateway = gateway_app.Gateway(settings, KeyRing.load(None, ["standard"]))
    store = FlakyStore()
    gateway.client = type("Client", (), {"store": store, "cells": NoCells()})()  # type: ignore[assignment]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # no clock: records each wait
        waits.append(seconds)
        if len(waits) == 4:
            raise Stop

    monkeypatch.setattr(gateway_app.asyncio, "sleep", sleep)
    with pytest.raises(Stop):
        gateway._renew_caller_lease().send(None)  # never suspends: fakes all the way down
    every = settings.gateway_lease_s / 3
    assert waits == [every, gateway_app.CALLER_LEASE_RETRY_S, every, every]
    assert gateway_app.CALLER_LEASE_RETRY_S < OUTAGE_GRACE_MIN_S
    assert store.renewals == [(gateway.caller_id, settings.gateway_lease_s)] * 3
