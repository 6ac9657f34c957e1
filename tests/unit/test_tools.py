"""The checks of tools and structured output (inferq.tools), and the tool-call pieces
of the data model (inferq.models): how a stream's pieces add up to the calls."""

from __future__ import annotations

from typing import Any

import pytest

from inferq import tools
from inferq.client import _StreamFold
from inferq.errors import InvalidRequest
from inferq.models import (
    FunctionCall,
    Result,
    StreamChunk,
    Timings,
    ToolCall,
    ToolCallDelta,
    merge_tool_deltas,
    parse_tool_calls,
    tool_calls_json,
    tool_calls_of,
    tool_deltas_of,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_good_shapes_pass() -> None:
    tools.check_tools(
        {
            "tools": [TOOL, {"type": "function", "function": {"name": "g-2", "strict": True}}],
            "tool_choice": {"type": "function", "function": {"name": "g-2"}},
            "parallel_tool_calls": True,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
            },
        }
    )
    tools.check_tools({"tool_choice": "none"})
    tools.check_tools({})


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"tools": []}, "params.tools"),
        ({"tools": [TOOL] * (tools.MAX_TOOLS + 1)}, "params.tools"),
        ({"tools": [None]}, "params.tools.0"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
            "params.tools.0.function.strict",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
            "params.tools.0.function.description",
        ),
        ({"tools": [TOOL], "tool_choice": 3}, "params.tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}},
            "params.tool_choice.function.name",
        ),
        ({"parallel_tool_calls": 1}, "params.parallel_tool_calls"),
        ({"response_format": "json"}, "params.response_format"),
        ({"response_format": {"type": "json_schema"}}, "params.response_format.json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": []},
                }
            },
            "params.response_format.json_schema.schema",
        ),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        tools.check_tools(params)
    assert refused.value.field == field


def test_the_size_bound_counts_utf8_bytes_of_the_json() -> None:
    size = tools.MAX_TOOLS_BYTES // 2  # 2 bytes a character: twice that, over the bound
    big = [{"type": "function", "function": {"name": "f", "description": "é" * size}}]
    with pytest.raises(InvalidRequest, match="bytes of JSON exceeds the limit"):
        tools.check_tools({"tools": big})


def test_pieces_merge_and_add_up_to_the_calls() -> None:
    pieces = (
        ToolCallDelta(index=0, id="a", name="f"),
        ToolCallDelta(index=0, arguments='{"x"'),
        ToolCallDelta(index=0, arguments=": 1}"),
        ToolCallDelta(index=1, id="b", name="g"),
        ToolCallDelta(index=1, arguments="{}"),
    )
    merged = merge_tool_deltas((), pieces)
    assert merged == (
        ToolCallDelta(index=0, id="a", name="f", arguments='{"x": 1}'),
        ToolCallDelta(index=1, id="b", name="g", arguments="{}"),
    )
    calls = tool_calls_of(pieces)
    assert calls == tool_calls_of(merged)
    assert calls == (
        ToolCall(id="a", function=FunctionCall(name="f", arguments='{"x": 1}')),
        ToolCall(id="b", function=FunctionCall(name="g", arguments="{}")),
    )
    assert tool_calls_of(tool_deltas_of(calls)) == calls
    assert parse_tool_calls(tool_calls_json(calls)) == calls
    assert parse_tool_calls("") == () and tool_calls_json(()) == ""


def result(calls: tuple[ToolCall, ...]) -> Result:
    return Result(
        request_id="r",
        status="succeeded",
        output="",
        tool_calls=calls,
        timings=Timings(submitted_at=1),
    )


def chunk(seq: int, calls: tuple[ToolCallDelta, ...], finish: str | None = None) -> StreamChunk:
    return StreamChunk(
        id=f"1-{seq}",
        attempt=1,
        seq=seq,
        delta="",
        tokens=seq,
        tool_calls=calls,
        finish_reason=finish,
    )


def test_the_stream_fold_yields_tool_pieces_and_mends_a_gap_from_the_result() -> None:
    call = ToolCall(id="a", function=FunctionCall(name="f", arguments="{}"))
    whole = _StreamFold(resumed=False)
    assert whole.feed(chunk(0, (ToolCallDelta(index=0, id="a", name="f"),))) is not None
    assert whole.feed(chunk(1, (ToolCallDelta(index=0, arguments="{}"),), "tool_calls"))
    assert [type(item) for item in whole.finish(result((call,)))] == [Result]  # they add up

    gap = _StreamFold(resumed=False)
    gap.feed(chunk(0, (ToolCallDelta(index=0, id="a", name="f"),)))
    gap.feed(chunk(2, (ToolCallDelta(index=0, arguments="}"),), "tool_calls"))  # seq 1 lost
    reset, final = list(gap.finish(result((call,))))
    assert isinstance(reset, StreamChunk) and reset.reset
    assert tool_calls_of(reset.tool_calls) == (call,) and isinstance(final, Result)

    nothing = _StreamFold(resumed=False)  # a server that streamed no pieces at all
    [mended, _] = list(nothing.finish(result((call,))))
    assert isinstance(mended, StreamChunk) and not mended.reset
    assert tool_calls_of(mended.tool_calls) == (call,)
