""":class:`AsyncStore`: the client's Redis calls for asyncio code (redis.asyncio), and
the worker engine's chunk writes (from its event loop).

The same scripts, arguments and reply parsers as :class:`~inferq.store.Store`
(:mod:`inferq.store.calls`): only the awaiting differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from inferq import defaults
from inferq.config import Settings
from inferq.errors import IdempotencyConflict, QueueFull, RedisUnavailable
from inferq.models import InferenceRequest, RequestRecord, StreamChunk
from inferq.store import calls
from inferq.store.calls import Call, Chunk, Submitted
from inferq.store.connection import MIN_BLOCK_S, AsyncConnection, block_limit_s, open_async_redis
from inferq.store.glance import redis_time
from inferq.store.keys import Keys
from inferq.store.scripts import script_source

#: The scripts a client runs.
CLIENT_SCRIPTS = ("submit", "cancel", "expire", "abort", "caller_lease")


class AsyncStore:
    """Asyncio access to one deployment's keys: what :class:`~inferq.client.AsyncClient` needs.

    Args:
        client: a ``redis.asyncio`` client with text replies (see :meth:`from_settings`).
        settings: limits, TTLs and the namespace.
    """

    def __init__(self, client: AsyncConnection, settings: Settings) -> None:
        self.redis: Any = client
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self._scripts = {
            name: client.register_script(script_source(name)) for name in CLIENT_SCRIPTS
        }
        self._block_limit = block_limit_s(client)

    @classmethod
    def from_settings(cls, settings: Settings) -> AsyncStore:
        """A store on ``settings.redis_url`` (no round trip: see :meth:`check`).

        Raises:
            ConfigError: the URL is malformed (password redacted).
        """
        return cls(open_async_redis(settings.redis_url), settings)

    async def check(self) -> None:
        """PING the server.

        Raises:
            RedisUnavailable: it does not answer (URL shown with the password redacted).
        """
        try:
            await self.redis.ping()
        except (redis.RedisError, OSError) as exc:
            raise RedisUnavailable(self.settings.redis_url, exc) from None

    async def close(self) -> None:
        """Close the connection pool."""
        await self.redis.aclose()

    async def _call(self, call: Call, client: Any = None) -> Any:
        return await self._scripts[call.script](keys=call.keys, args=call.args, client=client)

    async def now(self) -> float:
        """Redis server time, epoch seconds."""
        return redis_time(await self.redis.time())

    async def submit(
        self, request: InferenceRequest, *, explicit_deadline: bool = False
    ) -> Submitted:
        """See :meth:`inferq.store.Store.submit`."""
        call = calls.submit_call(self.keys, self.settings, request, explicit_deadline)
        return calls.parse_submit(await self._call(call), request)

    async def submit_many(
        self, requests: Sequence[tuple[InferenceRequest, bool]]
    ) -> list[Submitted | QueueFull | IdempotencyConflict]:
        """See :meth:`inferq.store.Store.submit_many` (one pipelined round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        for request, explicit in requests:
            await self._call(calls.submit_call(self.keys, self.settings, request, explicit), pipe)
        out: list[Submitted | QueueFull | IdempotencyConflict] = []
        for (request, _), reply in zip(requests, await pipe.execute(), strict=True):
            try:
                out.append(calls.parse_submit(reply, request))
            except (QueueFull, IdempotencyConflict) as exc:
                out.append(exc)
        return out

    async def record(self, request_id: str) -> RequestRecord:
        """See :meth:`inferq.store.Store.record`."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.req(request_id))
        pipe.get(self.keys.payload(request_id))
        fields, payload = await pipe.execute()
        return calls.parse_record(request_id, fields, payload, self.keys)

    async def wait_final(self, request_id: str, timeout_s: float) -> bool:
        """See :meth:`inferq.store.Store.wait_final`."""
        key = self.keys.done(request_id)
        wait = min(timeout_s, defaults.BLOCK_CHUNK_S)
        if self._block_limit is not None:  # a reply within the socket timeout
            wait = max(MIN_BLOCK_S, min(wait, self._block_limit))
        token = await self.redis.blmove(key, key, timeout=wait, src="RIGHT", dest="LEFT")
        return token is not None

    async def live_models(self) -> dict[str, int]:
        """Models served by live workers (``starting`` or ``ready``), with their counts."""
        ids = await self.redis.zrange(self.keys.workers, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hmget(self.keys.worker(wid), "model", "state")
        return calls.parse_live_models(await pipe.execute() if ids else [])

    async def api_key_digests(self) -> list[str]:
        """The SHA-256 hex digests of every stored API key (``inferq keys add``)."""
        return [str(d) for d in await self.redis.hkeys(self.keys.api_keys)]

    async def api_key(self, key_digest: str) -> str | None:
        """The JSON entry of a stored API key by its SHA-256 hex digest; None when absent."""
        value: str | None = await self.redis.hget(self.keys.api_keys, key_digest)
        return value

    async def rate_limited_event(self, tenant: str, what: str, per_minute: int) -> None:
        """Record a submission the gateway refused by a tenant's rate limit (a
        ``rate_limited`` event: ``tenant``, ``limit`` = requests or tokens, ``per_minute``)."""
        await self.redis.xadd(
            self.keys.events,
            {"type": "rate_limited", "tenant": tenant, "limit": what, "per_minute": per_minute},
            maxlen=self.settings.events_maxlen,
            approximate=True,
        )

    async def cancel_running(self, request_id: str, reason: str) -> str:
        """See :meth:`inferq.store.Store.cancel_running`."""
        row = await self.redis.hmget(self.keys.req(request_id), "state", "attempts", "worker")
        abort = calls.running_abort(request_id, row, reason)
        if abort is None:
            return "not_running"
        call = calls.abort_call(self.keys, self.settings, [abort], defaults.VTC_OUTPUT_WEIGHT)
        [verdict] = calls.parse_abort(await self._call(call))
        return verdict

    async def publish_chunks(self, chunks: Sequence[Chunk]) -> None:
        """See :meth:`inferq.store.Store.publish_chunks` (one round trip). The worker's
        engine writes its chunks with it from its own event loop: a thread hand-off per
        write sat between each token and its XADD (issue 14)."""
        if not chunks:
            return
        pipe = self.redis.pipeline(transaction=False)
        calls.queue_chunks(pipe, self.keys, chunks)
        await pipe.execute()

    async def read_stream(
        self, request_id: str, after: str, block_s: float
    ) -> list[tuple[str, StreamChunk | str | None]]:
        """See :meth:`inferq.store.Store.read_stream`."""
        block_ms = max(1, round(min(block_s, defaults.BLOCK_CHUNK_S) * 1000))
        reply = await self.redis.xread({self.keys.stream(request_id): after}, block=block_ms)
        return calls.parse_xread(reply)

    async def expire_ids(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, float]]:
        """See :meth:`inferq.store.Store.expire_ids`."""
        if not pairs:
            return []
        call = calls.expire_ids_call(self.keys, self.settings, pairs)
        return calls.parse_expire(await self._call(call))

    async def expire_waited(
        self, request_id: str, route: str, models: Sequence[str]
    ) -> list[tuple[str, float]]:
        """See :meth:`inferq.store.Store.expire_waited`."""
        call = calls.expire_waited_call(self.keys, self.settings, request_id, route, models)
        return calls.parse_expire(await self._call(call))

    async def renew_caller(self, caller_id: str, ttl_s: float) -> None:
        """Renew gateway ``caller_id``'s liveness lease for ``ttl_s`` seconds
        (``caller_lease.lua``): while it is renewed, the requests submitted through the
        gateway (``InferenceRequest.caller``) are not cancelled as orphans."""
        await self._call(calls.caller_lease_call(self.keys, caller_id, ttl_s))

    async def cancel(self, request_id: str) -> str:
        """See :meth:`inferq.store.Store.cancel`."""
        reply = await self._call(calls.cancel_call(self.keys, self.settings, request_id))
        return calls.parse_cancel(reply, request_id)
