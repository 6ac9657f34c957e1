"""The dashboard's pure parts: SLA attainment from events, and the HTML it renders."""

from __future__ import annotations

from inferq.dashboard.app import render_fragment
from inferq.dashboard.state import sla_attainment
from inferq.models import Event


def _e(etype: str, cls: str, ttft_ms: str) -> Event:
    return Event(id="1-0", type=etype, at=1.0, fields={"class": cls, "ttft_ms": ttft_ms})


def test_sla_attainment_counts_finishes_within_the_class_sla() -> None:
    events = [
        _e("finish", "realtime", "500"),
        _e("finish", "realtime", "2500"),  # late
        _e("fail", "realtime", "100"),  # a failure misses it
        _e("finish", "batch", "1000"),
        _e("dispatch", "realtime", "1"),  # not a final result
    ]
    out = sla_attainment(events, {"realtime": 2.0, "batch": 3600.0, "standard": 10.0})
    assert out["realtime"] == {"finished": 3, "met": 1, "attainment": 1 / 3}
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
