"""The client library: submit requests, wait for results, cancel, inspect.

::

    from inferq import Client

    with Client("redis://127.0.0.1:6379/0") as client:
        handle = client.submit("Write a haiku about GPUs", priority="realtime", max_tokens=64)
        result = handle.result(timeout=30)        # blocks on Redis, no polling
        print(result.status, result.output)

        handle = client.submit("Tell me a story", stream=True)
        for item in handle.stream():             # chunks as they are generated, then the Result
            if isinstance(item, StreamChunk):
                print(item.delta, end="", flush=True)

Every argument is validated before anything reaches Redis (see
:func:`inferq.intake.build_request`). :class:`AsyncClient` offers the same
calls for asyncio code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from inferq.cells import cell_for, cell_of, with_cell
from inferq.config import Settings
from inferq.errors import (
    IdempotencyConflict,
    InferqError,
    InvalidRequest,
    QueueFull,
    ResultTimeout,
)
from inferq.intake import build_request
from inferq.models import (
    InferenceRequest,
    RequestRecord,
    RequestState,
    Result,
    StreamChunk,
    ToolCallDelta,
    merge_tool_deltas,
    tool_calls_of,
    tool_deltas_of,
)
from inferq.store import CONNECTION_ERRORS, AsyncStore, Connection, Store, Submitted, connect

#: After the deadline, how long ``result()`` without a timeout still waits for a
#: running request (its worker times it out), seconds: two leases.
_RUNNING_GRACE_LEASES = 2.0
#: Why ``result()`` expired a request itself when no dispatcher beat (``expire.lua``,
#: mode ``waited``: with one running the reason says what kept the request instead).
EXPIRED_BY_CLIENT = "deadline passed with no dispatcher"
#: The error of a running request the caller cancelled (its worker aborts it).
CANCELLED_BY_CALLER = "cancelled by the caller while running"
#: ``stream()``: connection errors in a row it rides out (resuming from the last entry
#: it delivered) before raising, and the first pause between tries (doubling), seconds.
_STREAM_RETRIES = 5
_STREAM_RETRY_S = 0.1

#: What ``stream()`` yields: chunks, then the final result last.
StreamItem = StreamChunk | Result

H = TypeVar("H")
#: A store type: :class:`Store` for :class:`Client`, :class:`AsyncStore` for :class:`AsyncClient`.
S = TypeVar("S")


class _CellStores(Generic[S]):
    """The store of each cell (:mod:`inferq.cells`), opened on first use.

    Without cells every request goes to ``home`` (the client's own store). With cells a
    new request goes to the cell of its route and tenant, its id prefixed with the
    cell's name, and an id goes to the cell it names (``home`` when it names none).
    """

    def __init__(self, settings: Settings, home: S, open_store: Callable[[Settings], S]) -> None:
        self.settings = settings
        self.home: S = home
        self._open: Callable[[Settings], S] = open_store
        self._stores: dict[str, S] = {}

    def get(self, cell: str | None) -> S:
        if cell is None:
            return self.home
        if cell not in self._stores:
            url = self.settings.cells[cell].redis_url
            self._stores[cell] = self._open(self.settings.model_copy(update={"redis_url": url}))
        return self._stores[cell]

    def for_request(self, request: InferenceRequest) -> tuple[InferenceRequest, S]:
        """The request (its id naming its cell) and the store of that cell."""
        cell = cell_for(self.settings, request.model, request.tenant)
        if cell is not None:
            request = request.model_copy(update={"id": with_cell(cell, request.id)})
        return request, self.get(cell)

    def for_id(self, request_id: str) -> S:
        """The store of the cell ``request_id`` names. Raises InvalidRequest (unknown cell)."""
        return self.get(cell_of(self.settings, request_id))

    def by_store(
        self, requests: Sequence[tuple[InferenceRequest, bool]]
    ) -> list[tuple[S, list[int], list[tuple[InferenceRequest, bool]]]]:
        """The requests grouped by cell: (store, their indices, the requests with cell ids)."""
        groups: dict[int, tuple[S, list[int], list[tuple[InferenceRequest, bool]]]] = {}
        for i, (request, explicit) in enumerate(requests):
            routed, store = self.for_request(request)
            group = groups.setdefault(id(store), (store, [], []))
            group[1].append(i)
            group[2].append((routed, explicit))
        return list(groups.values())

    def others(self) -> list[S]:
        """The cell stores opened so far (the home store not included)."""
        return [s for s in self._stores.values() if s is not self.home]


def _in_order(n: int, parts: Iterable[tuple[list[int], Sequence[H]]]) -> list[H]:
    """Reassemble per-group outcomes into the order of the original ``n`` items."""
    out: list[Any] = [None] * n
    for indices, outcomes in parts:
        for i, outcome in zip(indices, outcomes, strict=True):
            out[i] = outcome
    return out


class BatchRefused(QueueFull):
    """Some requests of a ``submit_many`` call were refused in Redis; the others were written.

    Attributes:
        accepted: handles of the requests that were written.
        refused: (index in the input, the QueueFull or IdempotencyConflict that refused it).
        priority / tenant / limit: those of the first QueueFull among the refusals
            (when every refusal is an IdempotencyConflict: the first one's tenant,
            its request's class unknown here (``""``), limit 0).
    """

    def __init__(
        self, accepted: list[Any], refused: list[tuple[int, QueueFull | IdempotencyConflict]]
    ) -> None:
        first = refused[0][1]
        full = next((r for _, r in refused if isinstance(r, QueueFull)), None)
        if full is not None:
            super().__init__(full.priority, full.tenant, full.limit)
        else:
            assert isinstance(first, IdempotencyConflict)
            super().__init__("", first.tenant, 0)
        self.accepted = accepted
        self.refused = refused
        self.args = (f"{len(refused)} of {len(accepted) + len(refused)} refused; first: {first}",)


class RequestHandle:
    """A submitted request: its id and shortcuts to wait, inspect and cancel it."""

    def __init__(
        self, client: Client, submitted: Submitted, request: InferenceRequest | None = None
    ) -> None:
        self.client = client
        self.id = submitted.id
        self.duplicate = submitted.duplicate
        # The streamed request this handle submitted: its stream is read without reading
        # its record first (a duplicate's record may say otherwise: read it).
        self._streamed = _streamed(request, submitted.duplicate)

    def result(self, timeout: float | None = None) -> Result:
        """Block until the final result (see :meth:`Client.result`)."""
        return self.client.result(self.id, timeout=timeout)

    def stream(
        self, timeout: float | None = None, after: str | None = None
    ) -> Iterator[StreamItem]:
        """Chunks of the output as they are generated, then the final result (see
        :meth:`Client.stream`)."""
        if self._streamed is not None:
            store = self.client.cells.for_id(self.id)
            return self.client._chunks(store, self.id, self._streamed, timeout, after)
        return self.client.stream(self.id, timeout=timeout, after=after)

    def status(self) -> RequestRecord:
        """The request's current record."""
        return self.client.status(self.id)

    def cancel(self) -> RequestState:
        """Cancel it (see :meth:`Client.cancel`: a running one is aborted on its worker)."""
        return self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"RequestHandle({self.id!r})"


class Client:
    """Synchronous client.

    Args:
        redis_url: where Redis is (default: ``settings.redis_url``, i.e.
            ``INFERQ_REDIS_URL`` or ``redis://127.0.0.1:6379/0``).
        settings: classes, models and limits (default: :meth:`Settings.load`).
        namespace: overrides ``settings.namespace``.
        connection: an existing redis-py client (``decode_responses=True``).
        store: an existing store (a process that holds one already, e.g. the CLI).

    Raises:
        RedisUnavailable: Redis does not answer (URL shown with the password redacted).
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        namespace: str | None = None,
        connection: Connection | None = None,
        store: Store | None = None,
    ) -> None:
        base = settings or (store.settings if store is not None else None)
        self.settings = _settings(base, redis_url, namespace)
        self.store = store or Store(connection or connect(self.settings.redis_url), self.settings)
        self.cells = _CellStores(
            self.settings, self.store, lambda s: Store(connect(s.redis_url), s)
        )

    def close(self) -> None:
        """Close the connection pools (every cell's opened so far)."""
        for store in self.cells.others():
            store.close()
        self.store.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, prompt: str | None = None, **fields: Any) -> RequestHandle:
        """Validate and enqueue one request (one round trip).

        Args:
            prompt: the prompt text (or pass ``messages=[...]``).
            **fields: ``model``, ``priority``, ``tenant``, ``task_type``,
                ``max_tokens``, ``timeout`` (s) or ``deadline`` (epoch s),
                ``idempotency_key``, ``params``: see :func:`inferq.intake.build_request`.

        Raises:
            InvalidRequest: the arguments are refused (nothing written).
            QueueFull: a class or tenant queue limit is reached (nothing written).
            IdempotencyConflict: ``idempotency_key`` already names a request of this
                tenant with a different prompt or parameters (nothing written).
        """
        request, store = self.cells.for_request(
            build_request(self.settings, prompt=prompt, **fields)
        )
        submitted = store.submit(request, explicit_deadline="deadline" in fields)
        return RequestHandle(self, submitted, request)

    def submit_many(self, items: Iterable[Mapping[str, Any]]) -> list[RequestHandle]:
        """Validate every item, then enqueue them all in one pipelined round trip.

        Each item holds :meth:`submit`'s arguments (``prompt`` included).

        Raises:
            InvalidRequest: an item is refused; nothing at all is written. The
                field is prefixed with the item's index (``items[3].max_tokens``).
            BatchRefused: some items hit a queue limit or reused an idempotency key
                for a different request; the others were written (``exc.accepted``).
        """
        requests = _build_many(self.settings, items)
        parts = [
            (idx, store.submit_many(group)) for store, idx, group in self.cells.by_store(requests)
        ]
        outcomes = _in_order(len(requests), parts)
        return _handles(lambda s: RequestHandle(self, s), outcomes)

    def status(self, request_id: str) -> RequestRecord:
        """The request's record: state, timings, result when final.

        Raises:
            RequestNotFound: unknown id, or its result expired (``result_ttl_s``).
            InvalidRequest: the id names a cell the settings do not know.
        """
        return self.cells.for_id(request_id).record(request_id)

    def result(self, request_id: str, timeout: float | None = None) -> Result:
        """Block until the request is final and return its one result.

        Without ``timeout`` it waits until the deadline; a request still queued
        then is expired on the spot (so the caller is never left hanging even
        with no dispatcher running), a running one gets two leases' grace.

        Raises:
            ResultTimeout: ``timeout`` seconds passed first (the request goes on).
            RequestNotFound: unknown id.
        """
        wait = _ResultWait(self.settings, request_id, timeout)
        store = self.cells.for_id(request_id)
        while True:
            record = store.record(request_id)
            if record.result is not None:
                return record.result
            step = wait.next(record, store.now())
            if step.action == "expire":
                store.expire_waited(request_id, *_serving(self.settings, record))
            else:
                before = time.monotonic()
                if not store.wait_final(request_id, step.block_s):
                    _pace(before, step.seconds)

    def stream(
        self, request_id: str, timeout: float | None = None, after: str | None = None
    ) -> Iterator[StreamItem]:
        """Yield the request's output as it is generated, then its final :class:`Result`.

        Submit with ``stream=True`` for chunks to be published; for any other request
        the whole text comes as one chunk when it is final. The rule a caller relies on
        (see :class:`~inferq.models.StreamChunk`): the deltas since the last chunk with
        ``reset=True`` concatenate to the current attempt's text, and in the end to
        ``Result.output``. A retried request restarts its text (its new attempt's first
        chunk has ``reset=True``); a reader that fell behind the stream's cap gets one
        ``reset`` chunk with the whole text from the final result.

        Reads block on Redis (XREAD), no polling. A dropped connection is ridden out by
        reading again from the last entry delivered; ``after=chunk.id`` resumes a stream
        read elsewhere.

        Args:
            request_id: the request.
            timeout: longest silence (no chunk, no result), seconds; default: until the
                deadline, with :meth:`result`'s rules (a request still queued then is
                expired on the spot, a running one gets two leases' grace).
            after: resume after this entry id (a chunk's ``id``).

        Raises:
            ResultTimeout: ``timeout`` seconds passed with nothing new.
            RequestNotFound: unknown id.
            RedisUnavailable/ConnectionError: Redis stayed unreachable over several tries.
        """
        store = self.cells.for_id(request_id)
        record = store.record(request_id)
        if not record.request.stream:  # nothing is published: the whole text at the end
            yield from _StreamFold(after is not None).finish(self.result(request_id, timeout))
            return
        yield from self._chunks(store, request_id, record.request.deadline, timeout, after)

    def _chunks(
        self,
        store: Store,
        request_id: str,
        deadline: float,
        timeout: float | None,
        after: str | None,
    ) -> Iterator[StreamItem]:
        """:meth:`stream` of a streamed request whose deadline (epoch s) is known."""
        fold = _StreamFold(after is not None)
        last = after or "0"
        wait = _ResultWait(self.settings, request_id, timeout)
        block_s = _first_block(deadline, timeout)
        failures = 0
        while True:
            try:
                entries = store.read_stream(request_id, last, block_s)
                failures = 0
            except CONNECTION_ERRORS:
                failures += 1
                if failures > _STREAM_RETRIES:
                    raise
                time.sleep(_STREAM_RETRY_S * 2 ** (failures - 1))
                continue
            for entry_id, item in entries:
                last = entry_id
                if isinstance(item, str):  # the `end` entry: the request is final
                    yield from fold.finish(store.record(request_id).result)
                    return
                chunk = fold.feed(item)
                if chunk is not None:
                    yield chunk
            if entries:
                wait = _ResultWait(self.settings, request_id, timeout)
                continue
            record = store.record(request_id)
            if record.result is not None:  # final, its `end` entry trimmed or expired
                yield from fold.finish(record.result)
                return
            step = wait.next(record, store.now())
            if step.action == "expire":
                store.expire_waited(request_id, *_serving(self.settings, record))
            block_s = step.block_s

    def cancel(self, request_id: str) -> RequestState:
        """Cancel a request; returns its state after the call.

        A queued or assigned request is ``cancelled`` at once. A running one is
        aborted on its worker (a command on the worker's control channel: it stops the
        model-server call, frees the slot and writes ``cancelled`` within a moment);
        ``running`` is returned then. A final request is left as it is.

        Raises:
            RequestNotFound: unknown id.
        """
        store = self.cells.for_id(request_id)
        state = RequestState(store.cancel(request_id))
        if state is RequestState.RUNNING:
            store.cancel_running(request_id, CANCELLED_BY_CALLER)
        return state


class AsyncClient:
    """The asyncio twin of :class:`Client` (redis.asyncio); same arguments and errors."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        namespace: str | None = None,
    ) -> None:
        self.settings = _settings(settings, redis_url, namespace)
        self.store = AsyncStore.from_settings(self.settings)
        self.cells = _CellStores(self.settings, self.store, AsyncStore.from_settings)

    async def aclose(self) -> None:
        """Close the connection pools (every cell's opened so far)."""
        for store in self.cells.others():
            await store.close()
        await self.store.close()

    async def __aenter__(self) -> AsyncClient:
        await self.store.check()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(self, prompt: str | None = None, **fields: Any) -> AsyncRequestHandle:
        """See :meth:`Client.submit`."""
        request, store = self.cells.for_request(
            build_request(self.settings, prompt=prompt, **fields)
        )
        submitted = await store.submit(request, explicit_deadline="deadline" in fields)
        return AsyncRequestHandle(self, submitted.id, submitted.duplicate, request)

    async def submit_request(
        self, request: InferenceRequest, *, explicit_deadline: bool = False
    ) -> AsyncRequestHandle:
        """Enqueue a request already built by :func:`inferq.intake.build_request` (the
        gateway builds it first to check its class and rate limits; building it again
        would cost a validation per request).

        Args:
            request: the validated request (its id gets the cell's prefix here).
            explicit_deadline: the caller gave ``deadline`` rather than ``timeout``.

        Raises:
            QueueFull, IdempotencyConflict: as :meth:`submit`.
        """
        request, store = self.cells.for_request(request)
        submitted = await store.submit(request, explicit_deadline=explicit_deadline)
        return AsyncRequestHandle(self, submitted.id, submitted.duplicate, request)

    async def submit_many(self, items: Iterable[Mapping[str, Any]]) -> list[AsyncRequestHandle]:
        """See :meth:`Client.submit_many` (one pipelined round trip per cell)."""
        requests = _build_many(self.settings, items)
        parts = [
            (idx, await store.submit_many(group))
            for store, idx, group in self.cells.by_store(requests)
        ]
        outcomes = _in_order(len(requests), parts)
        return _handles(lambda s: AsyncRequestHandle(self, s.id, s.duplicate), outcomes)

    async def status(self, request_id: str) -> RequestRecord:
        """See :meth:`Client.status`."""
        return await self.cells.for_id(request_id).record(request_id)

    async def result(self, request_id: str, timeout: float | None = None) -> Result:
        """See :meth:`Client.result`."""
        wait = _ResultWait(self.settings, request_id, timeout)
        store = self.cells.for_id(request_id)
        while True:
            record = await store.record(request_id)
            if record.result is not None:
                return record.result
            step = wait.next(record, await store.now())
            if step.action == "expire":
                await store.expire_waited(request_id, *_serving(self.settings, record))
            else:
                await store.wait_final(request_id, step.block_s)

    async def stream(
        self, request_id: str, timeout: float | None = None, after: str | None = None
    ) -> AsyncIterator[StreamItem]:
        """See :meth:`Client.stream` (an async iterator)."""
        store = self.cells.for_id(request_id)
        record = await store.record(request_id)
        if not record.request.stream:
            result = await self.result(request_id, timeout)
            for item in _StreamFold(after is not None).finish(result):
                yield item
            return
        async for item in self._chunks(store, request_id, record.request.deadline, timeout, after):
            yield item

    async def _chunks(
        self,
        store: AsyncStore,
        request_id: str,
        deadline: float,
        timeout: float | None,
        after: str | None,
    ) -> AsyncIterator[StreamItem]:
        """:meth:`stream` of a streamed request whose deadline (epoch s) is known."""
        fold = _StreamFold(after is not None)
        last = after or "0"
        wait = _ResultWait(self.settings, request_id, timeout)
        block_s = _first_block(deadline, timeout)
        failures = 0
        while True:
            try:
                entries = await store.read_stream(request_id, last, block_s)
                failures = 0
            except CONNECTION_ERRORS:
                failures += 1
                if failures > _STREAM_RETRIES:
                    raise
                await asyncio.sleep(_STREAM_RETRY_S * 2 ** (failures - 1))
                continue
            for entry_id, entry in entries:
                last = entry_id
                if isinstance(entry, str):
                    for out in fold.finish((await store.record(request_id)).result):
                        yield out
                    return
                chunk = fold.feed(entry)
                if chunk is not None:
                    yield chunk
            if entries:
                wait = _ResultWait(self.settings, request_id, timeout)
                continue
            record = await store.record(request_id)
            if record.result is not None:
                for out in fold.finish(record.result):
                    yield out
                return
            step = wait.next(record, await store.now())
            if step.action == "expire":
                await store.expire_waited(request_id, *_serving(self.settings, record))
            block_s = step.block_s

    async def cancel(self, request_id: str) -> RequestState:
        """See :meth:`Client.cancel` (a running request is aborted on its worker)."""
        store = self.cells.for_id(request_id)
        state = RequestState(await store.cancel(request_id))
        if state is RequestState.RUNNING:
            await store.cancel_running(request_id, CANCELLED_BY_CALLER)
        return state


class AsyncRequestHandle:
    """A request submitted through :class:`AsyncClient`.

    Attributes:
        id: the request id.
        duplicate: true when the idempotency key already named this request.
    """

    def __init__(
        self,
        client: AsyncClient,
        request_id: str,
        duplicate: bool = False,
        request: InferenceRequest | None = None,
    ) -> None:
        self.client = client
        self.id = request_id
        self.duplicate = duplicate
        self._streamed = _streamed(request, duplicate)  # see RequestHandle

    async def result(self, timeout: float | None = None) -> Result:
        return await self.client.result(self.id, timeout=timeout)

    def stream(
        self, timeout: float | None = None, after: str | None = None
    ) -> AsyncIterator[StreamItem]:
        """See :meth:`Client.stream` (an async iterator)."""
        if self._streamed is not None:
            store = self.client.cells.for_id(self.id)
            return self.client._chunks(store, self.id, self._streamed, timeout, after)
        return self.client.stream(self.id, timeout=timeout, after=after)

    async def status(self) -> RequestRecord:
        return await self.client.status(self.id)

    async def cancel(self) -> RequestState:
        return await self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"AsyncRequestHandle({self.id!r})"


def _settings(settings: Settings | None, redis_url: str | None, namespace: str | None) -> Settings:
    """``settings`` (default: :meth:`Settings.load`) with the URL and namespace overridden."""
    overrides: dict[str, Any] = {}
    if redis_url is not None:
        overrides["redis_url"] = redis_url
    if namespace is not None:
        overrides["namespace"] = namespace
    base = settings or Settings.load()
    return base.model_copy(update=overrides) if overrides else base


def _build_many(
    settings: Settings, items: Iterable[Mapping[str, Any]]
) -> list[tuple[InferenceRequest, bool]]:
    if isinstance(items, Mapping | str | bytes) or not isinstance(items, Iterable):
        raise InvalidRequest("items", f"must be a list of mappings, got {type(items).__name__}")
    out: list[tuple[InferenceRequest, bool]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"items[{i}]", f"must be a mapping, got {type(item).__name__}")
        try:
            out.append((build_request(settings, **item), "deadline" in item))
        except InvalidRequest as exc:
            raise type(exc)(f"items[{i}].{exc.field}", exc.reason) from None
        except TypeError as exc:
            raise InvalidRequest(f"items[{i}]", str(exc)) from None
    return out


def _handles(
    handle: Callable[[Submitted], H],
    outcomes: Sequence[Submitted | QueueFull | IdempotencyConflict],
) -> list[H]:
    """A handle per accepted submission; :class:`BatchRefused` when any was refused."""
    handles: list[H] = []
    refused: list[tuple[int, QueueFull | IdempotencyConflict]] = []
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, QueueFull | IdempotencyConflict):
            refused.append((i, outcome))
        else:
            handles.append(handle(outcome))
    if refused:
        raise BatchRefused(handles, refused)
    return handles


def _serving(settings: Settings, record: RequestRecord) -> tuple[str, list[str]]:
    """The request's route and the models that may serve it (its class's fallbacks
    too), for the reason of an expiry by its waiting client."""
    from inferq.routes import candidates, parse_route

    request = record.request
    try:
        degrade = settings.priority_class(request.priority).allow_degrade
        models = candidates(parse_route(request.route), settings.models, degrade=degrade)
    except InferqError:  # a class or route the settings no longer know: no model serves it
        models = []
    return request.route, models


@dataclass(frozen=True, slots=True)
class _Step:
    """What ``result()`` does after reading a record that is not final yet.

    ``expire``: expire the request now (its deadline passed while still queued or
    assigned, and no dispatcher did it); ``block``: wait up to ``block_s`` for the
    request's final token (``seconds`` is the time left, 0 or less once past the deadline).
    """

    action: Literal["expire", "block"]
    seconds: float = 0.0

    @property
    def block_s(self) -> float:
        return max(self.seconds, 0.05)


class _ResultWait:
    """The rule of ``result()``, written once for :class:`Client` and :class:`AsyncClient`:
    given the latest record and the Redis time, the next step (the callers do the I/O).

    Raises (from :meth:`next`):
        ResultTimeout: ``timeout`` passed, or (without one) the request is still running
            two leases after its deadline.
    """

    def __init__(self, settings: Settings, request_id: str, timeout: float | None) -> None:
        self.settings = settings
        self.request_id = request_id
        self.timeout = timeout
        self.started = time.monotonic()
        self.expired = False

    def next(self, record: RequestRecord, now: float) -> _Step:
        wait = _next_wait(self.settings, record, time.monotonic() - self.started, self.timeout, now)
        if wait is None:
            raise ResultTimeout(_timeout_message(record, self.timeout))
        if wait <= 0 and not self.expired:
            self.expired = True
            return _Step("expire")
        return _Step("block", wait)


def _next_wait(
    settings: Settings, record: RequestRecord, waited_s: float, timeout: float | None, now: float
) -> float | None:
    """Seconds to block next; 0 or less = the deadline passed; None = give up."""
    if timeout is not None:
        left = timeout - waited_s
        return left if left > 0 else None
    until_deadline = record.request.deadline - now
    if until_deadline > 0:
        return until_deadline
    if record.state in (RequestState.QUEUED, RequestState.ASSIGNED):
        return 0.0
    grace = record.request.deadline + _RUNNING_GRACE_LEASES * settings.lease_s - now
    return grace if grace > 0 else None


class _StreamFold:
    """The reading rule of ``stream()``, written once for :class:`Client` and
    :class:`AsyncClient`: which chunks to yield, and what to add at the end so the
    deltas since the last reset always concatenate to the final text.

    Chunks of an attempt older than the newest seen are stale (a worker that lost the
    request) and skipped. A newer attempt restarts the text (``reset=True`` when
    anything was yielded before). A gap in ``seq`` (the reader fell behind the cap, or a
    worker dropped a write) stops the deltas of that attempt; the final result then
    supplies the whole text in one ``reset`` chunk.

    Args:
        resumed: reading starts after an entry id the caller gives: the text before it
            is the caller's, so it is not checked against the result.
    """

    def __init__(self, resumed: bool) -> None:
        self.resumed = resumed
        self.attempt = -1
        self.next_seq = 0
        self.parts: list[str] = []
        self.broken = False
        self.yielded = resumed
        self.whole = not resumed  # parts hold the attempt's text from its start
        self.finish_reason: str | None = None
        self.last_id = "0-0"
        self.calls: tuple[ToolCallDelta, ...] = ()  # the attempt's tool-call pieces

    def feed(self, chunk: StreamChunk | None) -> StreamChunk | None:
        """The chunk to yield for a stream entry, or None (skip it)."""
        if chunk is None:  # an entry that does not parse: the text has a hole
            self.broken = True
            return None
        self.last_id = chunk.id
        if chunk.attempt < self.attempt:
            return None
        reset = False
        if chunk.attempt > self.attempt:
            first_read = self.attempt < 0
            reset = self.yielded and not (first_read and self.resumed)
            self.whole = self.whole or not first_read
            self.attempt, self.parts, self.broken = chunk.attempt, [], False
            self.calls = ()
            self.next_seq = 0 if not (first_read and self.resumed) else chunk.seq
        if chunk.seq != self.next_seq:
            self.broken = True
        self.next_seq = chunk.seq + 1
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if self.broken:
            return None
        self.parts.append(chunk.delta)
        self.calls = merge_tool_deltas(self.calls, chunk.tool_calls)
        if not chunk.delta and not chunk.tool_calls and chunk.finish_reason is None:
            return None
        self.yielded = True
        return chunk.model_copy(update={"reset": reset}) if reset else chunk

    def finish(self, result: Result | None) -> Iterator[StreamItem]:
        """The last items: a ``reset`` chunk with the whole text (and the whole tool
        calls) when the deltas yielded do not add up to it (or none were), then the
        result."""
        if result is None:  # a final record always has a result; defensive
            return
        text = result.output or ""
        calls = tool_calls_of(self.calls)
        if result.ok and (
            self.broken
            or (self.whole and ("".join(self.parts) != text or calls != result.tool_calls))
            or (not self.yielded and (text or result.tool_calls))
        ):
            yield StreamChunk(
                id=self.last_id,
                attempt=result.attempt,
                seq=0,
                delta=text,
                tokens=result.completion_tokens or 0,
                finish_reason=self.finish_reason,
                reset=self.yielded,
                tool_calls=tool_deltas_of(result.tool_calls),
            )
        yield result


def _first_block(deadline: float, timeout: float | None) -> float:
    """How long the first read of a stream blocks: until the deadline (epoch s) or
    ``timeout``."""
    if timeout is not None:
        return max(timeout, 0.001)
    return max(deadline - time.time(), 0.05)


def _streamed(request: InferenceRequest | None, duplicate: bool) -> float | None:
    """The deadline (epoch s) of a streamed request a handle has just submitted, for its
    stream to be read at once: the first XREAD goes right after the submit, with no
    read of the record first (issue 14: the gateway's path to its first chunk). None
    when unknown, not streamed, or a duplicate (an earlier request's record rules).
    The deadline only bounds the first read's block (capped at ``BLOCK_CHUNK_S``); an
    empty read looks at the record as before."""
    if request is None or duplicate or not request.stream:
        return None
    return request.deadline


def _pace(before: float, wait: float) -> None:
    """Servers whose BLMOVE returns at once on an empty list (fakeredis): don't spin."""
    elapsed = time.monotonic() - before
    if elapsed < min(wait, 0.05):
        time.sleep(min(wait, 0.05) - elapsed)


def _timeout_message(record: RequestRecord, timeout: float | None) -> str:
    waited = f"{timeout:g} s" if timeout is not None else "past its deadline"
    return f"request {record.request.id} still {record.state.value} after {waited}"
