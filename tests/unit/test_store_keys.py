"""Every key starts with the namespace prefix, and the Lua templates agree with keys.py."""

from __future__ import annotations

import re
from importlib import resources

from hypothesis import given
from hypothesis import strategies as st

from inferq.store.keys import Keys, count_field_queue, join_parts

LIB = (resources.files("inferq.store") / "lua" / "includes" / "keys.lua").read_text()


def test_every_key_is_under_the_prefix() -> None:
    k = Keys("prod")
    built = [
        k.req("a"),
        k.queues,
        k.deadlines,
        k.leases,
        k.done("a"),
        k.payload("a"),
        k.stream("a"),
        k.callers,
        k.caller("g"),
        k.idem("t", "x"),
        k.counts,
        k.stats,
        k.workers,
        k.worker("w"),
        k.load("w"),
        k.inflight("w"),
        k.drain("w"),
        k.ctl("w"),
        k.fair_classes,
        k.fair_vtc("batch"),
        k.fair_live("batch"),
        k.fair_seen("batch"),
        k.fair_new("batch"),
        k.tenant_queue("batch", "m", "t"),
        k.tenant_index("batch", "m"),
        k.estimates_seen,
        k.dead,
        k.quarantine,
        k.quarantined("x"),
        k.events,
        k.prefix_log,
        k.rate_limits,
        k.wake,
        k.delayed,
        k.estimates,
        k.scaler_lease,
        k.metrics_lease,
        k.scaler_desired,
        k.scaler_state,
        k.scaler_workers,
    ]
    assert all(key.startswith("inferq:prod:") for key in built)
    assert len(set(built)) == len(built)


def test_lua_templates_match_keys_py() -> None:
    k = Keys("ns")
    templates = dict(re.findall(r"local function (k_\w+)\(p, [^)]*\) return p \.\. '([^']+)'", LIB))
    assert k.req("ID") == k.prefix + templates["k_req"] + "ID"
    assert k.done("ID") == k.prefix + templates["k_done"] + "ID"
    assert k.payload("ID") == k.prefix + templates["k_payload"] + "ID"
    assert k.stream("ID") == k.prefix + templates["k_stream"] + "ID"
    assert k.worker("W") == k.prefix + templates["k_worker"] + "W"
    assert k.load("W") == k.prefix + templates["k_load"] + "W"
    assert k.inflight("W") == k.prefix + templates["k_inflight"] + "W"
    assert k.ctl("W") == k.prefix + templates["k_ctl"] + "W"
    assert k.caller("G") == k.prefix + templates["k_caller"] + "G"
    assert "local function k_prefixlog(p) return p .. 'prefixlog' end" in LIB
    assert k.prefix_log == k.prefix + "prefixlog"
    queue_lua = (resources.files("inferq.store") / "lua" / "includes" / "queue.lua").read_text()
    assert count_field_queue("C", "R") == "q:C|R"
    assert "'q:' .. class .. '|' .. route" in queue_lua


@given(
    st.lists(st.text(min_size=0, max_size=8), min_size=1, max_size=4),
    st.lists(st.text(min_size=0, max_size=8), min_size=1, max_size=4),
)
def test_joined_parts_never_collide(a: list[str], b: list[str]) -> None:
    # Issue 12, fault 6: caller-chosen parts (tenant, idempotency key) joined into one
    # name: two different lists of parts never give the same name.
    assert (join_parts(*a) == join_parts(*b)) == (a == b)


def test_idempotency_keys_of_colliding_plain_joins_differ() -> None:
    k = Keys("prod")
    assert k.idem("acme", "inv:42") != k.idem("acme:inv", "42")
    assert k.idem("acme", "inv:42") == "inferq:prod:idem:4.acme:6.inv:42"


def test_request_id_of_reads_only_request_hash_keys() -> None:
    k = Keys("prod")
    assert k.request_id_of(k.req("abc")) == "abc"
    assert k.request_id_of(k.payload("abc")) is None
    assert k.request_id_of(k.done("abc")) is None


def test_tenant_queue_keys_are_unambiguous_and_match_lua() -> None:
    k = Keys("ns")
    # routes and tenants may both hold ':': the length prefix keeps the pairs apart
    assert k.tenant_queue("c", "a:b", "t") != k.tenant_queue("c", "a", "b:t")
    assert k.tenant_queue("c", "llama", "acme") == f"{k.prefix}tq:c:5:llama:acme"
    assert k.tenant_queue("c", "é", "t") == f"{k.prefix}tq:c:2:é:t"  # bytes, as string.len
    assert "'tq:' .. class .. ':' .. string.len(route) .. ':' .. route .. ':' .. tenant" in LIB
    assert k.tenant_index("C", "R") == f"{k.prefix}tix:C:R"
    assert "'tix:' .. class .. ':' .. route" in LIB
