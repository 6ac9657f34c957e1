"""The openai backend against a real stand-in HTTP server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from inferq.config import ModelSpec
from inferq.embedded import free_port
from inferq.errors import ConfigError
from inferq.models import (
    ChatMessage,
    FunctionCall,
    Payload,
    ToolCall,
    ToolCallDelta,
    tool_calls_of,
)
from inferq.workers.failures import classify, plan
from inferq.workers.servers import FailureKind, ServerError, ServerRequest, make_server
from inferq.workers.servers.openai import (
    OpenAIServer,
    error_message,
    retry_after_s,
    sse_data,
    status_error,
)
from tests.fakes.standin_openai import StandIn

SPEC = ModelSpec(
    name="llama-3.1-8b",
    params_b=8,
    weights_mib=15_320,
    kv_bytes_per_token=131_072,
    max_context=32_768,
    cold_start_s=15,
)


@pytest.fixture
def standin() -> Iterator[StandIn]:
    with StandIn() as server:
        yield server


def backend(server: StandIn | str, **options: Any) -> OpenAIServer:
    url = server if isinstance(server, str) else server.url
    return OpenAIServer(SPEC, base_url=url, load_poll_s=0.02, **options)


def prompt_request(
    prompt: str = "hello there", timeout_s: float = 10.0, **params: Any
) -> ServerRequest:
    return ServerRequest(
        id="r1",
        model=SPEC.name,
        payload=Payload(prompt=prompt, params=params),
        max_tokens=16,
        prompt_tokens=3,
        timeout_s=timeout_s,
    )


def chat_request(**params: Any) -> ServerRequest:
    messages = (
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    )
    return ServerRequest(
        id="c1",
        model=SPEC.name,
        payload=Payload(messages=messages, params=params),
        max_tokens=16,
        prompt_tokens=4,
        timeout_s=10.0,
    )


def generate(b: OpenAIServer, request: ServerRequest) -> Any:
    async def go() -> Any:
        try:
            return await b.generate(request, concurrency=1)
        finally:
            await b.close()

    return asyncio.run(go())


def generate_error(b: OpenAIServer, request: ServerRequest) -> ServerError:
    with pytest.raises(ServerError) as info:
        generate(b, request)
    return info.value


# --- answers ------------------------------------------------------------------


def test_prompt_goes_to_completions_and_reads_usage(standin: StandIn) -> None:
    result = generate(backend(standin), prompt_request("say something"))
    assert result.output == "w0 w1 w2 w3 w4"
    assert (result.prompt_tokens, result.completion_tokens) == (7, 5)
    assert result.ttft_s is None
    [post] = standin.posts()
    assert post.path == "/v1/completions"
    assert post.body == {"model": SPEC.name, "prompt": "say something", "max_tokens": 16}


def test_messages_go_to_chat_completions(standin: StandIn) -> None:
    result = generate(backend(standin), chat_request())
    assert result.output == "w0 w1 w2 w3 w4"
    assert (result.prompt_tokens, result.completion_tokens) == (7, 5)
    [post] = standin.posts()
    assert post.path == "/v1/chat/completions"
    assert post.body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert post.body["max_tokens"] == 16


CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
TOOLS = [{"type": "function", "function": {"name": n}} for n, _ in CALLS]


def test_tool_calls_are_read_from_a_plain_answer(standin: StandIn) -> None:
    standin.tool_calls = CALLS
    result = generate(backend(standin), chat_request(tools=TOOLS, tool_choice="required"))
    assert result.output == "" and result.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("id0", "get_weather", '{"city": "Paris"}'),
        ("id1", "get_time", "{}"),
    ]
    [post] = standin.posts()
    assert post.body["tools"] == TOOLS and post.body["tool_choice"] == "required"


def test_streamed_tool_calls_reach_the_sink_piece_by_piece(standin: StandIn) -> None:
    standin.tool_calls = CALLS
    seen: list[tuple[str, str | None, tuple[ToolCallDelta, ...]]] = []

    def sink(
        delta: str, tokens: int, finish: str | None, /, tool_calls: tuple[ToolCallDelta, ...] = ()
    ) -> None:
        seen.append((delta, finish, tool_calls))

    request = dataclasses.replace(chat_request(tools=TOOLS), on_chunk=sink)
    result = generate(backend(standin, stream=True), request)
    assert result.finish_reason == "tool_calls" and result.ttft_s is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("id0", "get_weather", '{"city": "Paris"}'),
        ("id1", "get_time", "{}"),
    ]
    pieces = tuple(p for _, _, calls in seen for p in calls)
    assert tool_calls_of(pieces) == result.tool_calls
    assert pieces[0] == ToolCallDelta(index=0, id="id0", name="get_weather")
    assert seen[-1][1] == "tool_calls"


def test_a_conversation_with_tool_calls_is_sent_in_openais_shape(standin: StandIn) -> None:
    call = ToolCall(id="id0", function=FunctionCall(name="get_weather", arguments="{}"))
    messages = (
        ChatMessage(role="user", content="weather?"),
        ChatMessage(role="assistant", content="", tool_calls=(call,)),
        ChatMessage(role="tool", content="sunny", tool_call_id="id0"),
    )
    request = dataclasses.replace(chat_request(), payload=Payload(messages=messages))
    generate(backend(standin), request)
    [post] = standin.posts()
    assert post.body["messages"] == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "id0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "id0"},
    ]


def test_params_are_forwarded_but_cannot_override_the_backend(standin: StandIn) -> None:
    params: dict[str, Any] = {
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 42,
        "model": "other",
        "max_tokens": 999,
        "sim_output_tokens": 3,
    }
    generate(backend(standin, served_model_name="served-8b"), prompt_request(**params))
    [post] = standin.posts()
    assert post.body == {
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 42,
        "model": "served-8b",
        "max_tokens": 16,
        "prompt": "hello there",
    }


def test_missing_usage_falls_back_to_estimates(standin: StandIn) -> None:
    standin.include_usage = False
    result = generate(backend(standin), prompt_request())
    assert result.output == "w0 w1 w2 w3 w4"  # 14 characters
    assert result.prompt_tokens == 3  # the scheduler's estimate
    assert result.completion_tokens == 4  # ceil(14 / 4 characters per token)


def test_api_key_is_sent_and_never_shown(standin: StandIn) -> None:
    standin.mode = "error"
    b = backend(standin, api_key="sk-secret-123")
    error = generate_error(b, prompt_request())
    [post] = standin.posts()
    assert post.headers["Authorization"] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(b)
    assert "sk-secret" not in str(error)


def test_no_authorization_header_without_a_key(standin: StandIn) -> None:
    generate(backend(standin), prompt_request())
    assert "Authorization" not in standin.posts()[0].headers


def test_concurrent_requests_all_answer(standin: StandIn) -> None:
    b = backend(standin)

    async def go() -> list[Any]:
        async with b:
            return await asyncio.gather(
                *(b.generate(prompt_request(), concurrency=8) for _ in range(8))
            )

    results = asyncio.run(go())
    assert [r.output for r in results] == ["w0 w1 w2 w3 w4"] * 8
    assert len(standin.posts()) == 8


def test_backend_works_across_event_loops(standin: StandIn) -> None:
    b = backend(standin)
    asyncio.run(b.load())
    result = asyncio.run(b.generate(prompt_request(), concurrency=1))  # a new loop
    asyncio.run(b.close())
    assert result.completion_tokens == 5


# --- errors ---------------------------------------------------------------------


def test_slow_answer_is_a_retryable_timeout(standin: StandIn) -> None:
    standin.mode = "slow"
    error = generate_error(backend(standin), prompt_request(timeout_s=0.2))
    assert error.retryable
    assert "timed out after 0.200 s" in str(error)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"error": {"message": "context too long: 9000 > 4096", "type": "invalid"}}, "9000 > 4096"),
        ({"object": "error", "message": "vLLM says: bad stop", "code": 400}, "vLLM says: bad stop"),
        ({"error": "TGI says: inputs too long", "error_type": "validation"}, "TGI says"),
    ],
)
def test_4xx_is_not_retryable_and_carries_the_server_message(
    standin: StandIn, body: Any, message: str
) -> None:
    standin.mode = "error"
    standin.error_status = 400
    standin.error_body = body
    error = generate_error(backend(standin), prompt_request())
    assert not error.retryable
    assert error.status == 400
    assert message in str(error)
    assert "HTTP 400" in str(error)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
def test_5xx_408_and_429_are_retryable(standin: StandIn, status: int) -> None:
    standin.mode = "error"
    standin.error_status = status
    standin.error_body = {"error": {"message": "engine overloaded"}}
    error = generate_error(backend(standin), prompt_request())
    assert error.retryable
    assert error.status == status
    assert "engine overloaded" in str(error)


def test_dropped_connection_is_retryable(standin: StandIn) -> None:
    standin.mode = "drop"
    error = generate_error(backend(standin), prompt_request())
    assert error.retryable
    assert "connection" in str(error)
    assert len(standin.posts()) == 2  # sent once more at once (a stale kept-alive connection)


def test_a_connection_closed_before_the_answer_is_sent_again_at_once(standin: StandIn) -> None:
    """A server that closes a kept-alive connection as the request goes out (llama.cpp
    after a few requests): the request is sent again on a new connection, in the same
    attempt, streamed or not."""
    for stream in (False, True):
        standin.requests.clear()
        standin.mode = "drop"
        standin.fail_posts = 1
        result = asyncio.run(
            backend(standin, stream=stream).generate(prompt_request(), concurrency=1)
        )
        assert result.completion_tokens == standin.completion_tokens
        assert len(standin.posts()) == 2


def test_refused_connection_is_retryable() -> None:
    error = generate_error(backend(f"http://127.0.0.1:{free_port()}"), prompt_request())
    assert error.retryable
    assert "ConnectError" in str(error)


def test_malformed_answer_is_retryable(standin: StandIn) -> None:
    standin.mode = "garbage"
    error = generate_error(backend(standin), prompt_request())
    assert error.retryable
    assert "malformed answer" in str(error)


def test_no_time_left_fails_without_calling_the_server(standin: StandIn) -> None:
    error = generate_error(backend(standin), prompt_request(timeout_s=0.0))
    assert error.retryable
    assert "no time left" in str(error)
    assert standin.posts() == []


def test_error_message_shapes() -> None:
    assert error_message({"error": {"message": "m1"}}) == "m1"
    assert error_message({"error": "m2"}) == "m2"
    assert error_message({"object": "error", "message": "m3"}) == "m3"
    assert error_message({"detail": "x"}) == '{"detail":"x"}'
    assert error_message(["x"]) == '["x"]'


# --- load -------------------------------------------------------------------------


def test_load_waits_while_the_server_is_loading(standin: StandIn) -> None:
    standin.models_unavailable = 3
    asyncio.run(backend(standin).load())
    gets = [r for r in standin.requests if r.method == "GET"]
    assert [g.path for g in gets] == ["/v1/models"] * 4


def test_load_waits_for_a_server_that_starts_later() -> None:
    server = StandIn(port=free_port())
    timer = threading.Timer(0.3, server.start)
    timer.start()
    try:
        asyncio.run(backend(server, load_timeout_s=30).load())
        assert [r.path for r in server.requests] == ["/v1/models"]
    finally:
        timer.join()
        server.stop()


def test_load_gives_up_after_its_bound() -> None:
    # The last check names the refused connection, or says no probe answered yet: on a
    # loaded machine the bound can pass before the first probe (its HTTP client's set-up)
    # finished.
    b = backend(f"http://127.0.0.1:{free_port()}", load_timeout_s=1.0)
    pattern = r"not ready after 1 s \(last check: .*(ConnectError|no answer yet)"
    with pytest.raises(ServerError, match=pattern) as info:
        asyncio.run(b.load())
    assert info.value.retryable


def test_load_fails_at_once_when_the_server_refuses_the_check(standin: StandIn) -> None:
    standin.models_status = 401
    with pytest.raises(ServerError, match=r"HTTP 401.*invalid api key") as info:
        asyncio.run(backend(standin, load_timeout_s=30).load())
    assert not info.value.retryable
    assert len(standin.requests) == 1


def test_load_warns_when_the_model_is_not_listed(
    standin: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    standin.models = ["/models/other.gguf"]
    with caplog.at_level(logging.WARNING, logger="inferq.workers.servers.openai"):
        asyncio.run(backend(standin).load())
    assert "/models/other.gguf" in caplog.text
    assert "set served_model_name" in caplog.text


def test_load_is_quiet_when_the_model_is_listed(
    standin: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="inferq.workers.servers.openai"):
        asyncio.run(backend(standin).load())
    assert caplog.text == ""


# --- streaming ----------------------------------------------------------------------


def test_stream_completion_measures_ttft_and_reads_usage(standin: StandIn) -> None:
    b = backend(standin, stream=True)

    async def go() -> tuple[Any, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        result = await b.generate(prompt_request(), concurrency=1)
        elapsed = loop.time() - start
        await b.close()
        return result, elapsed

    result, elapsed = asyncio.run(go())
    assert result.output == "w0 w1 w2 w3 w4"
    assert (result.prompt_tokens, result.completion_tokens) == (7, 5)
    assert result.ttft_s is not None
    assert 0 <= result.ttft_s <= elapsed
    body = standin.posts()[0].body
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_stream_chat_skips_the_empty_role_chunk(standin: StandIn) -> None:
    standin.include_usage = False
    result = generate(backend(standin, stream="true"), chat_request())
    assert result.output == "w0 w1 w2 w3 w4"
    assert result.completion_tokens == 4  # estimated: no usage chunk
    assert result.ttft_s is not None


def test_stream_4xx_is_not_retryable(standin: StandIn) -> None:
    standin.mode = "error"
    error = generate_error(backend(standin, stream=True), prompt_request())
    assert not error.retryable
    assert "bad request from stand-in" in str(error)


def test_stream_dropped_connection_is_retryable(standin: StandIn) -> None:
    standin.mode = "drop"
    assert generate_error(backend(standin, stream=True), prompt_request()).retryable


def test_sse_parser_joins_data_lines_and_skips_comments() -> None:
    lines = [": comment", "event: message", "data: a", "data:b", "", "", "data: [DONE]"]

    async def feed() -> AsyncIterator[str]:
        for line in lines:
            yield line

    async def collect() -> list[str]:
        return [d async for d in sse_data(feed())]

    assert asyncio.run(collect()) == ["a\nb", "[DONE]"]


# --- construction --------------------------------------------------------------------


def test_make_backend_builds_openai_with_options(standin: StandIn) -> None:
    b = make_server("openai", SPEC, base_url=standin.url + "/", served_model_name="m")
    assert isinstance(b, OpenAIServer)
    assert b.base_url == standin.url
    assert b.served_model_name == "m"


def test_invalid_options_name_the_option() -> None:
    with pytest.raises(ConfigError, match="load_timeout_s: must be >= 0"):
        OpenAIServer(SPEC, load_timeout_s=-1)
    with pytest.raises(ConfigError, match="stream: expected true or false"):
        OpenAIServer(SPEC, stream="maybe")


def test_repr_redacts_credentials_in_the_url() -> None:
    b = OpenAIServer(SPEC, base_url="http://user:pw@127.0.0.1:8000")
    assert "pw" not in repr(b)


# --- failure kinds, truncation, finish reason, probes (issue 13) ---------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (429, FailureKind.INFRASTRUCTURE),
        (502, FailureKind.INFRASTRUCTURE),
        (503, FailureKind.INFRASTRUCTURE),
        (504, FailureKind.INFRASTRUCTURE),
        (500, FailureKind.SERVER),
        (408, FailureKind.SERVER),
        (400, FailureKind.REQUEST),
        (404, FailureKind.REQUEST),
    ],
)
def test_http_failures_are_classified_by_status(
    standin: StandIn, status: int, kind: FailureKind
) -> None:
    standin.mode = "error"
    standin.error_status = status
    assert classify(generate_error(backend(standin), prompt_request())) is kind


def test_retry_after_is_read_from_a_429(standin: StandIn) -> None:
    standin.mode = "error"
    standin.error_status = 429
    standin.retry_after = "2"
    error = generate_error(backend(standin), prompt_request())
    assert error.retry_after_s == 2.0
    assert plan(error, 1).delay_s >= 2.0
    assert not plan(error, 1).spend_attempt


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert retry_after_s("3") == 3.0
    assert retry_after_s(" 0 ") == 0.0
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0


def test_refused_connection_is_an_infrastructure_failure() -> None:
    error = generate_error(backend(f"http://127.0.0.1:{free_port()}"), prompt_request())
    assert classify(error) is FailureKind.INFRASTRUCTURE


def test_dropped_connection_before_the_answer_is_an_infrastructure_failure(
    standin: StandIn,
) -> None:
    standin.mode = "drop"
    assert (
        classify(generate_error(backend(standin), prompt_request())) is FailureKind.INFRASTRUCTURE
    )


def test_a_stream_cut_off_before_its_finish_is_truncated_not_a_success(standin: StandIn) -> None:
    standin.mode = "truncate"
    error = generate_error(backend(standin, stream=True), prompt_request())
    assert error.retryable
    assert classify(error) is FailureKind.TRUNCATED
    assert plan(error, 1).spend_attempt


def test_a_chat_stream_cut_off_is_truncated(standin: StandIn) -> None:
    standin.mode = "truncate"
    error = generate_error(backend(standin, stream=True), chat_request())
    assert classify(error) is FailureKind.TRUNCATED


def test_a_200_with_an_empty_body_is_truncated(standin: StandIn) -> None:
    standin.mode = "truncate"
    error = generate_error(backend(standin), prompt_request())
    assert classify(error) is FailureKind.TRUNCATED
    assert "empty body" in str(error)


def test_a_cut_off_stream_does_not_poison_the_next_request_on_the_pool(
    standin: StandIn,
) -> None:
    standin.mode = "truncate"
    standin.fail_posts = 1
    b = backend(standin, stream=True)

    async def go() -> tuple[BaseException | None, Any]:
        try:
            first: BaseException | None = None
            try:
                await b.generate(prompt_request(), concurrency=1)
            except ServerError as exc:
                first = exc
            return first, await b.generate(prompt_request(), concurrency=1)
        finally:
            await b.close()

    first, second = asyncio.run(go())
    assert isinstance(first, ServerError)
    assert second.output == "w0 w1 w2 w3 w4"
    assert second.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_finish_reason_is_recorded(standin: StandIn, stream: bool) -> None:
    standin.completion_tokens = 40
    result = generate(backend(standin, stream=stream), prompt_request())
    assert result.finish_reason == "length"
    standin.completion_tokens = 3
    result = generate(backend(standin, stream=stream), chat_request())
    assert result.finish_reason == "stop"


def test_estimated_completion_tokens_never_exceed_max_tokens(standin: StandIn) -> None:
    standin.include_usage = False
    standin.completion_tokens = 16
    result = generate(backend(standin), prompt_request())  # 16 words ~ 30 chars ~ 8 tokens
    assert result.completion_tokens <= 16
    long = ServerRequest(
        id="r2",
        model=SPEC.name,
        payload=Payload(prompt="x"),
        max_tokens=2,
        prompt_tokens=1,
        timeout_s=10.0,
    )
    standin.completion_tokens = 2
    assert generate(backend(standin), long).completion_tokens <= 2


def test_probe_passes_on_a_healthy_server_and_fails_on_a_dead_one(standin: StandIn) -> None:
    async def probe(b: OpenAIServer) -> ServerError | None:
        try:
            return await b.probe()
        finally:
            await b.close()

    assert asyncio.run(probe(backend(standin))) is None
    probe_post = standin.posts()[-1]
    assert probe_post.body["max_tokens"] == 1
    standin.mode = "error"
    standin.error_status = 500
    error = asyncio.run(probe(backend(standin)))
    assert error is not None and error.status == 503  # /health said so first
    dead = asyncio.run(probe(backend(f"http://127.0.0.1:{free_port()}")))
    assert dead is not None and classify(dead) is FailureKind.INFRASTRUCTURE


def test_probe_passes_on_a_server_that_refuses_the_probe_itself(standin: StandIn) -> None:
    """A chat-only server (404 on ``/v1/completions``) is up: a 4xx but 408/429 from the
    probe's request is no outage; a 429 is."""

    async def probe(b: OpenAIServer) -> ServerError | None:
        try:
            return await b.probe()
        finally:
            await b.close()

    standin.not_found_paths = {"/v1/completions"}
    assert asyncio.run(probe(backend(standin))) is None
    standin.not_found_paths = set()
    standin.mode = "error"
    standin.error_status = 429
    error = asyncio.run(probe(backend(standin)))
    assert error is not None and error.status == 429


