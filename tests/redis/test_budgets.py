"""Budgets held at intake and settled when final (``lua/includes/budget.lua``), real Redis."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import openai
import pytest
import redis

from inferq.config import Settings
from inferq.errors import BudgetExceeded
from inferq.gateway.tenants import digest
from inferq.store import Completion, Store
from inferq.store.scripts import _read

from ..builders import inference_request
from ..conftest import REDIS_URL
from ..helpers import queue_key, ready_worker
from .gateway_server import GatewayServer
from .test_cli_ops import inferq
from .test_gateway import MODEL, sdk


def _budgeted(namespace: str, **budget: object) -> Settings:
    return Settings.load(redis_url=REDIS_URL, namespace=namespace, budgets={"acme-day": budget})


def _budget_hash(store: Store) -> dict[str, str]:
    [key] = store.redis.keys(store.keys.prefix + "budget:acme-day:*")
    return store.redis.hgetall(key)


def test_a_burst_of_50_with_one_request_of_budget_admits_one(
    redis_client: redis.Redis, namespace: str
) -> None:
    settings = _budgeted(namespace, tenant="acme", period="day", tokens=100)
    probe = inference_request(settings, tenant="acme", max_tokens=60)
    # Room for one request's estimate (prompt + max_tokens), not two.
    assert 2 * (probe.prompt_tokens + 60) > 100
    admitted: list[str] = []
    refused: list[BudgetExceeded] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def submit() -> None:
        store = Store(redis.Redis.from_url(REDIS_URL, decode_responses=True), settings)
        r = inference_request(settings, tenant="acme", max_tokens=60)
        start.wait()
        try:
            store.submit(r)
            with lock:
                admitted.append(r.id)
        except BudgetExceeded as exc:
            with lock:
                refused.append(exc)

    threads = [threading.Thread(target=submit) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(admitted) == 1 and len(refused) == 49
    exc = refused[0]
    assert exc.budget == "acme-day" and exc.period == "day" and exc.unit == "tokens"
    tomorrow = datetime.now(UTC).date().toordinal() + 1
    assert datetime.fromtimestamp(exc.resets_at, UTC).date().toordinal() == tomorrow
    assert "budget 'acme-day' exhausted" in str(exc) and "resets at" in str(exc)
    store = Store(redis_client, settings)
    assert float(_budget_hash(store)["held"]) == probe.prompt_tokens + 60
    # A refusal wrote nothing: one request queued, one record.
    assert store.redis.hget(store.keys.counts, f"c:{probe.priority}") == "1"
    assert len(store.redis.keys(store.keys.prefix + "req:*")) == 1


def test_a_final_request_settles_its_hold_and_frees_the_rest(
    redis_client: redis.Redis, namespace: str
) -> None:
    settings = _budgeted(namespace, tenant="acme", period="day", tokens=1000)
    store = Store(redis_client, settings)
    ready_worker(store, "w1")
    r = inference_request(settings, tenant="acme", max_tokens=200)
    store.submit(r)
    other = inference_request(settings, tenant="other", max_tokens=900)
    store.submit(other)  # another tenant: no budget applies
    held = r.prompt_tokens + 200
    assert float(_budget_hash(store)["held"]) == held
    [(rid, attempt)] = store.assign("w1", "b1", [(r.id, queue_key(store, r), 1.0)])
    store.start("w1", [(rid, attempt)])
    done = Completion(rid, attempt, "succeeded", prompt_tokens=30, completion_tokens=12)
    store.complete("w1", [done])
    store.complete("w1", [done])  # a duplicate settles nothing twice
    after = _budget_hash(store)
    assert float(after["held"]) == 0 and float(after["spent"]) == 42
    # A cancelled request gives its whole hold back and spends nothing.
    c = inference_request(settings, tenant="acme", max_tokens=900)
    store.submit(c)
    store.cancel(c.id)
    assert float(_budget_hash(store)["held"]) == 0 and float(_budget_hash(store)["spent"]) == 42
    with pytest.raises(BudgetExceeded, match="42 of 1,000 tokens"):
        store.submit(inference_request(settings, tenant="acme", max_tokens=990))


def test_a_usd_budget_by_api_key_prices_tokens_and_the_soft_limit_warns(
    redis_client: redis.Redis, namespace: str
) -> None:
    settings = Settings.load(
        redis_url=REDIS_URL,
        namespace=namespace,
        prices={"llama-3.1-8b": {"prompt_per_1m_usd": 1e6, "completion_per_1m_usd": 2e6}},
        budgets={"acme-day": {"key": "0123456789ab", "period": "month", "usd": 500, "soft": 100}},
    )  # $1 a prompt token, $2 a completion token
    store = Store(redis_client, settings)
    keyed = inference_request(settings, tenant="acme", max_tokens=50).model_copy(
        update={"api_key": "0123456789ab"}
    )
    store.submit(keyed)
    assert float(_budget_hash(store)["held"]) == keyed.prompt_tokens + 100
    events = [e for e in store.redis.xrange(store.keys.events) if e[1]["type"] == "budget_soft"]
    assert [e[1]["budget"] for e in events] == ["acme-day"]  # crossed the soft limit: warned
    [key] = store.redis.keys(store.keys.prefix + "budget:acme-day:*")
    assert key.endswith(":m" + datetime.now(UTC).strftime("%Y%m"))
    store.submit(inference_request(settings, tenant="acme", max_tokens=300))  # no key: no budget
    with pytest.raises(BudgetExceeded, match=r"\$") as exc:
        store.submit(
            inference_request(settings, tenant="acme", max_tokens=250).model_copy(
                update={"api_key": "0123456789ab"}
            )
        )
    assert exc.value.period == "month" and exc.value.unit == "usd"


@pytest.mark.parametrize(
    ("now", "period", "resets"),
    [
        (datetime(2026, 12, 6, 11, 0, tzinfo=UTC), "m202612", datetime(2027, 1, 1, tzinfo=UTC)),
        (datetime(2024, 2, 29, 23, 59, tzinfo=UTC), "m202402", datetime(2024, 3, 1, tzinfo=UTC)),
        (datetime(2000, 1, 31, tzinfo=UTC), "m200001", datetime(2000, 2, 1, tzinfo=UTC)),
        (datetime(2100, 3, 1, tzinfo=UTC), "m210003", datetime(2100, 4, 1, tzinfo=UTC)),
    ],
)
def test_the_month_period_is_the_utc_calendar_month(
    redis_client: redis.Redis, now: datetime, period: str, resets: datetime
) -> None:
    src = _read("includes/budget.lua") + "\nreturn {budget_period(ARGV[1], tonumber(ARGV[2]))}"
    ms = int(now.timestamp() * 1000)
    got = redis_client.eval(src, 0, "month", ms)
    assert got == [period, int(resets.timestamp() * 1000)]
    assert redis_client.eval(src, 0, "day", ms)[1] == (ms // 86_400_000 + 1) * 86_400_000


def test_the_gateway_refuses_a_spent_key_budget_with_insufficient_quota(
    redis_client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-budget"]\ntenant = "acme"\n')
    key_id = digest("sk-budget")[:12]
    settings = Settings.load(
        redis_url=REDIS_URL,
        namespace=namespace,
        budgets={"acme-day": {"key": key_id, "period": "day", "tokens": 10}},
    )
    ready_worker(Store(redis_client, settings), "w1")  # the route is served
    with (
        GatewayServer(settings, keys, rate_limits=False) as gateway,
        pytest.raises(openai.RateLimitError) as refused,
    ):
        sdk(gateway, "sk-budget").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60
        )
    error = refused.value.body
    assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"  # type: ignore[index]
    assert "budget 'acme-day' exhausted" in error["message"] and "resets at" in error["message"]  # type: ignore[index]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 86400


def test_inferq_gateway_refuses_a_budget_for_a_key_it_does_not_have(
    redis_client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-known"]\ntenant = "acme"\n')
    config = tmp_path / "inferq.toml"
    stored = digest("iq-stored-key")
    config.write_text(
        f'[budgets.stored]\nkey = "{stored[:12]}"\nperiod = "day"\ntokens = 10\n'
        '[budgets.typo]\nkey = "0123456789ab"\nperiod = "day"\ntokens = 10\n'
    )
    env = {"INFERQ_CONFIG": str(config)}
    store = Store(redis_client, Settings.load(redis_url=REDIS_URL, namespace=namespace))
    store.put_api_key(stored, '{"tenant": "acme"}')  # as inferq keys add stores it
    out = inferq(namespace, "gateway", "--keys", str(keys), "--redis-keys", "--port", "1", **env)
    assert out.returncode != 0
    assert "budgets['typo'].key: '0123456789ab' is not the id of any API key" in out.stderr
    assert "budgets['stored']" not in out.stderr  # checked first (by name): a known key
    # Without --redis-keys the stored key is not this gateway's either.
    out = inferq(namespace, "gateway", "--keys", str(keys), "--port", "1", **env)
    assert out.returncode != 0 and "budgets['stored'].key" in out.stderr
