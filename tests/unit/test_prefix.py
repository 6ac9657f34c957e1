"""Prefix identity (inferq.prefix): chained block hashes, their stored form, the checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq import prefix
from inferq.errors import InvalidRequest


def test_block_i_covers_blocks_0_to_i() -> None:
    a = prefix.text_chain("x" * 256 + "y" * 256 + "z" * 256, block_tokens=64, chars_per_token=4)
    b = prefix.text_chain("x" * 256 + "q" * 256 + "z" * 256, block_tokens=64, chars_per_token=4)
    assert len(a) == len(b) == 3
    assert a[0] == b[0]
    # the third block is the same text, but it follows another second block
    assert a[1] != b[1] and a[2] != b[2]


def test_only_full_blocks_are_hashed_and_the_chain_is_bounded() -> None:
    assert prefix.text_chain("x" * 255, block_tokens=64, chars_per_token=4) == ()
    assert len(prefix.text_chain("x" * 10_000, block_tokens=64, max_blocks=5)) == 5


def test_chains_of_different_block_sizes_never_share_a_hash() -> None:
    text = "abcd" * 1000
    small = set(prefix.text_chain(text, block_tokens=16))
    big = set(prefix.text_chain(text, block_tokens=32))
    assert small and big and not small & big


def test_a_conversation_s_rendering_grows_as_a_prefix() -> None:
    turn1 = [{"role": "system", "content": "S" * 900}, {"role": "user", "content": "hi " * 100}]
    answer = {"role": "assistant", "content": "ok " * 100}
    turn2 = [*turn1, answer, {"role": "user", "content": "x"}]
    t1, t2 = prefix.chat_text(turn1), prefix.chat_text(turn2)
    assert t2.startswith(t1)
    c1, c2 = prefix.text_chain(t1, 16), prefix.text_chain(t2, 16)
    assert c2[: len(c1)] == c1 and len(c2) > len(c1)


SYSTEM = {"role": "system", "content": "S" * 640}  # ten 16-token blocks at 4 chars a token
USER = {"role": "user", "content": "what is the weather in Paris? " * 10}


def _tools(name: str) -> str:
    from inferq import tools

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    return tools.tools_text(
        {"tools": [{"type": "function", "function": {"name": name, "parameters": schema}}]}
    )


def test_agents_with_other_tools_share_the_system_prompt_and_nothing_after_it() -> None:
    weather = prefix.text_chain(prefix.chat_text([SYSTEM, USER], _tools("get_weather")), 16)
    search = prefix.text_chain(prefix.chat_text([SYSTEM, USER], _tools("search_web")), 16)
    bare = prefix.text_chain(prefix.chat_text([SYSTEM, USER]), 16)
    shared = len(f"<|system|>\n{SYSTEM['content']}\n") // 64  # full blocks before the tools
    for other in (search, bare):
        common = next(i for i, (a, b) in enumerate(zip(weather, other, strict=False)) if a != b)
        assert common == shared


def test_the_tools_go_after_every_leading_system_message() -> None:
    text = prefix.chat_text([SYSTEM, {"role": "system", "content": "be brief"}, USER], "[T]")
    assert text.index("be brief") < text.index("<|tools|>\n[T]\n") < text.index("<|user|>")
    # a conversation of system messages only still renders its tools
    assert prefix.chat_text([SYSTEM], "[T]").endswith("<|tools|>\n[T]\n")


def test_an_assistant_s_tool_calls_are_part_of_the_prefix() -> None:
    def turn(city: str) -> list[dict[str, object]]:
        arguments = f'{{"city": "{city}"}}' * 20
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
        return [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [call]}]

    paris = prefix.text_chain(prefix.chat_text(turn("Paris")), 16)
    rome = prefix.text_chain(prefix.chat_text(turn("Rome")), 16)
    assert len(paris) == len(rome) and paris != rome
    # the next turn (the tool's answer) still extends the prefix
    answer = {"role": "tool", "content": "18 C", "tool_call_id": "c1"}
    assert prefix.chat_text([*turn("Paris"), answer]).startswith(prefix.chat_text(turn("Paris")))


def test_a_request_s_tools_change_its_chain_at_intake() -> None:
    from inferq.config import Settings
    from inferq.intake import build_request

    settings = Settings()

    def chain(tool: str | None) -> tuple[int, ...]:
        params = (
            {} if tool is None else {"tools": [{"type": "function", "function": {"name": tool}}]}
        )
        return build_request(settings, messages=[SYSTEM, USER], params=params).prefix_hashes

    assert chain("get_weather") == chain("get_weather")
    assert chain("get_weather") != chain("search_web") != chain(None)


@given(st.lists(st.integers(0, prefix.HASH_LIMIT - 1), max_size=50), st.integers(1, 4096))
def test_encode_decode_round_trip(hashes: list[int], size: int) -> None:
    text = prefix.encode(size, hashes)
    assert prefix.decode(text) == ((size, tuple(hashes)) if hashes else (0, ()))


@pytest.mark.parametrize(
    "text",
    [
        "x",
        "64:abc",
        "0:" + "0" * 16,
        "64:" + "f" * 16,
        "a:" + "0" * 16,
        "64:-000000000000001",  # int() took the sign: a negative hash in the index
        "64:_000000000000001",
        "64: 000000000000001",
        " 64:" + "0" * 16,
    ],
)
def test_a_bad_stored_chain_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        prefix.decode(text)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("abc", "must be a list of integers, got str"),
        ([1, "2"], "[1] must be an integer in [0, 2**63), got '2'"),
        ([True], "[0] must be an integer"),
        ([-1], "[0] must be an integer"),
        ([1 << 63], "[0] must be an integer"),
        (list(range(513)), "has 513 blocks, at most 512"),
        (["y" * 10_000], "got 'yyyyy"),  # shown cut short, not echoed whole
    ],
)
def test_a_caller_s_chain_is_checked(value: object, words: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        prefix.check_chain(value)
    assert err.value.field == "prefix_hashes"
    assert words in err.value.reason
    assert len(err.value.reason) < 200


def test_trace_block_ids_are_chained() -> None:
    assert prefix.chain_ids([1, 2, 3], 512)[:2] == prefix.chain_ids([1, 2, 9], 512)[:2]
    assert prefix.chain_ids([1, 2, 3], 512)[2] != prefix.chain_ids([1, 2, 9], 512)[2]
