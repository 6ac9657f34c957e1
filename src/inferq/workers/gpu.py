"""What the worker knows of its GPU: name and memory, from NVML or from configuration.

NVML is read through nvidia-ml-py (``import pynvml``), the optional ``gpu`` extra
(``pip install 'inferq[gpu]'``): on a host without it, without a driver or without
a GPU, the configured values stand in. :func:`probe_gpu` never raises for any of those reasons.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A GPU's name and memory.

    Attributes:
        name: the card's name (``""`` when not measured).
        total_mib / free_mib: its memory, MiB. From configuration, ``free_mib``
            equals ``total_mib``: nothing was measured, the worker does its own
            accounting of weights and KV cache.
        source: ``"nvml"`` when measured, ``"config"`` when configured.
    """

    name: str
    total_mib: int
    free_mib: int
    source: Literal["nvml", "config"]


def probe_gpu(index: int | None, configured_total_mib: int | None) -> GpuInfo:
    """Read GPU ``index`` (0 when None) through NVML, else fall back to configuration.

    NVML wins when it answers. The fallback has ``total_mib = free_mib =
    configured_total_mib`` (0 when that is None too: the worker should then
    require a configured VRAM size).

    Args:
        index: the CUDA device index, or None for the first GPU.
        configured_total_mib: the operator's VRAM figure, MiB, or None.

    Returns:
        A :class:`GpuInfo`; never raises because NVML is missing or fails.
    """
    pynvml = _import_pynvml()
    if pynvml is not None:
        measured = _read_nvml(pynvml, index or 0)
        if measured is not None:
            return measured
    total = max(0, configured_total_mib or 0)
    return GpuInfo(name="", total_mib=total, free_mib=total, source="config")


def _import_pynvml() -> ModuleType | None:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _read_nvml(pynvml: ModuleType, index: int) -> GpuInfo | None:
    nvml_error: type[BaseException] = getattr(pynvml, "NVMLError", Exception)
    try:
        pynvml.nvmlInit()
    except nvml_error as exc:
        log.debug("NVML unavailable (%s); using configured GPU values", exc)
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return GpuInfo(
            name=name.decode() if isinstance(name, bytes) else str(name),
            total_mib=int(memory.total) // MIB,
            free_mib=int(memory.free) // MIB,
            source="nvml",
        )
    except nvml_error as exc:
        log.warning("NVML cannot read GPU %d (%s); using configured GPU values", index, exc)
        return None
    finally:
        with contextlib.suppress(nvml_error):
            pynvml.nvmlShutdown()
