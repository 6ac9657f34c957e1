"""What the worker knows of its GPUs: name and memory, measured through NVML on every beat.

NVML is read through nvidia-ml-py (``import pynvml``), the optional ``gpu`` extra
(``pip install 'inferq[gpu]'``): on a host without it, without a driver or without
a GPU, the configured values stand in (``--vram-mib``) and nothing is measured.

``--gpu-index`` names CUDA devices, and CUDA numbers the devices it can see: under
``CUDA_VISIBLE_DEVICES=2,3`` CUDA device 0 is the machine's third GPU, while NVML
numbers every GPU of the machine. :func:`cuda_devices` maps each CUDA index to its
NVML device through the device UUID: the n-th entry of ``CUDA_VISIBLE_DEVICES`` (an
index, or a ``GPU-...`` UUID or unique UUID prefix, as CUDA accepts them; the list
ends at the first entry that names no device, as in CUDA), or the n-th NVML device
when the variable is unset. An entry may name a MIG instance (a worker pinned to one
slice of an A100/H100/H200): ``MIG-<uuid>`` (or a unique prefix; ``nvidia-smi -L``
lists them) or the R450/R460 form ``MIG-GPU-<gpu uuid>/<gpu instance>/<compute
instance>``; it is found through NVML's MIG calls (``nvmlDeviceGetHandleByUUID``, else
each GPU's ``nvmlDeviceGetMigDeviceHandleByIndex``) and its own memory is read, the
instance's, not its GPU's. One that NVML cannot resolve (no such instance, an
nvidia-ml-py or driver without MIG support) is refused with the variable's value: the
whole GPU's figures would be the wrong ones. That assumes CUDA numbers devices in PCI bus order as
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
            devices = cuda_devices(nvml, self.indices or (0,), environ=environ)
            self._handles = [d.handle for d in devices]
            self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = tuple(d.uuid for d in devices)
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


@dataclass(frozen=True, slots=True)
class NvmlDevice:
    """A device NVML reads: a whole GPU or a MIG instance (its handle and UUID)."""

    handle: Any
    uuid: str


def cuda_devices(
    nvml: Any, cuda_indices: Sequence[int], *, environ: Mapping[str, str] | None = None
) -> list[NvmlDevice]:
    """The NVML device of each CUDA device index, through ``CUDA_VISIBLE_DEVICES`` and UUIDs.

    Args:
        nvml: an initialised ``pynvml`` module.
        cuda_indices: CUDA device indices.
        environ: holds ``CUDA_VISIBLE_DEVICES`` (default: ``os.environ``).

    Raises:
        ConfigError: a CUDA index is not visible (the message lists what is), or an entry
            of ``CUDA_VISIBLE_DEVICES`` names a MIG instance NVML cannot resolve (the
            message names the variable's value and the MIG instances NVML knows).
        NVMLError: NVML failed.
    """
    env = os.environ if environ is None else environ
    gpus = [
        NvmlDevice(handle, _text(nvml.nvmlDeviceGetUUID(handle)))
        for handle in (
            nvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(nvml.nvmlDeviceGetCount()))
        )
    ]
    visible = _visible(nvml, env.get("CUDA_VISIBLE_DEVICES"), gpus)
    found = []
    for index in cuda_indices:
        if not 0 <= index < len(visible):
            shown = ", ".join(f"{n}={d.uuid}" for n, d in enumerate(visible)) or "none"
            where = (
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
                if "CUDA_VISIBLE_DEVICES" in env
                else f"{len(gpus)} NVML devices"
            )
            raise ConfigError(
                f"gpu_index: CUDA device {index} is not visible ({where}; visible: {shown})"
            )
        found.append(visible[index])
    return found


def _visible(nvml: Any, variable: str | None, gpus: list[NvmlDevice]) -> list[NvmlDevice]:
    """Devices CUDA sees, in CUDA order: every GPU, or ``CUDA_VISIBLE_DEVICES``'s entries
    up to the first that names no device (CUDA ignores it and what follows); a MIG entry
    NVML cannot resolve is refused instead (:func:`_mig_device`)."""
    if variable is None:
        return list(gpus)
    visible: list[NvmlDevice] = []
    for raw in variable.split(","):
        entry = raw.strip()
        if entry.startswith("MIG-"):
            match = [_mig_device(nvml, entry, gpus, variable)]
        elif entry.isdigit() and int(entry) < len(gpus):
            match = [gpus[int(entry)]]
        elif entry.startswith("GPU-"):
            match = [g for g in gpus if g.uuid.startswith(entry)]
        else:
            match = []
        if len(match) != 1 or match[0].uuid in {d.uuid for d in visible}:
            break
        visible.append(match[0])
    return visible


def _mig_device(nvml: Any, entry: str, gpus: list[NvmlDevice], variable: str) -> NvmlDevice:
    """The MIG instance a ``CUDA_VISIBLE_DEVICES`` entry names: ``MIG-<uuid>`` (exact,
    through ``nvmlDeviceGetHandleByUUID``, or a unique prefix among every GPU's MIG
    devices) or ``MIG-GPU-<gpu uuid>/<gpu instance id>/<compute instance id>``.

    Raises:
        ConfigError: NVML cannot resolve it (no MIG support, or no such instance).
    """
    error = _nvml_error(nvml)
    where = f"CUDA_VISIBLE_DEVICES={variable!r}: MIG device {entry!r}"
    try:
        migs = [(gpu, mig) for gpu in gpus for mig in _migs_of(nvml, gpu.handle)]
    except (AttributeError, error) as exc:  # an nvidia-ml-py or driver without MIG
        raise ConfigError(
            f"{where} cannot be read: NVML has no MIG support here ({exc}); upgrade "
            "nvidia-ml-py and the driver, or unset CUDA_VISIBLE_DEVICES's MIG entries "
            "and give the instance's memory with --vram-mib"
        ) from exc
    known = ", ".join(f"{mig.uuid} (on {gpu.uuid})" for gpu, mig in migs) or "none"
    if entry.startswith("MIG-GPU-"):
        parent, _, ids = entry[len("MIG-") :].partition("/")
        gi, _, ci = ids.partition("/")
        if not (gi.isdigit() and ci.isdigit()):
            raise ConfigError(
                f"{where} is not MIG-GPU-<uuid>/<gpu instance>/<compute instance> "
                f"(MIG instances: {known})"
            )
        match = [
            mig
            for gpu, mig in migs
            if gpu.uuid == parent
            and int(nvml.nvmlDeviceGetGpuInstanceId(mig.handle)) == int(gi)
            and int(nvml.nvmlDeviceGetComputeInstanceId(mig.handle)) == int(ci)
        ]
    else:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(entry)
            match = [NvmlDevice(handle, _text(nvml.nvmlDeviceGetUUID(handle)))]
        except error:  # not an exact UUID: a unique prefix, as for GPU-... entries
            match = [mig for _, mig in migs if mig.uuid.startswith(entry)]
    if len(match) != 1:
        raise ConfigError(f"{where} names no MIG instance NVML knows (MIG instances: {known})")
    return match[0]


def _migs_of(nvml: Any, handle: Any) -> list[NvmlDevice]:
    """The MIG devices of a GPU (none when it is not in MIG mode).

    Raises:
        AttributeError: this nvidia-ml-py has no MIG calls.
    """
    error = _nvml_error(nvml)
    get_max = nvml.nvmlDeviceGetMaxMigDeviceCount
    by_index = nvml.nvmlDeviceGetMigDeviceHandleByIndex
    try:
        count = int(get_max(handle))
    except error:  # not MIG-capable, or MIG mode off
        return []
    out = []
    for i in range(count):
        try:
            mig = by_index(handle, i)
        except error:  # an empty slot
            continue
        out.append(NvmlDevice(mig, _text(nvml.nvmlDeviceGetUUID(mig))))
    return out


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
