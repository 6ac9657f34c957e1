"""inferq: priority-, deadline- and GPU-aware scheduling of LLM inference requests on Redis.

The public API::

    from inferq import Client, AsyncClient, Settings
"""

from inferq.client import AsyncClient, Client, RequestHandle
from inferq.config import ModelSpec, PriorityClass, Settings
from inferq.errors import InferqError, InvalidRequest, QueueFull, ResultTimeout
from inferq.models import InferenceRequest, RequestState, Result, WorkerInfo

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Client",
    "InferenceRequest",
    "InferqError",
    "InvalidRequest",
    "ModelSpec",
    "PriorityClass",
    "QueueFull",
    "RequestHandle",
    "RequestState",
    "Result",
    "ResultTimeout",
    "Settings",
    "WorkerInfo",
    "__version__",
]
