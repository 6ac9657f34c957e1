"""API keys in Redis (``inferq keys``), and the per-tenant rate limits, on the real Redis.

The gateway runs with the official OpenAI SDK as its client, a dispatcher and a
simulated worker, as in ``test_gateway.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from inferq.cli.main import cli
from inferq.config import Settings
from inferq.gateway.tenants import KEY_CACHE_S, digest
from inferq.store import Store, connect

from ..conftest import REDIS_URL, purge_namespace
from ..helpers import ready_worker, wait_for
from .fleet import Fleet
from .gateway_server import GatewayServer
from .test_gateway import MODEL, sdk

FILE_KEYS = """
[keys."sk-file"]
tenant = "filed"
"""
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def keys_cli(namespace: str):  # type: ignore[no-untyped-def]
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(
            cli, ["--redis-url", REDIS_URL, "--namespace", namespace, "keys", *args]
        )

    return invoke


@pytest.fixture
def stored_gateway(fast_settings: Settings, tmp_path: Path) -> Iterator[GatewayServer]:
    path = tmp_path / "keys.toml"
    path.write_text(FILE_KEYS)
    with GatewayServer(fast_settings, path, redis_keys=True) as g:
        yield g


def test_keys_are_added_listed_and_revoked_by_digest_only(keys_cli, store: Store) -> None:  # type: ignore[no-untyped-def]
    added = keys_cli(
        "add", "--tenant", "acme", "--class", "realtime", "--class", "standard",
        "--default-class", "standard", "--tokens-per-minute", "5000", "--note", "web app",
        "--json",
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    made = json.loads(added.stdout)
    key = made["key"]
    assert key.startswith("iq-") and len(key) == 46
    stored = store.api_keys()
    assert list(stored) == [digest(key)]  # the digest, never the key
    assert key not in json.dumps(stored)
    listed = json.loads(keys_cli("list", "--json").stdout)
    assert listed == [
        {
            "id": made["id"],
            "digest": digest(key),
            "tenant": "acme",
            "classes": ["realtime", "standard"],
            "default_class": "standard",
            "requests_per_minute": None,
            "tokens_per_minute": 5000,
            "created_s": listed[0]["created_s"],
            "note": "web app",
        }
    ]
    table = keys_cli("list").stdout
    assert made["id"] in table and "acme" in table and key not in table
    refused = keys_cli("add", "--tenant", "acme", "--class", "urgent")
    assert refused.exit_code == 1 and "unknown class 'urgent'" in refused.output
    refused = keys_cli("add", "--tenant", "acme", "--class", "batch", "--default-class", "realtime")
    assert refused.exit_code == 1 and "default_class 'realtime' is not in classes" in refused.output
    refused = keys_cli("add", "--tenant", "no spaces")
    assert refused.exit_code == 1 and "tenant" in refused.output
    assert keys_cli("revoke", "00000000").exit_code == 1  # no such id
    revoked = keys_cli("revoke", made["id"])
    assert revoked.exit_code == 0 and f"revoked {made['id']}" in revoked.stdout
    assert store.api_keys() == {}
    assert "no API keys stored" in keys_cli("list").stdout


def test_the_gateway_serves_stored_keys_until_revoked(  # type: ignore[no-untyped-def]
    keys_cli,
    fleet: Fleet,
    stored_gateway: GatewayServer,
    store: Store,
) -> None:
    fleet.worker("w1", time_scale=0.0)
    made = keys_cli(
        "add", "--tenant", "nightly", "--class", "batch", "--default-class", "batch", "--json"
    )
    key = json.loads(made.stdout)["key"]
    client = sdk(stored_gateway, key)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"sim_output_tokens": 2}
    )
    record = store.record(chat.id.removeprefix("chatcmpl-"))
    assert record.request.tenant == "nightly" and record.request.priority == "batch"
    # Metered under the key's id, as ``inferq keys list`` shows it (``inferq usage --by key``).
    assert record.request.api_key == digest(key)[:12] == json.loads(made.stdout)["id"][:12]
    with pytest.raises(openai.PermissionDeniedError) as denied:  # a class it may not use
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_headers={"X-Inferq-Priority": "realtime"}
        )
    assert denied.value.body["param"] == "X-Inferq-Priority"  # type: ignore[index]  # as sent
    # The keys file still counts beside the stored keys.
    filed = sdk(stored_gateway, "sk-file").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"sim_output_tokens": 1}
    )
    assert store.record(filed.id.removeprefix("chatcmpl-")).request.tenant == "filed"
    # A corrupt stored entry refuses its key (401) and the gateway keeps serving.
    store.redis.hset(store.keys.api_keys, digest("iq-broken"), "{not json")
    with pytest.raises(openai.AuthenticationError):
        sdk(stored_gateway, "iq-broken").models.list()
    [broken] = [k for k in json.loads(keys_cli("list", "--json").stdout) if "error" in k]
    assert broken["digest"] == digest("iq-broken") and "invalid entry" in broken["error"]
    assert keys_cli("revoke", key).exit_code == 0  # by the key itself

    def refused() -> bool:
        answer = httpx.get(
            f"{stored_gateway.url}/models", headers={"Authorization": f"Bearer {key}"}
        )
        return answer.status_code == 401

    wait_for(refused, timeout=KEY_CACHE_S + 10, what="the revoked key refused")
    body = httpx.get(f"{stored_gateway.url}/models", headers={"Authorization": f"Bearer {key}"})
    assert body.json()["error"]["code"] == "invalid_api_key"


RATE_KEYS = """
[keys."sk-tokens"]
tenant = "tok"
tokens_per_minute = 100

