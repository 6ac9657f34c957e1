"""probe_gpu: NVML through a fake pynvml module, and the fallback to configured values."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

from inferq.workers.gpu import GpuInfo, probe_gpu

GIB = 1024**3


class FakeNVMLError(Exception):
    pass


def fake_pynvml(
    *,
    name: str | bytes = "NVIDIA A100-SXM4-80GB",
    total: int = 80 * GIB,
    free: int = 60 * GIB,
    fail_init: bool = False,
    devices: int = 1,
) -> Any:
    """A stand-in for nvidia-ml-py's ``pynvml`` module; records its calls."""
    module: Any = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.calls = []

    def nvmlInit() -> None:
        module.calls.append("init")
        if fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown() -> None:
        module.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(index: int) -> str:
        module.calls.append(f"handle:{index}")
        if index >= devices:
            raise FakeNVMLError("Invalid Argument")
        return f"gpu{index}"

    def nvmlDeviceGetMemoryInfo(handle: str) -> SimpleNamespace:
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetName(handle: str) -> str | bytes:
        return name

    module.nvmlInit = nvmlInit
    module.nvmlShutdown = nvmlShutdown
    module.nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex
    module.nvmlDeviceGetMemoryInfo = nvmlDeviceGetMemoryInfo
    module.nvmlDeviceGetName = nvmlDeviceGetName
    return module


def configured(mib: int) -> GpuInfo:
    return GpuInfo(name="", total_mib=mib, free_mib=mib, source="config")


def install(monkeypatch: pytest.MonkeyPatch, module: Any) -> Any:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_without_pynvml_configured_values_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)  # makes `import pynvml` raise ImportError
    assert probe_gpu(0, 24_576) == GpuInfo(
        name="", total_mib=24_576, free_mib=24_576, source="config"
    )


def test_without_pynvml_or_configuration_reports_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)
    assert probe_gpu(None, None) == configured(0)


def test_nvml_is_read_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, fake_pynvml())
    info = probe_gpu(None, 24_576)  # NVML wins over the configured figure
    assert info == GpuInfo(
        name="NVIDIA A100-SXM4-80GB", total_mib=81_920, free_mib=61_440, source="nvml"
    )
    assert nvml.calls == ["init", "handle:0", "shutdown"]


def test_nvml_reads_the_given_index_and_decodes_byte_names(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, fake_pynvml(name=b"Tesla T4", total=15 * GIB + 1, devices=4))
    info = probe_gpu(2, None)
    assert (info.name, info.total_mib, info.source) == ("Tesla T4", 15_360, "nvml")
    assert "handle:2" in nvml.calls


def test_nvml_without_driver_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml(fail_init=True))
    assert probe_gpu(0, 16_000) == GpuInfo(
        name="", total_mib=16_000, free_mib=16_000, source="config"
    )


def test_nvml_bad_index_falls_back_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, fake_pynvml(devices=1))
    info = probe_gpu(3, 16_000)
    assert info.source == "config"
    assert nvml.calls == ["init", "handle:3", "shutdown"]
