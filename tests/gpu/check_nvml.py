"""The measured-capacity checks of tests/unit/test_workers_gpu.py, on a real GPU.

``python tests/gpu/check_nvml.py [--json]`` (needs nvidia-ml-py, ``pip install
'inferq[gpu]'``, and an NVIDIA driver; exits 0 after printing why when there is no
GPU). It runs itself again in a child whose ``CUDA_VISIBLE_DEVICES`` names the
machine's *last* GPU by UUID, so that CUDA device 0 and NVML device 0 differ on a
machine of several GPUs, and there:

1. ``GpuReader((0,))`` must read the GPU of that UUID, and its total must equal what
   pynvml itself says of that UUID;
2. memory taken on CUDA device 0 through the driver API (``libcuda``: a context and
   a 1 GiB allocation) must show on the next :meth:`GpuReader.read` (free down and used
   up by at least 1 GiB), and come back once freed: NVML is read again on every beat,
   and on the GPU CUDA calls device 0;
3. ``booked_kv_cache_mib`` must refuse a model whose weights plus one full-context
   sequence exceed the measured free memory, with the GPU's UUID and free MiB in the
   message, and book ``free - weights`` (at most 0.9 x total - weights) for one that fits;
4. with every GPU listed (``--gpu-index 0,1,...``) the sums must equal NVML's.

The figures are printed (a table, or one JSON object); record them in
docs/reliability.md, "Measured capacity". ``tests/gpu/test_check_nvml.py`` runs it
under pytest and skips without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from typing import Any

from inferq.config import ModelSpec
from inferq.errors import ConfigError
from inferq.workers.gpu import MIB, GpuReader
from inferq.workers.telemetry import booked_kv_cache_mib

#: What the allocation check takes on CUDA device 0.
ALLOC_MIB = 1024
#: Exit status when there is no GPU (a skip, not a failure).
NO_GPU = 77


def gpu_uuids() -> list[str] | str:
    """Every NVML device's UUID, or why NVML cannot be read here."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install 'inferq[gpu]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"NVML unavailable: {exc}"
    try:
        uuids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return uuids or "NVML sees no GPU"
    finally:
        pynvml.nvmlShutdown()


def nvml_total_mib(uuid: str) -> int:
    """pynvml's own total memory of the device ``uuid``, MiB."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB
    finally:
        pynvml.nvmlShutdown()


class CudaAllocation:
    """A context and ``mib`` MiB on CUDA device 0, through the driver API (libcuda)."""

    def __init__(self, mib: int) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._check(self.cuda.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(self.cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(self.cuda.cuCtxCreate_v2(ctypes.byref(self.context), 0, device), "cuCtxCreate")
        self.pointer = ctypes.c_uint64()
        self._check(
            self.cuda.cuMemAlloc_v2(ctypes.byref(self.pointer), ctypes.c_size_t(mib * MIB)),
            "cuMemAlloc",
        )

    def free(self) -> None:
        self._check(self.cuda.cuMemFree_v2(self.pointer), "cuMemFree")
        self._check(self.cuda.cuCtxDestroy_v2(self.context), "cuCtxDestroy")

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} failed with CUDA error {status}")


def checks(uuids: list[str]) -> dict[str, Any]:
    """Run checks 1-4 in this process (CUDA_VISIBLE_DEVICES already set); the figures.

    Raises:
        AssertionError: a check failed (the message says which).
    """
    wanted = uuids[-1]
    gpus = GpuReader((0,), None)
    before = gpus.read()
    assert before.measured, "GpuReader did not reach NVML"
    assert before.uuids == (wanted,), f"CUDA device 0 read as {before.uuids}, not {wanted}"
    assert before.total_mib == nvml_total_mib(wanted), "total differs from pynvml's own"

    allocation = CudaAllocation(ALLOC_MIB)
    during = gpus.read()
    allocation.free()
    after = gpus.read()
    assert before.free_mib - during.free_mib >= ALLOC_MIB, (before, during)
    assert during.used_mib - before.used_mib >= ALLOC_MIB, (before, during)
    assert after.free_mib - during.free_mib >= ALLOC_MIB * 0.9, (during, after)

    weights = max(1, after.free_mib // 2)
    fits = ModelSpec(
        name="check-fits", params_b=1, weights_mib=weights, kv_bytes_per_token=MIB,
        max_context=16, cold_start_s=0,
    )  # fmt: skip
    booked = booked_kv_cache_mib(fits, after, (0,), external=False)
    assert booked == min(int(after.total_mib * 0.9) - weights, after.free_mib - weights)
    too_big = fits.model_copy(update={"name": "check-too-big", "max_context": after.free_mib})
    try:
        booked_kv_cache_mib(too_big, after, (0,), external=False)
    except ConfigError as exc:
        refusal = str(exc)
    else:
        raise AssertionError("a model larger than the free memory was not refused")
    assert wanted in refusal and f"{after.free_mib:,} MiB free" in refusal, refusal
    gpus.close()
    return {
        "gpu": before.name,
        "uuid": wanted,
        "visible_gpus": len(uuids),
        "total_mib": before.total_mib,
        "free_mib_before": before.free_mib,
        "free_mib_with_1gib_taken": during.free_mib,
        "used_mib_with_1gib_taken": during.used_mib,
        "free_mib_after_release": after.free_mib,
        "booked_kv_mib": booked,
        "refusal": refusal,
    }


def sums(uuids: list[str]) -> dict[str, Any]:
    """Check 4 (no CUDA_VISIBLE_DEVICES): every GPU listed, the sums equal NVML's."""
    import pynvml

    gpus = GpuReader(tuple(range(len(uuids))), None, environ={})  # every GPU visible
    info = gpus.read()
    gpus.close()
    pynvml.nvmlInit()
    try:
        memory = [
            pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(len(uuids))
        ]
    finally:
        pynvml.nvmlShutdown()
    total = sum(int(m.total) for m in memory) // MIB
    assert info.total_mib == total, (info, total)
    assert info.uuids == tuple(uuids), info.uuids
    return {"gpus": len(uuids), "total_mib_summed": info.total_mib}


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 when they pass, 1 when one fails, 77 without a GPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    found = gpu_uuids()
    if isinstance(found, str):
        print(f"no GPU: {found}", file=sys.stderr)
        return NO_GPU
    if args.child:
        print(json.dumps(checks(found)))
        return 0
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": found[-1]}
    child = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True
    )
    if child.returncode != 0:
        print(child.stdout + child.stderr, file=sys.stderr)
        return 1
    figures = {**json.loads(child.stdout.strip().splitlines()[-1]), **sums(found)}
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
