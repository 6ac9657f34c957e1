"""Token estimates: prompt size, chat overhead, output from history, the moving mean."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferq import defaults
from inferq.models import ChatMessage
from inferq.policy import estimate
from inferq.policy.estimate import (
    estimate_key,
    estimate_messages_tokens,
    estimate_output_tokens,
    estimate_prompt_tokens,
    update_moving_mean,
)


@pytest.fixture
def approximate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Force the characters-per-token approximation, installed tiktoken or not."""
    monkeypatch.setattr(estimate, "_tiktoken_counter", lambda: None)
    yield


@pytest.fixture
def exact(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], int]]:
    """A stand-in exact tokenizer: one token per word."""

    def count(text: str) -> int:
        return len(text.split())

    monkeypatch.setattr(estimate, "_tiktoken_counter", lambda: count)
    yield count


@pytest.mark.usefixtures("approximate")
def test_prompt_tokens_by_characters() -> None:
    assert estimate_prompt_tokens("") == 0
    assert estimate_prompt_tokens("a") == 1
    assert estimate_prompt_tokens("abcd") == 1
    assert estimate_prompt_tokens("abcde") == 2
    assert estimate_prompt_tokens("x" * 1000, chars_per_token=2.5) == 400


def test_prompt_tokens_rejects_bad_ratio() -> None:
    with pytest.raises(ValueError, match="chars_per_token must be > 0, got 0"):
        estimate_prompt_tokens("abc", 0)


def test_prompt_tokens_use_the_exact_tokenizer_when_present(exact: Callable[[str], int]) -> None:
    assert estimate_prompt_tokens("three words here") == 3
    assert estimate_prompt_tokens("   ") == 1  # non-empty text is never 0 tokens


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is not None, reason="tiktoken installed")
def test_tiktoken_absent_means_approximation() -> None:
    estimate._tiktoken_counter.cache_clear()
    assert estimate._tiktoken_counter() is None
    assert estimate_prompt_tokens("abcdefgh") == 2


@pytest.mark.usefixtures("approximate")
def test_messages_add_per_message_overhead() -> None:
    messages = [
        ChatMessage(role="system", content="abcd"),
        ChatMessage(role="user", content="abcdefgh"),
    ]
    expected = 1 + 2 + 2 * defaults.TOKENS_PER_MESSAGE
    assert estimate_messages_tokens(messages) == expected
    assert estimate_messages_tokens([{"role": "user", "content": ""}], per_message=3) == 3


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=500), st.floats(0.5, 8))
def test_prompt_estimate_is_the_ceiling_of_characters(text: str, ratio: float) -> None:
    with patch.object(estimate, "_tiktoken_counter", lambda: None):
        tokens = estimate_prompt_tokens(text, ratio)
    if not text:
        assert tokens == 0
    else:
        assert len(text) / ratio <= tokens < len(text) / ratio + 1 + 1e-9


def test_output_estimate_prefers_history_capped_at_max_tokens() -> None:
    estimates = {("m", "chat"): 120.0, ("m", ""): 30.0}
    assert estimate_output_tokens(500, estimates, "m", "chat") == 120.0
    assert estimate_output_tokens(100, estimates, "m", "chat") == 100.0
    assert estimate_output_tokens(500, estimates, "m", None) == 30.0
    assert estimate_output_tokens(500, estimates, "other", "chat") == 500.0
    assert estimate_output_tokens(500, {("m", "x"): -3.0}, "m", "x") == 0.0


def test_estimate_key_matches_untyped_requests() -> None:
    assert estimate_key("m", None) == ("m", "")
    assert estimate_key("m", "code") == ("m", "code")


def test_moving_mean_steps() -> None:
    assert update_moving_mean(None, 80) == 80.0
    assert update_moving_mean(100.0, 200, alpha=0.1) == pytest.approx(110.0)
    assert update_moving_mean(100.0, 200, alpha=1.0) == 200.0
    assert update_moving_mean(100.0, 200) == pytest.approx(
        100 + defaults.OUTPUT_ESTIMATE_ALPHA * 100
    )


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_moving_mean_rejects_alpha_outside_0_1(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha must be in"):
        update_moving_mean(1.0, 2, alpha)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0, 10_000),
    st.lists(st.integers(0, 10_000), min_size=1, max_size=50),
    st.floats(0.01, 1),
)
def test_moving_mean_stays_within_observed_range(
    start: float, observed: list[int], alpha: float
) -> None:
    mean = start
    for value in observed:
        mean = update_moving_mean(mean, value, alpha)
    low, high = min(start, *observed), max(start, *observed)
    assert low - 1e-6 <= mean <= high + 1e-6
