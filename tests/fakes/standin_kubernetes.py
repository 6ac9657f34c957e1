"""A stand-in Kubernetes API server for the kubernetes scaler backend's tests.

A real HTTP server (``http.server``) on 127.0.0.1 and an ephemeral port, run in
a thread, serving the calls the official client makes for the backend::

    GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
    PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   JSON patch or merge patch
    GET   /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...
    GET   /api/v1/namespaces/{ns}/pods/{name}
    PATCH /api/v1/namespaces/{ns}/pods/{name}                       merge patch
    DELETE /api/v1/namespaces/{ns}/pods/{name}                      terminating

It also plays the ReplicaSet controller: raising replicas creates ``Pending``
pods; lowering them marks pods terminating, chosen as the real controller ranks
them (pending before running, not ready before ready, lower
``controller.kubernetes.io/pod-deletion-cost`` first, newer first); a deleted
pod is replaced while the replica count asks for it. A JSON patch
whose ``test`` fails is answered 422, like the API server. ``races`` makes the
next scale reads each followed by another writer's ``+1``.

Every request is recorded in :attr:`K8sStandIn.requests` (method, path, query,
content type, JSON body).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .standin_http import LoopbackServer

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class Recorded:
    """One request the stand-in received."""

    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any


class PatchFailed(Exception):
    """A JSON patch operation did not apply (answered 422)."""


@dataclass
class Deployment:
    """A Deployment as the stand-in keeps it."""

    name: str
    namespace: str
    labels: dict[str, str]
    replicas: int = 0
    version: int = 1


@dataclass
class K8sStandIn(LoopbackServer):
    """The stand-in API server; use as a context manager."""

    port: int = 0
    deployments: dict[tuple[str, str], Deployment] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    races: int = 0
    _seq: int = 0
    _born: dict[str, int] = field(default_factory=dict)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the ``host`` of a client Configuration."""
        return f"http://127.0.0.1:{self.port}"

    # -- test helpers -------------------------------------------------------------

    def add_deployment(
        self, name: str, labels: dict[str, str], replicas: int = 0, namespace: str = "default"
    ) -> Deployment:
        """Create a Deployment whose pods carry (and are selected by) ``labels``."""
        with self._lock:
            d = Deployment(name, namespace, labels)
            self.deployments[(namespace, name)] = d
            self._reconcile(d, replicas)
            return d

    def set_ready(self, namespace: str = "default") -> None:
        """Every pending pod becomes running and ready (its model has loaded)."""
        with self._lock:
            for pod in self.pods.values():
                if (
                    pod["metadata"]["namespace"] == namespace
                    and pod["status"]["phase"] == "Pending"
                ):
                    pod["status"] = _status("Running", ready=True)

    def active(self, deployment: Deployment) -> list[str]:
        """Names of the Deployment's pods that are not terminating, oldest first."""
        return [p["metadata"]["name"] for p in self._active(deployment)]

    def terminating(self) -> list[str]:
        """Names of the pods the ReplicaSet is removing."""
        return [
            p["metadata"]["name"]
            for p in self.pods.values()
            if p["metadata"].get("deletionTimestamp")
        ]

    def calls(self, method: str, pattern: str) -> list[Recorded]:
        """Recorded requests of ``method`` whose path fully matches the regex ``pattern``."""
        with self._lock:
            return [
                r for r in self.requests if r.method == method and re.fullmatch(pattern, r.path)
            ]

    # -- the ReplicaSet ------------------------------------------------------------

    def _active(self, d: Deployment) -> list[dict[str, Any]]:
        return [
            p
            for p in self.pods.values()
            if p["metadata"]["namespace"] == d.namespace
            and p["metadata"]["name"].startswith(d.name + "-")
            and not p["metadata"].get("deletionTimestamp")
        ]

    def _reconcile(self, d: Deployment, replicas: int) -> None:
        d.replicas = replicas
        d.version += 1
        active = self._active(d)
        while len(active) < replicas:
            self._seq += 1
            name = f"{d.name}-7c9b6d5f4-p{self._seq:04d}"
            self.pods[(d.namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": d.namespace,
                    "labels": dict(d.labels),
                    "annotations": {},
                    "uid": f"uid-{self._seq}",
                    "resourceVersion": str(self._seq),
                },
                "spec": {"containers": [{"name": "worker", "image": "inferq:test"}]},
                "status": _status("Pending", ready=False),
            }
            self._born[name] = self._seq
            active = self._active(d)
        ranked = sorted(active, key=lambda p: _deletion_rank(p, self._born[p["metadata"]["name"]]))
        for pod in ranked[: max(0, len(active) - replicas)]:
            pod["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"

    def _scale(self, d: Deployment) -> dict[str, Any]:
        spec = {"replicas": d.replicas} if d.replicas else {}  # omitempty, like the API
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                "name": d.name,
                "namespace": d.namespace,
                "resourceVersion": str(d.version),
            },
            "spec": spec,
            "status": {
                "replicas": len(self._active(d)),
                "selector": ",".join(f"{k}={v}" for k, v in sorted(d.labels.items())),
            },
        }


