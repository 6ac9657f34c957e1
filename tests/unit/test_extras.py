"""Optional dependencies: the core install needs none, a feature that needs one says which.

``pip install inferq`` (the client, the daemons) brings neither matplotlib nor fakeredis
nor NVML; ``inferq demo``, ``inferq simulate --plot`` and the embedded Redis's fakeredis
fallback refuse with one line naming the extra when theirs is missing, before they start
anything.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from inferq.cli.main import cli
from inferq.embedded import EmbeddedRedis
from inferq.errors import InferqError, MissingExtra
from inferq.extras import import_extra

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: Installed by the extras, never by the core.
OPTIONAL = (
    "matplotlib",
    "fakeredis",
    "nvidia-ml-py",
    "docker",
    "kubernetes",
    "starlette",
    "uvicorn",
    "sse-starlette",
    "limits",
    "tokenizers",
)


def _name(requirement: str) -> str:
    return requirement.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib as if not installed (a None entry makes its import raise ImportError)."""
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


def test_the_core_install_pulls_no_optional_dependency() -> None:
    core = {_name(r) for r in PROJECT["dependencies"]}
    assert core.isdisjoint(OPTIONAL)
    extras = PROJECT["optional-dependencies"]
    assert {_name(r) for r in extras["demo"]} == {"matplotlib", "fakeredis"}
    assert {_name(r) for r in extras["gpu"]} == {"nvidia-ml-py"}
    assert "inferq[demo,docker,kubernetes,dashboard,gateway,tokenizer]" in extras["test"]
    assert {_name(r) for r in extras["tokenizer"]} == {"tokenizers"}
    assert {_name(r) for r in extras["dashboard"]} == {"starlette", "uvicorn"}
    assert {_name(r) for r in extras["gateway"]} == {
        "starlette",
        "uvicorn",
        "uvloop",
        "httptools",
        "sse-starlette",
        "limits",
    }


def test_the_components_import_no_optional_dependency() -> None:
    code = (
        "import sys\n"
        "import inferq.cli.main, inferq.client, inferq.dispatcher.daemon, inferq.workers.worker\n"
        "import inferq.scaler.daemon, inferq.metrics, inferq.demo, inferq.embedded, inferq.sim\n"
        "print(sorted(m for m in ('matplotlib', 'fakeredis', 'pynvml', 'docker', 'kubernetes',"
        " 'starlette', 'uvicorn', 'sse_starlette', 'limits')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_missing_extra_is_one_line_naming_it(no_matplotlib: None) -> None:
    with pytest.raises(MissingExtra) as caught:
        import_extra("matplotlib", "demo", "inferq demo")
    message = str(caught.value)
    assert message == (
        "inferq demo needs matplotlib, which is not installed: "
        "install inferq[demo] (pip install 'inferq[demo]')"
    )
    assert isinstance(caught.value, InferqError) and isinstance(caught.value, ImportError)
    assert import_extra("json", "demo", "x").__name__ == "json"


def test_inferq_demo_without_matplotlib_says_to_install_the_demo_extra(
    no_matplotlib: None, tmp_path: Path
) -> None:
    result = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path), "--duration", "10"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: inferq demo needs matplotlib, which is not installed: install inferq[demo] "
        "(pip install 'inferq[demo]')"
    ]
    assert list(tmp_path.iterdir()) == []  # refused before anything was started or written


def test_simulate_plot_without_matplotlib_refuses_before_running(
    no_matplotlib: None, tmp_path: Path
) -> None:
    args = ["simulate", "--duration", "10", "--plot", str(tmp_path / "p.png")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert "install inferq[demo]" in result.output
    assert "wall" not in result.output  # no policy was run


def test_the_fakeredis_fallback_names_the_demo_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fakeredis", None)
    with pytest.raises(MissingExtra, match=r"install inferq\[demo\]"), EmbeddedRedis("fakeredis"):
        pass
