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


class CountingStore:
    def __init__(self) -> None:
        self.renewals = 0

    async def renew_caller(self, caller_id: str, ttl_s: float) -> None:
        self.renewals += 1


class OneCell:
    def __init__(self, store: CountingStore) -> None:
        self.store = store

    def get(self, cell: str | None) -> CountingStore:
        return self.store


def test_a_submit_after_a_stall_renews_the_lease_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway stalled past its lease (SIGSTOP, a blocked event loop) submitted its
    first request on resuming under the lapsed lease, before its renewal loop woke: the
    dispatcher could cancel it as a dead gateway's (issue 14's note). The submit now
    renews first when the last renewal is half a lease old; a live loop (a renewal every
    third of the lease) costs the submits no round trip."""
    settings = Settings.load(namespace="unit-lease")
    gateway = gateway_app.Gateway(settings, KeyRing.load(None, ["standard"]))
    store = CountingStore()
    gateway.client = type("Client", (), {"cells": OneCell(store)})()  # type: ignore[assignment]
    now = [1000.0]
    monkeypatch.setattr(gateway_app.time, "monotonic", lambda: now[0])
    lease = settings.gateway_lease_s

    def hold() -> None:
        with pytest.raises(StopIteration):
            gateway._hold_caller_lease(None).send(None)

    hold()  # the first request in the cell: the lease is put there
    assert store.renewals == 1
    now[0] += lease / 3  # the loop's period: no renewal on the submit path
    hold()
    assert store.renewals == 1
    now[0] += 2 * lease  # stalled past the lease: renewed before the submit
    hold()
    assert store.renewals == 2
