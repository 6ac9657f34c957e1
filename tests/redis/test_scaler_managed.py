"""The scaler manages only the workers it launched (issue 15).

A worker started by hand, by compose or by another Deployment registers in the
same namespace; the scaler counts it as capacity but never drains or stops it,
and names it once at INFO. Real Redis, real worker processes (local platform).
"""

from __future__ import annotations

import functools
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inferq.config import Settings
from inferq.models import WorkerState
from inferq.policy.scaling import ModelLimits, ScalingConfig
from inferq.scaler.daemon import Scaler
from inferq.scaler.platforms.local import LocalPlatform
from inferq.store import Store

from ..conftest import REDIS_URL
from ..fakes.servers import sim_worker, stop_process, wait_ready
from ..helpers import wait_for

MODEL = "llama-3.1-8b"
wait_for_30 = functools.partial(wait_for, timeout=30)


@pytest.fixture
def fast_store(redis_client: redis.Redis, namespace: str) -> Store:
    settings = Settings.load(
        redis_url=REDIS_URL, namespace=namespace, heartbeat_interval_s=0.2, lease_s=1.0
    )
    return Store(redis_client, settings)


@pytest.fixture
def local(fast_store: Store, tmp_path: Path) -> Iterator[LocalPlatform]:
    platform = LocalPlatform(
        redis_url=REDIS_URL,
        namespace=fast_store.settings.namespace,
        log_dir=tmp_path / "logs",
        slots=2,
        vram_mib=24576,
        worker_options={"time_scale": "0"},
        heartbeat_interval_s=0.2,
        registered=fast_store.worker_registered,
        stop_timeout_s=5.0,
        drain_timeout_s=20.0,
    )
    yield platform
    platform.close()


@pytest.fixture
def hand_started(redis_client: redis.Redis, namespace: str) -> Iterator[subprocess.Popen[bytes]]:
    """A worker started by hand (``inferq worker``), not by the scaler."""
    proc = sim_worker(REDIS_URL, namespace, "hand-1")
    wait_ready(redis_client, namespace, "hand-1", proc)
    yield proc
    stop_process(proc)


def test_a_hand_started_worker_is_never_drained_on_scale_down(
    fast_store: Store,
    local: LocalPlatform,
    hand_started: subprocess.Popen[bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = local.launch(MODEL, "own-1")
    wait_for_30(
        lambda: (
            fast_store.redis.hget(fast_store.keys.worker("own-1"), "state")
            == WorkerState.READY.value
        ),
        what="own-1 ready",
    )
    # No load at all and no minimum: the policy wants both workers gone.
    config = ScalingConfig(
        limits={MODEL: ModelLimits(0, 4, 0)},
        up_cooldown_s=0.0,
        down_cooldown_s=0.0,
        idle_s=0.0,
        interval_s=0.2,
    )
    scaler = Scaler(fast_store, config=config, platform=local, default_slots=2)
    caplog.set_level(logging.INFO, logger="inferq.scaler.daemon")

    first = scaler.step()
    [decision] = first.decisions
    assert decision.current == 2  # the hand-started worker counts as capacity
    assert first.drained == [own.worker_id]  # ... but only the scaler's own is drained
    stopped: list[str] = []
    # The drained worker leaves and exits (within a minute, however loaded the host);
    # until then, and after, nothing more happens.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        report = scaler.step()
        assert report.drained == [] and report.launched == []
        stopped += report.stopped
        if not local.list():
            break
        time.sleep(0.2)
    # A local worker exits by itself once drained: the scaler stops it when a decision
    # falls between its deregistration and its exit, else the platform just reaps it.
    assert stopped in ([], [own.worker_id]) and local.exited == {own.worker_id: 0}
    for _ in range(5):  # the hand-started worker alone, idle, below the "desired" 0: held
        report = scaler.step()
        assert report.decisions[0].action == "hold" and report.drained == []

    assert hand_started.poll() is None
    assert fast_store.worker_registered("hand-1")
    assert fast_store.redis.exists(fast_store.keys.drain("hand-1")) == 0
    downs = [e for e in fast_store.events(count=10_000) if e.type == "scale_down"]
    assert [e.fields["workers"] for e in downs] == [own.worker_id]
    ignored = [r.getMessage() for r in caplog.records if "ignoring worker" in r.getMessage()]
    assert len(ignored) == 1 and "hand-1" in ignored[0]  # said once, not every decision
    assert "never drained" in ignored[0]


def test_a_busy_surplus_never_drains_a_hand_started_worker(
    fast_store: Store,
    local: LocalPlatform,
    hand_started: subprocess.Popen[bytes],
) -> None:
    """The surplus rule drains the least busy worker; an unmanaged one is not a candidate."""
    config = ScalingConfig(
        limits={MODEL: ModelLimits(0, 4, 0)},
        up_cooldown_s=0.0,
        down_cooldown_s=0.0,
        idle_s=0.0,
        interval_s=0.2,
    )
    scaler = Scaler(fast_store, config=config, platform=local, default_slots=2)
    # Only a hand-started worker, with a reservation on it so it is busy, not idle.
    fast_store.redis.hset(fast_store.keys.load("hand-1"), mapping={"slots": 1, "mib": 10})
    for _ in range(5):
        report = scaler.step()
        assert report.drained == [], report.decisions
    assert fast_store.redis.exists(fast_store.keys.drain("hand-1")) == 0
    fast_store.redis.delete(fast_store.keys.load("hand-1"))
