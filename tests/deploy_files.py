"""Reading the deployment files as Docker and Kubernetes read them (for the deploy tests).

Plain functions, no fixtures: the image's ENTRYPOINT and CMD from the Dockerfile,
the services of docker-compose.yml, the objects of deploy/kubernetes/, and the argv
and environment each container would get:

- Docker (and compose): ``entrypoint`` overrides the image's ENTRYPOINT and then
  drops its CMD; ``command`` overrides CMD; argv = entrypoint + command.
- Kubernetes: ``command`` overrides ENTRYPOINT (and drops CMD), ``args`` overrides
  CMD; ``$(VAR)`` in them expands from the container's environment (``$$`` escapes).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from inferq.scaler.platforms import kubernetes as kubernetes_platform

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
K8S_DIR = ROOT / "deploy" / "kubernetes"
KEDA = ROOT / "deploy" / "keda-scaledobject.yaml"
#: The image name the compose file and the manifests give inferq's own image.
INFERQ_IMAGES = ("inferq", "inferq:latest")


def _instruction(text: str, name: str) -> list[str] | None:
    """The last ``name`` instruction of a Dockerfile as Docker runs it (exec or shell form)."""
    joined = re.sub(r"\\\n", " ", text)  # line continuations
    value = None
    for line in joined.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == name:
            value = parts[1].strip()
    if value is None:
        return None
    if value.startswith("["):
        parsed = json.loads(value)
        assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), value
        return parsed
    return ["/bin/sh", "-c", value]


def image_entrypoint(dockerfile: Path = DOCKERFILE) -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the image the Dockerfile builds (empty lists when absent)."""
    text = dockerfile.read_text()
    return _instruction(text, "ENTRYPOINT") or [], _instruction(text, "CMD") or []


def docker_argv(command: list[str] | None, entrypoint: list[str] | None = None) -> list[str]:
    """What a container of the image runs for a compose service / ``docker run``."""
    image_entry, image_cmd = image_entrypoint()
    if entrypoint is not None:
        return [*entrypoint, *(command or [])]
    return [*image_entry, *(command if command is not None else image_cmd)]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def compose_services() -> dict[str, dict[str, Any]]:
    """The services built from inferq's image (not Redis), merge keys resolved by YAML."""
    return {
        name: svc
        for name, svc in compose()["services"].items()
        if svc.get("image") in INFERQ_IMAGES or "build" in svc
    }


def compose_argv(service: Mapping[str, Any]) -> list[str]:
    command = service.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    entrypoint = service.get("entrypoint")
    if isinstance(entrypoint, str):
        entrypoint = shlex.split(entrypoint)
    return docker_argv(command, entrypoint)


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of every object in the kustomization's resources, in order."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S_DIR / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


def objects(kind: str) -> dict[str, dict[str, Any]]:
    """Manifest objects of one kind, by name."""
    return {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == kind}


@dataclass(frozen=True)
class Container:
    """One container of a workload in the manifests."""

    workload: str
    spec: dict[str, Any]
    pod: dict[str, Any]  # the pod template (metadata + spec)
    init: bool = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def is_inferq(self) -> bool:
        return str(self.spec["image"]).split(":")[0] == "inferq"

    def environment(self, pod_name: str, namespace: str) -> dict[str, str]:
        """The environment Kubernetes gives the container (ConfigMaps from the manifests)."""
        maps = objects("ConfigMap")
        env: dict[str, str] = {}
        for source in self.spec.get("envFrom", []):
            env.update(maps[source["configMapRef"]["name"]]["data"])
        fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
        for item in self.spec.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
            elif "fieldRef" in item.get("valueFrom", {}):
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def argv(self, env: Mapping[str, str]) -> list[str]:
        """What the container runs: the image's entrypoint (inferq's image) + its args."""
        command, args = self.spec.get("command"), self.spec.get("args")
        if command is not None:
            raw = [*command, *(args or [])]
        elif self.is_inferq:
            image_entry, image_cmd = image_entrypoint()
            raw = [*image_entry, *(args if args is not None else image_cmd)]
        else:
            raise ValueError(f"{self.workload}/{self.name}: the image's entrypoint is unknown here")
        return [expand(str(a), env) for a in raw]


def containers() -> Iterator[Container]:
    """Every container (init containers included) of every workload in the manifests."""
    for _, doc in manifests():
        if doc["kind"] not in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            continue
        pod = doc["spec"]["template"]
        for spec in pod["spec"].get("initContainers", []):
            yield Container(doc["metadata"]["name"], spec, pod, init=True)
        for spec in pod["spec"]["containers"]:
            yield Container(doc["metadata"]["name"], spec, pod)


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables replaced, ``$$`` -> ``$``."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


# --- RBAC ---------------------------------------------------------------------------

_VERBS = {"read": "get", "list": "list", "patch": "patch", "delete": "delete", "create": "create"}
_RESOURCES = {
    "pod": ("", "pods"),
    "deployment_scale": ("apps", "deployments/scale"),
    "deployment": ("apps", "deployments"),
}


def platform_permissions() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every API call in inferq.scaler.platforms.kubernetes."""
    tree = ast.parse(Path(kubernetes_platform.__file__).read_text())
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("_apps", "_core")
        ):
            m = re.fullmatch(r"(read|list|patch|delete|create)_namespaced_(\w+)", node.attr)
            assert m, f"unmapped API call {node.attr}"
            group, resource = _RESOURCES[m[2]]
            out.add((group, resource, _VERBS[m[1]]))
    return out


def role_permissions(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
