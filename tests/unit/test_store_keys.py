"""Every key starts with the namespace prefix, and the Lua templates agree with keys.py."""

from __future__ import annotations

import re
from importlib import resources

from inferq.store.keys import Keys

LIB = (resources.files("inferq.store") / "lua" / "includes" / "keys.lua").read_text()


def test_every_key_is_under_the_prefix() -> None:
    k = Keys("prod")
    built = [
        k.req("a"),
        k.queue("realtime", ">=13b"),
        k.queues,
        k.deadlines,
        k.leases,
        k.done("a"),
        k.idem("t", "x"),
        k.counts,
        k.stats,
        k.workers,
        k.worker("w"),
        k.load("w"),
        k.inflight("w"),
        k.drain("w"),
        k.fair_classes,
        k.fair_tenants("batch"),
        k.fair_active("batch"),
        k.dead,
        k.quarantine,
        k.quarantined("x"),
        k.events,
        k.wake,
        k.estimates,
        k.scaler_lease,
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
    assert k.load("W") == k.prefix + templates["k_load"] + "W"
    assert k.inflight("W") == k.prefix + templates["k_inflight"] + "W"
    assert k.queue("C", "R") == f"{k.prefix}q:C:R"
    assert "'q:' .. class .. ':' .. route" in LIB
