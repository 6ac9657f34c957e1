"""Usage roll-ups read back, summed and priced (``inferq.usage``), and prices validated."""

from __future__ import annotations

import re

import pytest

from inferq import defaults, usage
from inferq.config import Price, Settings
from inferq.errors import ConfigError, InvalidUsageQuery
from inferq.store.scripts import script_source

H = usage.HOUR_MS


def _rec(hour: int, tenant: str = "acme", model: str = "m", **counts: int) -> usage.UsageRecord:
    values = tuple(counts.get(c, 0) for c in usage.COUNTERS)
    return usage.UsageRecord(hour, tenant, "", "standard", model, values)


def test_cost_sums_gpu_hours_and_token_rates() -> None:
    counts = dict.fromkeys(usage.COUNTERS, 0)
    counts.update(gpu_ms=1_800_000, prompt_tokens=2_000_000, cached_tokens=1_000_000)
    counts["completion_tokens"] = 500_000
    price = Price(gpu_hour_usd=4.0, prompt_per_1m_usd=1.0, completion_per_1m_usd=2.0)
    # half a GPU-hour, 2M prompt tokens (cached ones at the prompt rate), 0.5M completion
    assert usage.cost_usd(counts, price) == pytest.approx(2.0 + 2.0 + 1.0)
    cheap = price.model_copy(update={"cached_prompt_per_1m_usd": 0.1})
    assert usage.cost_usd(counts, cheap) == pytest.approx(2.0 + 1.0 + 0.1 + 1.0)


def test_roll_up_keeps_the_window_and_prices_by_model() -> None:
    records = [
        _rec(10, prompt_tokens=1_000_000, succeeded=1),
        _rec(11, model="free", prompt_tokens=5, failed=1),
        _rec(12, tenant="other", prompt_tokens=7, succeeded=1),  # outside the window
    ]
    [row] = usage.roll_up(records, "tenant", {"m": Price(prompt_per_1m_usd=3.0)}, 10 * H, 12 * H)
    assert (row.name, row.requests, row.counts["prompt_tokens"]) == ("acme", 2, 1_000_005)
    assert row.cost_usd == pytest.approx(3.0) and row.unpriced == {"free"}
    by_model = usage.roll_up(records, "model", {}, 0, 13 * H)
    assert [r.name for r in by_model] == ["free", "m"]


def test_parse_record_refuses_what_meter_lua_would_not_write() -> None:
    good = usage.parse_record("k", '[5,"acme","","standard","m"]', "1 0 0 0 3 0 2 40")
    assert isinstance(good, usage.UsageRecord) and good.counts[4] == 3
    for name, value in [
        ('[5,"acme"]', "1 0 0 0 3 0 2 40"),
        ("{}", "1 0 0 0 3 0 2 40"),
        ('[5,"acme","","standard","m"]', "1 0 0"),
        ('[5,"acme","","standard","m"]', "1 0 0 0 3 0 2 -4"),
        ('[5,"acme","","standard","m"]', "x"),
    ]:
        assert isinstance(usage.parse_record("k", name, value), usage.Corrupt)


def test_days_between_covers_the_window() -> None:
    d = usage.DAY_MS
    assert usage.days_between(d, 3 * d) == [1, 2]
    assert usage.days_between(d + 5, d + 6) == [1]
    assert usage.days_between(5, 5) == []


