"""Tools, ``response_format`` and ``n`` through the gateway with the official OpenAI SDK:
gateway + dispatcher + sim workers + Redis (issue 26).

The sim model server calls the tool ``tool_choice`` forces (see
:class:`~inferq.workers.servers.sim.SimServer`); the real llama.cpp server's turn is in
``test_gateway_llm.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from inferq.config import Settings
from inferq.intake import MAX_PARAMS_BYTES
from inferq.store import Store
from inferq.tools import MAX_TOOLS, MAX_TOOLS_BYTES

from ..helpers import wait_for
from .fleet import Fleet
from .gateway_server import GatewayServer

MODEL = "llama-3.1-8b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(fast_settings: Settings, fleet: Fleet, tmp_path: Path) -> Iterator[openai.OpenAI]:
    fleet.worker("w1", time_scale=0.0)
    with GatewayServer(fast_settings, None) as gateway:
        yield openai.OpenAI(base_url=gateway.url, api_key="none", max_retries=0, timeout=30)


def test_a_forced_tool_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[TIME, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=50,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "value", "days": 1}
    assert call.id.startswith("call_")
    assert chat.usage is not None and chat.usage.completion_tokens >= 1

    # the conversation goes on with the tool's answer: the messages travel as OpenAI's
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
        ],
        tools=[TIME, WEATHER],
        max_tokens=5,
        extra_body={"sim_output_tokens": 3},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.tool_calls is None
    assert len((answer.choices[0].message.content or "").split()) == 3


def test_a_streamed_tool_call_arrives_in_openais_chunk_shape(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[Any] = []
    texts: list[str | None] = []
    finish = None
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces += choice.delta.tool_calls or []
            if choice.delta.tool_calls:
                texts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert texts and all(t is None for t in texts)  # no text beside the calls, as OpenAI's
    assert usage is not None and usage.completion_tokens >= 1
    assert pieces[0].index == 0 and pieces[0].id and pieces[0].type == "function"
    assert pieces[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == {"city": "value", "days": 1}

    # the SDK's own accumulator puts the pieces together
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=50
    ) as helper:
        final = helper.get_final_completion()
    [call] = final.choices[0].message.tool_calls or []
    assert not final.choices[0].message.content
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "value", "days": 1}


def test_tools_the_model_may_skip_and_a_json_response_format(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="auto",
        parallel_tool_calls=False,
        response_format={"type": "json_object"},
        max_tokens=10,
        extra_body={"sim_output_tokens": 4},
    )
    choice = chat.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert len(json.loads(choice.message.content or "")["text"].split()) == 4


def test_n_choices_are_served_as_n_requests(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, n=3, max_tokens=4, extra_body={"sim_output_tokens": 4}
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(len((c.message.content or "").split()) == 4 for c in chat.choices)
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    one = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert one.usage is not None and chat.usage.prompt_tokens == 3 * one.usage.prompt_tokens

    text = client.completions.create(
        model=MODEL, prompt="Once", n=2, max_tokens=3, extra_body={"sim_output_tokens": 3}
    )
    assert sorted(c.index for c in text.choices) == [0, 1]


def test_n_streamed_choices_interleave_each_with_its_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        n=3,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"sim_output_tokens": 5},
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    roles: dict[int, int] = {}
    usage = None
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles[choice.index] = roles.get(choice.index, 0) + (choice.delta.role is not None)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert len(ids) == 1  # one response
    assert sorted(texts) == [0, 1, 2] and all(len(t.split()) == 5 for t in texts.values())
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert roles == {0: 1, 1: 1, 2: 1}  # the role once per choice
    assert usage is not None and usage.completion_tokens == 15

    # and n streamed tool calls: each choice its own call
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, tools=[WEATHER], tool_choice="required", stream=True
    )
    arguments: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                arguments[choice.index] = arguments.get(choice.index, "") + (
                    piece.function.arguments or ""
                )
    assert sorted(arguments) == [0, 1]
    assert all(json.loads(a) == {"city": "value", "days": 1} for a in arguments.values())


def big_tools() -> list[dict[str, Any]]:
    """Tools whose JSON is over MAX_TOOLS_BYTES, in fewer than MAX_TOOLS tools."""
    size = MAX_TOOLS_BYTES // 10 + 1
    return [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * size}}
        for i in range(10)
    ]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": big_tools()}, "tools", f"exceeds the limit of {MAX_TOOLS_BYTES} bytes"),
        (
            {"tools": [TIME] * (MAX_TOOLS + 1)},
            "tools",
            f"{MAX_TOOLS + 1} tools exceeds the limit of {MAX_TOOLS}",
        ),
        ({"tools": {"type": "function"}}, "tools", "non-empty list"),
        ({"tools": [{"type": "code", "function": {}}]}, "tools[0].type", "'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
            "1-64 letters",
        ),
        (
            {"tools": [TIME, TIME]},
            "tools[1].function.name",
            "declared twice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
            "an object",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be one of"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
            "not a declared tool (declared: get_weather)",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "1-64 letters",
        ),
        ({"n": 0}, "n", "outside 1..16"),
        ({"n": 17}, "n", "outside 1..16"),
        ({"n": 2.0}, "n", "must be an integer"),
    ],
)
def test_bad_tools_and_n_are_refused_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=fields)
    error = refused.value.body
    assert isinstance(error, dict)
    assert refused.value.status_code == 400 and error["param"] == param, error
    assert says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_tools_limit_is_apart_from_the_other_parameters(client: openai.OpenAI) -> None:
    """Tools over the 16 KiB of the other parameters (and under their own 64 KiB) pass."""
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 4000}}
        for i in range(8)
    ]
    assert len(json.dumps(tools)) > MAX_PARAMS_BYTES
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, max_tokens=5, extra_body={"sim_output_tokens": 2}
    )
    assert chat.choices[0].finish_reason == "stop"
    # and the tools' JSON counts in the prompt: the server renders it there
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert chat.usage is not None and plain.usage is not None
    assert chat.usage.prompt_tokens > plain.usage.prompt_tokens + 32_000 // 8


def test_a_failed_choice_fails_the_body(client: openai.OpenAI) -> None:
    """The model server refuses every choice (the sim's 400 for a bad parameter): one
    400 with the server's message, not a partial answer."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                n=3,
                max_tokens=4,
                stream=stream,
                extra_body={"sim_output_tokens": -1},
            )
        assert refused.value.code == "rejected_by_model_server"
        assert "sim_output_tokens must be an integer >= 0" in refused.value.message


