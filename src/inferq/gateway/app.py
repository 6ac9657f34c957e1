"""The gateway's Starlette application: the OpenAI HTTP API on :class:`~inferq.client.AsyncClient`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` true or
false), ``GET /v1/models`` (the models the fleet serves now), ``GET /health``,
``GET /metrics`` (this replica's counters, Prometheus text), ``GET /v1/usage`` (usage and
cost, behind the admin key: :mod:`~inferq.gateway.admin`).

A request's way through: bearer key -> tenant (:mod:`~inferq.gateway.tenants`); body ->
submission (:mod:`~inferq.gateway.openai_api`), validated by inferq's intake (400 naming
the field); class allowed for the key (403); a model no live worker and no scaler pool
can serve (503); rate limits (429 + ``Retry-After``); submit (``QueueFull``: 429 +
``Retry-After``); then the result (non-streamed) or the request's chunks as server-sent
events (streamed), ending ``data: [DONE]``. The first item is awaited before the
response starts, so a request that expires in the queue gets a 504 and one that fails
before its first token a 5xx, not an empty stream. When the HTTP client goes away the
request is cancelled, a running one included (its worker aborts the model-server call).
A body's ``n`` choices are ``n`` requests (see :class:`~inferq.gateway.openai_api.Submission`):
answered together, streamed interleaved by choice index; one that fails fails the
body and cancels the others.

When the gateway process itself dies mid-answer (SIGKILL, OOM, a lost host) nobody is
left to cancel: every replica holds a liveness lease in Redis (``P callers``, renewed
every third of ``gateway_lease_s``) and marks the requests it submits with its id
(``InferenceRequest.caller``); once the lease lapses the dispatcher cancels those still
running or waiting (``reap_callers.lua``). Requests submitted by other clients are tied
to no process.

Every replica is stateless (the queue, the rate-limit windows and the requests live in
Redis): run as many as needed behind any load balancer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferq import defaults
from inferq.cells import cell_for
from inferq.client import AsyncClient, AsyncRequestHandle
from inferq.config import Settings
from inferq.errors import (
    BudgetExceeded,
    ContextLengthExceeded,
    InferqError,
    InvalidRequest,
    InvalidUsageQuery,
    QueueFull,
    RedisUnavailable,
    UnknownRoute,
)
from inferq.gateway import openai_api as api
from inferq.gateway.admin import AdminKey, UsageReader, usage_query
from inferq.gateway.ratelimit import RateLimits
from inferq.gateway.tenants import (
    KEY_ID_LEN,
    OPEN,
    ApiKey,
    KeyRing,
    StoredKeys,
    check_budget_keys,
    digest,
)
from inferq.ids import new_id
from inferq.intake import build_request
from inferq.metrics import MetricsLease, build_registry
from inferq.metrics.events import EventObserver
from inferq.metrics.server import LEASE_TTL_S
from inferq.models import InferenceRequest, Result, StreamChunk
from inferq.routes import parse_route, served
from inferq.store import CONNECTION_ERRORS, Store, connect

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a replica trusts its view of the fleet's models, seconds (one heartbeat).
FLEET_CACHE_S = 1.0
#: While requests come, the view is read again this often in the background, seconds, so
#: a request finds it fresh (under FLEET_CACHE_S old) instead of reading it on its way to
#: the submit: two round trips, once in every FLEET_CACHE_S (issue 14).
FLEET_REFRESH_S = FLEET_CACHE_S / 2
#: The background reads of a cell stop after this long without a request for it, seconds
#: (the next request reads the view itself and starts them again).
FLEET_IDLE_S = 30.0
#: ``Retry-After`` of a full queue, seconds: queues drain at the fleet's pace, not a window's.
QUEUE_FULL_RETRY_S = 1
#: What reading a cell's fleet may raise and survive (that cell then serves nothing).
_FLEET_ERRORS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, RedisUnavailable)
#: What a cancel on disconnect says (the result's error).
DISCONNECTED = "the HTTP client disconnected"
#: Bytes of JSON a request body may take per byte of ``max_prompt_bytes``: escaping
#: makes text up to 6x longer (``\u00e9`` for one byte), the rest covers the structure.
BODY_BYTES_PER_PROMPT_BYTE = 8
#: Bytes of a request body beyond that (parameters, at most 16 KiB, and field names).
BODY_BASE_BYTES = 1024 * 1024


def max_body_bytes(settings: Settings) -> int:
    """The largest request body read, bytes: ``BODY_BYTES_PER_PROMPT_BYTE x
    max_prompt_bytes + BODY_BASE_BYTES`` (9 MiB by default). A larger one is refused
    with 413 before it is read whole: decoding costs about 3x its size in memory."""
    return BODY_BYTES_PER_PROMPT_BYTE * settings.max_prompt_bytes + BODY_BASE_BYTES


#: Seconds before a failed renewal of the gateway's liveness lease is tried again: after a
#: Redis outage longer than the lease, the renewal must land within the dispatcher's
#: reaping grace (``OUTAGE_GRACE_MIN_S``, 3 s), or the live streams would be cancelled.
CALLER_LEASE_RETRY_S = 0.5
#: Seconds a client may take to send its whole body (9 MiB at 150 KiB/s); a client that
#: stalls mid-body would otherwise hold its connection and task for ever.
BODY_READ_TIMEOUT_S = 60.0


class BodyTooLarge(Exception):
    """The request body is longer than :func:`max_body_bytes`."""


class Disconnected(Exception):
    """The HTTP client went away while its request was waiting."""


class GatewayMetrics:
    """This replica's counters (each replica exports its own; ``sum()`` over replicas).

    The deployment-wide series are the metrics lease holder's (see :class:`_GatewayLease`).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "inferq_gateway_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "inferq_gateway_tokens",
            "Tokens of succeeded requests, by kind (prompt, completion)",
            ["kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "inferq_gateway_ttft_seconds",
            "HTTP request received -> first token sent (streamed requests)",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.cancelled = Counter(
            "inferq_gateway_disconnect_cancels",
            "Requests cancelled because their HTTP client disconnected",
            registry=self.registry,
        )


class _GatewayLease(MetricsLease):
    """The metrics lease of a gateway replica: it tails the events stream (for the
    deployment's histograms and counters) only once it holds the lease, so replicas
    that never export pay nothing for it."""

    def __init__(self, store: Store, ttl_s: float) -> None:
        super().__init__(store, ttl_s=ttl_s)
        self.observer: EventObserver | None = None  # set once the registry is built
        self._observing = False

    def renew(self) -> bool:
        held = super().renew()
        if held and not self._observing and self.observer is not None:
            self._observing = True
            self.observer.start()
        return held

    def stop(self) -> None:
        if self._observing and self.observer is not None:
            self.observer.stop()
        super().stop()


class Gateway:
    """The application's state: settings, keys, the client, rate limits, metrics.

    Args:
        settings: the deployment (Redis URL, namespace, classes, models, scaling pools).
        keyring: the API keys of the keys file (an open ring: no file).
        rate_limits: enforce the keys' rate limits (on Redis).
        redis_keys: also accept the API keys stored in Redis (``inferq keys add``). With
            no keys file and no Redis keys the gateway is open (no authentication).
        deployment_metrics: take part in the deployment's metrics lease (as dispatchers
            and scalers do): the holder, whichever replica it is, exports the
            deployment-wide series on its ``/metrics``; False: this replica's counters only.
        metrics_lease_ttl_s: the lease's lifetime, seconds.
        admin_key: opens ``GET /v1/usage`` (None: that endpoint answers 403).
    """

    def __init__(
        self,
        settings: Settings,
        keyring: KeyRing,
        *,
        rate_limits: bool = True,
        redis_keys: bool = False,
        deployment_metrics: bool = True,
        metrics_lease_ttl_s: float = LEASE_TTL_S,
        admin_key: AdminKey | None = None,
    ) -> None:
        self.settings = settings
        self.keyring = keyring
        self.admin_key = admin_key
        self.usage_reader = UsageReader(settings) if admin_key is not None else None
        self.redis_keys = redis_keys
        self.deployment_metrics = deployment_metrics
        self.metrics_lease_ttl_s = metrics_lease_ttl_s
        self.lease: _GatewayLease | None = None
        self.deployment: CollectorRegistry | None = None
        self._metrics_store: Store | None = None
        self.stored_keys: StoredKeys | None = None
        self.metrics = GatewayMetrics()
        self.use_rate_limits = rate_limits
        self.client: AsyncClient | None = None
        self.limits: RateLimits | None = None
        self._fleet: dict[str | None, tuple[float, set[str]]] = {}  # cell -> (read at, models)
        self._fleet_used: dict[str | None, float] = {}  # cell -> when a request last asked
        self._fleet_readers: dict[str | None, asyncio.Future[None]] = {}  # see _refresh_fleet
        self._pools = set(settings.scaling.pools)
        self._classes = [c.name for c in settings.classes]
        #: This process's id as the caller of the requests it submits (its lease's name).
        self.caller_id = new_id()
        #: id() of each cell store this replica's lease is in -> time.monotonic() of its
        #: last successful renewal there
        self._leased: dict[int, float] = {}
        self._lease_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.client = AsyncClient(settings=self.settings)
        await self.client.store.check()
        await self._hold_caller_lease(None)
        self._lease_task = asyncio.create_task(self._renew_caller_lease())
        if self.redis_keys:
            self.stored_keys = StoredKeys(self.client.store.api_key)
        if any(b.key is not None for b in self.settings.budgets.values()):
            ids = self.keyring.ids()
            if self.redis_keys:
                ids |= {d[:KEY_ID_LEN] for d in await self.client.store.api_key_digests()}
            check_budget_keys(self.settings.budgets, ids)
        if self.use_rate_limits:
            self.limits = RateLimits(self.settings.redis_url, self.client.store.keys)
        if self.deployment_metrics:
            await anyio.to_thread.run_sync(self._start_lease)

    def _start_lease(self) -> None:
        store = Store(connect(self.settings.redis_url), self.settings)
        self._metrics_store = store
        lease = _GatewayLease(store, self.metrics_lease_ttl_s)
        registry, lease.observer = build_registry(store, lease)
        self.lease, self.deployment = lease, registry
        held = Gauge(
            "inferq_metrics_lease_held",
            "1 when this replica exports the deployment-wide series (holds the metrics lease)",
            registry=self.metrics.registry,
        )
        held.set_function(lambda: 1.0 if lease.held else 0.0)
        lease.start()

    async def stop(self) -> None:
        for reader in list(self._fleet_readers.values()):
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)
        if self.lease is not None:
            await anyio.to_thread.run_sync(self.lease.stop)
        if self._metrics_store is not None:
            self._metrics_store.close()
        if self.usage_reader is not None:
            await anyio.to_thread.run_sync(self.usage_reader.close)
        if self.client is not None:
            await self.client.aclose()

    @property
    def aclient(self) -> AsyncClient:
        assert self.client is not None, "the gateway is not started"
        return self.client

    # --- routes -------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completions")

    async def models(self, request: Request) -> Response:
        key = await self._key(request)
        if key is None:
            return self._unauthorized("models")
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "inferq"}
            for name in await self._served_routes(key.tenant)
        ]
        return self._json("models", 200, {"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        try:
            await self.aclient.store.check()
        except RedisUnavailable as exc:
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        text = generate_latest(self.metrics.registry)
        if self.deployment is not None:  # empty unless this replica holds the lease
            text += await anyio.to_thread.run_sync(generate_latest, self.deployment)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def usage(self, request: Request) -> Response:
        """``GET /v1/usage``: ``inferq usage --json``'s answer (see :mod:`.admin`)."""
        if self.admin_key is None or self.usage_reader is None:
            return self._error(
                "usage",
                403,
                "no admin key on this gateway: start it with --admin-key "
                "(INFERQ_GATEWAY_ADMIN_KEY) to read usage here",
                "invalid_request_error",
                code="admin_key_not_configured",
            )
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not self.admin_key.matches(token.strip()):
            return self._error(
                "usage",
                401,
                "missing or wrong admin key (send Authorization: Bearer <admin key>)",
                "invalid_request_error",
                code="invalid_api_key",
            )
        try:
            query = usage_query(request.query_params, self.settings)
            data = await anyio.to_thread.run_sync(self.usage_reader.report, query)
        except InvalidUsageQuery as exc:
            return self._error(
                "usage", 400, str(exc), "invalid_request_error", param=exc.field, code=exc.code
            )
        except _FLEET_ERRORS as exc:  # Redis did not answer
            return self._error("usage", 503, f"Redis unavailable: {exc}", "server_error")
        return self._json("usage", 200, data)

    # --- the completion path ----------------------------------------------------------

    async def _complete(self, request: Request, endpoint: api.Endpoint) -> Response:
        received = time.perf_counter()
        key = await self._key(request)
        if key is None:
            return self._unauthorized(endpoint)
        limit = max_body_bytes(self.settings)
        try:
            with anyio.fail_after(BODY_READ_TIMEOUT_S):
                raw = await _read_body(request, limit)
            body = json.loads(raw)
        except TimeoutError:
            return self._error(
                endpoint,
                408,
                f"the body was not received within {BODY_READ_TIMEOUT_S:g} s",
                "invalid_request_error",
                param="body",
                code="request_timeout",
            )
        except BodyTooLarge:
            return self._error(
                endpoint,
                413,
                f"the body exceeds the limit of {limit} bytes "
                f"({BODY_BYTES_PER_PROMPT_BYTE} x max_prompt_bytes + {BODY_BASE_BYTES})",
                "invalid_request_error",
                param="body",
                code="request_too_large",
            )
        except (ValueError, UnicodeDecodeError):
            return self._error(
                endpoint,
                400,
                "the body is not JSON",
                "invalid_request_error",
                code="invalid_json",
            )
        except RecursionError:  # the decoder recurses per nesting level
            return self._error(
                endpoint,
                400,
                "the body is JSON nested too deeply",
                "invalid_request_error",
                code="invalid_json",
            )
        try:
            sub = api.read_body(endpoint, body)
            inferq_request = self._request(request, key, sub)
            cell = cell_for(self.settings, inferq_request.model, inferq_request.tenant)
        except InvalidRequest as exc:
            return await self._invalid(endpoint, exc, key.tenant, body)
        if not key.allows(inferq_request.priority):
            allowed = ", ".join(key.classes)
            return self._error(
                endpoint,
                403,
                f"priority class {inferq_request.priority!r} is not allowed for this API key "
                f"(allowed: {allowed})",
                "permission_error",
                param=_header_names(request).get("priority", "priority"),
                code="class_not_allowed",
            )
        if not await self._servable(inferq_request, cell):
            served_now = ", ".join(await self._served_routes(key.tenant)) or "none"
            return self._error(
                endpoint,
                503,
                f"no live worker and no scaler pool serves model {sub.model!r} now "
                f"(served now: {served_now})",
                "service_unavailable",
                param="model",
                code="model_unavailable",
            )
        if self.limits is not None:  # one request of n choices: n x its tokens
            refusal = await self.limits.admit(
                key, sub.n * (inferq_request.prompt_tokens + inferq_request.max_tokens)
            )
            if refusal is not None:
                await self._record_refusal(key.tenant, refusal.what, refusal.limit)
                return self._error(
                    endpoint,
                    429,
                    refusal.message(key.tenant),
                    refusal.what,  # OpenAI's type: "requests" or "tokens"
                    code="rate_limit_exceeded",
                    retry_after=refusal.retry_after_s,
                )
        # n choices: n requests, the first as built, the others under ids of their own
        choices = [inferq_request] + [
            inferq_request.model_copy(update={"id": new_id()}) for _ in range(sub.n - 1)
        ]
        try:
            await self._hold_caller_lease(cell)
            handles = await self._submit_all(choices)
        except BudgetExceeded as exc:  # OpenAI's answer to a spent quota
            return self._error(
                endpoint,
                429,
                str(exc),
                "insufficient_quota",
                code="insufficient_quota",
                retry_after=max(1, math.ceil(exc.resets_at - time.time())),
            )
        except QueueFull as exc:
            return self._error(
                endpoint,
                429,
                str(exc),
                "requests",
                code="queue_full",
                retry_after=QUEUE_FULL_RETRY_S,
            )
        except InvalidRequest as exc:
            return await self._invalid(endpoint, exc, key.tenant, body)
        created = int(time.time())
        if sub.stream:
            return await self._stream(
                request, sub, handles, inferq_request.max_tokens, created, received
            )
        ids = [h.id for h in handles]
        try:
            results = await self._unless_disconnected(request, self._results(ids), ids)
        except Disconnected:
            return Response(status_code=499)
        for result in results:
            if not result.ok:
                return self._failure(endpoint, result)
        for result in results:
            self._count_tokens(result)
        return self._json(
            endpoint,
            200,
            api.completion_body(sub, ids[0], results, inferq_request.max_tokens, created),
        )

    async def _results(self, ids: list[str]) -> list[Result]:
        """The results of a body's choices, in order; or, as soon as one did not succeed,
        that one alone, the others cancelled (nobody will read them)."""
        reads = [asyncio.ensure_future(self.aclient.result(i)) for i in ids]
        try:
            for read in asyncio.as_completed(reads):
                result = await read
                if not result.ok:
                    with anyio.CancelScope(shield=True):
                        for request_id, other in zip(ids, reads, strict=True):
                            if not other.done():
                                await self._cancel_on_disconnect(request_id, disconnect=False)
                    return [result]
            return [read.result() for read in reads]
        finally:
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    async def _submit_all(self, requests: list[InferenceRequest]) -> list[AsyncRequestHandle]:
        """Submit the requests of one body's choices, in order.

        Raises:
            InferqError: as ``submit_request`` (a spent budget, a full queue, ...): the
                choices already in are cancelled first, since nobody will read them.
        """
        handles: list[AsyncRequestHandle] = []
        try:
            for one in requests:
                handles.append(await self.aclient.submit_request(one))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handle in handles:
                    await self._cancel_on_disconnect(handle.id, disconnect=False)
            raise
        return handles

    def _request(self, request: Request, key: ApiKey, sub: api.Submission) -> InferenceRequest:
        """The request of the submission's fields with the tenant, class and timeout, built
        and validated by intake once (it is submitted as built).

        Raises:
            InvalidRequest: a field is refused (names it).
        """
        fields = dict(sub.fields)
        fields["tenant"] = key.tenant
        names = _header_names(request)
        priority = request.headers.get(api.PRIORITY_HEADER) or sub.priority
        if priority is None:
            priority = key.implied_class
        if isinstance(priority, str) and priority.isascii() and priority.isdigit():
            priority = int(priority)
        if priority is not None:
            fields["priority"] = priority
        timeout = api.timeout_header(request.headers.get(api.TIMEOUT_HEADER)) or sub.timeout
        if timeout is not None:
            fields["timeout"] = timeout
        params = fields.get("params") or {}
        session = request.headers.get(api.SESSION_HEADER) or params.get("user")
        hint = api.session_hint(key.tenant, session if isinstance(session, str) else None)
        if hint is not None:
            fields["session"] = hint
        try:
            built = build_request(self.settings, **fields)
        except TypeError as exc:
            raise InvalidRequest("body", str(exc)) from None
        except InvalidRequest as exc:
            raise api.as_sent(exc, sub, names) from None
        return built.model_copy(update={"caller": self.caller_id, "api_key": _key_id(request, key)})

    # --- the caller lease -------------------------------------------------------------

    async def _hold_caller_lease(self, cell: str | None) -> None:
        """Put this replica's liveness lease in ``cell``'s Redis before its first request
        there (a request marked with a caller that has no lease would never be reaped);
        :meth:`_renew_caller_lease` keeps it.

        The lease is renewed here too, before the submit, when its last renewal is half a
        lease old (the loop renews every third, so only a replica that stalled, e.g.
        SIGSTOPped or its event loop blocked, gets there): a resumed gateway's first
        submit went in under a lapsed lease and could be cancelled as a dead gateway's
        before the loop's next renewal (issue 14's note, issue 24 item 4)."""
        store = self.aclient.cells.get(cell)
        renewed = self._leased.get(id(store))
        if renewed is None or time.monotonic() - renewed >= self.settings.gateway_lease_s / 2:
            await store.renew_caller(self.caller_id, self.settings.gateway_lease_s)
            self._leased[id(store)] = time.monotonic()

    async def _renew_caller_lease(self) -> None:
        """Renew the liveness lease every third of ``gateway_lease_s`` in every cell this
        replica has submitted to, for as long as it runs; a renewal that fails (Redis
        unreachable) is retried after :data:`CALLER_LEASE_RETRY_S`."""
        every = self.settings.gateway_lease_s / 3
        wait = every
        while True:
            await asyncio.sleep(wait)
            wait = every
            for store in [self.aclient.store, *self.aclient.cells.others()]:
                try:
                    await store.renew_caller(self.caller_id, self.settings.gateway_lease_s)
                    self._leased[id(store)] = time.monotonic()
                except Exception as exc:  # Redis away: retried soon; the loop must live
                    log.warning("could not renew the gateway's liveness lease: %s", exc)
                    wait = min(every, CALLER_LEASE_RETRY_S)

    async def _stream(
        self,
        request: Request,
        sub: api.Submission,
        handles: list[AsyncRequestHandle],
        max_tokens: int,
        created: int,
        received: float,
    ) -> Response:
        """The SSE response of the choices' streams; the first item of each is awaited
        first, so a choice that fails before its first token is an HTTP error."""
        # Each handle's stream: its first XREAD goes right after the submit, no read of
        # the record first (issue 14).
        ids = [h.id for h in handles]
        streams = [h.stream() for h in handles]
        try:
            firsts = await self._unless_disconnected(
                request, asyncio.gather(*(anext(items) for items in streams)), ids
            )
        except Disconnected:
            for items in streams:
                await _aclose(items)
            return Response(status_code=499)
        failed = [f for f in firsts if isinstance(f, Result) and not f.ok]
        if failed:  # the other choices will not be read
            with anyio.CancelScope(shield=True):
                for request_id, first, items in zip(ids, firsts, streams, strict=True):
                    if not isinstance(first, Result):
                        await self._cancel_on_disconnect(request_id, disconnect=False)
                    await _aclose(items)
            return self._failure(sub.endpoint, failed[0])
        self.metrics.requests.labels(sub.endpoint, "200").inc()
        return EventSourceResponse(
            self._events(sub, ids, max_tokens, created, received, firsts, streams),
            ping=15,
            sep="\n",
        )

    async def _events(
        self,
        sub: api.Submission,
        ids: list[str],
        max_tokens: int,
        created: int,
        received: float,
        firsts: list[StreamChunk | Result],
        streams: list[AsyncIterator[StreamChunk | Result]],
    ) -> AsyncIterator[dict[str, str]]:
        """The SSE events of the choices' streams, interleaved as their items come, each
        chunk with its choice's ``index``; then the usage chunk (when asked) and
        ``[DONE]`` once every choice ended. Cancels the choices not final when the
        client goes away or one choice fails."""
        n = len(ids)
        sent = [False] * n  # a chunk of the choice went out
        finish: list[str | None] = [None] * n
        results: dict[int, Result] = {}
        merged = _merged([_prepend(f, items) for f, items in zip(firsts, streams, strict=True)])
        try:
            async for index, item in merged:
                if isinstance(item, Result):
                    results[index] = item
                    if not item.ok:
                        _, kind, code = _failure_kind(item)
                        yield _data(api.error_body(_failure_message(item), kind, code=code))
                        return
                    self._count_tokens(item)
                    yield _data(
                        api.chunk_body(
                            sub,
                            ids[0],
                            created,
                            delta="" if sub.endpoint == "completions" else None,
                            first=not sent[index],
                            finish=api.finish_reason(item, max_tokens, finish[index]),
                            index=index,
                        )
                    )
                    sent[index] = True
                    if len(results) == n:
                        if sub.include_usage:
                            ordered = [results[i] for i in range(n)]
                            yield _data(api.chunk_body(sub, ids[0], created, result=ordered))
                        yield {"data": "[DONE]"}
                        return
                    continue
                if item.reset and sent[index]:  # OpenAI streams cannot take text back
                    yield _data(
                        api.error_body(
                            "the request was retried after its worker failed; the text sent "
                            "so far is void: retry the request",
                            "server_error",
                            code="stream_reset",
                        )
                    )
                    return
                finish[index] = item.finish_reason or finish[index]
                if item.delta or item.tool_calls or not sent[index]:
                    if not any(sent):
                        self.metrics.ttft.observe(time.perf_counter() - received)
                    yield _data(
                        api.chunk_body(
                            sub,
                            ids[0],
                            created,
                            delta=item.delta,
                            first=not sent[index],
                            index=index,
                            tool_calls=item.tool_calls,
                        )
                    )
                    sent[index] = True
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(merged)
                for index, request_id in enumerate(ids):
                    if index not in results:
                        await self._cancel_on_disconnect(
                            request_id, disconnect=not any(not r.ok for r in results.values())
                        )
                for items in streams:
                    await _aclose(items)

    async def _unless_disconnected(
        self, request: Request, work: Awaitable[T], request_ids: list[str]
    ) -> T:
        """``work``'s value, unless the HTTP client disconnects first: then the requests
        are cancelled (a running one is aborted on its worker) and :class:`Disconnected`
        raised."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for request_id in request_ids:
            await self._cancel_on_disconnect(request_id)
        raise Disconnected(request_ids[0])

    async def _record_refusal(self, tenant: str, what: str, limit: int) -> None:
        """A ``rate_limited`` event, so the lease holder's ``inferq_rate_limit_refusals_total``
        counts every replica's refusals once."""
        try:
            await self.aclient.store.rate_limited_event(tenant, what, limit)
        except CONNECTION_ERRORS as exc:
            log.warning("could not record a rate-limit refusal: %s", exc)

    async def _cancel_on_disconnect(self, request_id: str, *, disconnect: bool = True) -> None:
        """Cancel ``request_id``, a request nobody will read: its client went away
        (``disconnect``: counted in ``inferq_gateway_disconnect_cancels``), or another
        choice of its body failed or was refused. Logs, never raises, a failed cancel."""
        try:
            await self.aclient.cancel(request_id)
            if disconnect:
                self.metrics.cancelled.inc()
        except InferqError as exc:
            log.warning("could not cancel %s after its client left: %s", request_id, exc)
        except CONNECTION_ERRORS as exc:
            log.warning("could not cancel %s after its client left: %s", request_id, exc)

    async def _servable(self, request: InferenceRequest, cell: str | None) -> bool:
        """True when a live worker of the request's cell or a scaler pool serves a model the
        route accepts (its fallbacks too, when the request's class may degrade)."""
        cls = next(c for c in self.settings.classes if c.name == request.priority)
        route = parse_route(request.model)
        models = self.settings.models
        if served(route, models, self._pools, degrade=cls.allow_degrade):
            return True
        live = await self._live_models(cell)
        return served(route, models, live, degrade=cls.allow_degrade)

    async def _served_routes(self, tenant: str) -> list[str]:
        """The routes ``tenant`` can be served on now, sorted: ``GET /v1/models``.

        One Redis: the models of live workers and scaler pools. With cells
        (:mod:`inferq.cells`): every route a cell lists, and with a default cell every
        registry model, kept when the cell that serves it for ``tenant`` has a live
        worker (or a scaler pool) for a model the route accepts without degrading. A
        cell whose Redis does not answer serves nothing until it does.
        """
        if not self.settings.cells:
            return sorted(await self._live_models(None) | self._pools)
        routes = {route for spec in self.settings.cells.values() for route in spec.routes}
        if self.settings.default_cell is not None:
            routes |= {m.name for m in self.settings.models}
        out = []
        for text in sorted(routes):
            try:
                route = parse_route(text)
                cell = cell_for(self.settings, text, tenant)
            except InvalidRequest:
                continue
            models = self.settings.models
            if served(route, models, self._pools, degrade=False) or served(
                route, models, await self._live_models(cell), degrade=False
            ):
                out.append(text)
        return out

    async def _live_models(self, cell: str | None) -> set[str]:
        """Models of the live workers of ``cell`` (None: the only Redis), read at most once
        per :data:`FLEET_CACHE_S`; empty while the cell's Redis does not answer. While
        requests come the view is kept fresh in the background (:meth:`_refresh_fleet`)."""
        self._fleet_used[cell] = time.monotonic()
        if cell not in self._fleet_readers:
            reader = asyncio.ensure_future(self._refresh_fleet(cell))
            self._fleet_readers[cell] = reader
            reader.add_done_callback(lambda _: self._fleet_readers.pop(cell, None))
        at, models = self._fleet.get(cell, (float("-inf"), set()))
        if time.monotonic() - at > FLEET_CACHE_S:
            models = await self._read_fleet(cell)
        return models

    async def _read_fleet(self, cell: str | None) -> set[str]:
        """Read the models of ``cell``'s live workers into the view (timed from the read's
        start)."""
        began = time.monotonic()
        try:
            models = set(await self.aclient.cells.get(cell).live_models())
        except _FLEET_ERRORS as exc:
            log.warning("the fleet of cell %s is unreadable: %s", cell or "(home)", exc)
            models = set()
        self._fleet[cell] = (began, models)
        return models

    async def _refresh_fleet(self, cell: str | None) -> None:
        """Read ``cell``'s view every :data:`FLEET_REFRESH_S` until no request has asked
        for it for :data:`FLEET_IDLE_S`."""
        while time.monotonic() - self._fleet_used.get(cell, 0.0) < FLEET_IDLE_S:
            await asyncio.sleep(FLEET_REFRESH_S)
            await self._read_fleet(cell)

    # --- answers --------------------------------------------------------------------------

    async def _key(self, request: Request) -> ApiKey | None:
        """The caller's key: the keys file's entry, else the stored one (``--redis-keys``);
        :data:`~inferq.gateway.tenants.OPEN` on an open gateway; None when unknown."""
        if self.keyring.open and self.stored_keys is None:
            return OPEN
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        if not bearer:
            return None
        if not self.keyring.open:
            found = self.keyring.lookup(bearer)
            if found is not None:
                return found
        if self.stored_keys is not None:
            try:
                return await self.stored_keys.lookup(bearer)
            except CONNECTION_ERRORS as exc:
                log.warning("stored API keys unreadable: %s", exc)
        return None

    def _unauthorized(self, endpoint: str) -> Response:
        return self._error(
            endpoint,
            401,
            "missing or unknown API key (send Authorization: Bearer <key>)",
            "invalid_request_error",
            code="invalid_api_key",
        )

    async def _invalid(
        self, endpoint: api.Endpoint, exc: InvalidRequest, tenant: str, body: Any
    ) -> Response:
        """A refused field as OpenAI answers it: an unknown model is a 404
        ``model_not_found`` listing the models served now (``GET /v1/models``', not the
        registry's); a prompt over the context a 400 ``context_length_exceeded`` naming
        ``messages`` (or ``prompt``) as OpenAI does; any other a 400 naming the field,
        with the refusal's code (:attr:`InvalidRequest.code`)."""
        if isinstance(exc, UnknownRoute):
            served_now = ", ".join(await self._served_routes(tenant)) or "none"
            model = body.get("model") if isinstance(body, dict) else None
            return self._error(
                endpoint,
                404,
                f"the model {model!r} does not exist or is not served here; the models "
                f"served now: {served_now} (GET /v1/models)",
                "invalid_request_error",
                param="model",
                code=exc.code,
            )
        if isinstance(exc, ContextLengthExceeded):
            field = "messages" if endpoint == "chat" else "prompt"
            return self._error(
                endpoint,
                400,
                f"{field}: {exc.reason}",
                "invalid_request_error",
                param=field,
                code=exc.code,
            )
        return self._error(
            endpoint, 400, str(exc), "invalid_request_error", param=exc.field, code=exc.code
        )

    def _failure(self, endpoint: str, result: Result) -> Response:
        status, kind, code = _failure_kind(result)
        return self._error(endpoint, status, _failure_message(result), kind, code=code)

    def _count_tokens(self, result: Result) -> None:
        self.metrics.tokens.labels("prompt").inc(result.prompt_tokens or 0)
        self.metrics.tokens.labels("completion").inc(result.completion_tokens or 0)

    def _json(self, endpoint: str, status: int, body: dict[str, Any]) -> Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        return JSONResponse(body, status_code=status)

    def _error(
        self,
        endpoint: str,
        status: int,
        message: str,
        kind: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return JSONResponse(
            api.error_body(message, kind, param=param, code=code),
            status_code=status,
            headers=headers,
        )


def create_app(
    settings: Settings,
    keyring: KeyRing,
    *,
    rate_limits: bool = True,
    redis_keys: bool = False,
    deployment_metrics: bool = True,
    metrics_lease_ttl_s: float = LEASE_TTL_S,
    admin_key: AdminKey | None = None,
) -> Starlette:
    """The gateway as an ASGI application (run it with uvicorn: ``inferq gateway``).

    Args:
        settings: the deployment.
        keyring: the API keys of the keys file (:meth:`KeyRing.load`).
        rate_limits: enforce the keys' per-minute limits.
        redis_keys: also accept the API keys stored in Redis (``inferq keys``).
        deployment_metrics / metrics_lease_ttl_s / admin_key: see :class:`Gateway`.
    """
    gateway = Gateway(
        settings,
        keyring,
        rate_limits=rate_limits,
        redis_keys=redis_keys,
        deployment_metrics=deployment_metrics,
        metrics_lease_ttl_s=metrics_lease_ttl_s,
        admin_key=admin_key,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def http_error(request: Request, exc: Exception) -> Response:
        """404, 405 and the like as OpenAI's error body (Starlette's is plain text)."""
        assert isinstance(exc, HTTPException)
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            api.error_body(exc.detail, "invalid_request_error", code=code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def server_error(request: Request, exc: Exception) -> Response:
        """An unexpected fault as OpenAI's error body (logged by Starlette, with traceback)."""
        return JSONResponse(
            api.error_body("internal error in the gateway", "server_error", code="internal_error"),
            status_code=500,
        )

    app = Starlette(
        exception_handlers={HTTPException: http_error, Exception: server_error},
        routes=[
            Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
            Route("/v1/completions", gateway.completions, methods=["POST"]),
            Route("/v1/models", gateway.models, methods=["GET"]),
            Route("/v1/usage", gateway.usage, methods=["GET"]),
            Route("/health", gateway.health, methods=["GET"]),
            Route("/metrics", gateway.metrics_text, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app


def _header_names(request: Request) -> dict[str, str]:
    """inferq's name of a request field -> the header the caller gave it in (the
    headers win over the body's fields): a refusal names the header."""
    names = {}
    if request.headers.get(api.PRIORITY_HEADER):
        names["priority"] = api.PRIORITY_HEADER
    if request.headers.get(api.TIMEOUT_HEADER) is not None:
        names["timeout"] = api.TIMEOUT_HEADER
    return names


def _data(body: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(body, separators=(",", ":"))}


def _failure_kind(result: Result) -> tuple[int, str, str]:
    """HTTP status, OpenAI error type and code of a request that did not succeed."""
    if result.status == "expired":
        return 504, "timeout", "deadline_exceeded"
    if result.status == "cancelled" and defaults.CALLER_LAPSED in (result.error or ""):
        # this replica stalled past its lease and was taken for dead: the server's fault
        return 503, "server_error", "gateway_lease_lapsed"
    if result.status == "cancelled":
        return 409, "invalid_request_error", "cancelled"
    if result.rejection is not None:  # the model server refused it as invalid: the caller's
        return 400, "invalid_request_error", "rejected_by_model_server"
    return 500, "server_error", "generation_failed"


def _failure_message(result: Result) -> str:
    """What the caller is told of a request that did not succeed: the model server's own
    message when it refused the request as invalid (inferq's error text names its
    worker and the server's address, which are no business of the caller), else the
    result's error."""
    if result.rejection is not None:
        return result.rejection
    return result.error or result.status


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes.

    Raises:
        BodyTooLarge: its ``Content-Length`` or the bytes received exceed ``limit``
            (reading stops there).
    """
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(declared)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the HTTP client disconnects (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _prepend(first: T, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first``, then the items of ``items``."""
    yield first
    async for item in items:
        yield item


async def _merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of ``streams`` as ``(index of the stream, item)``, in the order they
    come (each stream's own order kept: one read of it at a time), until all end."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    reads = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=lambda r: reads[r]):
                index = reads.pop(read)
                try:
                    item = read.result()
                except StopAsyncIteration:
                    continue
                reads[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, item
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        for stream in streams:
            await _aclose(stream)


async def _aclose(items: AsyncIterator[Any]) -> None:
    close = getattr(items, "aclose", None)
    if close is not None:
        await close()


def _key_id(request: Request, key: ApiKey) -> str | None:
    """The id usage is metered under: the first ``KEY_ID_LEN`` hex digits of the bearer
    key's SHA-256 (as ``inferq keys list`` shows it); None on an open gateway."""
    if key is OPEN:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else ""
    return digest(bearer)[:KEY_ID_LEN] if bearer else None