@pytest.mark.parametrize("stream", [False, True])
def test_a_silent_answer_from_a_live_server_is_waited_for(standin: StandIn, stream: bool) -> None:
    """Silence alone (a long prefill, a non-streamed answer) is no failure: the server's
    /health answers, so the request goes on."""
    standin.mode, standin.delay_s = "slow", 1.0
    result = generate(backend(standin, stall_s=0.2, stream=stream), prompt_request())
    assert result.output == "w0 w1 w2 w3 w4"
    assert any(r.path == "/health" for r in standin.requests)


def test_a_hung_server_is_an_infrastructure_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts connections and never answers (SIGSTOP: the kernel still
    completes handshakes into the backlog): the request fails soon after ``stall_s`` as an
    infrastructure failure, not at its deadline."""
    monkeypatch.setattr("inferq.defaults.HEALTH_PROBE_TIMEOUT_S", 0.3)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # never accepted
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        started = time.monotonic()
        error = generate_error(backend(url, stall_s=0.3), prompt_request(timeout_s=30))
    assert time.monotonic() - started < 5
    assert classify(error) is FailureKind.INFRASTRUCTURE
    assert "the server hangs" in str(error)


class _HugeAnswer(BaseHTTPRequestHandler):
    """Answers every POST 200 with a completion of ``HUGE_BYTES`` of text (a server that
    ignores max_tokens, or a proxy that loops), streamed or not."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = "x" * HUGE_BYTES
        self.send_response(200)
        if body.get("stream"):
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = json.dumps({"choices": [{"index": 0, "text": text}]})
            with contextlib.suppress(OSError):
                self.wfile.write(f"data: {chunk}\n\n".encode())
            return
        data = json.dumps({"choices": [{"text": text, "finish_reason": "stop"}]}).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(data)


