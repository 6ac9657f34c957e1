"""The deployment commands, run as real processes against the real Redis (issue 15).

Each command is taken from its file exactly and run as the container would run it:
the image's ENTRYPOINT (parsed from the Dockerfile) before compose's ``command`` or
Kubernetes' ``args``, Kubernetes' ``$(VAR)`` expanded, the environment the container
gets (compose ``environment``, ConfigMaps, the downward API). Only what points at the
cluster is substituted, through the variables the files use: ``INFERQ_REDIS_URL``
(``redis://redis:6379/0`` -> the test Redis), ``INFERQ_NAMESPACE`` (-> the test's
namespace, in pod labels too), listening ports (-> free ones), the model server's
``base_url`` (vLLM on 127.0.0.1:8000 -> a stand-in OpenAI server), the Docker socket
(-> ``DOCKER_HOST`` of a stand-in Engine API) and the service account (-> a
kubeconfig of a stand-in API server). The worker command the docker scaler platform
builds is taken from the container it asks the (stand-in) Docker daemon to create,
and run the same way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml

from inferq.cli.main import cli
from inferq.config import Settings
from inferq.embedded import free_port
from inferq.intake import build_request
from inferq.models import WorkerState
from inferq.scaler.platforms.base import LABEL_MANAGED_BY, LABEL_NAMESPACE, LABEL_WORKER, MANAGED_BY
from inferq.store import Store

from .. import deploy_files as files
from ..conftest import REDIS_URL
from ..fakes.standin_docker import DockerStandIn
from ..fakes.standin_kubernetes import K8sStandIn
from ..fakes.standin_openai import StandIn as OpenAIStandIn
from ..helpers import wait_for

#: The console script pip installed: what the image's PATH finds for ENTRYPOINT inferq.
INFERQ = Path(sys.executable).with_name("inferq")


@dataclass
class Proc:
    """A command the test started, its output in a file."""

    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout: float = 30) -> None:
        def seen() -> bool:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.argv} exited {self.popen.returncode}:\n{self.output()}"
                )
            return re.search(pattern, self.output()) is not None

        wait_for(seen, timeout=timeout, what=f"{pattern!r} from {self.argv}")

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return self.popen.returncode


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Any]:
    """Start ``argv`` (its ``inferq`` is the installed console script) with ``env``."""
    started: list[Proc] = []

    def start(argv: list[str], env: Mapping[str, str]) -> Proc:
        assert argv[0] == "inferq", argv  # the image's ENTRYPOINT
        assert INFERQ.exists(), INFERQ
        log = tmp_path / f"proc-{len(started)}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("INFERQ_", "DOCKER_"))}
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [str(INFERQ), *argv[1:]],
                env={**base, **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc = Proc(argv, popen, log)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()


def in_test(env: Mapping[str, str], namespace: str) -> dict[str, str]:
    """The container's environment with the cluster's Redis and namespace swapped for
    the test's; the file's Redis URL must be the one the deployment expects."""
    out = dict(env)
    url = urlsplit(out["INFERQ_REDIS_URL"])
    assert (url.hostname, url.port) == ("redis", 6379), out["INFERQ_REDIS_URL"]
    test = urlsplit(REDIS_URL)
    out["INFERQ_REDIS_URL"] = urlunsplit(url._replace(netloc=test.netloc, path=test.path))
    out["INFERQ_NAMESPACE"] = namespace
    return out


def free_ports(argv: list[str]) -> list[str]:
    """``--metrics-port N`` / ``--port N`` on free ports (other tests run beside this one)."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in ("--metrics-port", "--port"):
            out[i + 1] = str(free_port())
    return out


def workers_json(env: Mapping[str, str]) -> list[dict[str, Any]]:
    """``inferq workers --json`` as an operator runs it."""
    out = subprocess.run(
        [str(INFERQ), "workers", "--json"],
        env={**os.environ, **env},
        capture_output=True,
        check=True,
        timeout=30,
    )
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def wait_worker_ready(store: Store, proc: Proc, worker_id: str | None = None) -> str:
    """Wait until a worker (``worker_id``, or any) heartbeats ready; returns its id."""
    found: list[str] = []

    def ready() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.argv} exited {proc.popen.returncode}:\n{proc.output()}")
        infos, _ = store.workers()
        found[:] = [
            w.id for w in infos if w.state is WorkerState.READY and worker_id in (None, w.id)
        ]
        return bool(found)

    wait_for(ready, timeout=30, what=f"worker {worker_id or '(any)'} ready")
    return found[0]