def test_tools_with_a_prompt_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL, prompt="Once", max_tokens=3, extra_body={"tools": [WEATHER]}
        )
    assert refused.value.param == "tools"
    assert "only chat messages take tools" in refused.value.message


def test_closing_an_n_stream_cancels_every_choice(
    fast_settings: Settings, fleet: Fleet, redis_client: Any
) -> None:
    fleet.worker("slow", time_scale=20.0)  # 200 tokens: seconds of decoding
    store = Store(redis_client, fast_settings)
    with GatewayServer(fast_settings, None) as gateway:
        client = openai.OpenAI(base_url=gateway.url, api_key="x", max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            n=3,
            max_tokens=200,
            stream=True,
            extra_body={"sim_output_tokens": 200},
        )
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        stream.close()
        keys = list(redis_client.scan_iter(store.keys.req("*")))
        assert len(keys) == 3

        def states() -> list[str]:
            return sorted(redis_client.hget(k, "state") for k in keys)

        wait_for(lambda: states() == ["cancelled"] * 3, what="every choice cancelled", timeout=10)


def test_a_rate_limit_counts_the_tokens_of_every_choice(
    fast_settings: Settings, fleet: Fleet, tmp_path: Path
) -> None:
    fleet.worker("w1", time_scale=0.0)
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-t"]\ntenant = "t"\ntokens_per_minute = 200\n')
    with GatewayServer(fast_settings, keys) as gateway:
        client = openai.OpenAI(base_url=gateway.url, api_key="sk-t", max_retries=0, timeout=30)
        one = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, extra_body={"sim_output_tokens": 1}
        )
        assert one.usage is not None
        cost = one.usage.prompt_tokens + 60
        assert 2 * cost <= 200 < 4 * cost  # one more choice fits the minute, three do not
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model=MODEL, messages=ASK, n=3, max_tokens=60)
        assert limited.value.code == "rate_limit_exceeded"
        assert "200 tokens per minute" in limited.value.message
