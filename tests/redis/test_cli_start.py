"""``inferq queues`` starts without the settings, the models or rich, and reads what the
store reads; a typo among the ``INFERQ_*`` variables is named on stderr (issue 15: CLI
start time and rough edges). Each case is a fresh process: what a process imports is
the thing under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from inferq.config import Settings
from inferq.store import Store

from ..builders import inference_request
from ..conftest import REDIS_URL

#: What ``inferq queues --json`` must not import: the settings and models (pydantic),
#: the Lua scripts' store, rich, and every daemon's or extra's dependency.
HEAVY = (
    "pydantic",
    "pydantic_settings",
    "inferq.config",
    "inferq.models",
    "inferq.store.sync",
    "inferq.store.aio",
    "rich",
    "rq",
    "prometheus_client",
    "httpx",
    "starlette",
    "numpy",
)

PROBE = (
    "import json, sys\n"
    "from inferq.cli.main import main\n"
    "sys.argv = ['inferq', *sys.argv[1:]]\n"
    "code = 0\n"
    "try:\n    main()\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
    "print('HEAVY', json.dumps(heavy), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``inferq ARGS`` in a fresh process with only ``env`` among the INFERQ_ variables."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("INFERQ_")}
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def heavy_of(out: subprocess.CompletedProcess[str]) -> list[str]:
    line = next(x for x in out.stderr.splitlines() if x.startswith("HEAVY "))
    return list(json.loads(line.removeprefix("HEAVY ")))


def test_queues_json_imports_no_heavy_module_and_reads_what_the_store_reads(
    store: Store, settings: Settings, namespace: str
) -> None:
    store.submit(inference_request(settings, priority="batch"))
    store.submit(inference_request(settings, priority="batch"))
    out = cli("queues", "--json", INFERQ_REDIS_URL=REDIS_URL, INFERQ_NAMESPACE=namespace)
    assert out.returncode == 0, out.stderr
    assert heavy_of(out) == []
    rows = json.loads(out.stdout)
    expected = [(c, r, n) for c, r, n, _ in store.queue_depths()]
    assert [(r["class"], r["route"], r["queued"]) for r in rows] == expected
    assert expected and expected[0][2] == 2
    assert rows[0]["oldest_wait_s"] >= 0


def test_queues_options_name_the_target_as_the_environment_does(namespace: str) -> None:
    out = cli("--redis-url", REDIS_URL, "--namespace", namespace, "queues", "--json")
    assert out.returncode == 0, out.stderr
    assert heavy_of(out) == [] and json.loads(out.stdout) == []
    assert f"namespace '{namespace}' has no keys" in out.stderr


def test_queues_loads_the_settings_when_anything_else_configures_them(
    namespace: str, tmp_path: Path
) -> None:
    # Another setting in the environment: validated as before (here, refused).
    out = cli("queues", "--json", INFERQ_NAMESPACE=namespace, INFERQ_MAX_ATTEMPTS="0")
    assert out.returncode == 1 and "error: setting max_attempts" in out.stderr
    assert "pydantic" in heavy_of(out)
    # A settings file: read (and validated) as before.
    path = tmp_path / "inferq.toml"
    path.write_text(f'redis_url = "{REDIS_URL}"\nnamespace = "{namespace}"\n')
    out = cli("queues", "--json", INFERQ_CONFIG=str(path))
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
    assert f"namespace '{namespace}' has no keys" in out.stderr
    # A namespace the settings refuse: their error, not a read of a bad namespace.
    out = cli("queues", "--json", INFERQ_REDIS_URL=REDIS_URL, INFERQ_NAMESPACE="a:b")
    assert out.returncode == 1 and "error: setting namespace" in out.stderr


def test_an_unknown_inferq_variable_is_named_once_with_the_closest_known_name(
    namespace: str,
) -> None:
    out = cli(
        "queues",
        "--json",
        INFERQ_REDIS_ULR="redis://127.0.0.1:1/0",
        INFERQ_REDIS_URL=REDIS_URL,
        INFERQ_NAMESPACE=namespace,
        INFERQ_WHATEVER="1",
    )
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.startswith("warning:")]
    assert lines == [
        "warning: INFERQ_REDIS_ULR is not a variable inferq reads (ignored); "
        "did you mean INFERQ_REDIS_URL?",
        "warning: INFERQ_WHATEVER is not a variable inferq reads (ignored)",
    ]
