"""A stand-in OpenAI-compatible server for the openai backend's tests.

A real HTTP server (``http.server``) on 127.0.0.1 and an ephemeral port, run in
a thread. Set its attributes to choose how it answers; it records every
request it receives in :attr:`StandIn.requests`.

``mode`` (POST requests):
    ``"ok"``     answer at once: ``completion_tokens`` words ``w0 w1 ...`` (at most
                 ``max_tokens``), usage when ``include_usage``; SSE when ``stream``.
    ``"slow"``   wait ``delay_s`` (or until the server stops), then answer as ``ok``.
    ``"error"``  answer ``error_status`` with ``error_body``.
    ``"drop"``   read the request, then close the connection without an answer.
    ``"garbage"`` answer 200 with a body that is not JSON.
    ``"truncate"`` begin the answer (SSE: ``truncate_after`` chunks; otherwise a 200 with an
                 empty body), then close the connection: no finish reason, no ``[DONE]``.
    ``"stream_error"`` a streamed POST: 200, then ``error_body`` as an SSE data event and
                 ``[DONE]`` (vLLM's error once its stream began); otherwise as ``error``.

``fail_posts``: when set, ``mode`` applies to that many POSTs only, later ones are
answered as ``ok``. ``retry_after``: a ``Retry-After`` header sent with ``error``
answers. Answers carry ``finish_reason`` (``length`` when ``max_tokens`` cut them,
else ``stop``). ``GET /health`` answers 200 (503 in ``error`` mode with a 5xx status).

``not_found_paths``: POST paths answered 404 (a chat-only server: ``{"/v1/completions"}``),
before ``mode`` and ``fail_posts`` are looked at.

``GET /v1/models`` answers 503 for the first ``models_unavailable`` calls, then
``models_status`` with the list ``models``.

``tool_calls``: when set, a chat POST with ``tools`` is answered with these calls
(``(name, arguments)`` pairs) in llama.cpp's shapes: ``message.tool_calls`` with
``content: null``, or streamed as one chunk of each call's id and name, then its
arguments in two pieces; ``finish_reason`` ``tool_calls``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, Self

Mode = Literal["ok", "slow", "error", "drop", "garbage", "truncate", "stream_error"]


@dataclass(frozen=True)
class Recorded:
    """One request the stand-in received."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float = 0.0  # time.monotonic() when received


