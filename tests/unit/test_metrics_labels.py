"""Bounded label values of the metrics: top-N tenants plus other, sticky labels, error kinds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.metrics.labels import ERROR_KINDS, OTHER, StickyLabels, error_kind, top_n

names = st.text(alphabet="abcdefgh", min_size=1, max_size=3)


@given(st.dictionaries(names, st.integers(0, 1000)), st.integers(0, 6))
def test_top_n_keeps_the_total_in_at_most_n_plus_one_labels(values: dict[str, int], n: int) -> None:
    out = top_n({k: float(v) for k, v in values.items()}, n)
    assert len(out) <= n + 1
    assert sum(out.values()) == sum(values.values())
    named = [k for k in out if k != OTHER]
    # Every tenant with its own label outranks every folded one.
    folded = [v for k, v in values.items() if k not in out or k == OTHER]
    assert all(values[k] >= max(folded, default=0) for k in named)


def test_top_n_breaks_ties_by_name_and_refuses_a_negative_n() -> None:
    assert top_n({"b": 1.0, "a": 1.0, "c": 1.0}, 2) == {"a": 1.0, "b": 1.0, "other": 1.0}
    assert top_n({"a": 1.0}, 1) == {"a": 1.0}
    with pytest.raises(ValueError, match="n must be >= 0"):
        top_n({}, -1)


@given(st.lists(names, max_size=50), st.integers(0, 5))
def test_sticky_labels_never_give_more_than_n_plus_one_values(seen: list[str], n: int) -> None:
    label = StickyLabels(n)
    first = [label(name) for name in seen]
    assert len(set(first)) <= n + 1
    assert [label(name) for name in seen] == first  # a tenant keeps its label


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("openai: request r timed out after 3.000 s (its remaining time) at x", "timeout"),
        ("openai: request r: connection to http://x failed: ConnectError: refused", "connection"),
        ("openai: request r: HTTP 503 from http://x: overloaded", "http_5xx"),
        ("openai: request r: HTTP 429 from http://x: slow down", "http_429"),
        ("openai: request r: HTTP 400 from http://x: bad prompt", "http_4xx"),
        ("openai: request r: malformed answer (not a JSON object): ''", "malformed"),
        ("lease expired on worker w1", "lease_lapsed"),
        ("openai: request r has no time left before its deadline", "deadline"),
        ("sim: simulated failure of request r", "simulated"),
        (
            "openai: request r: the stream ended without a finish reason or [DONE] after 2 "
            "chunks (truncated)",
            "truncated",
        ),
        ("openai: request r: HTTP 200 with an empty body", "truncated"),
        (
            "openai: request r: connection to http://llm-loadbalancer:8000 failed: "
            "ConnectError: refused",
            "connection",
        ),
        (
            "openai: request r timed out after 3.000 s (its remaining time) at "
            "http://connection-pool-gw:8000",
            "timeout",
        ),
        ("something else", "other"),
        ("", "unknown"),
    ],
)
def test_error_kind_names_each_failure_from_a_fixed_set(message: str, kind: str) -> None:
    assert error_kind(message) == kind
    assert kind in ERROR_KINDS
