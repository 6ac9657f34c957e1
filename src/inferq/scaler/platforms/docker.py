"""Docker platform: one container per worker, through the Docker SDK for Python.

Each worker is a detached container of a configured image whose ENTRYPOINT is
``inferq`` (this project's Dockerfile), run with the arguments ``worker --model M
--id ID`` plus the configured ones (``--backend``, ``--slots``, ``--vram-mib`` for
a worker that cannot read its GPU through NVML, ``-o KEY=VALUE``). It is labelled
``inferq.model``, ``inferq.worker``, ``inferq.namespace`` and
``inferq.managed-by=scaler``, so :meth:`DockerPlatform.list` finds exactly the
workers this deployment's scaler launched (never a container started by hand or
by compose), with ``INFERQ_REDIS_URL`` and ``INFERQ_NAMESPACE`` in its
environment, attached to ``network`` (under compose: the compose network, where
``redis`` resolves) and, when ``gpus_per_worker > 0``, a GPU device request (the
``--gpus N`` of ``docker run``; needs the NVIDIA container toolkit on the host).
``stop`` is ``docker stop`` (SIGTERM, then SIGKILL after ``stop_timeout_s``) and
``docker rm``; the scaler calls it only after the worker drained.

Needs the ``docker`` package (``pip install inferq[docker]``).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from inferq import defaults
from inferq.errors import MissingExtra
from inferq.scaler.platforms.base import (
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    LABEL_NAMESPACE,
    LABEL_WORKER,
    MANAGED_BY,
    WORKER_ARGS,
    Platform,
    PlatformError,
    WorkerHandle,
    card_args,
    worker_command,
    worker_environment,
)

try:
    import docker
    from docker.errors import DockerException, NotFound
    from docker.types import DeviceRequest
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingExtra("the Docker SDK", "docker", "the docker scaler backend") from exc


class DockerPlatform(Platform):
    """Workers as Docker containers.

    Args:
        image: the worker image; its ENTRYPOINT must be ``inferq`` (the command
            holds only the arguments, as ``docker run IMAGE worker ...``).
        redis_url: ``INFERQ_REDIS_URL`` given to the workers (as the containers see Redis).
        namespace: the inferq namespace (``INFERQ_NAMESPACE``, and the namespace label).
        base_url: Docker daemon address (``unix:///var/run/docker.sock``,
            ``tcp://host:2375``); None reads ``DOCKER_HOST`` and friends (``docker.from_env``).
        client: a ready ``docker.DockerClient`` (overrides ``base_url``).
        gpus_per_worker: GPUs requested per container (0 = no device request).
        network: Docker network to attach the containers to (None = the default bridge).
        command: the worker's arguments after the entrypoint (``{model}``, ``{worker_id}``
            filled in; default ``worker --model {model} --id {worker_id}``).
        extra_args: arguments appended to the command.
        vram_mib: ``--vram-mib`` of the workers (a worker without NVML needs it): one
            figure for every model, or model -> MiB.
        environment: extra environment variables for the workers.
        labels: extra labels (the four ``inferq.*`` labels always win).
        stop_timeout_s: seconds ``docker stop`` waits for a clean exit before SIGKILL.

    Raises:
        PlatformError: the Docker daemon cannot be reached.
    """

    name: ClassVar[str] = "docker"

    def __init__(
        self,
        *,
        image: str,
        redis_url: str,
        namespace: str,
        base_url: str | None = None,
        client: Any = None,
        gpus_per_worker: int = 0,
        network: str | None = None,
        command: Sequence[str] = WORKER_ARGS,
        extra_args: Sequence[str] = (),
        vram_mib: int | Mapping[str, int] | None = None,
        environment: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        stop_timeout_s: float = defaults.DOCKER_STOP_TIMEOUT_S,
    ) -> None:
        if gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {gpus_per_worker}")
        self.image = image
        self.namespace = namespace
        self.gpus_per_worker = gpus_per_worker
        self.network = network
        self.command = tuple(command)
        self.extra_args = tuple(extra_args)
        self.vram_mib = vram_mib
        self.environment = worker_environment(redis_url, namespace, environment)
        self.labels = dict(labels or {})
        self.stop_timeout_s = stop_timeout_s
        self._client = client if client is not None else _connect(base_url)

    def command_args(self, model: str, worker_id: str) -> builtins.list[str]:
        """The container's command: the arguments the image's ``inferq`` entrypoint gets."""
        extra = (*card_args(model, self.vram_mib), *self.extra_args)
        return worker_command(model, worker_id, self.command, extra)

    def launch(self, model: str, worker_id: str) -> WorkerHandle:
        """Run one detached worker container (pulls the image when it is missing).

        Raises:
            PlatformError: Docker refused (unknown image, no GPU runtime, ...).
        """
        kwargs: dict[str, Any] = {
            "command": self.command_args(model, worker_id),
            "name": self._container_name(worker_id),
            "labels": {
                **self.labels,
                LABEL_MODEL: model,
                LABEL_WORKER: worker_id,
                LABEL_NAMESPACE: self.namespace,
                LABEL_MANAGED_BY: MANAGED_BY,
            },
            "environment": self.environment,
            "detach": True,
        }
        if self.gpus_per_worker:
            kwargs["device_requests"] = [
                DeviceRequest(count=self.gpus_per_worker, capabilities=[["gpu"]])
            ]
        if self.network is not None:
            kwargs["network"] = self.network
        try:
            container = self._client.containers.run(self.image, **kwargs)
        except DockerException as exc:
            raise PlatformError(f"docker: cannot launch worker {worker_id}: {exc}") from exc
        return WorkerHandle(worker_id=worker_id, model=model, platform_ref=str(container.id))

    def stop(self, handle: WorkerHandle) -> None:
        """``docker stop`` then ``docker rm`` the worker's container; gone already is fine.

        Raises:
            PlatformError: Docker refused.
        """
        try:
            container = self._client.containers.get(handle.platform_ref)
            container.stop(timeout=round(self.stop_timeout_s))
            container.remove()
        except NotFound:
            return
        except DockerException as exc:
            raise PlatformError(
                f"docker: cannot stop worker {handle.worker_id} ({handle.platform_ref}): {exc}"
            ) from exc

    def list(self, model: str | None = None) -> builtins.list[WorkerHandle]:
        """The worker containers this namespace's scaler launched (any state), optionally
        of one model.

        Raises:
            PlatformError: Docker cannot be asked.
        """
        wanted = [f"{LABEL_NAMESPACE}={self.namespace}", f"{LABEL_MANAGED_BY}={MANAGED_BY}"]
        if model is not None:
            wanted.append(f"{LABEL_MODEL}={model}")
        try:
            containers = self._client.containers.list(all=True, filters={"label": wanted})
        except DockerException as exc:
            raise PlatformError(f"docker: cannot list workers: {exc}") from exc
        handles = []
        for c in containers:
            labels: Mapping[str, str] = c.labels or {}
            if LABEL_WORKER in labels and LABEL_MODEL in labels:
                handles.append(WorkerHandle(labels[LABEL_WORKER], labels[LABEL_MODEL], str(c.id)))
        return sorted(handles, key=lambda h: h.worker_id)

    def close(self) -> None:
        """Close the Docker client's HTTP connections."""
        self._client.close()

    def _container_name(self, worker_id: str) -> str:
        # Docker names allow [a-zA-Z0-9][a-zA-Z0-9_.-]*; namespaces and worker ids fit.
        return f"inferq-{self.namespace}-{worker_id}"


def _connect(base_url: str | None) -> Any:
    try:
        if base_url is None:
            return docker.from_env()
        return docker.DockerClient(base_url=base_url)
    except DockerException as exc:
        raise PlatformError(f"docker: cannot reach the daemon: {exc}") from exc
