"""The gateway's context check with the served model's tokenizer, through the OpenAI SDK:
the count is the tokenizer's (``usage.prompt_tokens`` on the sim, which reports intake's
count) and the refusal says so, where another model's says it is an estimate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from inferq.config import Settings
from inferq.store import Store

from .fleet import Fleet
from .gateway_server import GatewayServer

tokenizers = pytest.importorskip("tokenizers")

MODEL = "llama-3.1-8b"


@pytest.fixture
def counted(settings: Settings, tmp_path: Path) -> Settings:
    """Settings whose MODEL names a real tokenizer.json: one token a word."""
    vocab = {"[UNK]": 0, "hello": 1}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    models = [
        m.model_copy(update={"tokenizer": str(path)}) if m.name == MODEL else m
        for m in settings.models
    ]
    return settings.model_copy(
        update={"models": models, "heartbeat_interval_s": 0.2, "lease_s": 1.0}
    )


@pytest.fixture
def client(counted: Settings, redis_client: Any) -> Iterator[openai.OpenAI]:
    fleet = Fleet(counted, Store(redis_client, counted))
    fleet.worker("w1", time_scale=0.0)
    try:
        with GatewayServer(counted, None) as gateway:
            yield openai.OpenAI(base_url=gateway.url, api_key="x", max_retries=0, timeout=30)
    finally:
        fleet.close()


def test_the_tokenizer_counts_and_the_refusal_says_so(
    counted: Settings, client: openai.OpenAI
) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello " * 100}],
        max_tokens=2,
        extra_body={"sim_output_tokens": 1},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 100 + 4  # + the template's
    context = next(m.max_context for m in counted.models if m.name == MODEL)
    with pytest.raises(openai.BadRequestError) as over:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * context}]
        )
    assert (over.value.param, over.value.code) == ("messages", "context_length_exceeded")
    assert f"counted with {MODEL}'s tokenizer" in over.value.message
    assert "estimate" not in over.value.message
    with pytest.raises(openai.BadRequestError) as other:  # llama-2-13b names no tokenizer
        client.completions.create(model="llama-2-13b", prompt="hello " * 5000)
    assert other.value.code == "context_length_exceeded"
    assert "an estimate" in other.value.message
