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
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from inferq.errors import InferqError, redact_url

if TYPE_CHECKING:  # loaded when a command runs: `inferq --help` needs none of them (issue 15)
    from rich.console import Console
    from rich.progress import Progress

    from inferq.config import Settings
    from inferq.store import Glance, Store

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def console() -> Console:
    """The console of stdout (rich is imported on first use: ``--json`` never needs it)."""
    from rich.console import Console

    return Console()


def show(renderable: Any) -> None:
    """Print a rich renderable (tables, panels, groups of them) on stdout, cutting nothing.

    rich fits output to the terminal, or to 80 columns off a terminal (a pipe, a file,
    CI), and cut what did not fit with "…": ids and model names included, or whole
    columns cropped (issue 15). Here every cell that does not fit folds onto more lines
    instead (no "…"), ids stay whole (their columns do not wrap, see
    ``views._id_column``), and the width grows to what those need. Off a terminal it
    grows further, up to :data:`PIPE_WIDTH`, so a table keeps one line per row for
    ``grep`` and ``awk``; on a terminal a line wider than the window wraps there. Free
    text in a panel (a result's output, a long error) folds at the console's width
    wherever it is printed (see :func:`_widths`).
    """
    out = console()
    _fold_cells(renderable)
    least, most = _widths(out, renderable)
    needed = least if out.is_terminal else max(least, min(most, PIPE_WIDTH))
    if needed <= out.width:
        out.print(renderable)
        return
    fitted = out.width
    out.width = needed
    try:
        out.print(renderable, crop=False)
    finally:
        out.width = fitted


#: The widest output :func:`show` widens to off a terminal for free text (a column that
#: must not wrap, an id, may need more and gets it).
PIPE_WIDTH = 240
#: The width a renderable is measured at (any width above what a table can need).
_MEASURE_WIDTH = 100_000


def _widths(out: Console, renderable: Any) -> tuple[int, int]:
    """The (least, most) columns ``renderable`` needs, as :func:`show` widens to them.

    A panel holds free text (a result's output, an error): it folds at the console's
    width and only its title (the request id) must fit, so it never widens the output;
    rich's own measure of a panel is its text's full length (a 1,400-character output
    made a 1,400-column line). A group needs what its widest part needs.
    """
    from rich.console import Group
    from rich.measure import Measurement
    from rich.panel import Panel
    from rich.text import Text

    if isinstance(renderable, Panel):
        title = renderable.title
        least = Text.from_markup(title).cell_len + 6 if isinstance(title, str) else 0
        return least, least
    if isinstance(renderable, Group):
        parts = [_widths(out, child) for child in renderable.renderables] or [(0, 0)]
        return max(p[0] for p in parts), max(p[1] for p in parts)
    size = Measurement.get(out, out.options.update_width(_MEASURE_WIDTH), renderable)
    return size.minimum, size.maximum


def _fold_cells(renderable: Any) -> None:
    """Make every table column inside ``renderable`` fold what does not fit instead of
    cutting it with "…" (columns given another overflow keep it)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    if isinstance(renderable, Table):
        for column in renderable.columns:
            if column.overflow == "ellipsis":
                column.overflow = "fold"
            for cell in column.cells:
                _fold_cells(cell)
    elif isinstance(renderable, Group):
        for child in renderable.renderables:
            _fold_cells(child)
    elif isinstance(renderable, Panel):
        _fold_cells(renderable.renderable)


@functools.cache
def err_console() -> Console:
    """The console of stderr."""
    from rich.console import Console

    return Console(stderr=True)


class Context:
    """The settings, a lazily opened store, and the reads that need only a connection.

    Args:
        settings: the settings, when already loaded.
        load: builds the settings on first use (when ``settings`` is not given).
        target: ``(redis_url, namespace)`` when they are all that the settings would
            differ from their defaults by (:func:`inferq.envvars.connection_only`):
            :attr:`glance` then reads without loading the settings (pydantic), which
            halves the start of ``inferq queues`` (issue 15).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        load: Callable[[], Settings] | None = None,
        target: tuple[str, str] | None = None,
    ) -> None:
        if settings is None and load is None:
            raise TypeError("Context needs settings or a way to load them")
        self._settings = settings
        self._load = load
        self.target = target
        self._store: Store | None = None
        self._glance: Glance | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            assert self._load is not None
            self._settings = self._load()
        return self._settings

    @property
    def redis_url(self) -> str:
        """The Redis URL, without loading the settings when a target gives it."""
        if self._settings is None and self.target is not None:
            return self.target[0]
        return self.settings.redis_url

    @property
    def namespace(self) -> str:
        """The namespace, without loading the settings when a target gives it."""
        if self._settings is None and self.target is not None:
            return self.target[1]
        return self.settings.namespace

    @property
    def store(self) -> Store:
        if self._store is None:
            from inferq.store import Store, connect

            self._store = Store(connect(self.settings.redis_url), self.settings)
        return self._store

    @property
    def glance(self) -> Glance:
        """The reads of :class:`~inferq.store.glance.Glance`: over a connection of their
        own when a target spares loading the settings, else the store's."""
        if self._store is None and self._settings is None and self.target is not None:
            if self._glance is None:
                from inferq.store import Glance, connect

                self._glance = Glance(connect(self.target[0]), self.target[1])
            return self._glance
        return self.store


