"""Cells: independent Redis primaries, each serving a set of routes (the way past one primary).

One Redis primary bounds a deployment (``scripts/bench_redis_ops.py`` measures the
ceiling). Redis Cluster does not fit RQ's multi-key transactions and inferq's Lua
scripts, which touch many keys of one request, queue and worker at once; independent
cells do, on engines that exist: each cell is a Redis primary (Sentinel-managed in
production) with its own dispatchers, workers and scaler, and serves a set of routes.
A route (with its fallbacks) lives in exactly one cell; a cell may also be reserved
for some tenants' traffic on its routes. The client and the gateway pick a request's
cell from the routing table in the settings (:class:`inferq.config.CellSpec`), and
the request id starts with the cell's name (``east-0187...``), so ``status``,
``result`` and ``cancel`` go straight to the right cell with no search.

This is the pattern of "cell-based architecture" (AWS Well-Architected, "Reducing
the scope of impact with cell-based architecture", 2023): a cell's outage stops only
the routes it serves. docs/scaling.md sizes cells and says how a route moves.

Pure: no Redis, no clock.
"""

from __future__ import annotations

from inferq.config import Settings
from inferq.errors import InvalidRequest

#: Between a cell's name and the time-ordered id (cell names are ``[a-z0-9]``, ids hex).
SEPARATOR = "-"


def cell_for(settings: Settings, route: str, tenant: str) -> str | None:
    """The cell that serves ``route`` for ``tenant``; None when no cells are configured.

    A cell that lists both the route and the tenant wins; then the cell that lists
    the route for every tenant (no ``tenants``); then ``settings.default_cell``.

    Raises:
        InvalidRequest: cells are configured, none serves the route and there is no
            ``default_cell`` (field ``model``).
    """
    if not settings.cells:
        return None
    shared: str | None = None
    for name, cell in settings.cells.items():
        if route not in cell.routes:
            continue
        if tenant in cell.tenants:
            return name
        if not cell.tenants:
            shared = name
    if shared is not None:
        return shared
    if settings.default_cell is not None:
        return settings.default_cell
    raise InvalidRequest(
        "model", f"no cell serves route {route!r} (cells: {', '.join(sorted(settings.cells))})"
    )


def with_cell(cell: str | None, request_id: str) -> str:
    """``request_id`` prefixed with its cell's name (unchanged when ``cell`` is None)."""
    return request_id if cell is None else f"{cell}{SEPARATOR}{request_id}"


def cell_of(settings: Settings, request_id: str) -> str | None:
    """The cell a request id names; None for an id without a cell (a single-Redis deployment).

    Raises:
        InvalidRequest: the id names a cell the settings do not know (field ``request_id``).
    """
    name, sep, _ = request_id.partition(SEPARATOR)
    if not sep:
        return None
    if name not in settings.cells:
        known = ", ".join(sorted(settings.cells)) or "none configured"
        raise InvalidRequest(
            "request_id", f"names cell {name!r}, which is not configured ({known})"
        )
    return name
