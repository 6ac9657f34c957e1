"""Settings from TOML: named tables extend the defaults, errors name the field, and
every TOML snippet of the docs loads as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inferq import config
from inferq.config import Settings
from inferq.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _load(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "inferq.toml"
    path.write_text(text)
    return Settings.load(path)


def _snippets() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)):
            out.append((f"{doc.name}#{i}", block))
    # The module docstring's literal blocks (after "::", indented by 4).
    doc = config.__doc__ or ""
    for i, block in enumerate(re.findall(r"::\n\n((?:    .*\n|\n)+)", doc)):
        out.append((f"config.py#{i}", "\n".join(ln[4:] for ln in block.splitlines())))
    return out


SNIPPETS = _snippets()


def test_the_docs_have_toml_snippets() -> None:
    names = [name for name, _ in SNIPPETS]
    assert any(n.startswith("README.md") for n in names)
    assert any(n.startswith("config.py") for n in names)


@pytest.mark.parametrize(("name", "text"), SNIPPETS, ids=[n for n, _ in SNIPPETS])
def test_every_toml_snippet_of_the_docs_loads(tmp_path: Path, name: str, text: str) -> None:
    _load(tmp_path, text)


def test_named_tables_change_defaults_and_add_entries(tmp_path: Path) -> None:
    s = _load(
        tmp_path,
        "[classes.realtime]\nsla_s = 1.5\n\n"
        "[classes.bulk]\nsla_s = 3600.0\ntimeout_s = 86400.0\nweight = 1\n"
        "batch_delay_s = 5.0\naging_s = 600.0\n\n"
        '[models."llama-3.1-8b"]\ncold_start_s = 20.0\n',
    )
    defaults = Settings()
    assert [c.name for c in s.classes] == ["realtime", "standard", "batch", "bulk"]
    realtime = s.class_by_name["realtime"]
    assert realtime.sla_s == 1.5
    assert realtime.weight == defaults.class_by_name["realtime"].weight  # untouched fields stay
    assert s.model_by_name["llama-3.1-8b"].cold_start_s == 20.0
    assert [m.name for m in s.models] == [m.name for m in defaults.models]


def test_an_array_of_tables_replaces_the_defaults_and_the_error_says_how_to_extend(
    tmp_path: Path,
) -> None:
    text = '[[classes]]\nname = "realtime"\nsla_s = 2.0\ntimeout_s = 120.0\nweight = 8\n'
    text += "batch_delay_s = 0.0\naging_s = 1.0\n"
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    msg = str(err.value)
    assert msg.startswith("setting default_priority: 'standard' is not a class")
    assert "[classes.NAME]" in msg and "Value error" not in msg
    s = _load(tmp_path, 'default_priority = "realtime"\nclassifier = {}\n' + text)
    assert [c.name for c in s.classes] == ["realtime"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[classes.bulk]\nsla_s = 2.0\n", "setting classes.bulk.timeout_s: Field required"),
        ("[classes.realtime]\nsla_s = -1\n", "setting classes.realtime.sla_s: Input should be"),
        (
            '[models."llama-3.1-8b"]\nbogus = 1\n',
            "setting models.llama-3.1-8b.bogus: unknown setting",
        ),
        (
            "[classes.realtime]\nwieght = 3\n",
            "setting classes.realtime.wieght: unknown setting (did you mean 'weight'?)",
        ),
        (
            "max_atempts = 3\n",
            "setting max_atempts: unknown setting (did you mean 'max_attempts'?)",
        ),
        ("[classes]\nrealtime = 3\n", "setting classes.realtime: expected a table"),
        ('[classes.realtime]\nname = "fast"\n', "setting classes.realtime: name 'fast' differs"),
    ],
)
def test_table_errors_name_the_entry_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _load(tmp_path, text)
