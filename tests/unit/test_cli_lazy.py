"""`inferq --help` lists the lazily loaded commands without importing them, with the
help line each command really has (issue 15: CLI start time)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click
from click.testing import CliRunner

from inferq.cli.main import LAZY_COMMANDS, cli

#: What ``inferq --help`` must not import (tests/redis/test_cli_start.py holds the list
#: of ``inferq queues``, which needs redis).
HELP_HEAVY = (
    "inferq.sim",
    "inferq.scaler",
    "inferq.config",
    "inferq.models",
    "inferq.store",
    "redis",
    "pydantic",
    "pydantic_settings",
    "rich",
    "rq",
    "prometheus_client",
    "httpx",
    "starlette",
    "numpy",
)


def test_each_lazy_help_line_is_the_command_s_own() -> None:
    for name, (target, help_line) in LAZY_COMMANDS.items():
        module, attribute = target.split(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command) and command.name == name
        assert command.get_short_help_str(200) == help_line


def test_help_lists_every_command_and_imports_no_heavy_module() -> None:
    code = (
        "import sys\n"
        "from inferq.cli.main import main\n"
        "sys.argv = ['inferq', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"heavy = [m for m in {HELP_HEAVY!r} if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout
    for name in ("scaler", "simulate", "queues", "submit", "worker", "dispatcher"):
        assert f"\n  {name} " in out.stdout


def test_a_lazy_command_runs() -> None:
    result = CliRunner().invoke(cli, ["simulate", "--help"])
    assert result.exit_code == 0 and "--scenario" in result.output
