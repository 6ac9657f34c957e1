"""``python -m inferq ...`` with timestamp probes, for ``trace_ttft.py``.

Run as ``python _ttft_probe.py <inferq arguments>``: it wraps a few functions of the
worker and the gateway so that each call writes ``<epoch s> <name>:in`` and
``<name>:out`` lines (the first token seen by the worker: ``w.sink``) to the file named
by ``PROBE_LOG``, then runs inferq's CLI. Functions a tree lacks are skipped, so a
baseline commit runs with the probes it has.
"""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import sys
import threading
import time
from typing import Any

_LOG = open(os.environ["PROBE_LOG"], "a", buffering=1)  # noqa: SIM115 - for the process's life
_LOCK = threading.Lock()


def mark(name: str) -> None:
    with _LOCK:
        _LOG.write(f"{time.time():.6f} {name}\n")


def wrap(owner: Any, attr: str, name: str) -> None:
    """Stamp entry and exit of ``owner.attr`` (a function or a coroutine function)."""
    f = getattr(owner, attr, None)
    if f is None:
        return
    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def stamped_async(*a: Any, **k: Any) -> Any:
            mark(name + ":in")
            try:
                return await f(*a, **k)
            finally:
                mark(name + ":out")

        setattr(owner, attr, stamped_async)
        return

    @functools.wraps(f)
    def stamped(*a: Any, **k: Any) -> Any:
        mark(name + ":in")
        try:
            return f(*a, **k)
        finally:
            mark(name + ":out")

    setattr(owner, attr, stamped)


def install() -> None:
    from inferq.gateway import app
    from inferq.store import aio, sync
    from inferq.workers import runtime
    from inferq.workers.servers import openai

    wrap(runtime.Engine, "accept", "w.accept")
    wrap(runtime.Engine, "_launch", "w.launch")
    wrap(openai.OpenAIServer, "generate", "w.generate")
    wrap(sync.Store, "publish_chunks", "w.publish")
    wrap(aio.AsyncStore, "publish_chunks", "w.publish")
    wrap(app.Gateway, "_complete", "g.complete")
    wrap(aio.AsyncStore, "submit", "g.submit")
    wrap(aio.AsyncStore, "read_stream", "g.xread")
    sink = runtime.Engine._sink

    def stamped_sink(self: Any, *a: Any, **k: Any) -> Any:
        on_chunk = sink(self, *a, **k)

        def stamped(*x: Any) -> Any:
            mark("w.sink")
            return on_chunk(*x)

        return stamped

    runtime.Engine._sink = stamped_sink  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    sys.argv = ["inferq", *sys.argv[1:]]
    runpy.run_module("inferq", run_name="__main__")
