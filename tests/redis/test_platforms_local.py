"""The local backend with real worker subprocesses, and the scaler driving it end to end."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.models import WorkerState
from inferq.policy.scaling import ModelLimits, ScalingConfig
from inferq.scaler.daemon import Scaler
from inferq.scaler.platforms import platform_class
from inferq.scaler.platforms.base import PlatformError
from inferq.scaler.platforms.local import LocalPlatform
from inferq.store import Store

from ..conftest import REDIS_URL
from ..helpers import wait_for

MODEL = "llama-3.1-8b"
wait_for_30 = functools.partial(wait_for, timeout=30)


@pytest.fixture
def fast_store(redis_client, fast_settings: Settings) -> Store:  # type: ignore[no-untyped-def]
    return Store(redis_client, fast_settings)


@pytest.fixture
def local(fast_store: Store, tmp_path: Path) -> Iterator[LocalPlatform]:
    backend = LocalPlatform(
        redis_url=REDIS_URL,
        namespace=fast_store.settings.namespace,
        log_dir=tmp_path / "logs",
        slots=2,
        vram_mib=24576,
        worker_options={"time_scale": "0.5"},
        heartbeat_interval_s=0.2,
        registered=fast_store.worker_registered,
        stop_timeout_s=5.0,
        drain_timeout_s=20.0,
    )
    yield backend
    backend.close()


def state(store: Store, wid: str) -> str | None:
    value: str | None = store.redis.hget(store.keys.worker(wid), "state")
    return value


def test_launch_list_and_stop_a_drained_worker(local: LocalPlatform, fast_store: Store) -> None:
    assert platform_class("local") is LocalPlatform
    handle = local.launch(MODEL, "w1")
    assert [h.worker_id for h in local.list()] == ["w1"] and local.list("other") == []
    assert handle.platform_ref.isdigit()
    cmd = local.command(MODEL, "w1")
    assert cmd[1:3] == ["-m", "inferq"] and cmd[-2:] == ["-o", "time_scale=0.5"]
    wait_for_30(lambda: state(fast_store, "w1") == WorkerState.READY.value, what="w1 ready")
    assert fast_store.request_drain("w1")
    wait_for_30(lambda: not fast_store.worker_registered("w1"), what="w1 deregistered")
    local.stop(handle)
    assert local.list() == [] and local.exited == {"w1": 0}
    log = local.log_path("w1").read_text()
    assert "worker w1 ready" in log and "left" in log
    local.stop(handle)  # gone already: not an error


def test_stop_never_signals_a_worker_still_registered(
    local: LocalPlatform, fast_store: Store
) -> None:
    local.stop_timeout_s = 0.3
    handle = local.launch(MODEL, "w1")
    wait_for_30(lambda: state(fast_store, "w1") == WorkerState.READY.value, what="w1 ready")
    with pytest.raises(PlatformError, match="still registered"):
        local.stop(handle)
    assert [h.worker_id for h in local.list()] == ["w1"]  # left running
    local.close()  # drains it: exit 0, deregistered
    assert local.exited == {"w1": 0} and not fast_store.worker_registered("w1")


def test_close_drains_every_worker_it_started(local: LocalPlatform, fast_store: Store) -> None:
    for wid in ("a", "b"):
        local.launch(MODEL, wid)
    wait_for_30(
        lambda: all(state(fast_store, w) == WorkerState.READY.value for w in ("a", "b")),
        what="both ready",
    )
    local.close()
    assert local.exited == {"a": 0, "b": 0} and local.list() == []
    assert fast_store.workers()[0] == []


def test_burst_scales_up_drains_backlog_and_shrinks_back_without_killing(
    local: LocalPlatform, fast_store: Store, fast_settings: Settings, redis_client: redis.Redis
) -> None:
    config = ScalingConfig(
        limits={MODEL: ModelLimits(1, 3, 0)},
        up_cooldown_s=0.0,
        down_cooldown_s=0.5,
        idle_s=2.0,
        interval_s=0.3,
        trend_level_s=1.0,
        trend_slope_s=2.0,
    )
    scaler = Scaler(fast_store, config=config, platform=local, rate_window_s=2.0, default_slots=2)
    dispatcher = Dispatcher(Store(redis_client, fast_settings), tick_s=0.05)
    threads = [threading.Thread(target=t.run, daemon=True) for t in (dispatcher, scaler)]
    for t in threads:
        t.start()
    try:
        wait_for_30(lambda: len(fast_store.workers()[0]) == 1, what="the minimum pool")
        client = Client(settings=fast_settings, connection=redis_client)
        # 40 requests of 128 tokens, ~0.8 s each at time_scale 0.5: ~16 s on one 2-slot
        # worker, long enough for the new ones to start on a host loaded by -n 4 (a
        # worker process's start took most of the 8 s the old 64-token burst lasted).
        handles = client.submit_many(
            {"prompt": f"p{i}", "priority": "standard", "max_tokens": 128} for i in range(40)
        )
        wait_for_30(lambda: len(local.exited) + len(local.list()) >= 3, what="scale-up")
        results = [client.result(h.id, timeout=60) for h in handles]
        wait_for_30(
            lambda: len(local.list()) == 1 and len(fast_store.workers()[0]) == 1,
            timeout=30,
            what="the fleet back at its minimum",
        )
    finally:
        scaler.stop()
        dispatcher.stop()
        for t in threads:
            t.join(timeout=15)
    assert all(r.status == "succeeded" for r in results)
    assert all(r.attempt == 1 for r in results)  # nothing retried or handed back
    assert fast_store.stats().get("retried", 0) == 0
    assert len({r.worker for r in results}) >= 2  # the new workers took part
    assert local.exited and set(local.exited.values()) == {0}  # every drained worker exited clean
    events = [e for e in fast_store.events(count=100_000) if e.type.startswith("scale_")]
    ups = [e for e in events if e.type == "scale_up"]
    downs = [e for e in events if e.type == "scale_down"]
    assert max(int(e.fields["to"]) for e in ups) == 3
    assert downs and int(downs[-1].fields["to"]) == 1
    drained = {w for e in downs for w in e.fields["workers"].split(",")}
    assert drained == set(local.exited)  # stopped exactly the workers it drained
    assert not any(e.type == "worker_lost" for e in fast_store.events(count=100_000))
