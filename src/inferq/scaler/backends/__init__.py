"""Scaler backends: where workers run (local processes, Docker containers, Kubernetes pods).

:mod:`~inferq.scaler.backends.base` holds the interface; ``local``, ``docker``
and ``kubernetes`` implement it. The docker and kubernetes modules import their
client libraries (optional extras), so a backend module is imported only when
it is chosen, through :func:`backend_class`.
"""

from __future__ import annotations

import importlib

from inferq.scaler.backends.base import (
    ScalerBackend,
    ScalerBackendError,
    WorkerHandle,
    worker_command,
    worker_environment,
)

#: Backend name -> module implementing it.
BACKEND_MODULES = {
    "local": "inferq.scaler.backends.local",
    "docker": "inferq.scaler.backends.docker",
    "kubernetes": "inferq.scaler.backends.kubernetes",
}

__all__ = [
    "BACKEND_MODULES",
    "ScalerBackend",
    "ScalerBackendError",
    "WorkerHandle",
    "backend_class",
    "worker_command",
    "worker_environment",
]


def backend_class(name: str) -> type[ScalerBackend]:
    """The backend class called ``name`` (``local``, ``docker``, ``kubernetes``).

    Raises:
        ValueError: no backend has that name (the message lists the known ones).
        ImportError: the backend's client library is missing (the message names
            the extra to install).
    """
    if name not in BACKEND_MODULES:
        known = ", ".join(sorted(BACKEND_MODULES))
        raise ValueError(f"unknown scaler backend {name!r}; choose one of {known}")
    module = importlib.import_module(BACKEND_MODULES[name])
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, ScalerBackend)
            and getattr(value, "name", None) == name
        ):
            return value
    raise ValueError(f"module {module.__name__} defines no ScalerBackend named {name!r}")
