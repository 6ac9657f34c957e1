"""The long chaos run: the chaos tests' scenarios at soak size, with their figures.

Each scenario runs on a ``redis-server`` of its own (a free port, a temporary
directory, ``appendonly yes``, ``appendfsync everysec``) with every daemon as a
real process, exactly as ``tests/chaos`` does (this script imports the
scenarios from there), and checks the same promises:

- ``kill``: SIGKILL a random worker every second and one of two dispatchers
  every third kill during ``--requests`` requests; 0 lost, one final result
  each, kill-to-requeue time against two heartbeats plus the lease;
- ``restart``: SHUTDOWN Redis mid-run, then SIGKILL it mid-run; what was
  acknowledged and lost (the fsync window), what ran twice;
- ``clients``: ``CLIENT KILL TYPE normal`` every 0.2 s for ``--clients-s`` seconds;
- ``drains``: ``--drains`` scale-downs of busy workers under load; no request
  handed back or run twice, every drained worker exits 0.

Prints one JSON object per scenario and a verdict; exits 1 if any failed::

    python scripts/chaos_long.py --json chaos.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package

from tests.chaos import test_kill, test_redis_restart, test_scale_down
from tests.chaos.conftest import Deployment, RedisServer, Zygote
from tests.chaos.test_client_kill import run_client_kills

SCENARIOS = ("kill", "restart", "clients", "drains")


def run_kill(d: Deployment, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    figures, audit, ids = test_kill.run_kills(d, requests=args.requests, seed=args.seed)
    test_kill.check(figures, audit, ids)
    return figures.summary() | {"requeue_bound_s": test_kill.REQUEUE_BOUND_S}


def run_restart(d: Deployment, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    """SHUTDOWN (must lose nothing), then SIGKILL on a fresh namespace (reports the loss)."""
    graceful = test_redis_restart.run_restart(d, server, graceful=True, before_s=10, down_s=5)
    assert not graceful.lost, f"graceful restart lost {len(graceful.lost)} acknowledged"
    d.close()
    crashed = Deployment(server.url, d.log_dir / "sigkill")
    try:
        killed = test_redis_restart.run_restart(
            crashed, server, graceful=False, before_s=10, down_s=5
        )
    finally:
        crashed.close()
    return {"shutdown": graceful.summary(), "sigkill": killed.summary()}


def run_clients(d: Deployment, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    return run_client_kills(d, server, duration_s=args.clients_s, every_s=0.2).summary()


def run_drains(d: Deployment, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    zygote = Zygote(d)
    try:
        figures = test_scale_down.run_scale_down(
            d, zygote, drains=args.drains, at_once=3, seed=args.seed
        )
    finally:
        zygote.close()
    test_scale_down.check(figures, args.drains)
    return figures.summary()


RUNNERS: dict[str, Callable[[Deployment, RedisServer, argparse.Namespace], dict[str, Any]]] = {
    "kill": run_kill,
    "restart": run_restart,
    "clients": run_clients,
    "drains": run_drains,
}


def scenario(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Run one scenario on a fresh redis-server; its figures and verdict."""
    server = RedisServer(root / name / "redis")
    server.start()
    d = Deployment(server.url, root / name / "logs")
    started = time.monotonic()
    try:
        figures = RUNNERS[name](d, server, args)
        verdict = "passed"
    except AssertionError as exc:
        figures, verdict = {}, f"FAILED: {str(exc)[:2000]}"
    finally:
        d.close()
        server.kill()
    return {
        "scenario": name,
        "verdict": verdict,
        "wall_s": round(time.monotonic() - started, 1),
    } | {"figures": figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=SCENARIOS, action="append", help="run these (repeat)")
    p.add_argument("--requests", type=int, default=10_000, help="kill: requests")
    p.add_argument("--drains", type=int, default=1000, help="drains: scale-downs")
    p.add_argument("--clients-s", type=float, default=60.0, help="clients: seconds of kills")
    p.add_argument("--seed", type=int, default=7, help="victim choice")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the logs directory")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="inferq-chaos-"))
    results = []
    for name in args.only or SCENARIOS:
        print(f"--- {name} ...", flush=True)
        result = scenario(name, args, root)
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    failed = [r["scenario"] for r in results if r["verdict"] != "passed"]
    print(f"logs: {root}" if args.keep or failed else "", "verdict:", failed or "all passed")
    if not args.keep and not failed:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
