"""Measured capacity: the model server's own telemetry, polled, and the KV room it leaves.

The bookkeeping (the registry's weights, the reservations of assigned work) says what
a worker *should* have free; a GPU shared with another process, or a model server
smaller than the registry thinks, has less (issue 13: with 100 GiB of an H200 held by
another process, new workers still advertised 104-128 GiB free). The worker therefore
also advertises what it measured: NVML's memory on every beat
(:class:`~inferq.workers.gpu.GpuReader`), and the model server's own slots, KV cache
and queue (:class:`TelemetryPoller`, every ``TELEMETRY_INTERVAL_S``, off the request
path). :func:`measured_kv_free_mib` turns them into one figure, the KV room for new
work, which routing compares with the booked room and takes the smaller.
"""

from __future__ import annotations

import asyncio
import logging
import time

from inferq import defaults
from inferq.config import ModelSpec
from inferq.errors import ConfigError
from inferq.models import ServerTelemetry
from inferq.workers.gpu import MIB, GpuInfo
from inferq.workers.servers import ModelServer

log = logging.getLogger(__name__)


def measured_kv_free_mib(
    spec: ModelSpec,
    kv_cache_mib: int,
    server: ServerTelemetry,
    gpu: GpuInfo,
    *,
    external: bool,
) -> float | None:
    """The KV room for new work a worker measured, MiB; None when nothing was measured.

    - The model server reports free KV tokens: ``tokens x kv_bytes_per_token``.
    - It reports only a share (vLLM without ``cache_config_info``): that share of the
      booked KV cache ``kv_cache_mib``.
    - Else, for a model server inside the worker (``external`` False) on a GPU NVML
      reads: NVML's free memory (what a new sequence could still allocate).
    - Else (an external server that says nothing: its preallocated pool hides its room
      from NVML): None.
    """
    tokens = server.kv_free_tokens
    if tokens is not None:
        return tokens * spec.kv_bytes_per_token / MIB
    share = server.kv_free_fraction
    if share is not None:
        return share * kv_cache_mib
    if not external and gpu.measured:
        return float(gpu.free_mib)
    return None


def min_kv_mib(spec: ModelSpec) -> float:
    """The least KV cache a worker starts with: one sequence of ``max_context`` tokens, MiB.

    vLLM refuses to start on the same rule (its KV cache must hold one ``max_model_len``
    sequence).
    """
    return spec.max_context * spec.kv_bytes_per_token / MIB


def booked_kv_cache_mib(
    spec: ModelSpec, gpu: GpuInfo, gpu_index: tuple[int, ...], *, external: bool
) -> int:
    """The KV cache a worker books at start, MiB; refuses a model that cannot fit.

    The registry's room on the card (:meth:`ModelSpec.kv_cache_mib`: 0.9 of the total
    minus the weights). For a model server inside the worker on a GPU NVML reads, also
    at most the measured free memory minus the weights, and the worker refuses to
    start when that free memory cannot hold the weights plus :func:`min_kv_mib`. An
    external model server (``external``) has loaded its weights already: its room is
    measured by its telemetry instead.

    Raises:
        ConfigError: the weights do not fit the card, or (measured) the weights plus
            one ``max_context`` sequence of KV cache do not fit its free memory; the
            message names the GPU, its free MiB and the need.
    """
    room = spec.kv_cache_mib(gpu.total_mib)
    if external or not gpu.measured:
        return room
    kv = min_kv_mib(spec)
    need = spec.weights_mib + kv
    if gpu.free_mib < need:
        cards = ", ".join(map(str, gpu_index or (0,)))
        raise ConfigError(
            f"gpu_index: CUDA device {cards} ({gpu.name}, {', '.join(gpu.uuids)}) has "
            f"{gpu.free_mib:,} MiB free of {gpu.total_mib:,} (measured by NVML); "
            f"{spec.name} needs {need:,.0f} MiB: {spec.weights_mib:,} MiB of weights + "
            f"{kv:,.0f} MiB of KV cache for one {spec.max_context:,}-token sequence"
        )
    return min(room, gpu.free_mib - spec.weights_mib)


class TelemetryPoller:
    """Reads the model server's telemetry every ``interval_s`` in the engine's event loop.

    A read that fails or takes longer than ``TELEMETRY_TIMEOUT_S`` x 3 (the server's
    calls are bounded on their own) never reaches the request path or the worker: it
    logs one warning per transition (failing / reading again) and the heartbeat goes on
    without telemetry. A read older than ``TELEMETRY_STALE_INTERVALS`` intervals is
    dropped (:attr:`latest`).

    Args:
        server: the model server.
        worker_id: for the log lines.
        slots: the worker's ``--slots`` (a warning when the server has fewer).
        interval_s: pause between two reads, seconds.
    """

    def __init__(
        self,
        server: ModelServer,
        *,
        worker_id: str,
        slots: int,
        interval_s: float = defaults.TELEMETRY_INTERVAL_S,
    ) -> None:
        self.server = server
        self.worker_id = worker_id
        self.slots = slots
        self.interval_s = interval_s
        self.reads = 0
        self._latest = ServerTelemetry()
        self._read_at = -float("inf")
        self._failing = False
        self._warned_slots: int | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def latest(self) -> ServerTelemetry:
        """The last read, or no figures when it is older than the stale bound."""
        age = time.monotonic() - self._read_at
        if age > self.interval_s * defaults.TELEMETRY_STALE_INTERVALS:
            return ServerTelemetry()
        return self._latest

    def start(self) -> None:
        """Start polling; call from the event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def read_once(self) -> ServerTelemetry | None:
        """One read (logged, never raising); its figures become :attr:`latest`."""
        try:
            found = await asyncio.wait_for(
                self.server.telemetry(), timeout=3 * defaults.TELEMETRY_TIMEOUT_S
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # telemetry must never take the worker down
            if not self._failing:
                log.warning(
                    "worker %s: model server telemetry unreadable (%s: %s); routing on "
                    "the bookkeeping until it reads again",
                    self.worker_id,
                    type(exc).__name__,
                    exc,
                )
            self._failing = True
            return None
        if self._failing:
            log.warning("worker %s: model server telemetry reads again", self.worker_id)
        self._failing = False
        if found is None:
            return None
        self.reads += 1
        self._latest, self._read_at = found, time.monotonic()
        short = found.slots is not None and found.slots < self.slots
        if short and found.slots != self._warned_slots:
            self._warned_slots = found.slots
            log.warning(
                "worker %s: --slots %d but the model server runs %d slots: requests "
                "beyond %d wait inside the server, and that wait shows as TTFT",
                self.worker_id,
                self.slots,
                found.slots,
                found.slots,
            )
        return found

    async def _poll_forever(self) -> None:
        while True:
            await self.read_once()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        """Stop polling (at shutdown)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
