"""Security: no pickle anywhere, passwords redacted everywhere, prompts never logged.

- The package imports no pickle-like module and builds every RQ object with the JSON
  serializer; a pickled job planted on a worker's queue is refused, never unpickled,
  both in-process (``pickle.loads`` is booby-trapped) and by a real worker process (the
  payload would create a file if it were ever loaded).
- A password in a Redis URL never reaches CLI output, error messages or log lines.
- Prompt text never appears in a worker's or a dispatcher's output at INFO.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import rq.serializers
from click.testing import CliRunner
from rq.serializers import JSONSerializer

from inferq.cli.main import cli
from inferq.client import AsyncClient, Client
from inferq.delivery import BatchJob, rq_connection, worker_queue
from inferq.errors import ConfigError, RedisUnavailable, redact_text, redact_url
from inferq.logs import RedactingFilter, setup_logging
from inferq.store import connection
from inferq.store.keys import Keys

from ..conftest import REDIS_URL

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inferq"
SECRET = "s3cr3t-Pa55"

# --- no pickle -----------------------------------------------------------------------

#: Modules that deserialize into arbitrary objects (code execution on load).
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "jsonpickle", "shelve"}
#: rq names that resolve to pickle when no serializer is given.
RQ_CONSTRUCTORS = {"Queue", "Worker", "SimpleWorker", "Job", "BatchJob", "InferqWorker"}


def package_modules() -> list[tuple[Path, ast.Module]]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30  # the scan really reads the package
    return [(path, ast.parse(path.read_text(), str(path))) for path in files]


def test_the_package_imports_no_pickle_like_module() -> None:
    found = []
    for path, tree in package_modules():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                if set(name.split(".")) & PICKLE_MODULES or name.endswith(
                    ("PickleSerializer", "DefaultSerializer")
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    assert found == []


def test_every_rq_object_is_built_with_the_json_serializer() -> None:
    """Each Queue/Worker/Job construction or fetch names serializer=JSONSerializer."""
    calls = []
    for path, tree in package_modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else None
            fetch = ("fetch", "fetch_many", "create")
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                name = func.value.id if func.attr in fetch else None
            if name not in RQ_CONSTRUCTORS:
                continue
            kwargs = {k.arg: k.value for k in node.keywords}
            serializer = kwargs.get("serializer")
            ok = isinstance(serializer, ast.Name) and serializer.id == "JSONSerializer"
            calls.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", name, ok))
    assert {name for _, name, _ in calls} >= {"Queue", "InferqWorker"}  # the scan finds them
    assert [c for c in calls if not c[2]] == []


def test_batch_jobs_are_json_whatever_serializer_is_asked_for() -> None:
    conn = rq_connection(REDIS_URL)
    assert BatchJob(connection=conn, serializer=rq.serializers.PickleSerializer).serializer is (
        JSONSerializer
    )
    assert BatchJob(connection=conn).serializer is JSONSerializer
    assert worker_queue(conn, Keys("x"), "w").serializer is JSONSerializer


# --- passwords are redacted -----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://bob:{SECRET}@h:6379/0", "redis://bob:***@h:6379/0"),
        (f"rediss://:{SECRET}@h/0?ssl_ca_certs=/ca", "rediss://:***@h/0?ssl_ca_certs=/ca"),
        (f"redis://h/0?password={SECRET}&db=1", "redis://h/0?password=***&db=1"),
        (
            f"redis+sentinel://app:{SECRET}@s1:26379,s2:26380/m?sentinel_password={SECRET}",
            "redis+sentinel://app:***@s1:26379,s2:26380/m?sentinel_password=***",
        ),
        (f"redis://u:{SECRET}@with@at@h:1/0", "redis://u:***@h:1/0"),
        (f"redis://u:{SECRET}@[::1", "<unparseable url>"),
        (f"u:{SECRET}@h:6379", "<redacted: not a URL>"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://justauser@h:6379/0", "redis://justauser@h:6379/0"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    if "://" in url:  # free text: only what looks like a URL is recognised
        assert SECRET not in redact_text(f"connecting to {url} now")


@pytest.fixture
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "RETRIES", 0)  # unreachable servers fail at once


@pytest.mark.usefixtures("no_retries")
@pytest.mark.parametrize(
    "url",
    [
        f"redis://bob:{SECRET}@127.0.0.1:1/0",
        f"redis://127.0.0.1:1/0?password={SECRET}",
        f"redis+sentinel://bob:{SECRET}@127.0.0.1:1/mymaster?sentinel_password={SECRET}",
        f"http://bob:{SECRET}@127.0.0.1:1/0",
        f"redis://bob:{SECRET}@127.0.0.1:notaport/0",
    ],
)
@pytest.mark.parametrize("command", [["submit", "hi"], ["queues"], ["dispatcher"], ["purge"]])
def test_cli_errors_never_show_the_password(url: str, command: list[str]) -> None:
    result = CliRunner().invoke(cli, ["--redis-url", url, *command])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    line = result.output.strip()
    assert line.startswith("error: ") and "\n" not in line, result.output
    assert SECRET not in result.output and "***" in result.output


@pytest.mark.usefixtures("no_retries")
def test_client_errors_never_show_the_password() -> None:
    url = f"redis://bob:{SECRET}@127.0.0.1:1/0"
    with pytest.raises(RedisUnavailable) as info:
        Client(url)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    assert info.value.url == "redis://bob:***@127.0.0.1:1/0"
    with pytest.raises(ConfigError) as bad:
        Client(f"redis://bob:{SECRET}@127.0.0.1:port/0")
    assert SECRET not in str(bad.value)

    async def open_async() -> None:
        async with AsyncClient(url):
            pass

    with pytest.raises(RedisUnavailable) as ainfo:
        asyncio.run(open_async())
    assert SECRET not in str(ainfo.value) and "bob:***@" in str(ainfo.value)


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
@pytest.mark.parametrize("json_lines", [False, True])
def test_log_lines_never_show_the_password(
    json_lines: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("INFO", json_lines=json_lines)
    log = logging.getLogger("inferq.test")
    url = f"redis+sentinel://app:{SECRET}@s1,s2/m?sentinel_password={SECRET}"
    log.info("connecting to %s", url)
    log.warning(f"plain text with redis://:{SECRET}@h:6379/0 inside")
    try:
        raise ConnectionError(f"could not reach rediss://bob:{SECRET}@h:6380/0")
    except ConnectionError:
        log.exception("reconnecting to %s", f"redis://h/0?password={SECRET}")
    err = capsys.readouterr().err
    assert err.count("\n") >= 3 and "Traceback" in err and "could not reach" in err
    assert SECRET not in err
    assert "app:***@s1,s2/m?sentinel_password=***" in err
    if json_lines:
        assert all(json.loads(line)["level"] for line in err.strip().splitlines())


def test_the_filter_redacts_for_handlers_inferq_does_not_own() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger(f"inferq.test.{uuid.uuid4().hex}")
    log.addHandler(handler)
    log.propagate = False
    try:
        raise OSError(f"redis://u:{SECRET}@h/0 refused")
    except OSError:
        log.error("url %s", f"redis://u:{SECRET}@h/0", exc_info=True)
    assert "u:***@h/0 refused" in stream.getvalue() and SECRET not in stream.getvalue()


# --- prompts are never logged at INFO ---------------------------------------------------