@dataclass
class StandIn:
    """The stand-in server; see the module docstring. Use as a context manager."""

    port: int = 0
    mode: Mode = "ok"
    delay_s: float = 5.0
    error_status: int = 400
    error_body: Any = field(
        default_factory=lambda: {
            "error": {"message": "bad request from stand-in", "type": "invalid_request_error"}
        }
    )
    prompt_tokens: int = 7
    completion_tokens: int = 5
    #: ``usage.prompt_tokens_details.cached_tokens`` to report (None: no details)
    cached_tokens: int | None = None
    include_usage: bool = True
    models: list[str] = field(default_factory=lambda: ["llama-3.1-8b"])
    models_status: int = 200
    models_unavailable: int = 0
    fail_posts: int | None = None
    retry_after: str | None = None
    truncate_after: int = 2
    not_found_paths: set[str] = field(default_factory=set)
    tool_calls: list[tuple[str, str]] | None = None
    #: other GET routes: path -> (content type, body) (a model server's telemetry)
    pages: dict[str, tuple[str, str]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    _server: _Server | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        """Bind and serve in a daemon thread; sets :attr:`port` when it was 0."""
        server = _Server(("127.0.0.1", self.port), _Handler)
        server.standin = self
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake slow handlers and close the socket."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def record(self, item: Recorded) -> None:
        with self._lock:
            self.requests.append(item)

    def mode_for_post(self) -> Mode:
        """The mode of the next POST (``ok`` once ``fail_posts`` are spent)."""
        with self._lock:
            if self.fail_posts is None:
                return self.mode
            if self.fail_posts > 0:
                self.fail_posts -= 1
                return self.mode
            return "ok"

    def take_models_unavailable(self) -> bool:
        """True (and one fewer left) while GET /v1/models should still answer 503."""
        with self._lock:
            if self.models_unavailable > 0:
                self.models_unavailable -= 1
                return True
            return False

    def posts(self) -> list[Recorded]:
        """The POST requests received, in order."""
        with self._lock:
            return [r for r in self.requests if r.method == "POST"]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a client with many connections at once (the benchmarks) waits
    # for none (socketserver's 5 drops SYNs: a 1 s retransmit)
    standin: StandIn

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up on a slow or dropped answer is expected


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    @property
    def standin(self) -> StandIn:
        return self.server.standin

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def do_GET(self) -> None:
        s = self.standin
        s.record(Recorded("GET", self.path, dict(self.headers.items()), None, time.monotonic()))
        if self.path == "/health":
            down = s.mode == "error" and s.error_status >= 500 and s.fail_posts is None
            self._json(503 if down else 200, {"status": "error" if down else "ok"})
        elif self.path in s.pages:
            content_type, body = s.pages[self.path]
            self._send(200, content_type, body.encode())
        elif self.path != "/v1/models":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
        elif s.take_models_unavailable():
            self._json(503, {"error": "model is loading"})
        elif s.models_status >= 400:
            self._json(s.models_status, {"error": {"message": "invalid api key"}})
        else:
            models = [{"id": m, "object": "model"} for m in s.models]
            self._json(s.models_status, {"object": "list", "data": models})

    def do_POST(self) -> None:
        s = self.standin
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = json.loads(raw) if raw else {}
        s.record(Recorded("POST", self.path, dict(self.headers.items()), body, time.monotonic()))
        if self.path in s.not_found_paths:
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        mode = s.mode_for_post()
        if mode == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "stream_error" and body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self._data(s.error_body)
            self._event("data: [DONE]")
            return
        if mode in ("error", "stream_error"):
            extra = {} if s.retry_after is None else {"Retry-After": s.retry_after}
            self._json(s.error_status, s.error_body, extra)
            return
        if mode == "garbage":
            self._send(200, "text/plain", b"<html>not json</html>")
            return
        if mode == "truncate":
            self._truncate(body)
            return
        if mode == "slow" and s._stop.wait(s.delay_s):
            return
        if s.tool_calls is not None and body.get("tools"):
            self._call_tools(body, s.tool_calls)
            return
        self._answer(body)

    def _call_tools(self, body: dict[str, Any], calls: list[tuple[str, str]]) -> None:
        usage = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
        if not body.get("stream"):
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}, "id": f"id{i}"}
                    for i, (n, a) in enumerate(calls)
                ],
            }
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
            self._json(200, {"id": "x", "choices": [choice], "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
        for i, (name, arguments) in enumerate(calls):
            head = {"index": i, "id": f"id{i}", "type": "function"}
            head["function"] = {"name": name, "arguments": ""}
            self._data({"choices": [{"index": 0, "delta": {"tool_calls": [head]}}]})
            half = len(arguments) // 2
            for piece in (arguments[:half], arguments[half:]):
                tail = {"index": i, "function": {"arguments": piece}}
                self._data({"choices": [{"index": 0, "delta": {"tool_calls": [tail]}}]})
        self._data({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        self._data({"choices": [], "usage": usage})
        self._event("data: [DONE]")

    def _truncate(self, body: dict[str, Any]) -> None:
        self.close_connection = True
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(self.standin.truncate_after):
                self._data(
                    {"choices": [{"index": 0, "text": f" t{i}", "delta": {"content": f" t{i}"}}]}
                )
        else:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "0")
            self.end_headers()
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)

    def _answer(self, body: dict[str, Any]) -> None:
        s = self.standin
        chat = self.path == "/v1/chat/completions"
        n = min(int(body.get("max_tokens", 16)), s.completion_tokens)
        finish = "length" if n < s.completion_tokens else "stop"
        words = [f"w{i}" for i in range(n)]
        usage = {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": s.prompt_tokens + n,
        }
        if s.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": s.cached_tokens}  # type: ignore[assignment]
        if body.get("stream"):
            want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(words, chat, usage if (s.include_usage and want_usage) else None, finish)
            return
        text = " ".join(words)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = finish
        answer: dict[str, Any] = {"id": "cmpl-1", "model": body.get("model"), "choices": [choice]}
        if s.include_usage:
            answer["usage"] = usage
        self._json(200, answer)

    def _stream(
        self, words: list[str], chat: bool, usage: dict[str, int] | None, finish: str
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._event(": stand-in keep-alive comment")
        if chat:
            self._data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i, word in enumerate(words):
            piece = word if i == 0 else f" {word}"
            choice = (
                {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            )
            self._data({"choices": [choice]})
        end = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        self._data({"choices": [{**end, "finish_reason": finish}]})
        if usage is not None:
            self._data({"choices": [], "usage": usage})
        self._event("data: [DONE]")

    def _data(self, chunk: dict[str, Any]) -> None:
        self._event("data: " + json.dumps(chunk))

    def _event(self, text: str) -> None:
        self.wfile.write(text.encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, "application/json", json.dumps(body).encode(), headers)

    def _send(
        self, status: int, content_type: str, data: bytes, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
