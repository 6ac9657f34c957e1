"""The INFERQ_* names inferq knows: the settings' fields and every name in the source;
the connection-only reading of the environment (issue 15)."""

from __future__ import annotations

import re
from pathlib import Path

import inferq
from inferq import envvars
from inferq.config import Settings

SRC = Path(inferq.__file__).parent


def test_the_settings_fields_are_the_settings_class_s() -> None:
    assert set(Settings.model_fields) == set(envvars.SETTINGS_FIELDS)


def test_every_inferq_name_in_the_package_is_known() -> None:
    names = set()
    for path in SRC.rglob("*.py"):
        if path.name == "envvars.py":  # it spells a typo as its example
            continue
        names |= set(re.findall(r"\bINFERQ_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert names - set(envvars.KNOWN) == set()


def test_unknown_names_get_the_closest_known_name() -> None:
    env = {
        "INFERQ_REDIS_ULR": "x",
        "INFERQ_NAMESPCE": "x",
        "inferq_lease_s": "1",  # the settings read any case
        "inferq_config": "x",  # read only as INFERQ_CONFIG
        "INFERQ_ZZZ": "x",
        "PATH": "/bin",
    }
    assert envvars.unknown(env) == [
        ("INFERQ_NAMESPCE", "INFERQ_NAMESPACE"),
        ("INFERQ_REDIS_ULR", "INFERQ_REDIS_URL"),
        ("INFERQ_ZZZ", None),
        ("inferq_config", "INFERQ_CONFIG"),
    ]


def test_connection_only_when_nothing_else_configures_the_settings() -> None:
    assert envvars.connection_only({}) == (None, None)
    assert envvars.connection_only({"INFERQ_NAMESPACE": "a", "INFERQ_CELL": "b"}) == (None, "a")
    assert envvars.connection_only({"INFERQ_REDIS_URL": "redis://h/1", "X": "1"}) == (
        "redis://h/1",
        None,
    )
    for env in (
        {"INFERQ_CONFIG": "/etc/inferq.toml"},
        {"INFERQ_LEASE_S": "3"},
        {"inferq_namespace": "a"},
        {"INFERQ_REDIS_URL": ""},
    ):
        assert envvars.connection_only(env) is None, env


def test_valid_namespace_is_the_settings_rule() -> None:
    for name in ("default", "a.b-c_1", "x" * 64):
        assert envvars.valid_namespace(name)
    for name in ("", "a:b", "a|b", "-a", "x" * 65, "a\n"):
        assert not envvars.valid_namespace(name)
