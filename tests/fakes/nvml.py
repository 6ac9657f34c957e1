"""A stand-in for nvidia-ml-py's ``pynvml`` module: GPUs whose memory a test changes.

:func:`fake_pynvml` builds a module with the NVML calls inferq makes (init, count,
handle by index or UUID, UUID, name, memory info, shutdown, and the MIG calls: the
most MIG devices of a GPU, a MIG device's handle by index, its GPU and compute instance
ids), over a list of :class:`FakeGpu` a test mutates between reads (another process
taking memory). A GPU in MIG mode holds :class:`FakeMig` instances; a MIG device's
handle is ``(gpu index, MIG index)``, a whole GPU's its index. ``mig_api=False`` is an
nvidia-ml-py older than MIG (no MIG calls; a driver that finds no MIG UUID).
:func:`install` puts it in ``sys.modules`` so ``import pynvml`` finds it (``None``
makes the import fail). Every call is recorded in ``module.calls``.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

MIB = 1024 * 1024
GIB = 1024 * MIB


class FakeNVMLError(Exception):
    """The fake's ``pynvml.NVMLError``."""


@dataclass
class FakeMig:
    """One MIG device (a compute instance of a GPU instance): UUID, ids, memory in bytes."""

    uuid: str
    gi: int
    ci: int = 0
    name: str | bytes = "NVIDIA H200 MIG 3g.71gb"
    total: int = 71 * GIB
    free: int = 71 * GIB
    lost: bool = False


@dataclass
class FakeGpu:
    """One GPU: its NVML name, UUID and memory in bytes (``used`` = total - free), and its
    MIG devices when MIG mode is on (index = position; ``None`` an empty slot)."""

    uuid: str
    name: str | bytes = "NVIDIA H200"
    total: int = 143_771 * MIB
    free: int = 143_771 * MIB
    lost: bool = False  # fallen off the bus: memory reads fail
    migs: list[FakeMig | None] = field(default_factory=list)


#: MIG devices a GPU may hold at most (an H100/H200: 7 instances).
MAX_MIGS = 7


def fake_pynvml(
    gpus: list[FakeGpu] | None = None, *, fail_init: bool = False, mig_api: bool = True
) -> Any:
    """A ``pynvml`` module over ``gpus`` (default: one idle H200), in NVML (PCI) order;
    ``mig_api=False``: an nvidia-ml-py without the MIG calls."""
    devices = gpus if gpus is not None else [FakeGpu("GPU-00000000-aaaa")]
    module: Any = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.calls = []
    module.gpus = devices
    module.initialised = 0

    def nvmlInit() -> None:
        module.calls.append("init")
        if fail_init:
            raise FakeNVMLError("Driver Not Loaded")
        module.initialised += 1

    def nvmlShutdown() -> None:
        module.calls.append("shutdown")
        module.initialised -= 1

    def nvmlDeviceGetCount() -> int:
        return len(devices)

    def nvmlDeviceGetHandleByIndex(index: int) -> int:
        module.calls.append(f"handle:{index}")
        if not 0 <= index < len(devices):
            raise FakeNVMLError("Invalid Argument")
        return index

    def device(handle: Any) -> FakeGpu | FakeMig:
        if isinstance(handle, tuple):
            mig = devices[handle[0]].migs[handle[1]]
            assert mig is not None
            return mig
        return devices[handle]

    def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> Any:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        module.calls.append(f"uuid:{text}")
        for i, gpu in enumerate(devices):
            if gpu.uuid == text:
                return i
            for j, mig in enumerate(gpu.migs):
                if mig is not None and mig.uuid == text and mig_api:
                    return (i, j)
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetUUID(handle: Any) -> str:
        return device(handle).uuid

    def nvmlDeviceGetName(handle: Any) -> str | bytes:
        return device(handle).name

    def nvmlDeviceGetMemoryInfo(handle: Any) -> SimpleNamespace:
        module.calls.append(f"memory:{handle}")
        gpu = device(handle)
        if gpu.lost:
            raise FakeNVMLError("GPU is lost")
        return SimpleNamespace(total=gpu.total, free=gpu.free, used=gpu.total - gpu.free)

    def nvmlDeviceGetMaxMigDeviceCount(handle: int) -> int:
        if isinstance(handle, tuple) or not devices[handle].migs:
            raise FakeNVMLError("Not Supported")  # not in MIG mode
        return MAX_MIGS

    def nvmlDeviceGetMigDeviceHandleByIndex(handle: int, index: int) -> tuple[int, int]:
        migs = devices[handle].migs
        if not 0 <= index < MAX_MIGS:
            raise FakeNVMLError("Invalid Argument")
        if index >= len(migs) or migs[index] is None:
            raise FakeNVMLError("Not Found")
        return (handle, index)

    def nvmlDeviceGetGpuInstanceId(handle: tuple[int, int]) -> int:
        mig = device(handle)
        assert isinstance(mig, FakeMig)
        return mig.gi

    def nvmlDeviceGetComputeInstanceId(handle: tuple[int, int]) -> int:
        mig = device(handle)
        assert isinstance(mig, FakeMig)
        return mig.ci

    functions = [
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetHandleByUUID,
        nvmlDeviceGetUUID,
        nvmlDeviceGetName,
        nvmlDeviceGetMemoryInfo,
    ]
    if mig_api:
        functions += [
            nvmlDeviceGetMaxMigDeviceCount,
            nvmlDeviceGetMigDeviceHandleByIndex,
            nvmlDeviceGetGpuInstanceId,
            nvmlDeviceGetComputeInstanceId,
        ]
    for fn in functions:
        setattr(module, fn.__name__, fn)
    return module


def install(monkeypatch: pytest.MonkeyPatch, module: Any) -> Any:
    """Make ``import pynvml`` return ``module`` (None: raise ImportError) for one test."""
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module
