"""The OpenAI body reader's refusals of hostile input: each a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from inferq.errors import InvalidRequest
from inferq.gateway import openai_api as api

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "llama-3.1-8b", "messages": MESSAGES, **fields}


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_timeout_too_large_for_a_float_is_refused(value: int) -> None:
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", chat(timeout=value))
    assert refused.value.field == "timeout"
    assert "finite" in str(refused.value)


def test_a_text_part_whose_text_is_not_a_string_is_refused() -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": {"x": 1}}]}])
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", body)
    assert refused.value.field == "messages[0].content[0].text"


@pytest.mark.parametrize("n", [True, 1.0, "1", 0, -1, api.MAX_CHOICES + 1])
def test_n_must_be_an_integer_in_range(n: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", chat(n=n))
    assert refused.value.field == "n"
    assert ("outside 1..16" in str(refused.value)) == (type(n) is int)


def test_n_is_read_and_never_forwarded() -> None:
    assert api.read_body("chat", chat(n=1)).n == 1
    assert api.read_body("chat", chat(n=None)).n == 1
    sub = api.read_body("chat", chat(n=api.MAX_CHOICES))
    assert sub.n == api.MAX_CHOICES
    assert "n" not in sub.fields.get("params", {})


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tools_travel_as_parameters() -> None:
    sub = api.read_body(
        "chat",
        chat(
            tools=[TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            response_format={"type": "json_object"},
        ),
    )
    assert sub.fields["params"] == {
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
    }


@pytest.mark.parametrize("name", ["functions", "function_call"])
def test_the_legacy_function_fields_are_refused_pointing_at_tools(name: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", chat(**{name: [TOOL["function"]]}))
    assert refused.value.field == name
    assert "use tools" in str(refused.value)


def test_a_conversation_with_tool_calls_is_read() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    sub = api.read_body(
        "chat",
        chat(
            messages=[
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ]
        ),
    )
    assert sub.fields["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert sub.fields["messages"][2]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": 1}]}, "messages[0].tool_calls[0].id"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_a_malformed_tool_message_is_refused_naming_its_field(
    message: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", chat(messages=[message]))
    assert refused.value.field == field


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", [1]),
        ("frequency_penalty", {"a": 1}),
        ("presence_penalty", "0"),
        ("seed", "x"),
        ("seed", 1.5),
        ("stop", 5),
        ("stop", ["a", 1]),
        ("logit_bias", [1, 2]),
    ],
)
def test_a_sampling_field_of_the_wrong_type_is_refused(name: str, value: Any) -> None:
    """Each reached llama.cpp, which answered 400, and the caller a 500 generation_failed."""
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", chat(**{name: value}))
    assert refused.value.field == name


@pytest.mark.parametrize(
    ("name", "value", "bounds"),
    [
        ("temperature", 99, "0..2"),
        ("temperature", -0.1, "0..2"),
        ("top_p", 1.5, "0..1"),
        ("top_p", -1, "0..1"),
        ("presence_penalty", 2.5, "-2..2"),
        ("frequency_penalty", -3, "-2..2"),
        ("temperature", float("nan"), "0..2"),
    ],
)
def test_a_sampling_field_out_of_openais_range_is_refused(
    name: str, value: float, bounds: str
) -> None:
    """``"temperature": 99`` was a 200 (the model server sampled at 99); OpenAI's API
    reference bounds each field: a 400 names the field and the range."""
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", chat(**{name: value}))
    assert refused.value.field == name
    assert bounds in str(refused.value), str(refused.value)


def test_sampling_fields_at_their_bounds_are_forwarded() -> None:
    for fields in (
        {"temperature": 0, "top_p": 0, "presence_penalty": -2, "frequency_penalty": -2},
        {"temperature": 2, "top_p": 1, "presence_penalty": 2, "frequency_penalty": 2.0},
    ):
        assert api.read_body("chat", chat(**fields)).fields["params"] == fields


def test_sampling_fields_of_the_right_type_are_forwarded() -> None:
    fields = {"temperature": 0.5, "top_p": 1, "seed": 7, "stop": ["\\n"], "logit_bias": {}}
    sub = api.read_body("chat", chat(**fields))
    assert sub.fields["params"] == fields
    assert api.read_body("chat", chat(stop="END")).fields["params"] == {"stop": "END"}


@pytest.mark.parametrize("value", ["false", 0, 1, [True]])
def test_include_usage_must_be_a_boolean(value: Any) -> None:
    """``"false"`` was read as true (``bool("false")``) and the usage chunk sent."""
    body = chat(stream=True, stream_options={"include_usage": value})
    with pytest.raises(InvalidRequest) as refused:
        api.read_body("chat", body)
    assert refused.value.field == "stream_options.include_usage"
    for ok in (True, False, None):
        sub = api.read_body("chat", chat(stream=True, stream_options={"include_usage": ok}))
        assert sub.include_usage is bool(ok)


@pytest.mark.parametrize("value", ["10", "2.5", "0.25", "600"])
def test_a_timeout_header_of_plain_decimals_is_read(value: str) -> None:
    assert api.timeout_header(value) == float(value)


@pytest.mark.parametrize("value", ["1_0", "1e1", "inf", "nan", " 10", "+5", "-5", "\u0661", "10."])
def test_a_timeout_header_in_any_other_form_is_refused(value: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        api.timeout_header(value)
    assert refused.value.field == "X-Inferq-Timeout"
    assert "plain decimal" in refused.value.reason


def test_the_session_hint_is_per_tenant_and_always_valid() -> None:
    from inferq.gateway.openai_api import session_hint
    from inferq.intake import SESSION_RE

    a = session_hint("acme", "user with spaces and ünïcode " * 20)
    assert a is not None and SESSION_RE.fullmatch(a)
    assert session_hint("acme", "bob") != session_hint("other", "bob")
    assert session_hint("acme", None) is None and session_hint("acme", "") is None


def test_a_session_s_short_requests_share_their_first_block() -> None:
    from inferq.config import Settings
    from inferq.intake import build_request

    settings = Settings()
    one = build_request(settings, prompt="hi", session="s1", max_tokens=4)
    two = build_request(settings, prompt="hello there", session="s1", max_tokens=4)
    other = build_request(settings, prompt="hi", session="s2", max_tokens=4)
    assert one.prefix_hashes == two.prefix_hashes != other.prefix_hashes
    assert len(one.prefix_hashes) == 1
    assert build_request(settings, prompt="hi", max_tokens=4).prefix_hashes == ()
    # another tenant's session of the same name is another session
    theirs = build_request(settings, prompt="hi", session="s1", tenant="b", max_tokens=4)
    assert theirs.prefix_hashes != one.prefix_hashes
