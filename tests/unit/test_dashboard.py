"""The dashboard's pure parts: SLA attainment from events, and the HTML it renders."""

from __future__ import annotations

from inferq.config import Settings
from inferq.dashboard.app import render_fragment
from inferq.dashboard.state import sla_attainment
from inferq.models import Event

CLASSES = Settings().class_by_name


def _e(etype: str, cls: str, ttft_ms: str, **more: str) -> Event:
    return Event(id="1-0", type=etype, at=1.0, fields={"class": cls, "ttft_ms": ttft_ms, **more})


def test_sla_attainment_counts_finishes_within_the_class_slo() -> None:
    rt = CLASSES["realtime"]
    assert rt.tpot_s is not None
    long_prompt = int(rt.reference_prefill_tps)  # one more second of TTFT allowed
    late_ms = str(1000 * (rt.sla_s + 0.5))
    slow = 1000 * (rt.tpot_s * 2)  # two targets per token
    events = [
        _e("finish", "realtime", "500"),
        _e("finish", "realtime", late_ms),  # late for a short prompt
        _e("finish", "realtime", late_ms, ptokens=str(long_prompt)),  # on time for a long one
        _e("finish", "realtime", "500", e2e_ms=str(500 + 10 * slow), tokens="11"),  # slow decode
        _e("fail", "realtime", "100"),  # a failure misses it
        _e("finish", "batch", "1000"),
        _e("dispatch", "realtime", "1"),  # not a final result
    ]
    out = sla_attainment(events, CLASSES)
    assert out["realtime"] == {"finished": 5, "met": 2, "attainment": 2 / 5}
    assert out["batch"]["attainment"] == 1.0
    assert out["standard"] == {"finished": 0, "met": 0, "attainment": None}


def test_the_fragment_escapes_every_value() -> None:
    state = {
        "queues": [{"class": "realtime", "route": "<r>", "queued": 1, "oldest_wait_s": None}],
        "workers": [],
        "sla": {},
        "sla_window_s": 300.0,
        "events": [{"at": 0.0, "type": "retry", "fields": {"error": "<script>x</script>"}}],
        "dead_letter": {"count": 0, "requests": []},
    }
    html = render_fragment(state)
    assert "<script>" not in html and "&lt;script&gt;" in html and "&lt;r&gt;" in html


def test_a_workers_kv_cell_shows_the_measured_room_when_it_has_one() -> None:
    row = {
        "id": "w1", "model": "m", "state": "ready", "slots_used": 1, "slots": 4,
        "kv_used_mib": 45.0, "kv_cache_mib": 2651, "heartbeat_age_s": 0.2, "health": "ok",
    }  # fmt: skip
    state = {
        "queues": [],
        "workers": [{**row, "kv_measured_free_mib": 180.0}, {**row, "id": "w2"}],
        "sla": {},
        "sla_window_s": 300.0,
        "events": [],
        "dead_letter": {"count": 0, "requests": []},
    }
    html = render_fragment(state)
    assert "45/2651 MiB, 180 free measured" in html
    assert html.count("45/2651 MiB") == 2  # w2 measured nothing: the bookkeeping alone


def test_a_workers_prefix_hit_rate_is_shown_from_the_server_s_count() -> None:
    row = {
        "id": "w1", "model": "m", "state": "ready", "slots_used": 1, "slots": 4,
        "kv_used_mib": 45.0, "kv_cache_mib": 2651, "heartbeat_age_s": 0.2, "health": "ok",
        "kv_measured_free_mib": None,
    }  # fmt: skip
    state = {
        "queues": [],
        "workers": [{**row, "prefix_hit_rate": 0.625}, {**row, "id": "w2"}],
        "sla": {},
        "sla_window_s": 300.0,
        "events": [],
        "dead_letter": {"count": 0, "requests": []},
    }
    html = render_fragment(state)
    assert "prefix hits" in html and "62%" in html


def test_the_usage_tables_escape_names_and_mark_unpriced_models() -> None:
    row = {
        "name": "<b>acme</b>", "requests": 3, "succeeded": 2, "failed": 1, "expired": 0,
        "cancelled": 0, "prompt_tokens": 1200, "cached_tokens": 0, "completion_tokens": 9,
        "gpu_ms": 1500, "gpu_s": 1.5, "cost_usd": 0.25, "unpriced_models": ["m"],
    }  # fmt: skip
    report = {"rows": [row], "total": {**row, "name": "total"}}
    today = {"since_ms": 0, "until_ms": 3 * 3_600_000, "corrupt": 2, "tenant": report}
    state = {
        "queues": [],
        "workers": [],
        "sla": {},
        "sla_window_s": 300.0,
        "events": [],
        "dead_letter": {"count": 0, "requests": []},
        "usage": {**today, "model": {"rows": [], "total": {**row, "name": "total"}}},
    }
    html = render_fragment(state)
    assert "&lt;b&gt;acme&lt;/b&gt;" in html and "<b>acme" not in html
    assert "Usage today by tenant (UTC, 3 h" in html and "1,200" in html and "0.2500*" in html
    assert "nothing metered today" in html  # the model table has no row
    assert "2 usage record(s) do not parse" in html
