"""Shared helpers of the benchmark scripts: options, namespaces, percentiles, tables, JSON.

Every script runs against a real Redis (``--redis-url``, default ``INFERQ_REDIS_URL``
or ``redis://127.0.0.1:6379/0``) in a namespace of its own (``bench<hex>``) that it
deletes when it ends, RQ's keys included, so a benchmark can share a server with
tests and deployments. Figures are printed as a rich table and, with ``--json PATH``,
written with the machine, the date and the command line that produced them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from inferq.store import connect

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: Sets of RQ whose members name queues and workers (cleaned member by member).
_RQ_SETS = ("rq:queues", "rq:workers")

#: Wide enough for every table when the output is a pipe or a file (rich assumes 80).
console = Console(width=None if sys.stdout.isatty() else 160)


#: ``time.perf_counter()`` when :func:`stamp` last ran.
STAMP = [0.0]


#: The function of the RQ no-op jobs that workers run: a stdlib call with no effect, so
#: no worker imports anything for it (RQ's forking Worker would import this module,
#: rich and inferq in every child, a cost plain RQ jobs do not have).
NOOP_FUNC = "os.getpid"


def noop(*args: Any, **kwargs: Any) -> None:
    """The function of RQ jobs that are only enqueued, never run (``_bench.noop``)."""


def stamp(*args: Any, **kwargs: Any) -> None:
    """A no-op job that records when it ran in :data:`STAMP` (an in-process RQ worker's last)."""
    STAMP[0] = time.perf_counter()


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has (``--json``, ``--redis-url``)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the figures here")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("INFERQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis to run against (INFERQ_REDIS_URL)",
    )
    return p


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def new_namespace() -> str:
    """A namespace no one else uses: ``bench`` + 12 hex digits.

    ``INFERQ_BENCH_NAMESPACE`` overrides the prefix (the smoke tests name theirs,
    so they check only their own keys on a Redis shared with other runs).
    """
    return f"{os.environ.get('INFERQ_BENCH_NAMESPACE', 'bench')}{uuid.uuid4().hex[:12]}"


def purge(client: redis.Redis, namespace: str) -> int:
    """Delete every key of ``namespace``: inferq's, and RQ's whose names contain it.

    Returns:
        The number of keys deleted.
    """
    deleted = 0
    for pattern in (f"inferq:{namespace}:*", f"rq:*{namespace}*"):
        keys = list(client.scan_iter(match=pattern, count=5000))
        for i in range(0, len(keys), 1000):
            deleted += int(client.unlink(*keys[i : i + 1000]))
    for set_key in _RQ_SETS:
        members = [m for m in client.smembers(set_key) if namespace in str(m)]
        if members:
            client.srem(set_key, *members)
    return deleted


@contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    """The repository at ``rev``, checked out into a temporary git worktree (removed on exit).

    Raises:
        subprocess.CalledProcessError: ``rev`` is not a commit of this repository.
    """
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="inferq-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )


@contextmanager
def namespace(url: str) -> Iterator[str]:
    """A fresh namespace, purged on exit (also after an error or Ctrl-C)."""
    ns = new_namespace()
    client = connect(url)
    try:
        yield ns
    finally:
        purge(client, ns)
        client.close()


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation between closest ranks.

    This is numpy's default ("linear") method.

    Raises:
        ValueError: ``values`` is empty or ``p`` is outside 0..100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p={p} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    """The median (50th percentile)."""
    return percentile(values, 50)


def ratio(ours: float, baseline: float) -> float | None:
    """``ours / baseline``, or None when the baseline is zero."""
    return ours / baseline if baseline else None


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell: thousands separators, ``-`` for None."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a table (first column left-aligned, the others right-aligned)."""
    t = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    console.print(t)


def note(text: str) -> None:
    """Print a line under the tables."""
    console.print(text, highlight=False)


def machine(url: str) -> dict[str, Any]:
    """Where the figures come from: CPUs, platform, Python and Redis versions."""
    client = connect(url)
    try:
        server = client.info("server")
    finally:
        client.close()
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis": server.get("redis_version"),
    }


def write_json(path: Path | None, url: str, figures: dict[str, Any]) -> None:
    """Write ``figures`` with the date, machine and command line to ``path`` (if given)."""
    if path is None:
        return
    doc = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine(url),
        **figures,
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    note(f"figures written to {path}")


class Stopwatch:
    """Wraps callables to add up the seconds spent in each, by name.

    ``sw.wrap("assign", store.assign)`` returns a function that calls
    ``store.assign`` and adds its duration to ``sw.samples["assign"]``.
    """

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        samples = self.samples.setdefault(name, [])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - t0)

        return wrapper

    def total(self, name: str) -> float:
        """Seconds spent in ``name`` so far."""
        return sum(self.samples.get(name, ()))

    def reset(self) -> None:
        """Forget every sample (the wrappers keep working)."""
        for samples in self.samples.values():
            samples.clear()
