"""The Lua scripts' sources: ``lua/<name>.lua`` with the fragments it includes in front.

Every multi-key change is one script in ``lua/``, named for the transition (BullMQ's
``commands/*.lua`` layout). Fragments shared by several scripts (the clock, key names,
events, releasing a reservation, making a request final, requeueing) live once in
``lua/includes/<fragment>.lua``; a script names what it needs on a header line::

    -- include: clock, keys, events, release, finalize

An include may name others the same way; each fragment goes in once, after the ones it
includes, so a ``local function`` is always defined before it is used.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

#: Every script of ``lua/`` (each is loaded by :class:`~inferq.store.Store` at start).
SCRIPTS = (
    "submit",
    "assign",
    "start",
    "complete",
    "requeue",
    "abort",
    "requeue_preempted",
    "promote",
    "expire",
    "note_unschedulable",
    "cancel",
    "heartbeat",
    "drain",
    "remove_worker",
    "reap_leases",
    "dead_requeue",
    "quarantine",
    "forget_vanished",
    "lease",
    "caller_lease",
    "reap_callers",
    "fairness",
    "estimates",
    "dead_delete",
)

_INCLUDE = re.compile(r"^--\s*include:\s*(.+)$", re.M)


def _read(path: str) -> str:
    return (resources.files("inferq.store") / "lua" / path).read_text()


def includes_of(text: str) -> list[str]:
    """The fragment names a script or fragment includes, in the order given."""
    return [n.strip() for m in _INCLUDE.finditer(text) for n in m.group(1).split(",") if n.strip()]


def _resolve(name: str, order: list[str], stack: tuple[str, ...]) -> None:
    if name in order:
        return
    if name in stack:
        raise ValueError(f"lua include cycle: {' -> '.join([*stack, name])}")
    try:
        text = _read(f"includes/{name}.lua")
    except FileNotFoundError:
        raise ValueError(f"lua include {name!r} (from {stack[-1]}) does not exist") from None
    for inner in includes_of(text):
        _resolve(inner, order, (*stack, name))
    order.append(name)


@cache
def script_source(name: str) -> str:
    """Source of ``lua/<name>.lua`` with its includes (and theirs) in front, each once.

    Raises:
        ValueError: an include does not exist, or includes form a cycle.
        FileNotFoundError: there is no such script.
    """
    text = _read(f"{name}.lua")
    order: list[str] = []
    for inc in includes_of(text):
        _resolve(inc, order, (f"{name}.lua",))
    return "\n".join([*(_read(f"includes/{inc}.lua") for inc in order), text])
