"""The gateway's API keys file and OpenAI body mapping (no server, no Redis)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inferq.config import Budget, Settings
from inferq.errors import ConfigError, InvalidRequest
from inferq.gateway import openai_api as api
from inferq.gateway.tenants import ApiKey, KeyRing, check_budget_keys, digest

README = Path(__file__).resolve().parents[2] / "README.md"
CLASSES = [c.name for c in Settings.load().classes]


def test_the_readme_keys_file_loads(tmp_path: Path) -> None:
    [snippet] = re.findall(r"```toml keys\.toml\n(.*?)```", README.read_text(), re.S)
    path = tmp_path / "keys.toml"
    path.write_text(snippet)
    ring = KeyRing.load(path, CLASSES)
    key = ring.lookup("sk-acme")
    assert key is not None and key.tenant == "acme" and key.default_class == "standard"
    assert key.allows("realtime") and not key.allows("batch")
    assert ring.lookup("sk-other") is None and ring.lookup(None) is None


def test_keys_by_digest_in_json_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {f"sha256:{digest('secret')}": {"tenant": "t1"}}}))
    assert KeyRing.load(path, CLASSES).lookup("secret") is not None
    path.write_text(json.dumps({"keys": {"k": {"tenant": "t1", "classes": ["urgent"]}}}))
    with pytest.raises(ConfigError, match="unknown class 'urgent'"):
        KeyRing.load(path, CLASSES)
    path.write_text(json.dumps({"keys": {"k": {"tenant": "t", "classes": ["batch"],
                                                "default_class": "realtime"}}}))  # fmt: skip
    with pytest.raises(ConfigError, match="default_class 'realtime' is not in classes"):
        KeyRing.load(path, CLASSES)
    assert KeyRing.load(None, CLASSES).open


def test_openai_bodies_map_onto_submissions() -> None:
    sub = api.read_body(
        "chat",
        {
            "model": "llama-3.1-8b",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 5,
            "temperature": 0.2,
            "user": "u1",
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": "realtime",
            "timeout": 3,
        },
    )
    assert sub.fields["messages"] == [{"role": "system", "content": "hi"}]
    assert sub.fields["max_tokens"] == 5
    assert sub.fields["params"] == {"temperature": 0.2, "user": "u1"}
    assert sub.stream and sub.include_usage and sub.priority == "realtime" and sub.timeout == 3
    for body, field in (
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "x", "content": "y"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": "y"}], "n": 99}, "n"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "y"}], "functions": [{}]},
            "functions",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "y"}], "timeout": -1}, "timeout"),
    ):
        with pytest.raises(InvalidRequest) as caught:
            api.read_body("chat", body)
        assert caught.value.field == field
    with pytest.raises(InvalidRequest) as header:
        api.timeout_header("soon")
    assert header.value.field == api.TIMEOUT_HEADER


def test_stored_key_ids_resolve_to_one_digest() -> None:
    from inferq.gateway.tenants import resolve_key_id

    stored = [digest("iq-one"), digest("iq-two")]
    assert resolve_key_id("iq-two", stored) == stored[1]  # the key itself
    assert resolve_key_id(f"sha256:{stored[0].upper()}", stored) == stored[0]
    assert resolve_key_id(stored[0][:12], stored) == stored[0]  # its id, as listed
    with pytest.raises(ConfigError, match="no stored API key matches"):
        resolve_key_id("iq-three", stored)
    with pytest.raises(ConfigError, match="no stored API key matches"):
        resolve_key_id("00000000", stored)  # neither digest starts with 8 zeros
    twins = ["abcdef01" + "0" * 56, "abcdef01" + "1" * 56]
    with pytest.raises(ConfigError, match="matches 2 keys"):
        resolve_key_id("abcdef01", twins)


def test_stored_keys_are_cached_briefly_and_corrupt_entries_refused() -> None:
    import asyncio

    from inferq.gateway.tenants import KEY_CACHE_S, ApiKey, StoredKey, StoredKeys

    entry = StoredKey(key=ApiKey(tenant="acme", classes=("batch",)), created_s=1.0)
    table: dict[str, str] = {digest("iq-good"): entry.model_dump_json(), digest("iq-bad"): "{"}
    fetched: list[str] = []

    async def fetch(key_digest: str) -> str | None:
        fetched.append(key_digest)
        return table.get(key_digest)

    now = [100.0]
    keys = StoredKeys(fetch, clock=lambda: now[0])

    async def scenario() -> None:
        found = await keys.lookup("iq-good")
        assert found is not None and found.tenant == "acme" and found.classes == ("batch",)
        assert await keys.lookup("iq-bad") is None  # invalid JSON: refused, no crash
        assert await keys.lookup("iq-unknown") is None
        del table[digest("iq-good")]  # revoked
        assert await keys.lookup("iq-good") is not None  # still cached
        assert len(fetched) == 3
        now[0] += KEY_CACHE_S
        assert await keys.lookup("iq-good") is None  # refused once the cache entry is old
        assert len(fetched) == 4

    asyncio.run(scenario())


def test_a_key_with_one_class_implies_it_when_a_request_names_none() -> None:
    assert ApiKey(tenant="t", classes=("batch",)).implied_class == "batch"
    assert ApiKey(tenant="t", classes=("batch", "standard")).implied_class is None
    assert ApiKey(tenant="t").implied_class is None
    both = ApiKey(tenant="t", classes=("batch", "standard"), default_class="standard")
    assert both.implied_class == "standard"


def test_a_budget_naming_no_key_of_the_gateway_is_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[keys."sk-acme"]\ntenant = "acme"\n')
    ring = KeyRing.load(path, CLASSES)
    known = digest("sk-acme")[:12]
    assert ring.ids() == {known}
    budgets = {
        "ok": Budget(key=known, period="day", tokens=10),
        "by-tenant": Budget(tenant="zeta", period="day", tokens=10),
    }
    check_budget_keys(budgets, ring.ids())  # a known key and a tenant budget: accepted
    budgets["typo"] = Budget(key="0123456789ab", period="month", usd=5.0)
    with pytest.raises(ConfigError, match=r"budgets\['typo'\]\.key: '0123456789ab' is not"):
        check_budget_keys(budgets, ring.ids())
    with pytest.raises(ConfigError, match=r"budgets\['ok'\]\.key"):  # an open gateway
        check_budget_keys({"ok": budgets["ok"]}, KeyRing(None).ids())