def assert_listed_ready(env: Mapping[str, str], worker_id: str, model: str) -> None:
    rows = {r["id"]: r for r in workers_json(env)}
    assert rows[worker_id]["state"] == "ready" and rows[worker_id]["model"] == model, rows


def backlog(store: Store, settings: Settings, n: int = 20) -> None:
    for i in range(n):
        store.submit(build_request(settings, prompt=f"p{i}", priority="standard", max_tokens=16))


# --- docker compose ------------------------------------------------------------------


def compose_env(service: Mapping[str, Any], namespace: str) -> dict[str, str]:
    env = {k: str(v) for k, v in service["environment"].items()}
    return in_test(env, namespace)


def test_compose_dispatcher_starts(run: Any, namespace: str) -> None:
    service = files.compose_services()["dispatcher"]
    proc = run(free_ports(files.compose_argv(service)), compose_env(service, namespace))
    proc.wait_for_line(r"dispatcher started \(namespace " + namespace)
    assert proc.stop() == 0


def test_compose_worker_starts_and_is_listed_ready(run: Any, namespace: str, store: Store) -> None:
    service = files.compose_services()["worker"]
    env = compose_env(service, namespace)
    proc = run(files.compose_argv(service), env)
    wid = wait_worker_ready(store, proc)
    assert_listed_ready(env, wid, "llama-3.1-8b")
    assert proc.stop() == 0  # SIGTERM drains: a clean exit


def test_compose_scaler_launches_workers_that_start(
    run: Any, namespace: str, store: Store, settings: Settings
) -> None:
    """The scaler of docker-compose.yml, on a backlog, asks Docker for a worker
    container; that container's command, run as Docker would run it, starts a worker."""
    data = files.compose()
    service = data["services"]["scaler"]
    backlog(store, settings)
    with DockerStandIn(images={service["image"]}) as docker:
        # The socket mount of the compose file, as the SDK finds it: DOCKER_HOST.
        env = {**compose_env(service, namespace), "DOCKER_HOST": docker.url}
        scaler = run(free_ports(files.compose_argv(service)), env)
        scaler.wait_for_line(r"scaler \S+ started: act mode")
        wait_for(
            lambda: bool(docker.calls("POST", "/containers/create")),
            timeout=30,
            what="the scaler to launch a worker container",
        )
        create = docker.calls("POST", "/containers/create")[-1].body
    scaler.stop()

    assert create["Image"] == service["image"]
    labels = create["Labels"]
    assert labels[LABEL_MANAGED_BY] == MANAGED_BY and labels[LABEL_NAMESPACE] == namespace
    # The compose network, where `redis` resolves (here: the scaler's own Redis URL).
    assert create["HostConfig"]["NetworkMode"] == data["networks"]["default"]["name"]
    container_env = dict(e.split("=", 1) for e in create["Env"])
    assert container_env == {
        "INFERQ_REDIS_URL": env["INFERQ_REDIS_URL"],
        "INFERQ_NAMESPACE": namespace,
    }

    argv = files.docker_argv(create["Cmd"])  # the image's ENTRYPOINT + the container's command
    assert argv[:2] == ["inferq", "--log-level"] and "inferq" not in argv[1:]
    worker = run(argv, container_env)
    wid = wait_worker_ready(store, worker, labels[LABEL_WORKER])
    assert_listed_ready(container_env, wid, "llama-3.1-8b")
    assert worker.stop() == 0


# --- Kubernetes ----------------------------------------------------------------------


def k8s_container(workload: str, name: str) -> files.Container:
    [c] = [c for c in files.containers() if c.workload == workload and c.name == name]
    return c


def k8s_process(
    c: files.Container, namespace: str, pod_name: str
) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a manifest container, Redis and namespace the test's."""
    env = in_test(c.environment(pod_name, "default"), namespace)
    return free_ports(c.argv(env)), env


def test_kubernetes_dispatcher_starts(run: Any, namespace: str) -> None:
    c = k8s_container("inferq-dispatcher", "dispatcher")
    argv, env = k8s_process(c, namespace, "inferq-dispatcher-5d9c7-abcde")
    proc = run(argv, env)
    proc.wait_for_line(r"dispatcher started \(namespace " + namespace)
    assert proc.stop() == 0


