"""Every CLI command through click's runner against the real Redis."""

from __future__ import annotations

import warnings
from pathlib import Path

import click
import pytest
import yaml

from inferq.cli.common import gpu_indices
from inferq.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]


def _check_inferq_args(args: list[str]) -> None:
    """Parse ``inferq ARGS`` down to the subcommand's options without running it."""
    ctx = cli.make_context("inferq", list(args), resilient_parsing=False)
    with warnings.catch_warnings():  # click 8.2 deprecates protected_args, 9.0 folds it into args
        warnings.simplefilter("ignore", DeprecationWarning)
        name, sub, rest = cli.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
    assert sub is not None, f"not an inferq command: {args}"
    sub.make_context(name or "", rest, parent=ctx)


def test_every_compose_command_is_a_real_inferq_command() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    commands = [svc["command"] for name, svc in compose["services"].items() if name != "redis"]
    assert len(commands) == 3
    for args in commands:
        _check_inferq_args(args)
    with pytest.raises(Exception):  # noqa: B017 - the checker itself must be able to fail
        _check_inferq_args(["worker", "--no-such-flag"])


@pytest.mark.parametrize(("text", "indices"), [("", ()), ("0", (0,)), ("2, 3", (2, 3))])
def test_gpu_index_takes_one_cuda_index_or_a_list(text: str, indices: tuple[int, ...]) -> None:
    assert gpu_indices(text) == indices


@pytest.mark.parametrize(("text", "why"), [("0,x", "is not a CUDA index"), ("1,1", "twice")])
def test_gpu_index_refuses_what_is_not_a_list_of_indices(text: str, why: str) -> None:
    with pytest.raises(click.BadParameter, match=why):
        gpu_indices(text)
