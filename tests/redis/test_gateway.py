"""``inferq gateway`` with the official OpenAI SDK: gateway + dispatcher + sim workers + Redis.

The real llama.cpp server's turn (streaming, and a dropped client stopping generation
on the server) is in ``test_gateway_llm.py``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferq.config import Settings
from inferq.store import Store

from ..helpers import wait_for
from .fleet import Fleet
from .gateway_server import GatewayServer

MODEL = "llama-3.1-8b"
KEYS = """
[keys."sk-acme"]
tenant = "acme"
classes = ["realtime", "standard"]
default_class = "standard"

[keys."sk-batch"]
tenant = "nightly"
classes = ["batch"]
default_class = "batch"
requests_per_minute = 2
"""


@pytest.fixture
def gateway(fast_settings: Settings, tmp_path: Path) -> Iterator[GatewayServer]:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with GatewayServer(fast_settings, keys) as g:
        yield g


def sdk(gateway: GatewayServer, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key=key, max_retries=0, timeout=30)


def spend_the_batch_keys_minute(
    gateway: GatewayServer, messages: list[dict[str, str]]
) -> pytest.ExceptionInfo[openai.RateLimitError]:
    """Send ``sk-batch``'s 2 requests of the minute, then the third: its refusal."""
    batch = sdk(gateway, "sk-batch")
    for _ in range(2):
        batch.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body={"sim_output_tokens": 1}
        )
    with pytest.raises(openai.RateLimitError) as limited:
        batch.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    return limited


def test_chat_and_completions_with_the_sdk(fleet: Fleet, gateway: GatewayServer) -> None:
    fleet.worker("w1", time_scale=0.0)
    client = sdk(gateway)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_body={"sim_output_tokens": 5},
    )
    assert chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content.split()) == 5
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5
    text = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=8, extra_body={"sim_output_tokens": 3}
    )
    assert text.object == "text_completion"
    assert len(text.choices[0].text.split()) == 3 and text.choices[0].finish_reason == "stop"


def test_a_streamed_chat_arrives_chunk_by_chunk(fleet: Fleet, gateway: GatewayServer) -> None:
    fleet.worker("w1", time_scale=20.0)  # 30 tokens: about a second of decoding
    client = sdk(gateway)
    started = time.time()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"sim_output_tokens": 30},
    )
    arrivals: list[float] = []
    parts: list[str] = []
    finish = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            delta = chunk.choices[0].delta.content
            if delta:
                arrivals.append(time.time())
                parts.append(delta)
            finish = chunk.choices[0].finish_reason or finish
    ended = time.time()
    assert len(parts) >= 10 and len("".join(parts).split()) == 30
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 30
    assert arrivals[0] < ended - 0.3  # the first token came well before the end
    assert arrivals[0] - started < ended - started


def test_curl_style_sse_and_the_other_endpoints(fleet: Fleet, gateway: GatewayServer) -> None:
    fleet.worker("w1", time_scale=0.0)
    headers = {"Authorization": "Bearer sk-acme"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True, "sim_output_tokens": 3}
    with httpx.stream(
        "POST", f"{gateway.url}/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events).split().__len__() == 3
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    models = httpx.get(f"{gateway.url}/models", headers=headers).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{gateway.root}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{gateway.root}/metrics").text
    assert 'inferq_gateway_requests_total{code="200",endpoint="completions"}' in metrics


def test_refusals_use_the_openai_error_body(fleet: Fleet, gateway: GatewayServer) -> None:
    fleet.worker("w1", time_scale=0.0)
    client = sdk(gateway)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as unknown_key:
        sdk(gateway, "sk-nope").chat.completions.create(model=MODEL, messages=messages)
    assert unknown_key.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert "max_tokens" in bad.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers={"X-Inferq-Priority": "batch"}
        )
    assert denied.value.body["param"] == "X-Inferq-Priority"  # type: ignore[index]
    with pytest.raises(openai.InternalServerError) as unavailable:  # 503: no worker, no pool
        client.chat.completions.create(model="llama-3.1-70b-awq", messages=messages)
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["code"] == "model_unavailable"  # type: ignore[index]
    limited = spend_the_batch_keys_minute(gateway, messages)
    assert limited.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60


