"""The ``sim`` model server: a model server that only takes time, per :mod:`inferq.latency`.

It sleeps for the latency model's time to first token, then for the decode
time at the worker's current concurrency, and returns synthetic text of the
right token count. The demo, the tests and the benchmarks run on it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

from inferq import defaults
from inferq.config import ModelSpec
from inferq.latency import prefill_s, service_time
from inferq.models import FunctionCall, ToolCall, ToolCallDelta
from inferq.policy.prefix_index import PrefixIndex
from inferq.workers.servers.base import (
    ModelServer,
    ServerError,
    ServerRequest,
    ServerResult,
    bool_option,
    float_option,
)

#: Payload parameter that caps the synthetic output (tokens); default max_tokens.
OUTPUT_TOKENS_PARAM = "sim_output_tokens"

# One word = one token of synthetic output.
_WORDS = (
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "from",
    "or",
    "an",
    "are",
    "not",
    "model",
    "token",
    "batch",
    "queue",
    "worker",
    "time",
    "data",
    "value",
    "state",
    "result",
    "request",
    "answer",
)

Sleep = Callable[[float], Awaitable[None]]


class SimServer(ModelServer):
    """Simulated model server.

    Output tokens are ``min(max_tokens, payload.params["sim_output_tokens"])``
    (``max_tokens`` when the parameter is absent); one word per token. The
    prompt token count reported is the scheduler's estimate.

    Tools (``params["tools"]``, OpenAI's shape, checked by the gateway): with
    ``tool_choice`` ``required`` or naming a function, the answer is one call of that
    function (the first tool for ``required``) instead of text, ``finish_reason``
    ``tool_calls``, its arguments a JSON object with one value per property of the
    function's ``parameters`` (``"value"`` for a string, 1 for a number, true for a boolean,
    null otherwise), streamed as three pieces (the id and name, then the arguments in
    halves); with ``auto``, ``none`` or no ``tool_choice`` the tools are ignored, as by
    a model that chose to answer in text. ``response_format`` of type ``json_object``
    or ``json_schema`` makes the text a JSON object ``{"text": "<the words>"}``.

    It keeps a prefix cache as a real server does: an LRU of the prompts' blocks
    (:class:`~inferq.policy.prefix_index.PrefixIndex`, keyed on the request's chain)
    of ``prefix_cache_tokens``; the leading prompt tokens found there are not prefilled
    again (the ttft is ``prefill_s(prompt) - prefill_s(cached)``, the cost of the
    remaining positions under :func:`inferq.latency.prefill_s`) and are reported as
    ``cached_tokens``, as llama.cpp and vLLM report theirs.

    Args:
        spec: the model; its ``latency`` profile (:mod:`inferq.latency`) and
            ``cold_start_s`` drive the timings.
        time_scale: multiplies every sleep (>= 0; 0 = never sleep). Default 1.0.
        seed: seeds the generator of failures and output words; with a seed,
            the same sequence of calls gives the same results.
        failure_rate: probability (0..1) that a request fails with a retryable
            ``ServerError("simulated failure")`` after its prefill.
        cold_start: when true, :meth:`load` sleeps ``spec.cold_start_s x time_scale``.
        sleep: the sleep function (tests pass a recorder). Default ``asyncio.sleep``.
        prefix_cache_tokens: size of the prefix cache, tokens (0: none). Default: the
            model's KV cache on a ``SIM_VRAM_MIB`` card.

    Raises:
        ConfigError: an option is out of range.
    """

    name = "sim"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        time_scale: float | str = defaults.SIM_TIME_SCALE,
        seed: int | str | None = None,
        failure_rate: float | str = 0.0,
        cold_start: bool | str = False,
        sleep: Sleep = asyncio.sleep,
        prefix_cache_tokens: float | str | None = None,
    ) -> None:
        self.spec = spec
        self.time_scale = float_option("time_scale", time_scale, ge=0.0)
        self.failure_rate = float_option("failure_rate", failure_rate, ge=0.0, le=1.0)
        self.cold_start = bool_option("cold_start", cold_start)
        self._rng = random.Random(int(seed) if isinstance(seed, str) and seed.isdigit() else seed)
        self._sleep = sleep
        if prefix_cache_tokens is None:
            kv_mib = spec.kv_cache_mib(defaults.SIM_VRAM_MIB)
            prefix_cache_tokens = kv_mib * 1024 * 1024 / spec.kv_bytes_per_token
        self.cache = PrefixIndex()
        self.cache.set_capacity(
            "self", float_option("prefix_cache_tokens", prefix_cache_tokens, ge=0.0)
        )

    def __repr__(self) -> str:
        return (
            f"SimServer(model={self.spec.name!r}, time_scale={self.time_scale}, "
            f"failure_rate={self.failure_rate})"
        )

    async def load(self) -> None:
        """Sleep the model's cold start (scaled) when ``cold_start`` is on."""
        if self.cold_start:
            await self._pause(self.spec.cold_start_s * self.time_scale)

    async def generate(self, request: ServerRequest, *, concurrency: int) -> ServerResult:
        """Sleep the latency model's ttft and decode time, then return synthetic text.

        Timings: :func:`inferq.latency.service_time` with ``concurrency``
        sequences, times ``time_scale``. A request whose scaled service time
        exceeds ``request.timeout_s`` sleeps ``timeout_s`` and times out.

        Raises:
            ServerError: retryable on a simulated failure or a timeout; not
                retryable when ``sim_output_tokens`` is not an integer >= 0.
        """
        n_out = _output_tokens(request)
        call = _forced_call(request)
        # Draw everything random before the first await: results then depend only
        # on the order of calls, not on how their sleeps interleave.
        fails = self._rng.random() < self.failure_rate
        words = self._rng.choices(_WORDS, k=n_out)
        st = service_time(self.spec, request.prompt_tokens, n_out, max(1, concurrency))
        cached = self._cached(request)
        ttft_s = max(0.0, st.ttft_s - prefill_s(self.spec, cached)) * self.time_scale
        total_s = ttft_s + st.decode_s * self.time_scale
        if total_s > request.timeout_s or request.timeout_s <= 0:
            await self._pause(max(0.0, request.timeout_s))
            raise ServerError(
                f"sim: request {request.id} timed out after {max(0.0, request.timeout_s):.3f} s "
                f"(it needs {total_s:.3f} s)",
                retryable=True,
            )
        await self._pause(ttft_s)
        if fails:
            raise ServerError(f"sim: simulated failure of request {request.id}", retryable=True)
        if call is not None:
            return await self._call_tool(request, call, ttft_s, st.decode_s, cached)
        finish = "length" if n_out >= request.max_tokens else "stop"
        if _json_format(request):
            text = json.dumps({"text": " ".join(words)})
            await self._pause(st.decode_s * self.time_scale)
            if request.on_chunk is not None:
                request.on_chunk(text, n_out, finish)
            return ServerResult(
                output=text,
                prompt_tokens=request.prompt_tokens,
                completion_tokens=n_out,
                ttft_s=ttft_s,
                finish_reason=finish,
                cached_tokens=cached,
            )
        if request.on_chunk is None or n_out == 0:
            await self._pause(st.decode_s * self.time_scale)
        else:  # one word per token, one chunk per token, the decode time spread evenly
            finish = "length" if n_out >= request.max_tokens else "stop"
            step = st.decode_s * self.time_scale / n_out
            for i, word in enumerate(words):
                request.on_chunk(word if i == 0 else " " + word, i + 1, None)
                await self._pause(step)
            request.on_chunk("", n_out, finish)
        return ServerResult(
            output=" ".join(words),
            prompt_tokens=request.prompt_tokens,
            completion_tokens=n_out,
            ttft_s=ttft_s,
            finish_reason="length" if n_out >= request.max_tokens else "stop",
            cached_tokens=cached,
        )

    async def _call_tool(
        self,
        request: ServerRequest,
        tool: dict[str, Any],
        ttft_s: float,
        decode_s: float,
        cached: int,
    ) -> ServerResult:
        """Answer with one call of ``tool`` (a ``tools`` entry); see the class docstring."""
        function = tool.get("function") or {}
        name = str(function.get("name", ""))
        properties = (function.get("parameters") or {}).get("properties") or {}
        arguments = json.dumps({key: _sample_value(spec) for key, spec in properties.items()})
        call_id = f"call_{request.id}"
        tokens = max(1, min(request.max_tokens, math.ceil(len(arguments) / 4)))
        await self._pause(decode_s * self.time_scale)
        sink = request.on_chunk
        if sink is not None:
            half = len(arguments) // 2
            sink("", 0, None, tool_calls=(ToolCallDelta(index=0, id=call_id, name=name),))
            sink("", tokens, None, tool_calls=(ToolCallDelta(index=0, arguments=arguments[:half]),))
            last = (ToolCallDelta(index=0, arguments=arguments[half:]),)
            sink("", tokens, "tool_calls", tool_calls=last)
        return ServerResult(
            output="",
            prompt_tokens=request.prompt_tokens,
            completion_tokens=tokens,
            ttft_s=ttft_s,
            finish_reason="tool_calls",
            cached_tokens=cached,
            tool_calls=(
                ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments)),
            ),
        )

    def _cached(self, request: ServerRequest) -> int:
        """Leading prompt tokens of ``request`` found in the prefix cache, which then
        holds its whole chain as the most recent."""
        if not request.prefix:
            return 0
        held = self.cache.held("self", request.prefix)
        self.cache.touch("self", request.block_tokens, request.prefix)
        return min(held * request.block_tokens, request.prompt_tokens)

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` (already scaled); no call at all when that is 0."""
        if seconds > 0:
            await self._sleep(seconds)


def _forced_call(request: ServerRequest) -> dict[str, Any] | None:
    """The tool the request makes the model call: the one ``tool_choice`` names, the
    first for ``required``; None when the model may answer in text."""
    tools = request.payload.params.get("tools") or []
    choice = request.payload.params.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return dict(tools[0])
    wanted = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    for tool in tools:
        if (tool.get("function") or {}).get("name") == wanted:
            return dict(tool)
    return None


def _json_format(request: ServerRequest) -> bool:
    """True when ``response_format`` asks for JSON (``json_object``, ``json_schema``)."""
    fmt = request.payload.params.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")


def _sample_value(spec: Any) -> Any:
    """A value of a JSON schema's ``type``: ``"value"``, 1, true, or null for another
    (no draw from the generator: calls then leave the sequence of results as it was)."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "string":
        return "value"
    if kind in ("integer", "number"):
        return 1
    if kind == "boolean":
        return True
    return None


def _output_tokens(request: ServerRequest) -> int:
    raw = request.payload.params.get(OUTPUT_TOKENS_PARAM, request.max_tokens)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        said = f"{OUTPUT_TOKENS_PARAM} must be an integer >= 0, got {raw!r}"
        raise ServerError(
            f"sim: request {request.id}: payload.params.{said}",
            retryable=False,
            rejection=said,  # as a real server's 400: the caller's error
        )
    return min(request.max_tokens, raw)
