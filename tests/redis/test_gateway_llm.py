"""``inferq gateway`` on the real model server: the OpenAI SDK -> gateway -> Redis ->
dispatcher -> worker -> llama.cpp (SmolLM2-135M), streaming and not, and a client that
closes its stream mid-answer stopping the generation on the server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from inferq.config import Settings
from inferq.store import Store

from ..helpers import wait_for
from .gateway_server import GatewayServer
from .llm_server import MODEL
from .test_real_server import Stack


@pytest.fixture
def stack(fast_settings: Settings, redis_client: Any, llama_server_url: str) -> Iterator[Stack]:
    s = Stack(fast_settings, Store(redis_client, fast_settings), llama_server_url)
    yield s
    s.close()


@pytest.fixture
def gateway(fast_settings: Settings) -> Iterator[GatewayServer]:
    with GatewayServer(fast_settings, None) as g:  # open: every caller is the default tenant
        yield g


@pytest.fixture
def llama(llama_server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llama_server_url, trust_env=False, timeout=30) as http:
        yield http


def sdk(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=60)


def test_the_sdk_streams_and_not_through_the_gateway(stack: Stack, gateway: GatewayServer) -> None:
    stack.worker("w1")
    client = sdk(gateway)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].message.content
    assert plain.usage is not None and plain.usage.completion_tokens == 12
    assert plain.choices[0].finish_reason == "length"
    started = time.time()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    arrivals, parts, usage, finish = [], [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            if chunk.choices[0].delta.content:
                arrivals.append(time.time())
                parts.append(chunk.choices[0].delta.content)
    ended = time.time()
    assert len(parts) > 5 and finish == "length"
    assert usage is not None and usage.completion_tokens == 48
    assert started < arrivals[0] < ended  # the first token arrived before the answer ended
    assert arrivals[0] < arrivals[-1]


def test_closing_the_stream_stops_generation_on_the_server(
    stack: Stack, gateway: GatewayServer, llama: httpx.Client, fast_settings: Settings
) -> None:
    stack.worker("w1")
    client = sdk(gateway)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a very long story about a dragon."}],
        max_tokens=400,  # many seconds of decoding on a CPU
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    next(chunks)
    assert any(s["is_processing"] for s in llama.get("/slots").json())
    stream.close()
    closed = time.time()
    wait_for(
        lambda: not any(s["is_processing"] for s in llama.get("/slots").json()),
        what="llama.cpp's slots idle",
        timeout=10,
    )
    idle_after = time.time() - closed
    rid = first.id.removeprefix("chatcmpl-")
    store = stack.store
    wait_for(
        lambda: store.redis.hget(store.keys.req(rid), "state") == "cancelled",
        what="the request cancelled",
        timeout=10,
    )
    # The worker's slot is free within one heartbeat of the cancel (and the server idle).
    wait_for(
        lambda: store.redis.hget(store.keys.worker("w1"), "in_flight") == "0",
        what="the worker's slot free",
        timeout=fast_settings.heartbeat_interval_s * 3 + 2,
    )
    assert idle_after < 5


def test_the_servers_own_400_reaches_the_sdk_as_a_400(
    stack: Stack, gateway: GatewayServer, store: Store
) -> None:
    """llama.cpp refuses ``top_k: "x"`` (a field inferq passes on unchecked) with a 400;
    the caller got a 500 with inferq's internal error text. Now a 400 with the server's
    own message, streamed or not, and the request failed once, never retried."""
    stack.worker("w1")
    client = sdk(gateway)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=stream,
                extra_body={"top_k": "x"},
            )
        error = refused.value.body
        assert error["code"] == "rejected_by_model_server", error  # type: ignore[index]
        assert "top_k" in error["message"] and "openai:" not in error["message"]  # type: ignore[index]
    stats = store.redis.hgetall(store.keys.stats)
    assert stats.get("failed") == "2" and "retried" not in stats, stats
    assert store.dead_letters() == []


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_response_format_reaches_llamacpps_grammar(stack: Stack, gateway: GatewayServer) -> None:
    """``response_format`` travels to the server, whose grammar holds the model to the
    schema (SmolLM2-135M alone writes prose), streamed and not."""
    stack.worker("w1")
    client = sdk(gateway)
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, response_format=schema
    )
    assert isinstance(json.loads(plain.choices[0].message.content or "")["city"], str)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, response_format=schema, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text)["city"], str)


def test_a_tool_conversation_is_taken_by_llamacpp(stack: Stack, gateway: GatewayServer) -> None:
    """The tools and a conversation with an assistant's tool call and the tool's answer
    reach the server in OpenAI's shape (``content: null`` beside ``tool_calls``, the
    ``tool_call_id``): it answers them (SmolLM2's own chat template renders no tools, so
    the model answers in text, and the tool's answer is in its prompt)."""
    stack.worker("w1")
    client = sdk(gateway)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    asked = client.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=4, extra_body={"ignore_eos": True}
    )
    tooled = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert asked.usage is not None and tooled.usage is not None
    assert tooled.usage.completion_tokens == 4
    assert tooled.choices[0].message.content or tooled.choices[0].message.tool_calls
    assert tooled.usage.prompt_tokens > asked.usage.prompt_tokens + 5  # the tool's turn


def test_n_choices_on_llamacpp(stack: Stack, gateway: GatewayServer) -> None:
    stack.worker("w1")
    client = sdk(gateway)
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        n=2,
        max_tokens=6,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.usage is not None and plain.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        n=2,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finishes, usage = {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 12
