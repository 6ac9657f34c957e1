"""A stand-in for nvidia-ml-py's ``pynvml`` module: GPUs whose memory a test changes.

:func:`fake_pynvml` builds a module with the NVML calls inferq makes (init, count,
handle by index, UUID, name, memory info, shutdown), over a list of :class:`FakeGpu`
a test mutates between reads (another process taking memory). :func:`install` puts
it in ``sys.modules`` so ``import pynvml`` finds it (``None`` makes the import fail).
Every call is recorded in ``module.calls``.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

MIB = 1024 * 1024
GIB = 1024 * MIB


class FakeNVMLError(Exception):
    """The fake's ``pynvml.NVMLError``."""


@dataclass
class FakeGpu:
    """One GPU: its NVML name, UUID and memory in bytes (``used`` = total - free)."""

    uuid: str
    name: str | bytes = "NVIDIA H200"
    total: int = 143_771 * MIB
    free: int = 143_771 * MIB
    lost: bool = False  # fallen off the bus: memory reads fail


def fake_pynvml(gpus: list[FakeGpu] | None = None, *, fail_init: bool = False) -> Any:
    """A ``pynvml`` module over ``gpus`` (default: one idle H200), in NVML (PCI) order."""
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

    def nvmlDeviceGetUUID(handle: int) -> str:
        return devices[handle].uuid

    def nvmlDeviceGetName(handle: int) -> str | bytes:
        return devices[handle].name

    def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
        module.calls.append(f"memory:{handle}")
        gpu = devices[handle]
        if gpu.lost:
            raise FakeNVMLError("GPU is lost")
        return SimpleNamespace(total=gpu.total, free=gpu.free, used=gpu.total - gpu.free)

    for fn in (
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetUUID,
        nvmlDeviceGetName,
        nvmlDeviceGetMemoryInfo,
    ):
        setattr(module, fn.__name__, fn)
    return module


def install(monkeypatch: pytest.MonkeyPatch, module: Any) -> Any:
    """Make ``import pynvml`` return ``module`` (None: raise ImportError) for one test."""
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module