def test_each_refusal_raises_the_sdk_exception_openai_would(
    fleet: Fleet, gateway: GatewayServer
) -> None:
    """Issue 26: an unknown model was a 400 listing models nobody serves, an over-context
    chat named ``param: "prompt"`` with ``code: null``, and most refusals had no code.
    Each is now OpenAI's status (so the SDK's exception class), param and code."""
    fleet.worker("w1", time_scale=0.0)
    client = sdk(gateway)
    messages = [{"role": "user", "content": "hi"}]
    long_chat = [{"role": "user", "content": "word " * 5000}]  # ~5000 tokens > 4096
    cases: list[tuple[dict[str, Any], type[openai.APIStatusError], str | None, str]] = [
        ({"model": "gpt-4o"}, openai.NotFoundError, "model", "model_not_found"),
        ({"model": ">=900b"}, openai.NotFoundError, "model", "model_not_found"),
        (
            {"model": "llama-2-13b", "messages": long_chat},
            openai.BadRequestError,
            "messages",
            "context_length_exceeded",
        ),
        (
            {
                "model": "llama-2-13b",
                "max_tokens": 4000,
                "messages": [{"role": "user", "content": "word " * 200}],
            },
            openai.BadRequestError,
            "messages",
            "context_length_exceeded",
        ),
        ({"temperature": 5}, openai.BadRequestError, "temperature", "invalid_value"),
        ({"extra_body": {"echo": True}}, openai.BadRequestError, "echo", "unsupported_parameter"),
        (
            {"extra_headers": {"X-Inferq-Priority": "batch"}},
            openai.PermissionDeniedError,
            "X-Inferq-Priority",
            "class_not_allowed",
        ),
    ]
    for fields, error, param, code in cases:
        call = {"model": MODEL, "messages": messages, "max_tokens": 4, **fields}
        with pytest.raises(error) as refused:
            client.chat.completions.create(**call)
        assert refused.value.param == param, (fields, refused.value.body)
        assert refused.value.code == code, (fields, refused.value.body)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert unknown.value.type == "invalid_request_error"
    served = [m.id for m in client.models.list()]
    assert served == [MODEL]
    # the message lists what /v1/models lists, not the whole registry
    assert f"served now: {MODEL} " in unknown.value.message
    assert "llama-2-13b" not in unknown.value.message
    with pytest.raises(openai.BadRequestError) as over:
        client.chat.completions.create(model="llama-2-13b", messages=long_chat)
    assert "estimate" in over.value.message  # the count is not the model's tokenizer's
    with pytest.raises(openai.BadRequestError) as over_text:
        client.completions.create(model="llama-2-13b", prompt="word " * 5000)
    assert (over_text.value.param, over_text.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(openai.AuthenticationError) as unknown_key:
        sdk(gateway, "sk-nope").chat.completions.create(model=MODEL, messages=messages)
    assert (unknown_key.value.type, unknown_key.value.code) == (
        "invalid_request_error",
        "invalid_api_key",
    )
    limited = spend_the_batch_keys_minute(gateway, messages)
    assert (limited.value.type, limited.value.code) == ("requests", "rate_limit_exceeded")
    response = httpx.post(
        f"{gateway.url}/chat/completions",
        content=b"{nope",
        headers={"Authorization": "Bearer sk-acme"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_a_deadline_that_passes_in_the_queue_is_a_504(
    fleet: Fleet, gateway: GatewayServer, store: Store
) -> None:
    fleet.worker("w1", time_scale=50.0, slots=1)
    client = sdk(gateway)
    messages = [{"role": "user", "content": "hi"}]
    import threading

    def keep_busy() -> None:  # holds the only slot; its own answer does not matter here
        with contextlib.suppress(openai.APIError):
            sdk(gateway).chat.completions.create(
                model=MODEL, messages=messages, max_tokens=40, extra_body={"sim_output_tokens": 40}
            )

    busy = threading.Thread(target=keep_busy)
    busy.start()
    wait_for(lambda: bool(store.held_by("w1")), 30, "the busy request holding the only slot")
    with pytest.raises(openai.APIStatusError) as late:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            extra_headers={"X-Inferq-Timeout": "0.5"},
        )
    assert late.value.status_code == 504
    assert late.value.body["code"] == "deadline_exceeded"  # type: ignore[index]
    busy.join(timeout=60)


def test_a_client_that_hangs_up_cancels_its_running_request(
    fleet: Fleet, gateway: GatewayServer, store: Store, fast_settings: Settings
) -> None:
    fleet.worker("w1", time_scale=50.0, slots=1)  # 60 tokens: several seconds of decoding
    client = sdk(gateway)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=60,
        stream=True,
        extra_body={"sim_output_tokens": 60},
    )
    got = next(iter(stream))
    rid = got.id.removeprefix("chatcmpl-")
    stream.close()  # the SDK closes the HTTP response mid-answer
    wait_for(
        lambda: store.redis.hget(store.keys.req(rid), "state") == "cancelled",
        what="the request cancelled",
        timeout=10,
    )
    record = store.record(rid)
    assert record.result is not None and record.result.error is not None
    assert "disconnected" in record.result.error or "cancelled" in record.result.error
    # Its slot is free: the next request runs on the one-slot worker at once.
    quick = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"sim_output_tokens": 2},
    )
    assert quick.choices[0].finish_reason == "length"