@pytest.mark.parametrize(
    ("prices", "named"),
    [
        ({"llama-3.1-8b": {"gpu_hour_usd": -1}}, "prices.llama-3.1-8b.gpu_hour_usd"),
        ({"llama-3.1-8b": {"prompt_per_1m_usd": -0.5}}, "prices.llama-3.1-8b.prompt_per_1m_usd"),
        ({"no-such-model": {"gpu_hour_usd": 1}}, "prices['no-such-model']"),
        ({"llama-3.1-8b": {"gpu_hours": 1}}, "prices.llama-3.1-8b.gpu_hours"),
    ],
)
def test_a_bad_price_is_refused_naming_the_field(prices: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        Settings.load(prices=prices)


def test_a_usage_retention_below_a_day_is_refused() -> None:
    with pytest.raises(ConfigError, match="usage_retention_days"):
        Settings.load(usage_retention_days=0)


def test_meter_lua_default_retention_is_the_default_setting() -> None:
    src = script_source("complete")
    [days] = re.findall(r"local USAGE_RETENTION_S = (\d+) \* 86400", src)
    assert int(days) == defaults.USAGE_RETENTION_DAYS


def test_the_window_is_whole_hours_with_the_current_one() -> None:
    now = 100 * H + 1234
    assert usage.window_ms(now, "24h", "now") == (76 * H, 101 * H)
    assert usage.window_ms(now, "2d", "1d") == (52 * H, 77 * H)
    bad = (
        ("3x", "now", "since"),
        ("1h", "2h", "since"),
        ("1h", "x", "until"),
        ("999999d", "now", "since"),  # a million daily reads in one pipeline
        ("\u0663h", "now", "since"),  # an Arabic-Indic 3: ASCII digits only
    )
    for since, until, named in bad:
        with pytest.raises(InvalidUsageQuery) as refused:
            usage.window_ms(now, since, until)
        assert refused.value.field == named


def test_a_usage_query_by_an_unknown_dimension_is_refused_naming_by() -> None:
    assert usage.check_by("model") == "model"
    with pytest.raises(InvalidUsageQuery, match="tenant, key, class, model") as refused:
        usage.check_by("team")
    assert refused.value.field == "by"


def test_the_report_totals_its_rows_and_lists_what_it_skipped() -> None:
    recs = [
        usage.UsageRecord(100, "a", "", "standard", "m", (1, 0, 0, 0, 10, 0, 2, 500)),
        usage.UsageRecord(100, "b", "", "batch", "m", (0, 1, 0, 1, 4, 1, 0, 0)),
        usage.UsageRecord(99, "b", "", "batch", "m", (5, 0, 0, 0, 4, 1, 0, 0)),  # outside
    ]
    bad = [usage.Corrupt("k", "f", "why")]
    data = usage.report(recs, bad, "tenant", {}, 100 * H, 101 * H)
    assert [r["name"] for r in data["rows"]] == ["a", "b"]  # type: ignore[index]
    total = data["total"]
    assert isinstance(total, dict)
    assert (total["requests"], total["prompt_tokens"], total["gpu_s"]) == (3, 14, 0.5)
    assert total["unpriced_models"] == ["m"]
    assert data["corrupt"] == [{"key": "k", "field": "f", "reason": "why"}]


@pytest.mark.parametrize(
    ("budget", "named"),
    [
        ({"tenant": "acme", "period": "week", "tokens": 5}, "budgets.b.period"),
        ({"tenant": "acme", "period": "day", "tokens": -5}, "budgets.b.tokens"),
        ({"tenant": "acme", "period": "day", "usd": -1.0}, "budgets.b.usd"),
        ({"tenant": "acme", "period": "day"}, "exactly one of tokens and usd"),
        ({"period": "day", "tokens": 5}, "exactly one of tenant and key"),
        ({"key": "not-a-key-id", "period": "day", "tokens": 5}, "budgets.b.key"),
        ({"tenant": "acme", "period": "day", "tokens": 5, "soft": 9}, "soft (9.0) must be below"),
        ({"tenant": "acme", "period": "day", "tokens": 5, "cap": 9}, "budgets.b.cap"),
    ],
)
def test_a_bad_budget_is_refused_naming_the_field(budget: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        Settings.load(budgets={"b": budget})


def test_a_final_events_usage_parses_or_is_refused() -> None:
    u = usage.parse_event_usage('["succeeded","acme","","standard","m",30,16,7,1200]')
    assert (u.outcome, u.tenant, u.model, u.prompt_tokens, u.cached_tokens) == (
        "succeeded", "acme", "m", 30, 16,
    )  # fmt: skip
    assert (u.completion_tokens, u.gpu_ms) == (7, 1200)
    for bad in (
        "[1",  # not JSON
        '["succeeded","acme","","standard","m",30,16,7]',  # 8 values
        '["running","acme","","standard","m",0,0,0,0]',  # not a final state
        '["failed","acme","","standard","m",-1,0,0,0]',  # below 0
        '["failed","acme","","standard","m",1.5,0,0,0]',  # not whole
        '["failed",3,"","standard","m",1,0,0,0]',  # a dimension not a string
    ):
        with pytest.raises(ValueError):
            usage.parse_event_usage(bad)
