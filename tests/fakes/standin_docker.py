"""A stand-in Docker Engine API for the docker scaler backend's tests.

A real HTTP server (``http.server``) on 127.0.0.1 and an ephemeral port, run in
a thread, answering the few Engine API calls the Docker SDK makes for the
backend (paths may carry a ``/v1.xx`` version prefix)::

    GET    /version                     the API version the SDK then uses
    POST   /containers/create?name=N    404 "No such image" unless the image is known
    POST   /images/create?fromImage=I   "pulls" the image (a JSON progress stream)
    GET    /images/{name}/json          inspect a known image
    POST   /containers/{id}/start       state -> running
    GET    /containers/json?filters=..  list, filtered by ``label`` (key=value)
    GET    /containers/{id}/json        inspect (by id or name)
    POST   /containers/{id}/stop        state -> exited
    DELETE /containers/{id}             remove

Every request is recorded in :attr:`DockerStandIn.requests` (method, path
without the version prefix, query, JSON body) for the tests to check.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .standin_http import LoopbackServer

API_VERSION = "1.44"


@dataclass(frozen=True)
class Recorded:
    """One request the stand-in received."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class DockerStandIn(LoopbackServer):
    """The stand-in Docker daemon; use as a context manager."""

    port: int = 0
    images: set[str] = field(default_factory=lambda: {"inferq:test"})
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        """``tcp://127.0.0.1:<port>``: a ``base_url`` for ``docker.DockerClient``."""
        return f"tcp://127.0.0.1:{self.port}"

    def calls(self, method: str, pattern: str) -> list[Recorded]:
        """Recorded requests of ``method`` whose path fully matches the regex ``pattern``."""
        with self._lock:
            return [
                r for r in self.requests if r.method == method and re.fullmatch(pattern, r.path)
            ]

    def find(self, ref: str) -> dict[str, Any] | None:
        """A container by id, id prefix or name."""
        for c in self.containers.values():
            if c["Id"].startswith(ref) or c["Name"] == "/" + ref:
                return c
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes

    def log_message(self, format: str, *args: Any) -> None:
        return None

    @property
    def standin(self) -> DockerStandIn:
        return self.server.standin  # type: ignore[attr-defined, no-any-return]

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        parts = urlsplit(self.path)
        path = re.sub(r"^/v[0-9.]+", "", unquote(parts.path))
        query = parse_qs(parts.query)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw.strip() else None
        s = self.standin
        with s._lock:
            s.requests.append(Recorded(method, path, query, body))
            status, answer = _route(s, method, path, query, body)
        self._reply(status, answer)

    def _reply(self, status: int, answer: Any) -> None:
        data = b"" if answer is None else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Api-Version", API_VERSION)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _route(
    s: DockerStandIn, method: str, path: str, query: dict[str, list[str]], body: Any
) -> tuple[int, Any]:
    if method == "GET" and path == "/version":
        return 200, {"ApiVersion": API_VERSION, "MinAPIVersion": "1.24", "Version": "25.0.0"}
    if method == "POST" and path == "/containers/create":
        return _create(s, query.get("name", [""])[0], body)
    if method == "POST" and path == "/images/create":
        image = query["fromImage"][0] + ":" + query.get("tag", ["latest"])[0]
        s.images.add(image)
        return 200, {"status": f"Downloaded newer image for {image}"}
    if m := re.fullmatch(r"/images/(.+)/json", path):
        if m[1] in s.images:
            return 200, {"Id": "sha256:" + "0" * 64, "RepoTags": [m[1]]}
        return 404, {"message": f"No such image: {m[1]}"}
    if method == "GET" and path == "/containers/json":
        return 200, _list(s, query)
    if m := re.fullmatch(r"/containers/([^/]+)(/json|/start|/stop)?", path):
        return _container_op(s, method, m[1], m[2] or "")
    return 404, {"message": f"stand-in: no route for {method} {path}"}


def _create(s: DockerStandIn, name: str, body: dict[str, Any]) -> tuple[int, Any]:
    image = body["Image"] if ":" in body["Image"] else body["Image"] + ":latest"
    if image not in s.images:
        return 404, {"message": f"No such image: {image}"}
    if name and s.find(name) is not None:
        return 409, {"message": f'Conflict. The container name "/{name}" is already in use'}
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    s.containers[cid] = {
        "Id": cid,
        "Name": "/" + (name or cid[:12]),
        "Image": body["Image"],
        "Config": {
            "Image": body["Image"],
            "Cmd": body.get("Cmd"),
            "Env": body.get("Env"),
            "Labels": body.get("Labels") or {},
        },
        "HostConfig": body.get("HostConfig") or {},
        "State": {"Status": "created", "Running": False},
    }
    return 201, {"Id": cid, "Warnings": []}


def _list(s: DockerStandIn, query: dict[str, list[str]]) -> list[dict[str, Any]]:
    filters = json.loads(query.get("filters", ["{}"])[0])
    wanted = filters.get("label", [])
    if isinstance(wanted, dict):  # the other accepted form: {"k=v": true}
        wanted = list(wanted)
    running_only = query.get("all", ["0"])[0] in ("0", "false", "False")
    out = []
    for c in s.containers.values():
        labels = c["Config"]["Labels"]
        if running_only and not c["State"]["Running"]:
            continue
        if all(_label_matches(labels, w) for w in wanted):
            out.append(
                {
                    "Id": c["Id"],
                    "Names": [c["Name"]],
                    "Image": c["Image"],
                    "Labels": labels,
                    "State": c["State"]["Status"],
                }
            )
    return out


def _label_matches(labels: dict[str, str], wanted: str) -> bool:
    key, sep, value = wanted.partition("=")
    return key in labels and (not sep or labels[key] == value)


def _container_op(s: DockerStandIn, method: str, ref: str, op: str) -> tuple[int, Any]:
    c = s.find(ref)
    if c is None:
        return 404, {"message": f"No such container: {ref}"}
    if method == "GET" and op == "/json":
        return 200, c
    if method == "POST" and op == "/start":
        c["State"] = {"Status": "running", "Running": True}
        return 204, None
    if method == "POST" and op == "/stop":
        if not c["State"]["Running"]:
            return 304, None
        c["State"] = {"Status": "exited", "Running": False}
        return 204, None
    if method == "DELETE" and op == "":
        if c["State"]["Running"]:
            return 409, {"message": "cannot remove a running container: stop it first"}
        del s.containers[c["Id"]]
        return 204, None
    return 404, {"message": f"stand-in: no route for {method} /containers/{ref}{op}"}


DockerStandIn.handler = _Handler
