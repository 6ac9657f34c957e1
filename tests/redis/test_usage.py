"""Metering at the source (``lua/includes/meter.lua``) and reading it back, real Redis."""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import httpx
import pytest
import redis

from inferq import usage
from inferq.config import Price, Settings
from inferq.errors import ConfigError
from inferq.gateway.admin import AdminKey
from inferq.models import RequestState
from inferq.store import Completion, Store

from ..builders import inference_request
from ..helpers import queue_key, ready_worker
from .gateway_server import GatewayServer
from .test_cli_ops import inferq


def _window(store: Store) -> tuple[int, int]:
    """From yesterday to tomorrow, Redis ms: every hour a test writes."""
    now = round(store.now() * 1000)
    return now - usage.DAY_MS, now + usage.DAY_MS


def _run(store: Store, settings: Settings, worker: str = "w1", **fields: object) -> tuple[str, int]:
    """Submit one request and start it on ``worker``: (id, attempt)."""
    r = inference_request(settings, **fields)
    store.submit(r)
    [(rid, attempt)] = store.assign(worker, r.id + "b", [(r.id, queue_key(store, r), 1.0)])
    assert store.start(worker, [(rid, attempt)]) == ["run"]
    return rid, attempt


def _by(store: Store, by: str) -> dict[str, usage.UsageRow]:
    records, corrupt = store.usage_records(*_window(store))
    assert corrupt == []
    return {row.name: row for row in usage.roll_up(records, by, {}, *_window(store))}