[keys."sk-requests"]
tenant = "req"
requests_per_minute = 3

[keys."sk-small"]
tenant = "small"
tokens_per_minute = 50
"""


def test_tokens_and_requests_per_minute_are_shared_by_replicas(  # type: ignore[no-untyped-def]
    fleet: Fleet,
    fast_settings: Settings,
    tmp_path: Path,
    store: Store,
) -> None:
    fleet.worker("w1", time_scale=0.0)
    path = tmp_path / "keys.toml"
    path.write_text(RATE_KEYS)
    with GatewayServer(fast_settings, path) as one, GatewayServer(fast_settings, path) as two:
        # Tokens: prompt estimate + max_tokens reserved at admission. "hi" is a few
        # tokens, so 60 + prompt fits 100 once; the second request, on the other
        # replica, finds the window holding the first one's reservation.
        first = sdk(one, "sk-tokens").chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=60, extra_body={"sim_output_tokens": 1}
        )
        assert first.usage is not None and first.usage.completion_tokens == 1
        with pytest.raises(openai.RateLimitError) as limited:
            sdk(two, "sk-tokens").chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=60
            )
        error = limited.value.body
        assert error["code"] == "rate_limit_exceeded"  # type: ignore[index]
        assert "tenant 'tok' may use 100 tokens per minute" in error["message"]  # type: ignore[index]
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
        # Requests: 3 per minute across both replicas.
        for gateway in (one, two, one):
            sdk(gateway, "sk-requests").chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"sim_output_tokens": 1}
            )
        with pytest.raises(openai.RateLimitError) as limited:
            sdk(two, "sk-requests").chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1
            )
        error = limited.value.body
        assert "tenant 'req' may use 3 requests per minute" in error["message"]  # type: ignore[index]
        # A request larger than the whole limit fits only an empty window, where it counts
        # as the whole limit (it could never be admitted otherwise).
        small = sdk(one, "sk-small")
        small.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=500, extra_body={"sim_output_tokens": 1}
        )
        with pytest.raises(openai.RateLimitError) as limited:
            small.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        assert "50 tokens per minute" in limited.value.body["message"]  # type: ignore[index]
    # The windows live in Redis, under the deployment's prefix.
    windows = list(store.redis.scan_iter(match=f"{store.keys.rate_limits}*"))
    assert any("tok" in w for w in windows) and any("req" in w for w in windows)


def test_models_lists_the_routes_each_cell_serves_now(namespace: str, tmp_path: Path) -> None:
    """Two cells on two databases of the test Redis: a route is listed when the cell that
    serves it for the caller's tenant has a live worker for a model the route accepts."""
    cell_urls = {"a": f"{REDIS_URL.rsplit('/', 1)[0]}/1", "b": f"{REDIS_URL.rsplit('/', 1)[0]}/2"}
    settings = Settings.load(
        namespace=namespace,
        cells={
            "a": {"redis_url": cell_urls["a"], "routes": ["llama-3.1-8b", ">=13b"]},
            "b": {"redis_url": cell_urls["b"], "routes": ["llama-2-13b"], "tenants": ["big"]},
        },
        default_cell="a",
    )
    stores = {
        name: Store(connect(url), settings.model_copy(update={"redis_url": url}))
        for name, url in cell_urls.items()
    }
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-big"]\ntenant = "big"\n\n[keys."sk-small"]\ntenant = "small"\n')
    try:
        with GatewayServer(settings, keys) as gateway:

            def listed(key: str) -> list[str]:
                answer = httpx.get(
                    f"{gateway.url}/models", headers={"Authorization": f"Bearer {key}"}
                )
                return [m["id"] for m in answer.json()["data"]]

            assert listed("sk-small") == [] and listed("sk-big") == []  # no worker anywhere
            ready_worker(stores["a"], "a-w1", model="llama-3.1-8b")
            wait_for(lambda: listed("sk-small") == ["llama-3.1-8b"], what="cell a's route")
            # llama-2-13b is cell b's route for tenant big only; for small the default
            # cell a serves it, where no 13b worker runs.
            ready_worker(stores["b"], "b-w1", model="llama-2-13b", params_b=13)
            wait_for(
                lambda: listed("sk-big") == ["llama-2-13b", "llama-3.1-8b"],
                what="cell b's route for tenant big",
            )
            assert listed("sk-small") == ["llama-3.1-8b"]
            # >=13b lives in cell a: a 13b worker there serves it (and llama-2-13b for small).
            ready_worker(stores["a"], "a-w2", model="llama-2-13b", params_b=13)
            wait_for(
                lambda: listed("sk-small") == [">=13b", "llama-2-13b", "llama-3.1-8b"],
                what="cell a's size route",
            )
            # A request for a route whose cell has no worker is a 503 naming the model.
            stores["b"].redis.delete(stores["b"].keys.workers)
            time.sleep(1.2)  # the replica's fleet cache (FLEET_CACHE_S)
            big = sdk(gateway, "sk-big")
            with pytest.raises(openai.InternalServerError) as unavailable:
                big.chat.completions.create(model="llama-2-13b", messages=MESSAGES)
            assert unavailable.value.status_code == 503
            assert listed("sk-big") == [">=13b", "llama-3.1-8b"]  # >=13b: cell a, for all
    finally:
        for store in stores.values():
            purge_namespace(store.redis, namespace)
            store.close()


