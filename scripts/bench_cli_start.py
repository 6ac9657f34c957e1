"""CLI start time: CPU seconds of `inferq --help` and `inferq queues` against a baseline.

Issue 15's benchmark (goal: half of the time at the issue's start). Each command runs
``--runs`` times as a fresh process (``python -m inferq ...``), alternating between this
tree and a baseline commit checked out into a temporary git worktree (run with its
``src`` first on ``PYTHONPATH``, the same virtual environment), so a loaded machine
moves both sides. The figure is the child processes' CPU time (user + system, from
``getrusage``), which a busy machine inflates much less than wall time; wall time is
shown beside it. ``queues`` runs against ``--redis-url`` in an empty namespace.

    python scripts/bench_cli_start.py --baseline c9ff83c --runs 10
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _bench

ROOT = Path(__file__).resolve().parents[1]
GOAL_RATIO = 0.5


def run_once(src: Path, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU s, wall s) of one ``python -m inferq ARGS`` with ``src`` first on the path."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "inferq", *args],
        env={**env, "PYTHONPATH": str(src)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    p = _bench.parser(__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="c9ff83c", help="commit to compare against")
    p.add_argument("--runs", type=_bench.positive, default=10, help="runs per command and side")
    args = p.parse_args()
    commands = {"--help": ["--help"], "queues": ["queues", "--json"]}
    env = {**os.environ, "INFERQ_REDIS_URL": args.redis_url}
    with (
        tempfile.TemporaryDirectory(prefix="inferq-baseline-") as tmp,
        _bench.namespace(args.redis_url) as ns,
    ):
        env["INFERQ_NAMESPACE"] = ns
        base = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            sides = {"this tree": ROOT / "src", f"baseline {args.baseline}": base / "src"}
            samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for _ in range(args.runs):
                for cmd, cmd_args in commands.items():
                    for side, src in sides.items():
                        samples.setdefault((cmd, side), []).append(run_once(src, cmd_args, env))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                check=False,
                capture_output=True,
            )
    report(args, commands, list(sides), samples)


def report(
    args: Any,
    commands: dict[str, list[str]],
    sides: list[str],
    samples: dict[tuple[str, str], list[tuple[float, float]]],
) -> None:
    rows = []
    figures: dict[str, Any] = {}
    for cmd in commands:
        ours = _bench.median([c for c, _ in samples[(cmd, sides[0])]])
        theirs = _bench.median([c for c, _ in samples[(cmd, sides[1])]])
        ratio = _bench.ratio(ours, theirs)
        met = ratio is not None and ratio <= GOAL_RATIO
        figures[cmd] = {"cpu_ms": ours * 1000, "baseline_cpu_ms": theirs * 1000, "ratio": ratio}
        figures[cmd]["goal_met"] = met
        figures[cmd]["wall_ms"] = _bench.median([w for _, w in samples[(cmd, sides[0])]]) * 1000
        figures[cmd]["baseline_wall_ms"] = (
            _bench.median([w for _, w in samples[(cmd, sides[1])]]) * 1000
        )
        rows.append(
            [
                f"inferq {' '.join(commands[cmd])}",
                _bench.fmt(ours * 1000, 0),
                _bench.fmt(theirs * 1000, 0),
                f"{_bench.fmt(ratio)} ({'met' if met else 'MISSED'})",
                f"{figures[cmd]['wall_ms']:,.0f} / {figures[cmd]['baseline_wall_ms']:,.0f}",
            ]
        )
    _bench.table(
        f"CLI start, median of {args.runs} runs (CPU ms of the process)",
        ["command", "this tree", sides[1], f"ratio (goal <= {GOAL_RATIO:g})", "wall ms (both)"],
        rows,
    )
    _bench.write_json(args.json, args.redis_url, {"runs": args.runs, "commands": figures})


if __name__ == "__main__":
    main()
