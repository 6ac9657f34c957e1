"""The ``openai`` model server: any OpenAI-compatible server (vLLM, TGI, llama.cpp, Ollama).

A prompt goes to ``POST /v1/completions``, chat messages to
``POST /v1/chat/completions``, through one ``httpx.AsyncClient``. Each request
is bounded by its remaining time (``ServerRequest.timeout_s``). Error mapping:

==========================================  ==========================================
server answer                               ``ServerError`` (kind: see ``workers.failures``)
==========================================  ==========================================
4xx (except 408, 429)                       ``retryable=False``: request
429, 502, 503, 504                          ``retryable=True``: infrastructure, with
                                            the ``Retry-After`` when sent
408, 500, other 5xx                         ``retryable=True``: server
refused or timed out before the answer      ``retryable=True``: infrastructure
began; reset or an incomplete HTTP message
mid-answer (the server died)
a stream that ended cleanly without a       ``retryable=True``: truncated
finish reason or ``[DONE]``, a 200 with an
empty body, an answer with neither text nor
a finish reason
2xx with a body that does not parse         ``retryable=True``: server
==========================================  ==========================================

With ``stream=True`` (recommended, and what llama.cpp needs: a non-streamed request
whose client gives up keeps its slot busy until the generation ends, while a
streamed one is stopped at the next token) the answer is read as server-sent
events and the time to first token is measured; otherwise ``ttft_s`` is ``None``.
The finish reason (``stop``, ``length``) is recorded; completion tokens never exceed
``max_tokens``. A connection cut mid-answer is closed, never returned to the pool.
For a request whose caller reads its output as it comes (``ServerRequest.on_chunk``)
the answer is always streamed, and each piece is handed to ``on_chunk``.

The HTTP client belongs to the event loop that first used it; on a new loop
(``asyncio.run`` per batch) a new client is made, so a worker should keep one
loop for its lifetime (e.g. an ``asyncio.Runner``) to reuse connections.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any

import httpx
from pydantic import ValidationError

from inferq import defaults
from inferq.config import ModelSpec
from inferq.errors import ConfigError, redact_url
from inferq.models import (
    ChatMessage,
    FailureKind,
    FunctionCall,
    ServerTelemetry,
    ToolCall,
    ToolCallDelta,
    merge_tool_deltas,
    tool_calls_of,
)
from inferq.workers.servers import telemetry as parse
from inferq.workers.servers.base import (
    ModelServer,
    ServerError,
    ServerRequest,
    ServerResult,
    bool_option,
    float_option,
)

log = logging.getLogger(__name__)

#: Request fields the model server sets itself; ``payload.params`` cannot override them.
#: ``max_completion_tokens`` (OpenAI) and ``n_predict`` (llama.cpp, which prefers it to
#: ``max_tokens``) would lift the answer past the ``max_tokens`` the request was sized,
#: admitted and rate-limited for.
RESERVED_PARAMS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "n_predict",
        "stream",
        "stream_options",
    }
)
#: Prefix of parameters meant for the sim model server; never forwarded.
SIM_PARAM_PREFIX = "sim_"
#: 4xx statuses that say "try again" rather than "this request is invalid".
RETRYABLE_4XX = frozenset({408, 429})
#: 4xx answers that judge the request itself invalid, so the server's message is for the
#: caller (a field inferq does not check: 400 Bad Request, 413 Content Too Large, 422
#: Unprocessable Content, RFC 9110 section 15.5). Other 4xx (401, 403, 404: the worker's
#: key or the server's routes) are the deployment's fault, not the caller's.
REJECTING_4XX = frozenset({400, 413, 422})
#: Longest server message kept in an error, characters.
MAX_MESSAGE_CHARS = 1000
#: Values of the ``telemetry`` option.
TELEMETRY_KINDS = ("auto", "llamacpp", "vllm", "tgi", "off")


class OpenAIServer(ModelServer):
    """Client of an OpenAI-compatible model server on the host.

    Args:
        spec: the model the worker serves.
        base_url: the server's root, without ``/v1``. Default ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer ...`` when given; never logged.
        served_model_name: the ``model`` field sent to the server; default
            ``spec.name`` (vLLM's ``--served-model-name``).
        stream: read answers as server-sent events to measure time to first token.
        load_timeout_s: longest wait in :meth:`load` for the server to answer, seconds.
        load_poll_s: pause between two checks in :meth:`load`, seconds.
        telemetry: which server's own figures :meth:`telemetry` reads: ``llamacpp``,
            ``vllm``, ``tgi``, ``off``, or ``auto`` (default: found on the first read,
            see :meth:`telemetry`).
        stall_s: seconds an answer may stay silent (no byte of a stream, no answer at all
            otherwise) before the server's ``GET /health`` is checked; when that does not
            answer within ``HEALTH_PROBE_TIMEOUT_S`` either, the server hangs and the
            request fails as an infrastructure failure (see :meth:`_watched`). Default
            ``SERVER_STALL_S``.

    Raises:
        ConfigError: an option is out of range.
    """

    name = "openai"
    external = True

    def __init__(
        self,
        spec: ModelSpec,
        *,
        base_url: str = defaults.OPENAI_BASE_URL,
        api_key: str | None = None,
        served_model_name: str | None = None,
        stream: bool | str = False,
        load_timeout_s: float | str = defaults.SERVER_LOAD_TIMEOUT_S,
        load_poll_s: float | str = defaults.SERVER_LOAD_POLL_S,
        telemetry: str = "auto",
        stall_s: float | str = defaults.SERVER_STALL_S,
    ) -> None:
        self.spec = spec
        self.base_url = base_url.rstrip("/")
        self.served_model_name = served_model_name or spec.name
        self.stream = bool_option("stream", stream)
        self.load_timeout_s = float_option("load_timeout_s", load_timeout_s, ge=0.0)
        self.load_poll_s = float_option("load_poll_s", load_poll_s, ge=0.01)
        if telemetry not in TELEMETRY_KINDS:
            raise ConfigError(
                f"option telemetry: expected one of {', '.join(TELEMETRY_KINDS)}, got {telemetry!r}"
            )
        self.telemetry_kind = telemetry
        self.stall_s = float_option("stall_s", stall_s, ge=0.1)
        self._liveness: asyncio.Task[str | None] | None = None  # one /health check at a time
        self._api_key = api_key
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_probe = "no answer yet"
        self._tgi_info: Any = None  # GET /info, read once (its max_batch_total_tokens)

    def __repr__(self) -> str:
        return (
            f"OpenAIServer(base_url={redact_url(self.base_url)!r}, "
            f"served_model_name={self.served_model_name!r}, stream={self.stream})"
        )

    # -- lifecycle ---------------------------------------------------------------

    async def load(self) -> None:
        """Wait until ``GET /v1/models`` answers, at most ``load_timeout_s``.

        Logs a warning when the server lists models but not ``served_model_name``
        (llama.cpp lists its file name yet answers to any name, so it is no error).

        Raises:
            ServerError: not retryable when the server refuses the check (4xx,
                e.g. a wrong API key); retryable when it is not up in time.
        """
        loop = asyncio.get_running_loop()
        started = next_note = loop.time()
        try:
            async with asyncio.timeout(self.load_timeout_s):
                while not await self._probe():
                    if loop.time() >= next_note:  # say why the worker is still `starting`
                        log.warning(
                            "openai: waiting for the model server at %s (%.0f s so far; %s)",
                            redact_url(self.base_url),
                            loop.time() - started,
                            self._last_probe,
                        )
                        next_note = loop.time() + 30.0
                    await asyncio.sleep(self.load_poll_s)
        except TimeoutError:
            raise ServerError(
                f"openai: server at {redact_url(self.base_url)} not ready after "
                f"{self.load_timeout_s:g} s (last check: {self._last_probe})",
                retryable=True,
            ) from None
        log.info("openai backend ready: %s model=%s", self, self.served_model_name)

    async def close(self) -> None:
        """Close the HTTP client when it belongs to the running loop; drop it otherwise."""
        http, self._http = self._http, None
        if http is not None and self._loop is asyncio.get_running_loop():
            await http.aclose()
        self._loop = None

    # -- requests ----------------------------------------------------------------

    async def generate(self, request: ServerRequest, *, concurrency: int) -> ServerResult:
        """Send one request and read its answer (the server batches; ``concurrency`` is unused).

        Raises:
            ServerError: see the module docstring for which errors are retryable.
        """
        if request.timeout_s <= 0:
            raise ServerError(
                f"openai: request {request.id} has no time left before its deadline",
                retryable=True,
            )
        stream = self.stream or request.on_chunk is not None
        path, body = build_body(request, self.served_model_name, stream=stream)
        start = time.monotonic()
        answered: list[bool] = []  # non-empty once the answer began (status line received)
        heard = [start]  # monotonic time of the last byte of answer (or of the send)

        def send() -> Awaitable[ServerResult]:
            post = (
                self._post_stream(request, path, body, start, answered, heard)
                if stream
                else self._post(request, path, body, answered)
            )
            return self._watched(request, post, heard)

        try:
            async with asyncio.timeout(request.timeout_s):
                try:
                    return await send()
                except httpx.RemoteProtocolError:
                    if answered:
                        raise
                # The server closed the connection without a byte of answer: a kept-alive
                # connection it had just closed (llama.cpp's HTTP server ends one after a
                # few requests or seconds idle, racing the pool's reuse; found by
                # scripts/bench_gateway.py: 3 of 40 streams reset). The request did not
                # start there: send it once more, on a fresh connection, before counting
                # a failed attempt.
                heard[0] = time.monotonic()
                return await send()
        except (TimeoutError, httpx.TimeoutException):
            raise self._timeout_error(request, answered=bool(answered)) from None
        except httpx.HTTPError as exc:
            cause = f"{type(exc).__name__}: {exc}"
            if answered:  # a transport failure mid-answer (reset, incomplete message)
                raise ServerError(
                    f"openai: request {request.id}: answer cut off by "
                    f"{redact_url(self.base_url)}: {cause}",
                    retryable=True,
                    kind=FailureKind.INFRASTRUCTURE,
                ) from None
            raise ServerError(
                f"openai: request {request.id}: connection to {redact_url(self.base_url)} "
                f"failed: {cause}",
                retryable=True,
                kind=FailureKind.INFRASTRUCTURE,
            ) from None

    async def _post(
        self, request: ServerRequest, path: str, body: dict[str, Any], answered: list[bool]
    ) -> ServerResult:
        client = self._client()
        async with client.stream("POST", path, json=body, timeout=request.timeout_s) as response:
            answered.append(True)
            if not response.is_success:
                await response.aread()
                raise status_error(request.id, response)
            limit = answer_limit_bytes(request.max_tokens)
            content = bytearray()
            async for piece in response.aiter_bytes():
                content += piece
                if len(content) > limit:
                    raise _too_large(request, limit)
        if not content.strip():
            raise ServerError(
                f"openai: request {request.id}: HTTP {response.status_code} with an empty body",
                retryable=True,
                kind=FailureKind.TRUNCATED,
            )
        data = _json_object(request.id, content.decode("utf-8", errors="replace"))
        chat = path.endswith("chat/completions")
        output, usage, finish, calls = _read_completion(request.id, data, chat=chat)
        if not output and not calls and finish is None:
            raise _nothing_generated(request)
        return _result(
            request,
            output,
            usage,
            ttft_s=None,
            finish_reason=finish,
            timings=data.get("timings"),
            tool_calls=calls,
        )

    async def _watched(
        self, request: ServerRequest, call: Coroutine[Any, Any, ServerResult], heard: list[float]
    ) -> ServerResult:
        """Run ``call``; each time the answer has been silent for ``stall_s`` (``heard[0]``:
        the last byte), check that the server still answers ``GET /health``.

        A server that stops without closing anything (SIGSTOP, a hung GPU, a paused VM)
        sends no byte and no error: the request would wait for its deadline while other
        workers could serve it (issue 13 attack). A silent answer alone proves nothing (a
        long prompt's prefill, a non-streamed answer), so the judge is the health endpoint:
        any HTTP answer within ``HEALTH_PROBE_TIMEOUT_S`` means the server lives.

        Raises:
            ServerError: infrastructure, when the answer was silent for ``stall_s`` and
                ``/health`` did not answer either; whatever ``call`` raises.
        """
        task = asyncio.ensure_future(call)
        check_at = 0.0  # after a check the server passed: the next one, monotonic
        try:
            while True:
                wait_s = max(heard[0] + self.stall_s, check_at) - time.monotonic()
                if wait_s > 0:
                    await asyncio.wait({task}, timeout=wait_s)
                    if task.done():
                        return task.result()
                    continue
                silent_s = time.monotonic() - heard[0]
                dead = await self._check_liveness()
                if task.done():
                    return task.result()
                if dead is not None:
                    raise ServerError(
                        f"openai: request {request.id}: no answer from "
                        f"{redact_url(self.base_url)} for {silent_s:.1f} s and its /health "
                        f"does not answer either ({dead}): the server hangs",
                        retryable=True,
                        kind=FailureKind.INFRASTRUCTURE,
                        server_down=True,
                    )
                check_at = time.monotonic() + self.stall_s
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _check_liveness(self) -> str | None:
        """None when ``GET /health`` gets any HTTP answer within ``HEALTH_PROBE_TIMEOUT_S``;
        else why not. Requests silent at the same time share one check."""
        if self._liveness is None or self._liveness.done():
            self._liveness = asyncio.ensure_future(self._health_answers())
        return await asyncio.shield(self._liveness)

    async def _health_answers(self) -> str | None:
        try:
            await self._client().get("/health", timeout=defaults.HEALTH_PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return None

    async def _post_stream(
        self,
        request: ServerRequest,
        path: str,
        body: dict[str, Any],
        start: float,
        answered: list[bool],
        heard: list[float],
    ) -> ServerResult:
        client = self._client()
        chat = path.endswith("chat/completions")
        parts: list[str] = []
        pieces: tuple[ToolCallDelta, ...] = ()  # of the tool calls, as they came
        usage: Any = None
        timings: Any = None
        ttft_s: float | None = None
        finish: str | None = None
        done = False
        sink = request.on_chunk
        sent_finish = False
        async with client.stream("POST", path, json=body, timeout=request.timeout_s) as response:
            answered.append(True)
            heard[0] = time.monotonic()
            if not response.is_success:
                await response.aread()
                raise status_error(request.id, response)
            limit = answer_limit_bytes(request.max_tokens)
            lines = _lines(request, response.aiter_bytes(), heard, limit)
            async for data in sse_data(lines):
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = _json_object(request.id, data)
                if "error" in chunk:
                    raise stream_error(request.id, chunk)
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                piece, reason, calls = _chunk_text(request.id, chunk, chat=chat)
                finish = reason or finish
                if piece or calls:
                    if ttft_s is None:
                        ttft_s = time.monotonic() - start
                    if piece:
                        parts.append(piece)
                    pieces = merge_tool_deltas(pieces, calls)
                if sink is not None and (piece or calls or (reason and not sent_finish)):
                    sink(piece, len(parts), reason, tool_calls=calls)
                    sent_finish = sent_finish or reason is not None
        if finish is None and done and not parts and not pieces:
            raise _nothing_generated(request)
        if not done and finish is None:
            raise ServerError(
                f"openai: request {request.id}: the stream ended without a finish reason "
                f"or [DONE] after {len(parts)} chunks (truncated)",
                retryable=True,
                kind=FailureKind.TRUNCATED,
            )
        if sink is not None and not sent_finish:  # a server that names no finish reason
            sink("", len(parts), finish or "stop")
        return _result(
            request,
            "".join(parts),
            usage,
            ttft_s=ttft_s,
            finish_reason=finish,
            timings=timings,
            tool_calls=tool_calls_of(pieces),
        )

    async def probe(self, *, strict: bool = False) -> ServerError | None:
        """Is the server healthy? ``GET /health`` (llama.cpp, vLLM, TGI), then a 1-token
        completion. None when both pass, else the error of the first that failed (its kind
        and ``Retry-After`` included). An answer that refuses the probe itself (a 4xx but
        408 and 429: no ``/health`` route, a chat-only server without ``/v1/completions``)
        counts as a pass: the server is up and answering, and an outage is what is probed.
        With ``strict`` (a server taken out for refusing every request) the 1-token
        completion must succeed: its refusal is the fault probed for (a 404 or 405, no
        such route, still passes)."""
        timeout = defaults.HEALTH_PROBE_TIMEOUT_S
        try:
            response = await self._client().get("/health", timeout=timeout)
            if not response.is_success and (error := status_error("health", response)).retryable:
                return error
            body = {"model": self.served_model_name, "prompt": "Hi", "max_tokens": 1}
            response = await self._client().post("/v1/completions", json=body, timeout=timeout)
            if not response.is_success:
                error = status_error("probe", response)
                if error.retryable or (strict and response.status_code not in (404, 405)):
                    return error
        except httpx.HTTPError as exc:
            return ServerError(
                f"openai: probe of {redact_url(self.base_url)} failed: {type(exc).__name__}: {exc}",
                retryable=True,
                kind=FailureKind.INFRASTRUCTURE,
            )
        return None

    async def telemetry(self) -> ServerTelemetry | None:
        """The server's own figures (the parsers and their sources: :mod:`.telemetry`).

        ``auto`` finds the server on the first read that gets an answer: llama.cpp
        when ``GET /props`` names ``total_slots`` (then its slot count is logged), else
        vLLM or TGI by the metric names of ``GET /metrics``; a server that is neither is
        remembered as ``off``. Each call is bounded by ``TELEMETRY_TIMEOUT_S`` per
        HTTP call.

        Raises:
            httpx.HTTPError, ValueError: the server did not answer, or not in the
                expected format (the worker logs it and tries again later).
        """
        if self.telemetry_kind == "auto":
            self.telemetry_kind = await self._detect_telemetry()
        kind = self.telemetry_kind
        if kind == "llamacpp":
            slots = (await self._get("/slots")).json()
            metrics = await self._get_if_served("/metrics")
            return parse.llama_cpp(slots, metrics.text if metrics is not None else None)
        if kind == "vllm":
            return parse.vllm((await self._get("/metrics")).text)
        if kind == "tgi":
            if self._tgi_info is None:
                self._tgi_info = (await self._get("/info")).json()
            return parse.tgi((await self._get("/metrics")).text, self._tgi_info)
        return None

    async def _detect_telemetry(self) -> str:
        """``llamacpp``, ``vllm``, ``tgi`` or ``off`` (see :meth:`telemetry`); raises
        ``httpx.HTTPError`` when the server does not answer, so the next read tries again."""
        props = await self._get_if_served("/props")
        if props is not None:
            try:
                data = props.json()
            except ValueError:
                data = None
            if isinstance(data, dict) and isinstance(data.get("total_slots"), int):
                log.info(
                    "openai backend: llama.cpp at %s with %d slots",
                    redact_url(self.base_url),
                    data["total_slots"],
                )
                return "llamacpp"
        metrics = await self._get_if_served("/metrics")
        text = metrics.text if metrics is not None else ""
        for prefix, kind in (("vllm:", "vllm"), ("tgi_", "tgi")):
            if prefix in text:
                log.info("openai backend: %s telemetry at %s", kind, redact_url(self.base_url))
                return kind
        log.info("openai backend: %s reports no known telemetry", redact_url(self.base_url))
        return "off"

    async def _get(self, path: str) -> httpx.Response:
        """``GET path`` within ``TELEMETRY_TIMEOUT_S``, its body read up to
        ``TELEMETRY_MAX_BYTES``.

        Raises:
            httpx.HTTPError: no answer, or a non-2xx one.
            ValueError: a body larger than ``TELEMETRY_MAX_BYTES`` (not read further).
        """
        client = self._client()
        async with client.stream("GET", path, timeout=defaults.TELEMETRY_TIMEOUT_S) as response:
            response.raise_for_status()
            content = bytearray()
            async for piece in response.aiter_bytes():
                content += piece
                if len(content) > defaults.TELEMETRY_MAX_BYTES:
                    raise ValueError(
                        f"GET {path}: larger than {defaults.TELEMETRY_MAX_BYTES:,} bytes "
                        f"(not read further)"
                    )
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=bytes(content),
            request=response.request,
        )

    async def _get_if_served(self, path: str) -> httpx.Response | None:
        """:meth:`_get`, but None for a non-2xx answer (a route the server lacks)."""
        try:
            return await self._get(path)
        except httpx.HTTPStatusError:
            return None

    # -- helpers -----------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            # trust_env=False: the server is on the host; a proxy from the
            # environment must not capture loopback traffic.
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                trust_env=False,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
            self._loop = loop
        return self._http

    async def _probe(self) -> bool:
        """One ``GET /v1/models``: True when up, False when not yet (reason in ``_last_probe``)."""
        try:
            response = await self._client().get("/v1/models", timeout=self.load_timeout_s)
        except httpx.HTTPError as exc:
            self._last_probe = f"{type(exc).__name__}: {exc}"
            return False
        if response.is_success:
            self._warn_if_not_listed(response)
            return True
        error = status_error("load", response)
        if not error.retryable:
            raise error
        self._last_probe = str(error)
        return False

    def _warn_if_not_listed(self, response: httpx.Response) -> None:
        try:
            ids = [str(m["id"]) for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            return
        if ids and self.served_model_name not in ids:
            log.warning(
                "openai backend: server %s lists %s, not %r (set served_model_name)",
                redact_url(self.base_url),
                ids,
                self.served_model_name,
            )

    def _timeout_error(self, request: ServerRequest, *, answered: bool) -> ServerError:
        return ServerError(
            f"openai: request {request.id} timed out after {request.timeout_s:.3f} s "
            f"(its remaining time) at {redact_url(self.base_url)}",
            retryable=True,
            kind=FailureKind.SERVER if answered else FailureKind.INFRASTRUCTURE,
        )


def build_body(
    request: ServerRequest, served_model_name: str, *, stream: bool
) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body for ``request``.

    ``payload.params`` are forwarded as they are, except :data:`RESERVED_PARAMS`
    and ``sim_*`` parameters.

    Returns:
        ``("/v1/completions", body)`` for a prompt, ``("/v1/chat/completions", body)``
        for chat messages.
    """
    payload = request.payload
    body: dict[str, Any] = {
        k: v
        for k, v in payload.params.items()
        if k not in RESERVED_PARAMS and not k.startswith(SIM_PARAM_PREFIX)
    }
    body["model"] = served_model_name
    body["max_tokens"] = request.max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if payload.messages is not None:
        body["messages"] = [chat_message(m) for m in payload.messages]
        return "/v1/chat/completions", body
    body["prompt"] = payload.prompt
    return "/v1/completions", body


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """A chat message in OpenAI's request shape: ``role`` and ``content``, and an
    assistant's ``tool_calls``, a tool answer's ``tool_call_id`` and a ``name`` when set
    (an assistant message that only calls tools sends ``content: null``, as OpenAI's
    API and llama.cpp's chat templates expect)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump(mode="json") for c in message.tool_calls]
        if not message.content:
            out["content"] = None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def status_error(request_id: str, response: httpx.Response) -> ServerError:
    """The ``ServerError`` for a non-2xx answer: retryable for 5xx, 408 and 429, with the
    ``Retry-After`` header (delay-seconds or an HTTP date, RFC 9110 section 10.2.3; a date
    is judged against the answer's own ``Date`` header when it has one: the server's
    clock, not this host's, which may be off by seconds)."""
    status = response.status_code
    retryable = status >= 500 or status in RETRYABLE_4XX
    try:
        message = error_message(response.json())
    except ValueError:
        message = response.text.strip()
    message = (message or response.reason_phrase)[:MAX_MESSAGE_CHARS]
    return ServerError(
        f"openai: request {request_id}: HTTP {status} from "
        f"{redact_url(str(response.request.url))}: {message}",
        retryable=retryable,
        status=status,
        rejection=message if status in REJECTING_4XX else None,
        retry_after_s=retry_after_s(
            response.headers.get("retry-after"), now=_http_date(response.headers.get("date"))
        ),
    )


def stream_error(request_id: str, chunk: dict[str, Any]) -> ServerError:
    """The ``ServerError`` for an error event inside a stream that began (HTTP 200):
    retryable, unless the event carries a status in :data:`REJECTING_4XX` (vLLM's and
    llama.cpp's ``{"error": {"message", "type", "code": 400}}``): then the request itself is
    invalid, as the same status before the stream would say, and fails at once with the
    server's message as its rejection (the caller's error)."""
    message = error_message(chunk)[:MAX_MESSAGE_CHARS]
    error = chunk.get("error")
    code = error.get("code") if isinstance(error, dict) else chunk.get("code")
    status = int(code) if isinstance(code, int | str) and str(code).isdecimal() else None
    rejected = status in REJECTING_4XX
    return ServerError(
        f"openai: request {request_id}: error in stream: {message}",
        retryable=not rejected,
        status=status,
        rejection=message if rejected else None,
    )


def _http_date(value: str | None) -> float | None:
    """An HTTP date header as epoch seconds; None when absent or unreadable."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header as seconds from now (None when absent or unreadable).

    Args:
        value: delay-seconds (``"1"``) or an HTTP date (``"Wed, 21 Oct 2015 07:28:00 GMT"``).
        now: epoch seconds for an HTTP date (default: this host's clock; a date in the past
            gives 0).
    """
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text).timestamp()
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def error_message(body: Any) -> str:
    """The server's error text from an error body, in any of the servers' shapes.

    OpenAI, llama.cpp and Ollama: ``{"error": {"message": ...}}``; vLLM:
    ``{"object": "error", "message": ...}``; TGI: ``{"error": "...", "error_type": ...}``.
    Anything else is returned as compact JSON.
    """
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return json.dumps(body, separators=(",", ":"))


def answer_limit_bytes(max_tokens: int) -> int:
    """The most bytes read of one answer: ``ANSWER_BASE_BYTES + max_tokens x
    ANSWER_BYTES_PER_TOKEN``. A server that sends more ignores ``max_tokens`` (or loops);
    the rest is not read, kept in memory, or recorded as the output."""
    return defaults.ANSWER_BASE_BYTES + max_tokens * defaults.ANSWER_BYTES_PER_TOKEN


def _nothing_generated(request: ServerRequest) -> ServerError:
    """No text and no finish reason in a well-formed answer: not an answer (a real empty
    one says ``stop``); truncated, so it is retried."""
    return ServerError(
        f"openai: request {request.id}: an answer with no text and no finish reason (truncated)",
        retryable=True,
        kind=FailureKind.TRUNCATED,
    )


def _too_large(request: ServerRequest, limit: int) -> ServerError:
    return ServerError(
        f"openai: request {request.id}: answer larger than {limit:,} bytes for max_tokens "
        f"{request.max_tokens} (the server ignores max_tokens?); not read further",
        retryable=True,
        kind=FailureKind.SERVER,
    )


async def _lines(
    request: ServerRequest, chunks: AsyncIterator[bytes], heard: list[float], limit: int
) -> AsyncIterator[str]:
    """The lines of a byte stream (``\n`` or ``\r\n`` ends one), noting in ``heard[0]``
    the monotonic time each piece arrived (a keep-alive comment included: the server
    lives); at most ``limit`` bytes in all, so neither a long stream nor one line without
    an end is held in memory whole.

    Raises:
        ServerError: server, more than ``limit`` bytes.
    """
    buffer = bytearray()
    total = 0
    async for chunk in chunks:
        heard[0] = time.monotonic()
        total += len(chunk)
        if total > limit:
            raise _too_large(request, limit)
        start = len(buffer)
        buffer += chunk
        end = buffer.rfind(b"\n", start)  # the last line end: only the new bytes can hold it
        if end < 0:
            continue
        for line in bytes(buffer[:end]).split(b"\n"):
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
        del buffer[: end + 1]
    if buffer:
        yield bytes(buffer).removesuffix(b"\r").decode("utf-8", errors="replace")


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined with newlines).

    Follows the HTML spec's event-stream parsing: an event ends at a blank line;
    ``:`` lines are comments; fields other than ``data`` are ignored.
    """
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


def _json_object(request_id: str, text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ServerError(
            f"openai: request {request_id}: malformed answer (not a JSON object): {text[:200]!r}",
            retryable=True,
        )
    return data


def _read_completion(
    request_id: str, data: dict[str, Any], *, chat: bool
) -> tuple[str, Any, str | None, tuple[ToolCall, ...]]:
    """(text of choice 0, usage, its finish reason or None, its tool calls) of an answer.

    Raises:
        ServerError: retryable, when the answer has no such choice or malformed calls.
    """
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        raw = choice["message"].get("tool_calls") if chat else None
        calls = tuple(
            ToolCall(
                id=str(c.get("id") or f"call_{i}"),
                function=FunctionCall(
                    name=c["function"]["name"], arguments=c["function"].get("arguments") or ""
                ),
            )
            for i, c in enumerate(raw or ())
        )
    except (KeyError, IndexError, TypeError, AttributeError, ValidationError):
        raise ServerError(
            f"openai: request {request_id}: malformed answer (no choices[0] text): "
            f"{json.dumps(data)[:200]}",
            retryable=True,
        ) from None
    finish = choice.get("finish_reason")
    return str(text or ""), data.get("usage"), str(finish) if finish else None, calls


def _chunk_text(
    request_id: str, chunk: dict[str, Any], *, chat: bool
) -> tuple[str, str | None, tuple[ToolCallDelta, ...]]:
    """(text of choice 0, its finish reason or None, its pieces of tool calls) of one
    stream chunk.

    Raises:
        ServerError: retryable, when the chunk is malformed.
    """
    choices = chunk.get("choices") or []
    if not choices:
        return "", None, ()  # the usage chunk at the end has no choices
    try:
        choice = choices[0]
        piece = choice["delta"].get("content") if chat else choice["text"]
        raw = choice["delta"].get("tool_calls") if chat else None
        calls = tuple(
            ToolCallDelta(
                index=c.get("index", 0),
                id=c.get("id") or None,
                name=(c.get("function") or {}).get("name") or None,
                arguments=(c.get("function") or {}).get("arguments") or "",
            )
            for c in raw or ()
        )
    except (KeyError, TypeError, AttributeError, ValidationError):
        raise ServerError(
            f"openai: request {request_id}: malformed stream chunk: {json.dumps(chunk)[:200]}",
            retryable=True,
        ) from None
    finish = choice.get("finish_reason")
    return str(piece or ""), str(finish) if finish else None, calls


def _result(
    request: ServerRequest,
    output: str,
    usage: Any,
    *,
    ttft_s: float | None,
    finish_reason: str | None = None,
    timings: Any = None,
    tool_calls: tuple[ToolCall, ...] = (),
) -> ServerResult:
    """Token counts from ``usage`` when present, else estimates (the scheduler's, and
    ``CHARS_PER_TOKEN`` characters per output token); completion tokens at most
    ``max_tokens`` (an estimate from characters may exceed it). The prompt tokens the
    server reused from its cache: :func:`cached_prompt_tokens`."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if not isinstance(prompt, int) or prompt < 0:
        prompt = request.prompt_tokens
    if not isinstance(completion, int) or completion < 0:
        completion = math.ceil(len(output) / defaults.CHARS_PER_TOKEN)
    return ServerResult(
        output=output,
        prompt_tokens=prompt,
        completion_tokens=min(completion, request.max_tokens),
        ttft_s=ttft_s,
        finish_reason=finish_reason,
        cached_tokens=cached_prompt_tokens(usage, timings),
        tool_calls=tool_calls,
    )


def cached_prompt_tokens(usage: Any, timings: Any) -> int | None:
    """Prompt tokens the server reused from its prefix cache, as it reports them.

    OpenAI's (and vLLM's, with ``--enable-prompt-tokens-details``)
    ``usage.prompt_tokens_details.cached_tokens``, else llama.cpp's ``timings.cache_n``
    (its server's own count of prompt tokens taken from the slot's cache); None when
    the answer holds neither (or a value that is not a non-negative integer).
    """
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    if value is None and isinstance(timings, dict):
        value = timings.get("cache_n")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value
