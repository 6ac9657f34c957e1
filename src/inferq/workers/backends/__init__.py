"""Worker backends: the model servers a worker runs requests on.

Build one by name with :func:`make_backend` (``"sim"``, ``"openai"``, or any
backend added with :func:`register_backend` or the ``inferq.backends`` entry
points); see :mod:`inferq.workers.backends.base` for the interface.
"""

from inferq.workers.backends.base import (
    ENTRY_POINT_GROUP,
    Backend,
    BackendError,
    BackendFactory,
    BackendRequest,
    BackendResult,
    backend_names,
    make_backend,
    register_backend,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendError",
    "BackendFactory",
    "BackendRequest",
    "BackendResult",
    "backend_names",
    "make_backend",
    "register_backend",
]