def test_a_duplicate_completion_is_metered_once(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    rid, attempt = _run(store, settings, tenant="acme")
    done = Completion(
        rid, attempt, "succeeded", output="hi", prompt_tokens=30, completion_tokens=7,
        cached_tokens=16,
    )  # fmt: skip
    assert store.complete("w1", [done]) == ["ok"]
    assert store.complete("w1", [done]) == ["stale"]  # resent: a second flush, a retry
    row = _by(store, "tenant")["acme"]
    assert row.requests == 1 and row.counts["succeeded"] == 1
    assert (row.counts["prompt_tokens"], row.counts["cached_tokens"]) == (30, 16)
    assert row.counts["completion_tokens"] == 7
    assert row.counts["gpu_ms"] >= 0
    share = store.redis.hget(store.keys.req(rid), "gpu_ms")
    assert share is not None and row.counts["gpu_ms"] == int(share)


def test_tenant_totals_equal_the_sum_over_final_results(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1", slots=64)
    rng = random.Random(23)
    final: list[str] = []
    for i in range(40):
        tenant = f"t{i % 4}"
        if i % 10 == 9:  # cancelled while queued: made final by cancel.lua, not the worker
            r = inference_request(settings, tenant=tenant)
            store.submit(r)
            store.cancel(r.id)
            final.append(r.id)
            continue
        rid, attempt = _run(
            store, settings, tenant=tenant, priority=rng.choice(["batch", "standard"])
        )
        final.append(rid)
        status = "failed" if i % 7 == 3 else "succeeded"
        c = Completion(
            rid, attempt, status, prompt_tokens=rng.randint(1, 500),
            completion_tokens=rng.randint(0, 200), cached_tokens=rng.randint(0, 1),
        )  # fmt: skip
        assert store.complete("w1", [c, c]) == ["ok", "stale"]
    want: dict[str, dict[str, int]] = {}
    for rid in final:
        rec = store.record(rid)
        w = want.setdefault(rec.request.tenant, dict.fromkeys(usage.COUNTERS[:7], 0))
        w[rec.state.value] += 1
        fields = store.redis.hgetall(store.keys.req(rid))
        w["prompt_tokens"] += int(fields.get("prompt_tokens_used", 0))
        w["completion_tokens"] += int(fields.get("completion_tokens", 0))
        w["cached_tokens"] += int(fields.get("cached_tokens", 0))
    got = _by(store, "tenant")
    assert {t: {c: r.counts[c] for c in usage.COUNTERS[:7]} for t, r in got.items()} == want
    stats = store.redis.hgetall(store.keys.stats)
    for outcome in usage.OUTCOMES:  # the reconciliation with ``inferq stats``
        assert sum(r.counts[outcome] for r in got.values()) == int(stats.get(outcome, 0))
    assert sum(r.requests for r in _by(store, "class").values()) == 40


def test_usage_is_kept_by_key_class_and_model(store: Store, settings: Settings) -> None:
    ready_worker(store, "w1")
    rid, attempt = _run(store, settings, tenant="acme", priority="batch")
    store.redis.hset(store.keys.req(rid), "api_key", "0123456789ab")  # as the gateway writes it
    store.complete("w1", [Completion(rid, attempt, "succeeded", prompt_tokens=5)])
    rid, attempt = _run(store, settings, tenant="acme", priority="standard")
    store.complete("w1", [Completion(rid, attempt, "succeeded", prompt_tokens=2)])
    keys = _by(store, "key")
    assert keys["0123456789ab"].counts["prompt_tokens"] == 5 and keys[""].requests == 1
    assert {n: r.requests for n, r in _by(store, "class").items()} == {"batch": 1, "standard": 1}
    assert {n: r.requests for n, r in _by(store, "model").items()} == {settings.default_model: 2}


def test_gpu_time_is_the_workers_busy_time_shared_among_the_requests_it_holds(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1", slots=8)
    a, a_attempt = _run(store, settings, tenant="a")
    time.sleep(0.2)  # a alone
    b, b_attempt = _run(store, settings, tenant="b")
    time.sleep(0.3)  # a and b side by side: each is charged half of it
    store.complete("w1", [Completion(a, a_attempt, "succeeded", completion_tokens=1)])
    time.sleep(0.1)  # b alone
    store.complete("w1", [Completion(b, b_attempt, "succeeded", completion_tokens=1)])
    f = {rid: store.redis.hgetall(store.keys.req(rid)) for rid in (a, b)}
    t0, t1 = int(f[a]["dispatched_ms"]), int(f[b]["dispatched_ms"])
    t2, t3 = int(f[a]["finished_ms"]), int(f[b]["finished_ms"])
    assert t1 - t0 >= 200 and t2 - t1 >= 300 and t3 - t2 >= 100
    want_a = (t1 - t0) + (t2 - t1) / 2
    want_b = (t2 - t1) / 2 + (t3 - t2)
    assert abs(int(f[a]["gpu_ms"]) - want_a) <= 1 and abs(int(f[b]["gpu_ms"]) - want_b) <= 1
    # The shares add up to the worker's busy time, first claim to last release.
    rows = _by(store, "tenant")
    assert abs(rows["a"].counts["gpu_ms"] + rows["b"].counts["gpu_ms"] - (t3 - t0)) <= 1
    # Each request's own service time (start to end) counts the overlap whole.
    assert int(f[a]["service_ms"]) + int(f[b]["service_ms"]) > t3 - t0 + 250


def test_usage_is_keyed_by_the_model_that_served_it_not_the_route(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w70", model="llama-3.1-70b-awq", params_b=70)
    rid, attempt = _run(store, settings, worker="w70", model=">=30b")
    done = Completion(rid, attempt, "succeeded", prompt_tokens=5, completion_tokens=2)
    assert store.complete("w70", [done]) == ["ok"]  # no model given: the heartbeat's
    rid2, attempt2 = _run(store, settings, worker="w70", model=">=30b")
    done = Completion(rid2, attempt2, "succeeded", prompt_tokens=1)
    assert store.complete("w70", [done], "llama-3.1-70b-awq") == ["ok"]  # as workers pass it
    queued = inference_request(settings, model=">=30b")
    store.submit(queued)
    store.cancel(queued.id)  # never served: counted under its route, with no tokens
    models = _by(store, "model")
    assert set(models) == {"llama-3.1-70b-awq", ">=30b"}
    assert models["llama-3.1-70b-awq"].requests == 2
    assert models["llama-3.1-70b-awq"].counts["prompt_tokens"] == 6
    assert models[">=30b"].counts["cancelled"] == 1
    assert store.redis.hget(store.keys.req(rid), "served_model") == "llama-3.1-70b-awq"
    # Every final event carries the request's usage, as meter.lua added it.
    finals = {e.fields.get("id"): e for e in store.events(count=100) if "usage" in e.fields}
    assert json.loads(finals[rid].fields["usage"]) == [
        "succeeded", "default", "", "standard", "llama-3.1-70b-awq", 5, 0, 2,
        int(store.redis.hget(store.keys.req(rid), "gpu_ms") or 0),
    ]  # fmt: skip
    assert json.loads(finals[queued.id].fields["usage"])[:5] == [
        "cancelled", "default", "", "standard", ">=30b",
    ]  # fmt: skip


def test_a_roll_up_expires_after_its_day_and_the_retention(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1")
    store.set_usage_retention()
    rid, attempt = _run(store, settings)
    store.complete("w1", [Completion(rid, attempt, "succeeded")])
    [key] = store.redis.keys(store.keys.prefix + "usage:[0-9]*")
    keep = settings.usage_retention_days * 86400
    assert keep < store.redis.ttl(key) <= keep + 86400


def test_a_corrupt_roll_up_value_is_moved_aside_and_skipped(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1", slots=8)
    rid, attempt = _run(store, settings, tenant="acme")
    store.complete("w1", [Completion(rid, attempt, "succeeded", prompt_tokens=4)])
    [key] = store.redis.keys(store.keys.prefix + "usage:[0-9]*")
    [field] = store.redis.hkeys(key)
    store.redis.hset(key, field, "garbage")
    store.redis.hset(key, "not json", "1 2 3")
    records, corrupt = store.usage_records(*_window(store))
    assert records == [] and {c.field for c in corrupt} == {field, "not json"}
    # The next request of that field: the bad value is reported aside, counting restarts.
    rid, attempt = _run(store, settings, tenant="acme")
    store.complete("w1", [Completion(rid, attempt, "succeeded", prompt_tokens=6)])
    assert store.redis.hget(store.keys.quarantine, f"usage:{key.rsplit(':', 1)[1]}|{field}")
    records, corrupt = store.usage_records(*_window(store))
    assert [r.counts[4] for r in records] == [6] and [c.field for c in corrupt] == ["not json"]
    assert store.record(rid).state is RequestState.SUCCEEDED


def test_a_roll_up_key_of_another_type_is_reported(store: Store) -> None:
    day = round(store.now() * 1000) // usage.DAY_MS
    store.redis.set(store.keys.usage_day(day), "x")
    records, corrupt = store.usage_records(day * usage.DAY_MS, (day + 1) * usage.DAY_MS)
    assert records == [] and [c.key for c in corrupt] == [store.keys.usage_day(day)]


def test_inferq_usage_prints_rows_cost_and_skips_corrupt_records(
    store: Store, settings: Settings, namespace: str, tmp_path: Path
) -> None:
    ready_worker(store, "w1", slots=8)
    for tenant, prompt in (("acme", 3), ("acme", 4), ("zeta", 10)):
        rid, attempt = _run(store, settings, tenant=tenant)
        done = Completion(rid, attempt, "succeeded", prompt_tokens=prompt, completion_tokens=1)
        store.complete("w1", [done])
    config = tmp_path / "inferq.toml"
    model = settings.default_model
    config.write_text(
        f'[prices."{model}"]\nprompt_per_1m_usd = 1000000.0\ncompletion_per_1m_usd = 2000000.0\n'
    )
    out = inferq(namespace, "usage", "--json", INFERQ_CONFIG=str(config))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = {r["name"]: r for r in data["rows"]}
    assert (rows["acme"]["requests"], rows["acme"]["prompt_tokens"]) == (2, 7)
    assert rows["acme"]["cost_usd"] == pytest.approx(7 + 2 * 2)  # $1/prompt, $2/completion token
    assert data["total"]["prompt_tokens"] == 17 and data["total"]["requests"] == 3
    assert data["corrupt"] == [] and data["total"]["unpriced_models"] == []
    # A corrupt record is skipped and reported; the rest still prints.
    [key] = store.redis.keys(store.keys.prefix + "usage:[0-9]*")
    store.redis.hset(key, "[1,2]", "bad")
    table = inferq(namespace, "usage", "--by", "class", "--since", "2d")
    assert table.returncode == 0, table.stderr
    assert "standard" in table.stdout and "total" in table.stdout and "cost $" in table.stdout
    assert "skipped 1 usage record" in table.stderr and "[1,2]" in table.stderr
    assert "no price for" in table.stderr  # no config: every model unpriced


def test_inferq_usage_refuses_a_bad_window(namespace: str) -> None:
    bad = inferq(namespace, "usage", "--since", "3 weeks")
    assert bad.returncode != 0 and "--since" in bad.stderr and "24h" in bad.stderr
    backwards = inferq(namespace, "usage", "--since", "1d", "--until", "2d")
    assert backwards.returncode != 0 and "--since: '1d' is not before until" in backwards.stderr


ADMIN = "admin-key-for-the-tests-0123456789"


def test_the_gateways_usage_endpoint_gives_the_clis_figures_behind_the_admin_key(
    store: Store, settings: Settings, namespace: str, tmp_path: Path
) -> None:
    ready_worker(store, "w1", slots=8)
    for tenant, prompt in (("acme", 3), ("acme", 4), ("zeta", 10)):
        rid, attempt = _run(store, settings, tenant=tenant)
        store.complete("w1", [Completion(rid, attempt, "succeeded", prompt_tokens=prompt)])
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-tenant"]\ntenant = "acme"\n')
    options = {"rate_limits": False, "deployment_metrics": False}
    digest_form = "sha256:" + hashlib.sha256(ADMIN.encode()).hexdigest()
    with GatewayServer(settings, keys, admin_key=AdminKey(digest_form), **options) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        got = httpx.get(f"{gw.url}/usage", params={"by": "tenant", "since": "2d"}, headers=admin)
        assert got.status_code == 200, got.text
        data = got.json()
        cli = inferq(namespace, "usage", "--json", "--since", "2d")
        assert cli.returncode == 0, cli.stderr
        same = ("by", "rows", "total", "corrupt")  # the window moves if the hour turns
        assert {k: data[k] for k in same} == {k: json.loads(cli.stdout)[k] for k in same}
        assert {r["name"]: r["prompt_tokens"] for r in data["rows"]} == {"acme": 7, "zeta": 10}
        by_model = httpx.get(f"{gw.url}/usage?by=model", headers=admin).json()
        assert [r["name"] for r in by_model["rows"]] == [settings.default_model]
        # A tenant's key, a wrong key, no key: not the admin's.
        for headers in ({"Authorization": "Bearer sk-tenant"}, {"Authorization": "Bearer x"}, {}):
            refused = httpx.get(f"{gw.url}/usage", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == (
                "invalid_api_key"
            )
        # The admin key opens nothing else.
        assert httpx.get(f"{gw.url}/models", headers=admin).status_code == 401
        # Bad parameters: 400 naming the parameter.
        for params, named in (
            ({"by": "team"}, "by"),
            ({"since": "3 weeks"}, "since"),
            ({"until": "x"}, "until"),
            ({"since": "1d", "until": "2d"}, "since"),
            ({"cell": "east"}, "cell"),
            ({"tenant": "acme"}, "tenant"),
        ):
            bad = httpx.get(f"{gw.url}/usage", params=params, headers=admin)
            assert bad.status_code == 400, (params, bad.text)
            assert bad.json()["error"]["param"] == named, bad.text
            assert bad.json()["error"]["message"].startswith(f"{named}: ")

        # Redis away: a 503, not a traceback.
        def unreachable(query: object) -> dict[str, object]:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

        gw.app.state.gateway.usage_reader.report = unreachable
        down = httpx.get(f"{gw.url}/usage", headers=admin)
        assert down.status_code == 503 and "Connection refused" in down.json()["error"]["message"]
    with GatewayServer(settings, keys, **options) as closed:
        shut = httpx.get(f"{closed.url}/usage", headers={"Authorization": f"Bearer {ADMIN}"})
        assert shut.status_code == 403 and "--admin-key" in shut.json()["error"]["message"]


def test_an_admin_key_too_short_or_a_bad_digest_is_refused() -> None:
    for text in ("short", "sha256:abc"):
        with pytest.raises(ConfigError, match="--admin-key"):
            AdminKey(text)
    assert AdminKey(ADMIN).matches(ADMIN) and not AdminKey(ADMIN).matches(ADMIN + "x")


def test_the_dashboard_shows_todays_usage_by_tenant_and_model(
    store: Store, settings: Settings
) -> None:
    from inferq.dashboard.app import render_fragment
    from inferq.dashboard.state import dashboard_state, usage_today

    ready_worker(store, "w1", slots=64)
    priced = settings.model_copy(
        update={"prices": {settings.default_model: Price(prompt_per_1m_usd=1_000_000.0)}}
    )
    store = Store(store.redis, priced)
    for i in range(5):
        rid, attempt = _run(store, settings, tenant=f"t{i}")
        store.complete("w1", [Completion(rid, attempt, "succeeded", prompt_tokens=i + 1)])
    now_ms = round(store.now() * 1000)
    today = usage_today(store, now_ms, rows=3)
    cli = store.usage_report("tenant", f"{now_ms % usage.DAY_MS // usage.HOUR_MS}h", "now")
    assert today["tenant"]["total"] == cli["total"]  # inferq usage's figures, since midnight
    names = [r["name"] for r in today["tenant"]["rows"]]
    assert names == ["t4", "t3", "t2", "(2 more)"]  # by cost, the rest in one row
    assert today["tenant"]["rows"][-1]["prompt_tokens"] == 1 + 2
    assert today["tenant"]["rows"][-1]["cost_usd"] == pytest.approx(3.0)
    assert [r["name"] for r in today["model"]["rows"]] == [settings.default_model]
    html = render_fragment(dashboard_state(store))
    assert "Usage today by tenant" in html and "Usage today by model" in html
    assert "<td>t4</td>" in html
    assert "15.0000" in html  # the day's cost: 15 prompt tokens at $1 each


def test_a_request_whose_load_was_rebuilt_is_metered_its_service_time(
    store: Store, settings: Settings
) -> None:
    ready_worker(store, "w1", slots=8)
    rid, attempt = _run(store, settings)
    time.sleep(0.05)
    store.quarantine(store.keys.load("w1"), "test: load set aside")  # rebuilt from inflight
    assert store.redis.hget(store.keys.load("w1"), "gpu_acc") is None
    store.complete("w1", [Completion(rid, attempt, "succeeded", completion_tokens=1)])
    fields = store.redis.hgetall(store.keys.req(rid))
    assert int(fields["gpu_ms"]) == int(fields["service_ms"])  # not 0: the share is unknown