LEASE_KEYS = """
[keys."sk-once"]
tenant = "once"
requests_per_minute = 1
"""


def _scrape(gateway: GatewayServer) -> str:
    return httpx.get(f"{gateway.root}/metrics", timeout=10).text


def _holds(text: str) -> bool:
    return "inferq_metrics_lease_held 1.0" in text


def test_one_gateway_replica_exports_the_deployment_gauges(
    fleet: Fleet, fast_settings: Settings, tmp_path: Path, store: Store
) -> None:
    fleet.worker("w1", time_scale=0.0)
    path = tmp_path / "keys.toml"
    path.write_text(LEASE_KEYS)
    store.put_api_key(digest("iq-stored"), '{"key": {"tenant": "t"}, "created_s": 1}')
    # Long enough that a loaded host's stall of the holder's renewal cannot hand the lease
    # to the other replica mid-test (the takeover below is the holder giving it back).
    options = {"metrics_lease_ttl_s": 10.0}
    with (
        GatewayServer(fast_settings, path, **options) as one,
        GatewayServer(fast_settings, path, **options) as two,
    ):
        replicas = {"one": one, "two": two}
        wait_for(
            lambda: sum(_holds(_scrape(g)) for g in replicas.values()) == 1,
            what="exactly one replica holding the metrics lease",
        )
        holder = next(name for name, g in replicas.items() if _holds(_scrape(g)))
        other = "two" if holder == "one" else "one"
        # Each replica counts its own requests; the deployment's series come from
        # the holder alone (a sum() over replicas counts each once).
        client = sdk(replicas[other], "sk-once")
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"sim_output_tokens": 1}
        )
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        texts = {name: _scrape(g) for name, g in replicas.items()}
        assert 'inferq_gateway_requests_total{code="429",endpoint="chat"} 1.0' in texts[other]
        assert 'code="429"' not in texts[holder]
        assert "inferq_gateway_api_keys 1.0" in texts[holder]
        assert "inferq_queue_depth" in texts[holder] and "inferq_workers{" in texts[holder]
        for series in ("inferq_gateway_api_keys", "inferq_queue_depth", "inferq_workers{"):
            assert series not in texts[other]
        assert "inferq_metrics_lease_held 0.0" in texts[other]
        # The other replica's refusal reaches the holder through the events stream.
        wait_for(
            lambda: (
                'inferq_rate_limit_refusals_total{tenant="once"} 1.0' in _scrape(replicas[holder])
            ),
            what="the refusal counted by the holder",
        )
        wait_for(
            lambda: (
                'inferq_ttft_seconds_count{model="llama-3.1-8b",priority_class'
                in _scrape(replicas[holder])
            ),
            what="the finished request in the holder's histograms",
        )
        # When the holder stops it gives the lease back: the other takes over.
        replicas[holder].__exit__(None, None, None)
        wait_for(lambda: _holds(_scrape(replicas[other])), what="the other replica takes over")
        assert "inferq_gateway_api_keys 1.0" in _scrape(replicas[other])
