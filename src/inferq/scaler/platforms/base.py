"""The interface every scaler platform implements: launch, list and stop workers.

The scaler daemon decides (:mod:`inferq.policy.scaling`) and a platform acts:
``launch`` starts one worker running ``inferq worker --model M --id ID``; a
scale-down first drains the worker through Redis and only once it has finished
its in-flight requests and deregistered calls ``prepare_scale_down`` and
``stop``. A platform never decides which worker goes, and never stops a worker
the daemon has not drained, so no in-flight request is ever killed by scaling.

``list`` is the platform's view of what exists (including workers that have not
registered a heartbeat yet): the daemon counts a listed worker without a
heartbeat as ``starting``, so a slow start never triggers a second launch.
``list`` returns only the workers this deployment's scaler launched (the local
platform's own children; containers and pods labelled ``inferq.managed-by=scaler``
and ``inferq.namespace=<namespace>``): the daemon drains and stops only those, so
a worker started by hand, by compose or by another Deployment is never touched.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from inferq.errors import InferqError

#: The worker's arguments after the program; ``{model}`` and ``{worker_id}`` are filled in.
#: An image whose ENTRYPOINT is ``inferq`` (this project's Dockerfile) takes exactly these.
WORKER_ARGS: tuple[str, ...] = ("worker", "--model", "{model}", "--id", "{worker_id}")
#: The whole worker command, for a platform that runs a program rather than an image.
WORKER_COMMAND: tuple[str, ...] = ("inferq", *WORKER_ARGS)

#: Labels (Docker) and pod labels (Kubernetes) that mark inferq's workers.
LABEL_MODEL = "inferq.model"
LABEL_WORKER = "inferq.worker"
LABEL_NAMESPACE = "inferq.namespace"
#: Marks a worker the scaler manages (with ``inferq.namespace``: which deployment's scaler).
LABEL_MANAGED_BY = "inferq.managed-by"
MANAGED_BY = "scaler"


class PlatformError(InferqError):
    """The orchestrator refused or failed an operation; the message says which and why."""


@dataclass(frozen=True, slots=True)
class WorkerHandle:
    """A worker as a platform knows it.

    Attributes:
        worker_id: the id the worker registers under (its heartbeat, its RQ queue).
        model: the model it serves.
        platform_ref: the platform's own name for it: a pid, a container id, a pod name.
    """

    worker_id: str
    model: str
    platform_ref: str


class Platform(ABC):
    """Starts and stops worker processes, containers or replicas.

    Implementations must be safe to call from one thread at a time (the scaler
    daemon acts from one loop, and only the replica holding the scaler lease acts).
    """

    name: ClassVar[str]

    @abstractmethod
    def launch(self, model: str, worker_id: str) -> WorkerHandle:
        """Start one worker running ``inferq worker --model <model> --id <worker_id>``.

        Returns at once; the worker registers as ``starting`` and then ``ready``
        on its own after its cold start.

        Raises:
            PlatformError: the orchestrator refused the launch.
        """

    @abstractmethod
    def stop(self, handle: WorkerHandle) -> None:
        """Remove a worker that has drained and deregistered (never a busy one).

        Stopping a worker that is already gone is not an error.

        Raises:
            PlatformError: the orchestrator refused the operation.
        """

    @abstractmethod
    def list(self, model: str | None = None) -> builtins.list[WorkerHandle]:
        """Workers this platform runs (of ``model`` only, when given), starting ones included.

        Raises:
            PlatformError: the orchestrator could not be asked.
        """

    def prepare_scale_down(self, handle: WorkerHandle) -> None:  # noqa: B027 - optional hook
        """Mark ``handle`` as the one to remove before ``stop`` (default: nothing to do)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections to the orchestrator (default: nothing to release)."""


def worker_command(
    model: str,
    worker_id: str,
    template: Sequence[str] = WORKER_COMMAND,
    extra_args: Sequence[str] = (),
) -> builtins.list[str]:
    """The worker's argv: ``template`` with ``{model}``/``{worker_id}`` filled, then ``extra_args``.

    >>> worker_command("llama-3.1-8b", "w1")
    ['inferq', 'worker', '--model', 'llama-3.1-8b', '--id', 'w1']
    """
    values = {"model": model, "worker_id": worker_id}
    return [part.format_map(values) for part in template] + builtins.list(extra_args)


def card_args(model: str, vram_mib: int | Mapping[str, int] | None) -> tuple[str, ...]:
    """``--vram-mib N`` for ``model``'s workers: one figure for every model, or model -> MiB.

    A worker without NVML (simulated, or beside a GPU it cannot see) needs it; an
    empty tuple when no figure is given for the model.

    >>> card_args("llama-3.1-8b", {"llama-3.1-8b": 24576})
    ('--vram-mib', '24576')
    """
    vram = vram_mib.get(model) if isinstance(vram_mib, Mapping) else vram_mib
    return ("--vram-mib", str(vram)) if vram is not None else ()


def worker_environment(
    redis_url: str, namespace: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What a worker needs to find its deployment: ``INFERQ_REDIS_URL``, ``INFERQ_NAMESPACE``.

    ``extra`` is added last, so it may override either.
    """
    env = {"INFERQ_REDIS_URL": redis_url, "INFERQ_NAMESPACE": namespace}
    env.update(extra or {})
    return env
