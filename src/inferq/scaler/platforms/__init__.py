"""Scaler platforms: where workers run (local processes, Docker containers, Kubernetes pods).

:mod:`~inferq.scaler.platforms.base` holds the interface; ``local``, ``docker``
and ``kubernetes`` implement it. The docker and kubernetes modules import their
client libraries (optional extras), so a platform module is imported only when
it is chosen, through :func:`platform_class`.
"""

from __future__ import annotations

import importlib

from inferq.scaler.platforms.base import (
    Platform,
    PlatformError,
    WorkerHandle,
    worker_command,
    worker_environment,
)

#: Platform name (``--backend`` of ``inferq scaler``) -> module implementing it.
PLATFORM_MODULES = {
    "local": "inferq.scaler.platforms.local",
    "docker": "inferq.scaler.platforms.docker",
    "kubernetes": "inferq.scaler.platforms.kubernetes",
}

__all__ = [
    "PLATFORM_MODULES",
    "Platform",
    "PlatformError",
    "WorkerHandle",
    "platform_class",
    "worker_command",
    "worker_environment",
]


def platform_class(name: str) -> type[Platform]:
    """The platform class called ``name`` (``local``, ``docker``, ``kubernetes``).

    Raises:
        ValueError: no platform has that name (the message lists the known ones).
        ImportError: the platform's client library is missing (the message names
            the extra to install).
    """
    if name not in PLATFORM_MODULES:
        known = ", ".join(sorted(PLATFORM_MODULES))
        raise ValueError(f"unknown scaler backend {name!r}; choose one of {known}")
    module = importlib.import_module(PLATFORM_MODULES[name])
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, Platform)
            and getattr(value, "name", None) == name
        ):
            return value
    raise ValueError(f"module {module.__name__} defines no Platform named {name!r}")