def test_hostile_bodies_and_headers_are_400s_not_crashes(gateway: GatewayServer) -> None:
    """Each was a 500 (an uncaught RecursionError, OverflowError, ValueError)."""
    headers = [(b"authorization", b"Bearer sk-acme"), (b"content-type", b"application/json")]
    url = f"{gateway.url}/chat/completions"
    deep = b"[" * 100_000 + b"]" * 100_000
    huge_timeout = (
        b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "timeout": 1'
        + b"0" * 400
        + b"}"
    )
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    superscript = [*headers, (b"x-inferq-priority", "\u00b2".encode("latin-1"))]
    for content, sent, param in [
        (deep, headers, None),
        (huge_timeout, headers, "timeout"),
        (body, superscript, "X-Inferq-Priority"),
    ]:
        response = httpx.post(url, content=content, headers=sent, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_a_body_over_the_limit_is_a_413_before_it_is_read(
    fast_settings: Settings, gateway: GatewayServer
) -> None:
    """A 40 MB body was read and decoded whole (about 3x its size in memory) before
    intake refused the prompt; now it is refused by its length, declared or received."""
    from inferq.gateway.app import max_body_bytes

    limit = max_body_bytes(fast_settings)
    prefix = b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "'
    big = prefix + b"a" * (limit + 1) + b'"}]}'
    headers = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}
    url = f"{gateway.url}/chat/completions"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    for content in (big, chunked()):
        response = httpx.post(url, content=content, headers=headers, timeout=60)
        assert response.status_code == 413, response.text[:200]
        error = response.json()["error"]
        assert error["param"] == "body" and error["code"] == "request_too_large"
        assert str(limit) in error["message"]


def test_unknown_paths_and_methods_answer_the_openai_error_body(gateway: GatewayServer) -> None:
    """Starlette's own 404 and 405 were plain text, which OpenAI clients cannot parse."""
    headers = {"Authorization": "Bearer sk-acme"}
    for method, path, status in [
        ("GET", "/nope", 404),
        ("GET", "/chat/completions", 405),
        ("POST", "/models", 405),
    ]:
        response = httpx.request(method, f"{gateway.url}{path}", headers=headers, timeout=30)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]