HUGE_BYTES = 40 * 1024 * 1024


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_far_larger_than_max_tokens_allows_is_refused(stream: bool) -> None:
    """A 200 whose body is 40 MiB for a 16-token request (issue 13 attack): it was read
    whole and recorded as the request's output (40 MiB in Redis, completion_tokens 16).
    Reading stops at ``answer_limit_bytes``; the answer is a server failure."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HugeAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        error = generate_error(backend(url, stream=stream), prompt_request())
    finally:
        server.shutdown()
        server.server_close()
    assert classify(error) is FailureKind.SERVER
    assert "larger than" in str(error)


def test_an_http_date_retry_after_is_judged_on_the_servers_date(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Retry-After`` as an HTTP date is relative to the server's clock; read against the
    worker's, a worker 15 s ahead ignored a 10 s wait (issue 13 attack). The answer's
    ``Date`` header is the reference when it has one."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 15.0)
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/completions")
    server_now = real()
    headers = {
        "Date": email.utils.formatdate(server_now, usegmt=True),
        "Retry-After": email.utils.formatdate(server_now + 10, usegmt=True),
    }
    response = httpx.Response(503, headers=headers, request=request, json={"error": "busy"})
    error = status_error("r1", response)
    assert error.retry_after_s is not None
    assert 9.0 <= error.retry_after_s <= 11.0, error.retry_after_s


class _EmptyAnswer(BaseHTTPRequestHandler):
    """200 with no text and no finish reason: a stream of only ``data: [DONE]``, or a
    completion whose choice has empty text and no ``finish_reason``."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("stream"):
            data = b"data: [DONE]\n\n"
            content_type = "text/event-stream"
        else:
            data = json.dumps({"choices": [{"index": 0, "text": ""}]}).encode()
            content_type = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_answer_without_a_finish_reason_is_truncated(stream: bool) -> None:
    """Nothing generated and no finish reason: no answer at all, though well-formed (issue
    13 attack: a stream of only ``[DONE]`` was recorded as a success with empty output).
    A real empty answer names its finish reason (``stop``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EmptyAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        error = generate_error(backend(url, stream=stream), prompt_request())
    finally:
        server.shutdown()
        server.server_close()
    assert classify(error) is FailureKind.TRUNCATED


@pytest.mark.parametrize("name", ["n_predict", "max_completion_tokens", "max_tokens"])
def test_params_cannot_lift_the_answer_past_max_tokens(name: str) -> None:
    """``n_predict: 64`` beside ``max_tokens: 8`` made llama.cpp answer 64 tokens: it
    reads ``n_predict`` before ``max_tokens`` (found through the gateway, issue 14)."""
    from inferq.workers.servers.openai import build_body

    _, body = build_body(chat_request(**{name: 100_000}), "served", stream=False)
    assert body["max_tokens"] == 16
    assert all(body.get(k) in (None, 16) for k in ("n_predict", "max_completion_tokens"))
