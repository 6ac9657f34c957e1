"""The import contract of docs/architecture.md ("Layout"), checked the way CI checks it.

- Every import-linter contract of pyproject.toml holds (layers, no cycles, pure rules,
  the RQ and Redis seams, the simulator on rules only), counting imports inside
  functions and under TYPE_CHECKING, as ``lint-imports`` in ``.ci/run`` does.
- The checks can fail: an upward import or a cycle added to a copy of the graph is
  reported.
- No raw Redis or RQ call hides outside the store, the delivery seam and the
  embedded server (a scan of the source, which import-linter cannot see: an
  attribute call on a connection someone passed in).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter import api  # noqa: F401  (configures import-linter before use)
from importlinter.application import use_cases
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.layers import LayersContract

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "inferq"
OPTIONS = use_cases.read_user_options(str(ROOT / "pyproject.toml"))
#: Where raw Redis (and, for delivery, RQ) calls belong.
IO_HOMES = ("store", "delivery", "embedded.py")


def contract_options(contract_id: str) -> dict[str, Any]:
    [options] = [c for c in OPTIONS.contracts_options if c["id"] == contract_id]
    return {k: v for k, v in options.items() if k not in ("id", "name", "type")}


def build() -> grimp.ImportGraph:
    return grimp.build_graph("inferq", include_external_packages=True, cache_dir=None)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return build()


def test_every_import_contract_holds(capsys: pytest.CaptureFixture[str]) -> None:
    kept = use_cases.lint_imports(
        config_filename=str(ROOT / "pyproject.toml"), cache_dir=None, no_logo=True
    )
    assert kept, capsys.readouterr().out


def _layers(graph: grimp.ImportGraph) -> bool:
    contract = LayersContract(
        name="layers",
        session_options=OPTIONS.session_options,
        contract_options=contract_options("layers"),
    )
    return contract.check(graph, verbose=False).kept


def _acyclic(graph: grimp.ImportGraph) -> bool:
    contract = AcyclicSiblingsContract(
        name="acyclic",
        session_options=OPTIONS.session_options,
        contract_options=contract_options("acyclic"),
    )
    return contract.check(graph, verbose=False).kept


def test_an_upward_import_breaks_the_layers(graph: grimp.ImportGraph) -> None:
    assert _layers(graph)
    tampered = build()
    tampered.add_import(importer="inferq.policy.routing", imported="inferq.store.sync")
    assert not _layers(tampered)


def test_a_cycle_breaks_the_acyclic_contract(graph: grimp.ImportGraph) -> None:
    assert _acyclic(graph)
    tampered = build()  # store.sync imports store.calls: this closes a circle
    tampered.add_import(importer="inferq.store.calls", imported="inferq.store.sync")
    assert not _acyclic(tampered)


def test_the_package_root_is_a_facade_outside_the_layers(graph: grimp.ImportGraph) -> None:
    """inferq/__init__ names every layer (under TYPE_CHECKING): allowed, it is the API."""
    assert "inferq.client" in graph.find_modules_directly_imported_by("inferq")
    layers = contract_options("layers")["layers"]
    assert not any("__init__" in layer for layer in layers)


# --- raw Redis and RQ outside their homes -------------------------------------------


def _outside_io() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(IO_HOMES):
            yield path, ast.parse(path.read_text(), str(path))


def _imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _raw_calls(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Calls on a Redis client: ``<x>.redis.<cmd>(...)``, ``<x>.rq.<cmd>(...)``,
    ``redis.<cmd>(...)``, and ``<x>.pipeline(...)``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if name in ("redis", "rq") or node.func.attr == "pipeline":
            yield node.lineno, ast.unparse(node.func)


def test_redis_and_rq_are_imported_only_where_they_belong() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {module}"
        for path, tree in _outside_io()
        for line, module in _imports(tree)
        if module.split(".")[0] in ("redis", "rq")
    ]
    rq_outside_delivery = [
        f"{path.relative_to(PACKAGE)}:{line}: {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.relative_to(PACKAGE).as_posix().startswith("delivery/")
        for line, module in _imports(ast.parse(path.read_text()))
        if module.split(".")[0] == "rq"
    ]
    assert found == [] and rq_outside_delivery == []


def test_no_raw_redis_call_outside_the_store_delivery_and_embedded() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {call}"
        for path, tree in _outside_io()
        for line, call in _raw_calls(tree)
    ]
    assert found == []


def test_the_scan_finds_raw_calls() -> None:
    """The scanner itself: each form of raw call is caught, a store call is not."""
    source = (
        "self.store.redis.hget(k, 'f')\nstore.redis.pipeline()\nredis.Redis()\n"
        "self.rq.pipeline()\nconn.pipeline(transaction=False)\nself.store.record('x')\n"
    )
    calls = [call for _, call in _raw_calls(ast.parse(source))]
    assert calls == [
        "self.store.redis.hget",
        "store.redis.pipeline",
        "redis.Redis",
        "self.rq.pipeline",
        "conn.pipeline",
    ]
