"""Measured capacity on the real Redis: a worker re-reads NVML (a fake pynvml) on every beat,
maps its CUDA index by UUID, refuses a model that cannot fit, and the dispatcher's
snapshot routes on the smaller of the measured and the booked room (issue 13)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.store import Store
from inferq.workers.runtime import Engine
from inferq.workers.worker import WorkerOptions, build_engine

from ..fakes.nvml import GIB, FakeGpu, fake_pynvml, install

MODEL = "llama-3.1-8b"


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> object:
    """Two idle H200s; the worker sees only the second (CUDA_VISIBLE_DEVICES by UUID)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1b1b")
    return install(monkeypatch, fake_pynvml([FakeGpu("GPU-0a0a"), FakeGpu("GPU-1b1b")]))


@pytest.fixture
def engine(settings: Settings, store: Store, machine: object) -> Iterator[Engine]:
    opts = WorkerOptions(model=MODEL, gpu_index=(0,), worker_id="w1", heartbeat_process=False)
    engine = build_engine(settings, opts, store)
    assert engine.start()
    yield engine
    engine.stop()


def heartbeat(store: Store) -> dict[str, str]:
    return store.redis.hgetall(store.keys.worker("w1"))  # type: ignore[no-any-return]


def test_each_beat_reads_nvml_again_and_routing_takes_the_smaller_room(
    engine: Engine, store: Store, settings: Settings, machine: object
) -> None:
    nvml = machine
    spec = settings.model_by_name[MODEL]
    beat = heartbeat(store)
    assert beat["gpu_uuids"] == "GPU-1b1b" and beat["gpu_index"] == "0"
    assert int(beat["vram_measured_free_mib"]) == 143_771
    assert int(beat["vram_measured_used_mib"]) == 0
    assert int(beat["kv_cache_mib"]) == 114_073  # an idle card: the registry's share
    (view,) = store.dispatch_view(["standard"], 8, 3.0).snapshot.workers
    assert view.free_mib == 114_073

    # Another process takes 100 GiB of the worker's GPU (the H200): the next
    # beat says so, and the dispatcher's view of the worker shrinks with it.
    nvml.gpus[1].free = 40 * GIB  # type: ignore[attr-defined]
    nvml.gpus[0].free = 1 * GIB  # type: ignore[attr-defined]  # not this worker's GPU
    engine.beat()
    beat = heartbeat(store)
    assert int(beat["vram_measured_free_mib"]) == 40_960
    assert int(beat["vram_measured_used_mib"]) == 143_771 - 40_960
    assert float(beat["kv_measured_free_mib"]) == 40_960
    assert int(beat["vram_free_mib"]) == 143_771 - spec.weights_mib  # the bookkeeping, beside
    (view,) = store.dispatch_view(["standard"], 8, 3.0).snapshot.workers
    assert view.kv_cache_mib == 114_073
    assert view.free_mib == 40_960


def test_a_model_that_cannot_fit_the_measured_free_memory_refuses_to_start(
    settings: Settings, store: Store, machine: object
) -> None:
    machine.gpus[1].free = 20 * GIB  # type: ignore[attr-defined]
    opts = WorkerOptions(model="llama-3.1-70b-awq", gpu_index=(0,), worker_id="w1")
    with pytest.raises(ConfigError, match=r"CUDA device 0 \(NVIDIA H200, GPU-1b1b\) has 20,480"):
        build_engine(settings, opts, store)
    assert not heartbeat(store)  # it never joined the fleet
