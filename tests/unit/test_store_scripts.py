"""The Lua scripts as files: each documents its contract, includes resolve, fragments exist once."""

from __future__ import annotations

import re
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq import defaults
from inferq.store import scripts
from inferq.store.glance import redis_time_ms
from inferq.store.keys import Keys
from inferq.store.scripts import SCRIPTS, includes_of, script_source
from inferq.store.snapshot import WORKER_FIELDS

LUA = resources.files("inferq.store") / "lua"
FRAGMENTS = sorted(p.name.removesuffix(".lua") for p in (LUA / "includes").iterdir())
#: What Lua, Redis and the scripts themselves provide without an include.
BUILTINS = {"tonumber", "tostring", "ipairs", "pairs", "unpack", "type", "error", "pcall"}
_DEFINED = re.compile(r"^\s*local function (\w+)\(", re.M)
_CALLED = re.compile(r"(?<![\w.:'])(\w+)\(")
#: A one-line Lua string literal: its text ("worker(s)") is not a call.
_STRING = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")
_KEYWORDS = {"function", "if", "elseif", "and", "or", "not", "return", "while", "until", "in"}


def _all_sources() -> dict[str, str]:
    files = {f"{n}.lua": (LUA / f"{n}.lua").read_text() for n in SCRIPTS}
    files |= {f"includes/{n}.lua": (LUA / "includes" / f"{n}.lua").read_text() for n in FRAGMENTS}
    return files


def test_every_script_file_is_loaded_and_states_its_contract() -> None:
    on_disk = sorted(p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua"))
    assert on_disk == sorted(SCRIPTS)
    for name in SCRIPTS:
        head = [line for line in (LUA / f"{name}.lua").read_text().splitlines() if line]
        comment = "\n".join(line for line in head if line.startswith("--"))
        assert head[0].startswith(f"-- {name}:"), name
        for word in ("Returns", "Invariant"):
            assert word in comment, f"{name}.lua does not say {word}"
        assert "ARGV" in comment or "KEYS" in comment, name


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_function_a_script_calls_is_defined_before_it_is_used(name: str) -> None:
    source = script_source(name)
    code = "\n".join(_STRING.sub("''", line).split("--", 1)[0] for line in source.splitlines())
    defined: set[str] = set()
    for line in code.splitlines():
        called = set(_CALLED.findall(line)) - _KEYWORDS - BUILTINS
        fresh = set(_DEFINED.findall(line))
        missing = called - defined - fresh - {"redis", "math", "string", "table"}
        assert not missing, f"{name}.lua calls {sorted(missing)} before any include defines it"
        defined |= fresh


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_fragment_is_included_once_and_only_when_named(name: str) -> None:
    source = script_source(name)
    names = _DEFINED.findall(source)
    assert len(names) == len(set(names)), f"{name}.lua defines a function twice"
    script = (LUA / f"{name}.lua").read_text()
    assert source.endswith(script)


def test_shared_steps_are_written_once() -> None:
    """The wake push, leaving the queue (with the tenant's sub-queue and index) and the
    leave-the-queue-or-release block exist in one file each."""
    files = _all_sources()
    wake = [f for f, text in files.items() if "'wake'" in text]
    assert wake == ["includes/wake.lua"]
    leave = [f for f, text in files.items() if re.search(r"ZREM', k_tqueue\(", text)]
    assert leave == ["includes/queue.lua"]
    enter = [f for f, text in files.items() if re.search(r"ZADD', k_tqueue\(", text)]
    assert enter == ["includes/queue.lua"]
    # Every other way out of a sub-queue (assign's CAS, quarantine) does its bookkeeping.
    after = [f for f, text in files.items() if re.search(r"\bsubqueue_removed\(", text)]
    assert sorted(after) == ["assign.lua", "includes/queue.lua", "quarantine.lua"]
    withdraw = [f for f, text in files.items() if re.search(r"\bqueue_remove\(", text)]
    assert sorted(withdraw) == ["includes/queue.lua", "includes/withdraw.lua"]
    assert [f for f, text in files.items() if "local function release(" in text] == [
        "includes/release.lua"
    ]


def test_unknown_and_circular_includes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = {
        "s.lua": "-- s: x\n-- include: a\n",
        "includes/a.lua": "-- include: b\n",
        "includes/b.lua": "-- include: a\n",
        "t.lua": "-- t: x\n-- include: nowhere\n",
    }

    def read(path: str) -> str:
        if path not in texts:
            raise FileNotFoundError(path)
        return texts[path]

    monkeypatch.setattr(scripts, "_read", read)
    with pytest.raises(ValueError, match=r"cycle: s\.lua -> a -> b -> a"):
        scripts.script_source.__wrapped__("s")
    with pytest.raises(ValueError, match="'nowhere'"):
        scripts.script_source.__wrapped__("t")
    assert includes_of("-- include: a, b\n-- include: c") == ["a", "b", "c"]


def test_the_changed_workers_marks_agree_with_the_snapshot() -> None:
    """``includes/changed.lua`` marks a worker when a field the snapshot reads changes:
    its list is WORKER_FIELDS but the id, its key ``Keys.worker_changes``, and it keeps
    marks as long as the dispatcher assumes (issue 17's incremental snapshot)."""
    text = (LUA / "includes" / "changed.lua").read_text()
    listed = re.search(r"ROUTING_FIELDS = \{([^}]*)\}", text)
    assert listed is not None
    assert re.findall(r"'(\w+)'", listed.group(1)) == [f for f in WORKER_FIELDS if f != "id"]
    keep = re.search(r"CHANGES_KEEP_MS = (\d+)", text)
    assert keep is not None and int(keep.group(1)) == defaults.WORKER_CHANGES_KEEP_S * 1000
    assert Keys("n").worker_changes == Keys("n").prefix + "wchanged" and "'wchanged'" in text
    assert defaults.SNAPSHOT_FULL_REFRESH_S < defaults.WORKER_CHANGES_KEEP_S / 2


@given(st.integers(0, 2**33), st.integers(0, 999_999))
def test_redis_time_ms_floors_as_the_lua_clock_does(sec: int, usec: int) -> None:
    """The snapshot's ``since_ms`` and the scripts' marks must be the same ms
    (``lua/includes/clock.lua``: ``sec * 1000 + floor(usec / 1000)``)."""
    assert redis_time_ms([str(sec), str(usec)]) == sec * 1000 + usec // 1000
    assert "math.floor(tonumber(t[2]) / 1000)" in script_source("heartbeat")
