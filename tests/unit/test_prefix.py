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
