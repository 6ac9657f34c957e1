"""Prompts counted with the served model's own tokenizer (inferq.tokens) when its
registry entry names a tokenizer.json and the ``tokenizers`` library is installed;
otherwise estimated, and the refusal says which."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inferq import tokens
from inferq.config import Settings
from inferq.errors import ContextLengthExceeded
from inferq.intake import build_request

tokenizers = pytest.importorskip("tokenizers")

MODEL = "llama-3.1-8b"
WORDS = ["hello", "world", "tool", "call"]


def word_tokenizer(path: Path) -> str:
    """A real tokenizer.json: one token a known word (or unknown one) or punctuation."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return str(path)


def settings_with(tokenizer: str | None) -> Settings:
    base = Settings.load()
    models = [
        m.model_copy(update={"tokenizer": tokenizer}) if m.name == MODEL else m for m in base.models
    ]
    return base.model_copy(update={"models": models})


def test_the_models_tokenizer_counts_the_prompt(tmp_path: Path) -> None:
    settings = settings_with(word_tokenizer(tmp_path / "tokenizer.json"))
    text = "hello world, hello tool call"  # 6 tokens; 28 characters
    assert build_request(settings, prompt=text, model=MODEL).prompt_tokens == 6
    chat = build_request(settings, messages=[{"role": "user", "content": text}], model=MODEL)
    assert chat.prompt_tokens == 6 + 4  # the chat template's markers: 4 a message
    other = build_request(settings, prompt=text, model="llama-2-13b")  # names none
    assert other.prompt_tokens == 7  # ceil(28 / 4): the estimate


def test_the_refusal_says_whether_the_count_is_the_tokenizers(tmp_path: Path) -> None:
    counted = settings_with(word_tokenizer(tmp_path / "tokenizer.json"))
    spec = next(m for m in counted.models if m.name == MODEL)
    prompt = "hello " * spec.max_context  # exactly max_context tokens, 6x the characters
    with pytest.raises(ContextLengthExceeded) as exact:
        build_request(counted, prompt=prompt, model=MODEL, max_tokens=1)
    assert f"{spec.max_context} tokens (counted with {MODEL}'s tokenizer)" in str(exact.value)
    words = spec.max_context * 4 // 5  # 80% of the context by the tokenizer...
    short = "hello " * words
    assert build_request(counted, prompt=short, model=MODEL, max_tokens=1).prompt_tokens == words
    with pytest.raises(
        ContextLengthExceeded
    ) as estimated:  # ...120% estimated (6 characters a word)
        build_request(settings_with(None), prompt=short, model=MODEL, max_tokens=1)
    assert "~" in str(estimated.value) and "an estimate" in str(estimated.value)


def test_a_tokenizer_that_does_not_load_falls_back_to_the_estimate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{not a tokenizer")
    with caplog.at_level(logging.WARNING, logger="inferq.tokens"):
        req = build_request(settings_with(str(bad)), prompt="hello world", model=MODEL)
    assert req.prompt_tokens == 3  # ceil(11 / 4)
    assert "does not load" in caplog.text


def test_a_route_over_models_of_different_tokenizers_has_no_single_count(
    tmp_path: Path,
) -> None:
    path = word_tokenizer(tmp_path / "tokenizer.json")
    settings = settings_with(path)
    specs = [m for m in settings.models if m.name in (MODEL, "llama-2-13b")]
    assert tokens.tokenizer_for(specs) is None
    same = [m.model_copy(update={"tokenizer": path}) for m in specs]
    found = tokens.tokenizer_for(same)
    assert found is not None and found.count("hello world") == 2