def handle_errors(func: F) -> F:
    """Turn inferq and Redis errors into one line on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from inferq.store import REDIS_ERRORS, describe_error

        try:
            return func(*args, **kwargs)
        except InferqError as exc:
            fail(str(exc))
        except REDIS_ERRORS as exc:
            ctx = click.get_current_context().find_object(Context)
            fail(describe_error(ctx.redis_url if ctx else "?", exc))

    return wrapper  # type: ignore[return-value]


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: <message>`` as one line on stderr (no markup, no wrapping), exit ``code``."""
    from rich.markup import escape

    err_console().print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def progress(hidden: bool = False) -> Progress:
    """A progress bar on stderr for long work (hidden for ``--json``, or off a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console(),
        transient=True,
        disable=hidden or not err_console().is_terminal,
    )


def hint_if_empty(obj: Context) -> None:
    """Say on stderr when the namespace has no keys at all (a wrong --namespace?)."""
    if not obj.glance.namespace_has_keys():
        click.echo(
            f"note: namespace {obj.namespace!r} has no keys on "
            f"{redact_url(obj.redis_url)}: is --namespace (INFERQ_NAMESPACE) right?",
            err=True,
        )


pass_ctx = click.make_pass_decorator(Context)


def metrics_options(func: F) -> F:
    """``--metrics-port`` and ``--metrics-host`` of a daemon."""
    func = click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        envvar="INFERQ_METRICS_HOST",
        help="Address the metrics endpoint binds (0.0.0.0: every interface, e.g. in a container).",
    )(func)
    return click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")(
        func
    )


def start_metrics(store: Store, port: int | None, host: str) -> str | None:
    """Serve ``/metrics`` when ``port`` is given; returns its URL (None when not serving).

    Raises:
        ConfigError: the port is in use or the address cannot be bound.
    """
    if port is None:
        return None
    from inferq.metrics import serve_metrics

    return serve_metrics(store, port, host).url


def say_ready(
    component: str, settings: Settings, metrics_url: str | None, detail: str = ""
) -> None:
    """Print the daemon's one ready line on stderr: Redis (redacted), namespace, metrics."""
    parts = [
        f"redis {redact_url(settings.redis_url)}",
        f"namespace {settings.namespace}",
        f"metrics {metrics_url or 'off'}",
    ]
    if detail:
        parts.insert(0, detail)
    click.echo(f"inferq {component} ready: " + ", ".join(parts), err=True)


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


def gpu_indices(text: str) -> tuple[int, ...]:
    """``--gpu-index``: ``""`` (unset), ``"0"`` or ``"0,1"`` as CUDA indices.

    Raises:
        click.BadParameter: (naming ``--gpu-index``) an item is not a whole number >= 0,
            or one repeats.
    """
    items = [item.strip() for item in text.split(",")] if text.strip() else []
    if not all(item.isdigit() for item in items):
        raise click.BadParameter(
            f"{text!r} is not a CUDA index or a comma-separated list of them (e.g. 0,1)",
            param_hint="--gpu-index",
        )
    indices = tuple(int(item) for item in items)
    if len(set(indices)) != len(indices):
        raise click.BadParameter(f"{text!r} names a GPU twice", param_hint="--gpu-index")
    return indices


class LazyGroup(click.Group):
    """A command group whose heavy subcommands are imported only when they run.

    ``lazy`` maps a command name to ``("module:attribute", "one-line help")``: the help
    line is listed by ``--help`` without importing the module (the pattern of click's
    documentation, "Lazily Loading Subcommands"). ``inferq scaler`` and ``inferq
    simulate`` import the scaler's platforms and the simulator, which every other
    command would otherwise pay for at start (issue 15).
    """

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            import importlib

            module, attribute = self.lazy[cmd_name][0].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, with the lazy commands' help lines given, not imported."""
        entries: list[tuple[str, str | None]] = []
        for name in self.list_commands(ctx):
            if name in self.lazy and name not in self.commands:
                entries.append((name, self.lazy[name][1]))
                continue
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                entries.append((name, None))
        if not entries:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in entries)
        rows = []
        for name, lazy_help in entries:
            if lazy_help is not None:
                shown = click.Command(name, help=lazy_help)  # click's own shortening
                rows.append((name, shown.get_short_help_str(limit)))
            else:
                cmd = self.commands[name]
                rows.append((name, cmd.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)