def test_a_client_that_stalls_mid_body_gets_a_408(
    gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sent part of its body and stopped held its connection for ever."""
    import socket

    from inferq.gateway import app

    monkeypatch.setattr(app, "BODY_READ_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer sk-acme\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model"'
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == "body" and error["code"] == "request_timeout"


def test_header_numbers_must_be_plain_decimals(gateway: GatewayServer) -> None:
    """``X-Inferq-Timeout: 1_0`` was a 10 s deadline (Python's float() takes digit
    separators, exponents, ``inf`` and non-ASCII digits); a header number is digits with
    an optional decimal part, and anything else is a 400 naming the header and the form."""
    headers = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for value in ("1_0", "1e1", "inf", "nan", "0x10", "+5", "-5", "10.", ".5"):
        response = httpx.post(
            f"{gateway.url}/chat/completions",
            json=body,
            headers={**headers, "X-Inferq-Timeout": value},
            timeout=30,
        )
        assert response.status_code == 400, (value, response.text)
        error = response.json()["error"]
        assert error["param"] == "X-Inferq-Timeout", value
        assert "X-Inferq-Timeout" in error["message"] and "plain decimal" in error["message"]


def test_every_refusal_names_the_field_the_caller_sent(gateway: GatewayServer) -> None:
    """``max_completion_tokens: "x"`` was refused naming ``max_tokens`` (intake's name for
    it); a header's value, or a sampling field refused as part of ``params``, was named
    by inferq's field too. The error's param and message name what the caller sent."""
    headers = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    deep: Any = 1
    for _ in range(40):  # nested deeper than intake's limit on params (32)
        deep = [deep]
    for extra, sent_headers, param in [
        ({"max_completion_tokens": "x"}, {}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, {}, "max_completion_tokens"),
        ({"max_completion_tokens": 10**9, "max_tokens": 5}, {}, "max_completion_tokens"),
        ({"max_tokens": "x"}, {}, "max_tokens"),
        ({"priority": "nope"}, {}, "priority"),
        ({}, {"X-Inferq-Priority": "nope"}, "X-Inferq-Priority"),
        ({"timeout": 10**7}, {}, "timeout"),
        ({}, {"X-Inferq-Timeout": "10000000"}, "X-Inferq-Timeout"),
        ({"stop": "s" * 20_000}, {}, "stop"),
        ({"user": "\ud800"}, {}, "user"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, {}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b\x00"}]},
            {},
            "messages[1].content",
        ),
        ({"metadata": {"a": deep}, "stop": "s" * 100}, {}, "metadata"),
    ]:
        response = httpx.post(
            f"{gateway.url}/chat/completions",
            content=json.dumps({**base, **extra}),
            headers={**headers, **sent_headers},
            timeout=30,
        )
        assert response.status_code == 400, (extra, sent_headers, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (extra, sent_headers, error)
        assert error["message"].startswith(f"{param}: "), error["message"]


def test_a_model_servers_400_reaches_the_caller_as_a_400(
    fleet: Fleet, gateway: GatewayServer, store: Store
) -> None:
    """A field inferq does not check (``top_k: "x"``) that the model server refuses with a
    400 came back as a 500 ``generation_failed`` carrying inferq's internal error text.
    It is the caller's error: a 400 with the server's own message, run once, not
    retried, not dead-lettered, and the worker stays ready."""
    from tests.fakes.standin_openai import StandIn

    from .test_worker_failures import openai_worker

    said = "top_k: must be an integer"
    body = {"error": {"message": said, "type": "invalid_request_error", "code": 400}}
    with StandIn(mode="error", error_status=400, error_body=body) as server:
        openai_worker(fleet, "w1", server.url)
        client = sdk(gateway)
        messages = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=4,
                    stream=stream,
                    extra_body={"top_k": "x"},
                )
            error = refused.value.body
            assert refused.value.status_code == 400
            assert error["message"] == said, error  # type: ignore[index]
            assert error["type"] == "invalid_request_error"  # type: ignore[index]
            assert error["code"] == "rejected_by_model_server"  # type: ignore[index]
        posts = [r for r in server.requests if r.method == "POST"]
        assert len(posts) == 2  # one each: never retried
        assert all(r.body.get("top_k") == "x" for r in posts)
        assert store.dead_letters() == []
        assert fleet.state("w1") == "ready"
        stats = store.redis.hgetall(store.keys.stats)
        assert "retried" not in stats and stats.get("failed") == "2", stats


def test_a_resent_chat_reports_the_prompt_tokens_its_server_reused(
    fleet: Fleet, gateway: GatewayServer
) -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: the sim backend keeps a
    prefix cache as a real server does and says what it reused (issue 22)."""
    fleet.worker("w1", time_scale=0.0)
    client = sdk(gateway)
    messages = [{"role": "system", "content": "You answer briefly. " * 200}]
    messages.append({"role": "user", "content": "hi"})
    usage = []
    for _ in range(2):
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"sim_output_tokens": 2}
        )
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        usage.append(chat.usage)
    assert usage[0].prompt_tokens_details.cached_tokens == 0  # a cold cache
    assert 0 < usage[1].prompt_tokens_details.cached_tokens <= usage[1].prompt_tokens
    assert usage[1].prompt_tokens_details.cached_tokens >= usage[1].prompt_tokens // 2
