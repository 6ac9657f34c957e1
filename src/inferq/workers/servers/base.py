"""The model server interface: what a worker calls to run one request on its model.

A model server is async because the requests of one batch run concurrently, up to
the worker's slots. The worker calls :meth:`ModelServer.load` once (it stays
``starting`` until that returns), then :meth:`ModelServer.generate` per request,
then :meth:`ModelServer.close` on exit. Model servers are built by name through
:func:`make_server`: the built-in ones (``sim``, ``openai``), those added with
:func:`register_server`, and those installed under the entry-point group
``inferq.backends`` (a ``Callable[..., ModelServer]`` called as ``factory(spec, **options)``).
Adding an in-process model server never touches the worker loop.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self

from inferq.config import ModelSpec
from inferq.errors import ConfigError, InferqError
from inferq.models import FailureKind, Payload, ServerTelemetry, ToolCall, ToolCallDelta

#: Entry-point group scanned for third-party model servers.
ENTRY_POINT_GROUP = "inferq.backends"

ServerFactory = Callable[..., "ModelServer"]


class ChunkSink(Protocol):
    """Called by a model server for each piece of output while it generates, as
    ``on_chunk(text delta, output tokens so far, finish reason or None, tool_calls=
    pieces of tool calls)``; the last call of a request carries the finish reason
    (``stop``, ``length``, ``tool_calls``). It must not block (the worker only buffers
    the chunk; a publisher task writes it to Redis)."""

    def __call__(
        self,
        delta: str,
        tokens: int,
        finish: str | None,
        /,
        tool_calls: tuple[ToolCallDelta, ...] = (),
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class ServerRequest:
    """One request as a model server sees it.

    Attributes:
        id: the request id (for error messages and logs).
        model: the registry name of the model the worker serves.
        payload: prompt or chat messages plus generation parameters.
        max_tokens: most output tokens to generate.
        prompt_tokens: the scheduler's estimate of the prompt, tokens.
        timeout_s: time left before the request's deadline, seconds.
        on_chunk: when set, the caller reads the output as it is generated: a model
            server that can stream calls it for each piece (see :data:`ChunkSink`); one
            that cannot leaves it, and the caller gets the whole text with the result.
        prefix / block_tokens: the prompt's chain of block hashes and its block size
            (:mod:`inferq.prefix`; the simulated server's prefix cache keys on it).
    """

    id: str
    model: str
    payload: Payload
    max_tokens: int
    prompt_tokens: int
    timeout_s: float
    on_chunk: ChunkSink | None = None
    prefix: tuple[int, ...] = ()
    block_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ServerResult:
    """What a model server produced for one request.

    Attributes:
        output: the generated text.
        prompt_tokens / completion_tokens: token counts, as the model server counted
            them (or estimated, when it reports none).
        ttft_s: seconds from the ``generate`` call to the first output token,
            when the model server measures it; ``None`` otherwise.
        finish_reason: why generation stopped (``stop``: the model ended it or a stop
            sequence; ``length``: ``max_tokens`` reached), when the server says.
        cached_tokens: prompt tokens the server reused from its prefix cache (not
            prefilled again), as it reported them (llama.cpp's ``timings.cache_n``,
            OpenAI's and vLLM's ``usage.prompt_tokens_details.cached_tokens``); None
            when it reports none.
        tool_calls: the tool calls the model made (``finish_reason`` ``tool_calls``);
            () when none.
    """

    output: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class ServerError(InferqError):
    """A model server could not produce a result for a request.

    Attributes:
        retryable: True when another attempt (on another worker) may succeed:
            server errors (5xx, 408, 429), timeouts, dropped connections.
            False when the server rejected the request itself (other 4xx):
            it fails at once with the server's message.
        status: the HTTP status, when there was one.
        kind: what failed, when the model server knows (None: judged from ``status``
            and ``retryable`` by :func:`inferq.workers.failures.classify`).
        retry_after_s: the server's ``Retry-After``, seconds, when it sent one.
        server_down: the model server was found not answering at all (its health
            endpoint included): the worker turns ``unhealthy`` at once instead of
            probing first (a probe of a hung server takes its whole timeout, and work
            would be assigned meanwhile).
        rejection: the server's own message when it refused the request as invalid
            (the caller's error: HTTP 400, 413, 422); the request fails at once with it
            in ``Result.rejection``, and the gateway answers the caller 400 with it.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        kind: FailureKind | None = None,
        retry_after_s: float | None = None,
        server_down: bool = False,
        rejection: str | None = None,
    ) -> None:
        self.retryable = retryable
        self.rejection = rejection
        self.server_down = server_down
        self.status = status
        self.kind = kind
        self.retry_after_s = retry_after_s
        super().__init__(message)


class ModelServer(ABC):
    """A model server a worker runs requests on.

    Subclasses set :attr:`name` and implement :meth:`generate`; :meth:`load`
    and :meth:`close` default to no-ops. Usable as an async context manager
    (``load`` on enter, ``close`` on exit).

    Attributes:
        name: the model server's name (``--backend``).
        external: True when the model runs in another process that owns its GPU memory
            (vLLM preallocates ~90% of the card): then NVML's free memory says nothing of
            the worker's KV room and the worker does not check that its weights fit.
            False (the default) for a model server inside the worker process.
    """

    name: ClassVar[str]
    external: ClassVar[bool] = False

    async def load(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Load or check the model; the worker is ``starting`` until this returns.

        Raises:
            ServerError: the model cannot be served.
        """

    @abstractmethod
    async def generate(self, request: ServerRequest, *, concurrency: int) -> ServerResult:
        """Run one request.

        Args:
            request: the request, with the time left before its deadline.
            concurrency: requests the worker is running at once, this one
                included (>= 1); a model server may use it to model batching.

        Raises:
            ServerError: the request failed; ``retryable`` says whether to retry it.
        """

    async def close(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Release connections and resources. Safe to call twice."""

    async def probe(self, *, strict: bool = False) -> ServerError | None:
        """Check the server is healthy (the worker calls it after a failure, and then
        every ``HEALTH_PROBE_INTERVAL_S`` while it holds the server unhealthy).

        Args:
            strict: the server was taken out for refusing every request
                (:mod:`inferq.workers.rejections`): only an answer that serves the probe
                request passes, a refusal of it (a 4xx) fails.

        Returns:
            None when healthy; otherwise the error that says why not (its ``kind`` and
            ``retry_after_s`` are honoured). The default: always healthy.
        """
        return None

    async def telemetry(self) -> ServerTelemetry | None:
        """The server's own figures (slots, KV cache, queue), read off the request path
        every ``TELEMETRY_INTERVAL_S`` by the worker (:mod:`inferq.workers.telemetry`).

        Returns:
            None when the server reports none (the default). May raise anything: the
            worker logs it and advertises no telemetry until a read succeeds.
        """
        return None

    async def __aenter__(self) -> Self:
        await self.load()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


# --- registry -----------------------------------------------------------------

#: Built-in model servers as ``module:attribute``, imported on first use (so a sim
#: worker never imports httpx).
_BUILTIN: dict[str, str] = {
    "sim": "inferq.workers.servers.sim:SimServer",
    "openai": "inferq.workers.servers.openai:OpenAIServer",
}
_REGISTERED: dict[str, ServerFactory] = {}


def register_server(name: str, factory: ServerFactory) -> None:
    """Make ``factory`` buildable as ``make_server(name, ...)``; replaces any earlier one.

    Args:
        name: the model server's name (``--backend NAME`` on the worker).
        factory: called as ``factory(spec, **options)``; returns a :class:`ModelServer`.
    """
    _REGISTERED[name] = factory


def server_names() -> list[str]:
    """Names :func:`make_server` accepts, sorted (entry points included)."""
    names = set(_BUILTIN) | set(_REGISTERED)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def make_server(name: str, spec: ModelSpec, **options: Any) -> ModelServer:
    """Build the model server called ``name`` for the model ``spec``.

    Lookup order: :func:`register_server`, the built-ins, then the
    ``inferq.backends`` entry points.

    Args:
        name: ``"sim"``, ``"openai"`` or a registered / installed model server.
        spec: the registry entry of the model the worker serves.
        **options: the model server's keyword options (see each model server's docstring).

    Raises:
        ConfigError: no model server has this name, or an option is unknown or invalid.
    """
    factory = _find_factory(name)
    try:
        inspect.signature(factory).bind(spec, **options)
    except TypeError as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from None
    except ValueError:  # no signature available (a builtin): let the call decide
        pass
    return factory(spec, **options)


def _find_factory(name: str) -> ServerFactory:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        factory: ServerFactory = getattr(importlib.import_module(module), attr)
        return factory
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            loaded: ServerFactory = ep.load()
            return loaded
    raise ConfigError(f"backend {name!r} is unknown; known backends: {', '.join(server_names())}")


# --- option parsing (options may arrive as strings from the command line) -------


def float_option(name: str, value: object, *, ge: float, le: float | None = None) -> float:
    """``value`` as a float in ``[ge, le]``.

    Raises:
        ConfigError: not a number, or out of range (the message names the option and limit).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"option {name}: expected a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"option {name}: expected a number, got {value!r}") from None
    if not number >= ge:  # also refuses NaN
        raise ConfigError(f"option {name}: must be >= {ge}, got {value!r}")
    if le is not None and number > le:
        raise ConfigError(f"option {name}: must be <= {le}, got {value!r}")
    return number


def bool_option(name: str, value: object) -> bool:
    """``value`` as a bool: a bool, or one of ``true/false/1/0/yes/no`` (any case).

    Raises:
        ConfigError: anything else.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"option {name}: expected true or false, got {value!r}")
