"""Model servers: what a worker runs requests on (``inferq worker --backend NAME``).

Build one by name with :func:`make_server` (``"sim"``, ``"openai"``, or any
server added with :func:`register_server` or the ``inferq.backends`` entry
points, a name kept for plugins); see :mod:`inferq.workers.servers.base` for the
interface.
"""

from inferq.models import FailureKind
from inferq.workers.servers.base import (
    ENTRY_POINT_GROUP,
    ChunkSink,
    ModelServer,
    ServerError,
    ServerFactory,
    ServerRequest,
    ServerResult,
    make_server,
    register_server,
    server_names,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ChunkSink",
    "FailureKind",
    "ModelServer",
    "ServerError",
    "ServerFactory",
    "ServerRequest",
    "ServerResult",
    "make_server",
    "register_server",
    "server_names",
]
