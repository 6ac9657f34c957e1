"""What every ``inferq`` command shares: the context object, the error handler, options.

:mod:`inferq.cli.main` defines the command group and the core commands; the larger
commands live in their own modules (:mod:`~inferq.cli.scaler`,
:mod:`~inferq.cli.simulate`) and take what they share with main from here, so no
command module imports another.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.markup import escape

from inferq.config import Settings
from inferq.errors import InferqError
from inferq.store import REDIS_ERRORS, Store, connect, describe_error

F = TypeVar("F", bound=Callable[..., Any])

console = Console()
err_console = Console(stderr=True)


class Context:
    """Settings and a lazily opened store, shared by the subcommands."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(connect(self.settings.redis_url), self.settings)
        return self._store


def handle_errors(func: F) -> F:
    """Turn inferq and Redis errors into one line on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except InferqError as exc:
            fail(str(exc))
        except REDIS_ERRORS as exc:
            ctx = click.get_current_context().find_object(Context)
            fail(describe_error(ctx.settings.redis_url if ctx else "?", exc))

    return wrapper  # type: ignore[return-value]


def fail(message: str) -> NoReturn:
    """Print ``error: <message>`` as one line on stderr (no markup, no wrapping), exit 1."""
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(1)


pass_ctx = click.make_pass_decorator(Context)


def pairs(option: str, values: tuple[str, ...]) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict.

    Raises:
        click.BadParameter: (naming ``option``) an item is not ``KEY=VALUE``.
    """
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=option)
        out[key] = value
    return out