def _deletion_rank(pod: dict[str, Any], born: int) -> tuple[int, int, int, int]:
    """The ReplicaSet's order: pending, not ready, low deletion cost, newer go first."""
    status = pod["status"]
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
    cost = int(pod["metadata"].get("annotations", {}).get(DELETION_COST, "0"))
    return (status["phase"] != "Pending", ready, cost, -born)


def _status(phase: str, *, ready: bool) -> dict[str, Any]:
    return {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes

    def log_message(self, format: str, *args: Any) -> None:
        return None

    @property
    def standin(self) -> K8sStandIn:
        return self.server.standin  # type: ignore[attr-defined, no-any-return]

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = parse_qs(parts.query)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw.strip() else None
        content_type = self.headers.get("Content-Type", "")
        s = self.standin
        with s._lock:
            s.requests.append(Recorded(method, path, query, content_type, body))
            status, answer = _route(s, method, path, query, content_type, body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _route(
    s: K8sStandIn,
    method: str,
    path: str,
    query: dict[str, list[str]],
    content_type: str,
    body: Any,
) -> tuple[int, Any]:
    if m := re.fullmatch(r"/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale", path):
        d = s.deployments.get((m[1], m[2]))
        if d is None:
            return _failure(404, "NotFound", f'deployments.apps "{m[2]}" not found')
        if method == "GET":
            answer = s._scale(d)
            if s.races > 0:  # another writer slips in between this read and the patch
                s.races -= 1
                s._reconcile(d, d.replicas + 1)
            return 200, answer
        return _patch_scale(s, d, content_type, body)
    if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path):
        return 200, _list_pods(s, m[1], query.get("labelSelector", [""])[0])
    if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path):
        pod = s.pods.get((m[1], m[2]))
        if pod is None:
            return _failure(404, "NotFound", f'pods "{m[2]}" not found')
        if method == "PATCH":
            if "merge-patch" not in content_type or not isinstance(body, dict):
                return _failure(415, "UnsupportedMediaType", f"stand-in: {content_type}")
            _merge(pod, body)
        if method == "DELETE":
            pod["metadata"].setdefault("deletionTimestamp", "2024-01-01T00:00:00Z")
            for d in s.deployments.values():  # the ReplicaSet replaces it if still wanted
                if d.namespace == m[1] and m[2].startswith(d.name + "-"):
                    s._reconcile(d, d.replicas)
        return 200, pod
    return _failure(404, "NotFound", f"stand-in: no route for {method} {path}")


def _patch_scale(s: K8sStandIn, d: Deployment, content_type: str, body: Any) -> tuple[int, Any]:
    scale = s._scale(d)
    if content_type == "application/json-patch+json":
        try:
            scale = _json_patch(scale, body)
        except PatchFailed as exc:
            return _failure(422, "Invalid", str(exc))
    elif "merge-patch" in content_type:
        _merge(scale, body)
    else:
        return _failure(415, "UnsupportedMediaType", f"stand-in: {content_type}")
    s._reconcile(d, int(scale["spec"].get("replicas", 0)))
    return 200, s._scale(d)


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``test``/``add``/``replace`` on object members (all the backend sends)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, leaf = op["path"].lstrip("/").split("/")
        target = doc
        for key in parents:
            if key not in target:
                raise PatchFailed(f"doc is missing path: {op['path']}")
            target = target[key]
        if op["op"] == "test":
            if target.get(leaf) != op["value"]:
                raise PatchFailed(f"testing value {op['path']} failed")
        elif op["op"] == "replace":
            if leaf not in target:
                raise PatchFailed(f"replace operation does not apply: missing {op['path']}")
            target[leaf] = op["value"]
        elif op["op"] == "add":
            target[leaf] = op["value"]
        else:
            raise PatchFailed(f"stand-in: unsupported op {op['op']}")
    return doc


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Merge patch (RFC 7386): objects merge, null deletes, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _list_pods(s: K8sStandIn, namespace: str, selector: str) -> dict[str, Any]:
    wanted = [tuple(part.split("=", 1)) for part in selector.split(",") if part]
    items = [
        p
        for p in s.pods.values()
        if p["metadata"]["namespace"] == namespace
        and all(p["metadata"]["labels"].get(k) == v for k, v in wanted)
    ]
    items.sort(key=lambda p: s._born[p["metadata"]["name"]])
    return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}


def _failure(code: int, reason: str, message: str) -> tuple[int, Any]:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return code, status


K8sStandIn.handler = _Handler
