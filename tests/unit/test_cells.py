"""Cells: which cell serves a route and tenant, ids that name their cell, the settings' checks."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.cells import SEPARATOR, cell_for, cell_of, with_cell
from inferq.config import Settings
from inferq.errors import ConfigError, InvalidRequest
from inferq.ids import new_id
from inferq.models import ID_PATTERN


def settings(cells: dict[str, Any], **kw: Any) -> Settings:
    return Settings.load(cells=cells, **kw)


CELLS = {
    "east": {"redis_url": "redis://east:6379/0", "routes": ["llama-3.1-8b"]},
    "west": {"redis_url": "redis://west:6379/0", "routes": ["llama-2-13b", ">=13b"]},
    "acme": {"redis_url": "redis://acme:6379/0", "routes": ["llama-3.1-8b"], "tenants": ["acme"]},
}


def test_no_cells_means_one_redis_and_plain_ids() -> None:
    plain = Settings.load()
    assert cell_for(plain, "llama-3.1-8b", "t") is None
    rid = new_id()
    assert with_cell(None, rid) == rid and cell_of(plain, rid) is None


def test_the_route_picks_the_cell_and_a_tenant_cell_wins_for_its_tenants() -> None:
    s = settings(CELLS)
    assert cell_for(s, "llama-3.1-8b", "bob") == "east"
    assert cell_for(s, "llama-3.1-8b", "acme") == "acme"
    assert cell_for(s, "llama-2-13b", "acme") == "west"  # acme's cell does not serve 13b
    assert cell_for(s, ">=13b", "bob") == "west"


def test_a_route_no_cell_serves_is_refused_naming_the_field_unless_a_default_cell() -> None:
    s = settings(CELLS)
    with pytest.raises(InvalidRequest) as exc:
        cell_for(s, "smollm2-135m", "bob")
    assert exc.value.field == "model" and "smollm2-135m" in exc.value.reason
    assert cell_for(settings(CELLS, default_cell="east"), "smollm2-135m", "bob") == "east"


def test_an_id_names_its_cell_and_an_unknown_cell_is_refused() -> None:
    s = settings(CELLS)
    rid = with_cell("west", new_id())
    assert rid.startswith("west" + SEPARATOR) and cell_of(s, rid) == "west"
    with pytest.raises(InvalidRequest) as exc:
        cell_of(s, "north-0187")
    assert exc.value.field == "request_id" and "north" in exc.value.reason


def test_a_retired_cell_takes_no_new_requests_but_its_ids_resolve() -> None:
    s = settings({**CELLS, "old": {"redis_url": "redis://old:6379/0", "routes": []}})
    assert "old" not in {cell_for(s, r, "t") for r in ("llama-3.1-8b", "llama-2-13b")}
    assert cell_of(s, with_cell("old", new_id())) == "old"


@pytest.mark.parametrize(
    ("cells", "extra", "message"),
    [
        (
            {**CELLS, "dup": {"redis_url": "redis://d/0", "routes": ["llama-3.1-8b"]}},
            {},
            "served by cell 'east' too",
        ),
        ({"East": {"redis_url": "redis://e/0", "routes": ["x"]}}, {}, "1-16 of [a-z0-9]"),
        ({"a-b": {"redis_url": "redis://e/0", "routes": ["x"]}}, {}, "1-16 of [a-z0-9]"),
        (CELLS, {"default_cell": "north"}, "default_cell 'north' is not in cells"),
    ],
)
def test_settings_refuse_ambiguous_cells(
    cells: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=r"cells|default_cell") as exc:
        settings(cells, **extra)
    assert message in str(exc.value)


names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=16)


@given(cell=names)
def test_every_cell_id_is_a_valid_request_id_and_round_trips(cell: str) -> None:
    s = settings({cell: {"redis_url": "redis://x/0", "routes": ["llama-3.1-8b"]}})
    rid = with_cell(cell_for(s, "llama-3.1-8b", "t"), new_id())
    assert re.match(ID_PATTERN, rid)
    assert cell_of(s, rid) == cell
