"""What the worker knows of its GPUs: name and memory, measured through NVML on every beat.

NVML is read through nvidia-ml-py (``import pynvml``), the optional ``gpu`` extra
(``pip install 'inferq[gpu]'``): on a host without it, without a driver or without
a GPU, the configured values stand in (``--vram-mib``) and nothing is measured.

``--gpu-index`` names CUDA devices, and CUDA numbers the devices it can see: under
``CUDA_VISIBLE_DEVICES=2,3`` CUDA device 0 is the machine's third GPU, while NVML
numbers every GPU of the machine. :func:`cuda_to_nvml` maps each CUDA index to its
NVML device through the device UUID: the n-th entry of ``CUDA_VISIBLE_DEVICES`` (an
index, or a ``GPU-...`` UUID or unique UUID prefix, as CUDA accepts them; the list
ends at the first entry that names no device, as in CUDA; MIG instances are not
supported), or the n-th NVML device
when the variable is unset. That assumes CUDA numbers devices in PCI bus order as
NVML does (``CUDA_DEVICE_ORDER=PCI_BUS_ID``; CUDA's default, fastest first, gives the
same order on a machine of identical GPUs). A worker spanning several GPUs (a
tensor-parallel model server, ``--gpu-index 0,1``) reports their sums.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from inferq.errors import ConfigError

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """The worker's GPUs as of one read: names and memory, summed over the GPUs.

    Attributes:
        name: the cards' names, ``+``-joined when they differ (``""`` when not measured).
        total_mib / free_mib / used_mib: their memory, MiB. From configuration,
            ``free_mib`` equals ``total_mib`` and ``used_mib`` is 0: nothing was
            measured, the worker does its own accounting of weights and KV cache.
        source: ``"nvml"`` when measured, ``"config"`` when configured.
        uuids: the NVML device UUIDs, in ``--gpu-index`` order (empty when configured).
    """

    name: str
    total_mib: int
    free_mib: int
    source: Literal["nvml", "config"]
    used_mib: int = 0
    uuids: tuple[str, ...] = ()

    @property
    def measured(self) -> bool:
        """True when NVML measured these figures."""
        return self.source == "nvml"


def configured_gpu(total_mib: int | None) -> GpuInfo:
    """The stand-in without NVML: ``total_mib`` (0 when None) all free, nothing measured."""
    total = max(0, total_mib or 0)
    return GpuInfo(name="", total_mib=total, free_mib=total, source="config")


class GpuReader:
    """The worker's GPUs: NVML handles resolved once, memory re-read on every :meth:`read`.

    Args:
        indices: CUDA device indices (``--gpu-index``); None or empty means CUDA device 0
            (:attr:`indices` keeps them as given: empty when unset).
        configured_total_mib: the operator's VRAM figure (``--vram-mib``), used when NVML
            is unavailable.
        environ: the environment that holds ``CUDA_VISIBLE_DEVICES`` (default: this
            process's).

    Raises:
        ConfigError: NVML answers but a CUDA index names no visible device (the message
            lists the visible ones).
    """

    def __init__(
        self,
        indices: Sequence[int] | None,
        configured_total_mib: int | None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.indices = tuple(indices or ())
        self._last = configured_gpu(configured_total_mib)
        self._nvml: ModuleType | None = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._uuids: tuple[str, ...] = ()
        self._failing = False
        nvml = _import_pynvml()
        if nvml is None:
            return
        error = _nvml_error(nvml)
        try:
            nvml.nvmlInit()
        except error as exc:
            log.debug("NVML unavailable (%s); using configured GPU values", exc)
            return
        try:
            nvml_indices = cuda_to_nvml(nvml, self.indices or (0,), environ=environ)
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in nvml_indices]
            self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = tuple(_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles)
        except error as exc:
            log.warning("NVML cannot read GPUs %s (%s); using configured values", indices, exc)
            self._handles = []
            _shutdown(nvml)
            return
        except ConfigError:
            _shutdown(nvml)
            raise
        self._nvml = nvml

    @property
    def measured(self) -> bool:
        """True when NVML reads these GPUs (else :meth:`read` returns the configuration)."""
        return self._nvml is not None

    def read(self) -> GpuInfo:
        """The GPUs' memory now, summed; the configured figures when NVML is unavailable.

        Never raises: an NVML error (a GPU fallen off the bus) logs one warning and
        returns the last total, unmeasured, until NVML answers again.
        """
        nvml = self._nvml
        if nvml is None:
            return self._last
        try:
            memory = [nvml.nvmlDeviceGetMemoryInfo(h) for h in self._handles]
        except _nvml_error(nvml) as exc:
            if not self._failing:
                log.warning("NVML read of GPUs %s failed (%s)", self.indices, exc)
            self._failing = True
            return configured_gpu(self._last.total_mib)
        if self._failing:
            log.warning("NVML reads GPUs %s again", self.indices)
        self._failing = False
        self._last = GpuInfo(
            name="+".join(dict.fromkeys(self._names)),
            total_mib=sum(int(m.total) for m in memory) // MIB,
            free_mib=sum(int(m.free) for m in memory) // MIB,
            used_mib=sum(int(m.used) for m in memory) // MIB,
            source="nvml",
            uuids=self._uuids,
        )
        return self._last

    def close(self) -> None:
        """Release NVML (safe to call twice)."""
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            _shutdown(nvml)


def cuda_to_nvml(
    nvml: Any, cuda_indices: Sequence[int], *, environ: Mapping[str, str] | None = None
) -> list[int]:
    """The NVML index of each CUDA device index, through ``CUDA_VISIBLE_DEVICES`` and UUIDs.

    Args:
        nvml: an initialised ``pynvml`` module.
        cuda_indices: CUDA device indices.
        environ: holds ``CUDA_VISIBLE_DEVICES`` (default: ``os.environ``).

    Raises:
        ConfigError: a CUDA index is not visible (the message lists what is).
        NVMLError: NVML failed.
    """
    env = os.environ if environ is None else environ
    uuids = [
        _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
        for i in range(int(nvml.nvmlDeviceGetCount()))
    ]
    visible = _visible(env.get("CUDA_VISIBLE_DEVICES"), uuids)
    found = []
    for index in cuda_indices:
        if not 0 <= index < len(visible):
            shown = ", ".join(f"{n}={uuids[v]}" for n, v in enumerate(visible)) or "none"
            where = (
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
                if "CUDA_VISIBLE_DEVICES" in env
                else f"{len(uuids)} NVML devices"
            )
            raise ConfigError(
                f"gpu_index: CUDA device {index} is not visible ({where}; visible: {shown})"
            )
        found.append(visible[index])
    return found


def _visible(variable: str | None, uuids: list[str]) -> list[int]:
    """NVML indices CUDA sees, in CUDA order: every device, or ``CUDA_VISIBLE_DEVICES``'s
    entries up to the first that names no device (CUDA ignores it and what follows)."""
    if variable is None:
        return list(range(len(uuids)))
    visible: list[int] = []
    for raw in variable.split(","):
        entry = raw.strip()
        if entry.isdigit() and int(entry) < len(uuids):
            match = [int(entry)]
        elif entry.startswith("GPU-"):
            match = [i for i, u in enumerate(uuids) if u.startswith(entry)]
        else:
            match = []
        if len(match) != 1 or match[0] in visible:
            break
        visible.append(match[0])
    return visible


def _import_pynvml() -> ModuleType | None:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _nvml_error(nvml: Any) -> type[BaseException]:
    error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
    return error


def _shutdown(nvml: Any) -> None:
    with contextlib.suppress(_nvml_error(nvml)):
        nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