def test_kubernetes_worker_starts_beside_its_model_server(
    run: Any, namespace: str, store: Store
) -> None:
    """The worker container of the worker Deployment (what every pod the scaler adds
    runs), against a stand-in for its vLLM sidecar; its id is the pod name."""
    c = k8s_container("inferq-worker-llama-3-1-8b", "worker")
    pod = "inferq-worker-llama-3-1-8b-6f7d9c8b5-x2x9z"
    argv, env = k8s_process(c, namespace, pod)
    with OpenAIStandIn(models=["llama-3.1-8b"]) as vllm:
        i = argv.index("base_url=http://127.0.0.1:8000")
        argv[i] = f"base_url={vllm.url}"
        proc = run(argv, env)
        wait_worker_ready(store, proc, pod)
        assert_listed_ready(env, pod, "llama-3.1-8b")
        assert any(r.path == "/v1/models" for r in vllm.requests)  # it waited for the server
        assert proc.stop() == 0


def test_kubernetes_scaler_scales_its_deployment_within_its_role(
    run: Any, namespace: str, tmp_path: Path
) -> None:
    """The scaler Deployment's command, with a kubeconfig in place of its service
    account: it reads and raises the worker Deployment (pool minimum 1), and every
    call it makes is one its Role grants."""
    c = k8s_container("inferq-scaler", "scaler")
    argv, env = k8s_process(c, namespace, "inferq-scaler-7c5b8-qwert")
    worker = files.objects("Deployment")["inferq-worker-llama-3-1-8b"]
    config_ns = files.objects("ConfigMap")["inferq"]["data"]["INFERQ_NAMESPACE"]
    labels = {
        k: (namespace if k == LABEL_NAMESPACE and v == config_ns else v)
        for k, v in worker["spec"]["selector"]["matchLabels"].items()
    }
    with K8sStandIn() as api:
        deployment = api.add_deployment(worker["metadata"]["name"], labels, replicas=0)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(_kubeconfig(api.url)))
        proc = run(argv, {**env, "KUBECONFIG": str(kubeconfig)})
        proc.wait_for_line(r"scaler \S+ started: act mode")
        wait_for(lambda: deployment.replicas == 1, timeout=30, what="the scaler's scale-up")
        proc.stop()
        calls = list(api.requests)
    assert calls
    granted = files.role_permissions(files.objects("Role")["inferq-scaler"])
    used = {_permission(r.method, r.path, r.query) for r in calls}
    assert used <= granted, used - granted
    assert used <= files.platform_permissions()


def test_kubernetes_gateway_starts(run: Any, namespace: str) -> None:
    if "gateway" not in cli.commands:  # type: ignore[attr-defined]
        pytest.skip("inferq gateway arrives with issue 14")
    c = k8s_container("inferq-gateway", "gateway")
    argv, env = k8s_process(c, namespace, "inferq-gateway-6d8f9-zxcvb")
    port = argv[argv.index("--port") + 1]
    proc = run(argv, env)

    def healthy() -> bool:
        assert proc.popen.poll() is None, proc.output()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    wait_for(healthy, timeout=30, what="the gateway's /health")
    proc.stop()


def _kubeconfig(server: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "standin", "cluster": {"server": server}}],
        "users": [{"name": "scaler", "user": {}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "scaler"}}],
        "current-context": "standin",
    }


_K8S_VERB = {"GET": "get", "PATCH": "patch", "DELETE": "delete", "POST": "create", "PUT": "update"}


def _permission(method: str, path: str, query: Mapping[str, list[str]]) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) an API request needs, as Kubernetes' RBAC names it."""
    m = re.fullmatch(r"/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/[^/]+/(?P<rest>.+)", path)
    assert m, path
    parts = m["rest"].split("/")
    resource = parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")
    verb = _K8S_VERB[method]
    if method == "GET" and len(parts) == 1:
        verb = "watch" if query.get("watch") else "list"
    return (m["group"] or "", resource, verb)


def test_the_permission_mapping_itself() -> None:
    assert _permission("GET", "/api/v1/namespaces/d/pods", {}) == ("", "pods", "list")
    assert _permission("GET", "/api/v1/namespaces/d/pods/p", {}) == ("", "pods", "get")
    assert _permission("PATCH", "/apis/apps/v1/namespaces/d/deployments/x/scale", {}) == (
        "apps",
        "deployments/scale",
        "patch",
    )
    assert _permission("DELETE", "/api/v1/namespaces/d/pods/p", {}) == ("", "pods", "delete")
    assert _permission("GET", "/apis/apps/v1/namespaces/d/deployments/x", {}) not in (
        files.role_permissions(files.objects("Role")["inferq-scaler"])
    )
