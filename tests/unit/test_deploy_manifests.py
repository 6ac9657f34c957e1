"""The deployment files, checked without running them (issue 15).

- every Kubernetes manifest against the Kubernetes JSON schemas (``kubernetes-validate``,
  which ships them: no network), strictly (an unknown field fails);
- the KEDA ScaledObject against the models generated from KEDA's CRD
  (``cloudcoil-models-keda``), strictly, and its prometheus triggers' metadata
  against the scaler's parameters (the CRD types ``metadata`` as a string map, so a
  misplaced ``metricType`` passes the schema: KEDA then ignores it);
- the image's entrypoint against every command (compose, manifests): after the
  entrypoint comes an inferq command that parses, never ``inferq`` again;
- the scaler's Role against the calls of the kubernetes platform's code, and the worker
  Deployment against what that platform selects;
- the vLLM sidecar's shape (it cannot run here).

Running the commands is tests/redis/test_deploy_commands.py.
"""

from __future__ import annotations

import copy
import re
import typing
import warnings
from typing import Any

import click
import kubernetes_validate
import pytest
from cloudcoil.models.keda.v1alpha1 import ScaledObject, ScaledObjectSpec

from inferq.cli.main import cli
from inferq.scaler.platforms import kubernetes as k8s_platform
from inferq.scaler.platforms.base import LABEL_MANAGED_BY, LABEL_MODEL, LABEL_NAMESPACE, MANAGED_BY

from .. import deploy_files as files

#: The oldest Kubernetes the manifests support (native sidecars: restartPolicy on an
#: init container, beta and on by default since 1.29) and the newest schemas shipped.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())

#: The prometheus trigger's parameters (keda.sh/docs/2.16/scalers/prometheus/, and
#: authModes from its authentication section). KEDA reads only these from metadata.
PROMETHEUS_PARAMETERS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "timeout",
    "authModes",
}


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1]['metadata']['name']}"


# --- Kubernetes schemas ----------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", files.manifests(), ids=_id)
def test_every_manifest_is_valid_kubernetes(item: tuple[str, dict[str, Any]], version: str) -> None:
    _, doc = item
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_kustomization_lists_every_manifest_and_names_no_namespace() -> None:
    listed = {name for name, _ in files.manifests()}
    on_disk = {p.name for p in files.K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    kinds = {d["kind"] for _, d in files.manifests()}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    for _, doc in files.manifests():  # namespace-agnostic: kubectl -n / kustomize decide
        assert "namespace" not in doc["metadata"], _id(("", doc))
        for subject in doc.get("subjects", []):
            assert "namespace" not in subject


def test_the_schema_check_itself_catches_a_bad_field() -> None:
    doc = copy.deepcopy(files.objects("Deployment")["inferq-dispatcher"])
    doc["spec"]["template"]["spec"]["containers"][0]["argz"] = ["dispatcher"]
    with pytest.raises(kubernetes_validate.ValidationError, match="argz"):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


# --- KEDA --------------------------------------------------------------------------


def _trigger_fields() -> set[str]:
    """The fields of a ScaledObject trigger in KEDA's CRD (``type``, ``metricType``, ...)."""
    [trigger] = typing.get_args(ScaledObjectSpec.model_fields["triggers"].annotation)
    return {f.alias or name for name, f in trigger.model_fields.items()}


def keda_problems(doc: dict[str, Any]) -> list[str]:
    """What is wrong with a ScaledObject: schema errors, fields the CRD does not have
    (the models ignore unknown fields, so a round trip finds them), and trigger metadata
    that the prometheus scaler does not read."""
    try:
        parsed = ScaledObject.model_validate(doc)
    except ValueError as exc:
        return [str(exc)]
    problems = _unknown(doc, parsed.model_dump(by_alias=True, exclude_unset=True, mode="json"))
    trigger_fields = _trigger_fields()
    for i, trigger in enumerate(doc["spec"]["triggers"]):
        for key in trigger.get("metadata", {}):
            if key in trigger_fields:
                problems.append(f"triggers[{i}].metadata.{key}: a trigger field, not metadata")
            elif trigger["type"] == "prometheus" and key not in PROMETHEUS_PARAMETERS:
                problems.append(f"triggers[{i}].metadata.{key}: not a prometheus parameter")
    return problems


def _unknown(given: Any, kept: Any, path: str = "") -> list[str]:
    if isinstance(given, dict):
        assert isinstance(kept, dict)
        out = [f"{path}.{k}: not in KEDA's CRD" for k in given if k not in kept]
        return out + [
            e for k in given if k in kept for e in _unknown(given[k], kept[k], path + f".{k}")
        ]
    if isinstance(given, list):
        return [
            e
            for i, (g, k) in enumerate(zip(given, kept, strict=True))
            for e in _unknown(g, k, f"{path}[{i}]")
        ]
    return []


def keda() -> dict[str, Any]:
    import yaml

    doc: dict[str, Any] = yaml.safe_load(files.KEDA.read_text())
    return doc


def test_the_keda_scaledobject_is_valid_against_kedas_crd() -> None:
    doc = keda()
    assert keda_problems(doc) == []
    assert doc["spec"]["scaleTargetRef"]["name"] in files.objects("Deployment")
    for trigger in doc["spec"]["triggers"]:
        assert trigger["metricType"] in ("Value", "AverageValue")


def test_the_keda_check_catches_metric_type_inside_metadata_and_unknown_fields() -> None:
    bad = keda()
    bad["spec"]["triggers"][0]["metadata"]["metricType"] = bad["spec"]["triggers"][0].pop(
        "metricType"
    )
    assert keda_problems(bad) == ["triggers[0].metadata.metricType: a trigger field, not metadata"]
    typo = keda()
    typo["spec"]["triggers"][0]["metadata"]["treshold"] = "1"
    typo["spec"]["cooldownPeriods"] = 300
    assert keda_problems(typo) == [
        ".spec.cooldownPeriods: not in KEDA's CRD",
        "triggers[0].metadata.treshold: not a prometheus parameter",
    ]
    wrong_type = keda()
    wrong_type["spec"]["maxReplicaCount"] = "eight"
    assert keda_problems(wrong_type) and "maxReplicaCount" in keda_problems(wrong_type)[0]


def test_keda_queries_take_max_of_gauges_every_process_exports() -> None:
    """The dispatcher and the scaler export the same Redis-derived gauges: sum() counts
    each once per process (issue 15 measured sum 2, max 1)."""
    for trigger in keda()["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        assert not re.search(r"\bsum\s*\(", query), query
        assert re.match(r"max\s*\(", query), query


# --- the entrypoint against every command --------------------------------------------


def parse_inferq(args: list[str]) -> click.Command:
    """Parse ``inferq ARGS`` down to the subcommand's options without running it."""
    ctx = cli.make_context("inferq", list(args), resilient_parsing=False)
    with warnings.catch_warnings():  # click 8.2 deprecates protected_args
        warnings.simplefilter("ignore", DeprecationWarning)
        name, sub, rest = cli.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
    assert sub is not None, f"not an inferq command: {args}"
    sub.make_context(name or "", rest, parent=ctx)
    return sub


def every_inferq_command() -> list[tuple[str, list[str]]]:
    """(where, argv) of each command of inferq's image in the compose file and manifests."""
    out = [(f"compose:{n}", files.compose_argv(s)) for n, s in files.compose_services().items()]
    for c in files.containers():
        if c.is_inferq:
            out.append((f"k8s:{c.workload}/{c.name}", c.argv(c.environment("pod-0", "ns"))))
    return out


def test_the_image_entrypoint_is_inferq() -> None:
    entrypoint, cmd = files.image_entrypoint()
    assert entrypoint == ["inferq"] and cmd == ["--help"]
    assert files.docker_argv(None) == ["inferq", "--help"]  # `docker run inferq`


@pytest.mark.parametrize(
    "where,argv", [pytest.param(w, a, id=w) for w, a in every_inferq_command()]
)
def test_each_command_is_one_inferq_command_after_the_entrypoint(
    where: str, argv: list[str]
) -> None:
    assert argv[0] == "inferq"
    assert argv[1] != "inferq", f"{where}: `inferq inferq ...`"
    if "gateway" in argv and "gateway" not in cli.commands:  # type: ignore[attr-defined]
        pytest.skip("inferq gateway arrives with issue 14")
    parse_inferq(argv[1:])


def test_the_entrypoint_check_fails_on_a_doubled_program() -> None:
    with pytest.raises(click.UsageError, match="No such command 'inferq'"):
        parse_inferq(["inferq", "worker", "--model", "llama-3.1-8b"])
    with pytest.raises(click.NoSuchOption):
        parse_inferq(["worker", "--model", "llama-3.1-8b", "--no-such-flag"])


def test_the_compose_scaler_gives_launched_workers_what_they_need() -> None:
    data = files.compose()
    scaler = data["services"]["scaler"]
    argv = files.compose_argv(scaler)
    network = data["networks"]["default"]["name"]
    assert argv[argv.index("--docker-network") + 1] == network
    assert argv[argv.index("--docker-image") + 1] == scaler["image"]
    assert "--vram-mib" in argv and argv[argv.index("--worker-backend") + 1] == "sim"
    # The Docker socket is root's and the docker group's: the scaler runs as root.
    assert "/var/run/docker.sock:/var/run/docker.sock" in scaler["volumes"]
    assert scaler.get("user") == "root" or scaler.get("group_add")


# --- Kubernetes: RBAC and the worker Deployment against the platform's code ------------------


def test_the_scaler_role_grants_exactly_what_the_platform_calls() -> None:
    wanted = files.platform_permissions()
    assert wanted == {
        ("apps", "deployments/scale", "get"),
        ("apps", "deployments/scale", "patch"),
        ("", "pods", "list"),
        ("", "pods", "get"),
        ("", "pods", "patch"),
        ("", "pods", "delete"),
    }
    assert files.role_permissions(files.objects("Role")["inferq-scaler"]) == wanted
    binding = files.objects("RoleBinding")["inferq-scaler"]
    assert binding["roleRef"]["name"] == "inferq-scaler"
    [subject] = binding["subjects"]
    scaler = files.objects("Deployment")["inferq-scaler"]
    assert subject == {"kind": "ServiceAccount", "name": "inferq-scaler"}
    assert scaler["spec"]["template"]["spec"]["serviceAccountName"] == subject["name"]


def worker_deployments() -> dict[str, dict[str, Any]]:
    return {n: d for n, d in files.objects("Deployment").items() if n.startswith("inferq-worker-")}


@pytest.mark.parametrize("name", sorted(worker_deployments()))
def test_worker_deployments_are_what_the_scaler_platform_selects(name: str) -> None:
    doc = worker_deployments()[name]
    config = files.objects("ConfigMap")["inferq"]["data"]
    selector = doc["spec"]["selector"]["matchLabels"]
    model = selector[LABEL_MODEL]
    assert selector == {
        LABEL_MODEL: model,
        LABEL_NAMESPACE: config["INFERQ_NAMESPACE"],
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    pod_labels = doc["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    platform = k8s_platform.KubernetesPlatform(namespace="x", host="http://127.0.0.1:1")
    assert platform.deployment_name(model) == name
    assert "replicas" not in doc["spec"]  # the scaler owns the count
    scaler = files.objects("Deployment")["inferq-scaler"]
    [scaler_c] = scaler["spec"]["template"]["spec"]["containers"]
    assert f"{model}=" in " ".join(scaler_c["args"])  # a --pool for this model

    [worker] = [c for c in files.containers() if c.workload == name and c.is_inferq]
    argv = worker.argv(worker.environment("pod-abc", "ns"))
    assert argv[argv.index("--id") + 1] == "pod-abc"  # the pod name: the scaler's handle
    assert argv[argv.index("--model") + 1] == model
    assert "--stay-after-drain" in argv  # an exited container is restarted in place
    assert "--vram-mib" in argv  # the GPU is the sidecar's: NVML cannot read it here
    grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 120


@pytest.mark.parametrize("name", sorted(worker_deployments()))
def test_the_vllm_sidecar_has_the_shape_the_worker_expects(name: str) -> None:
    """vLLM cannot run here (no GPU, no weights): check its shape instead."""
    doc = worker_deployments()[name]
    spec = doc["spec"]["template"]["spec"]
    [vllm] = spec["initContainers"]
    [worker] = [c for c in files.containers() if c.workload == name and c.is_inferq]
    argv = worker.argv(worker.environment("p", "ns"))
    model = argv[argv.index("--model") + 1]

    assert vllm["image"].startswith("vllm/vllm-openai:") and not vllm["image"].endswith(":latest")
    assert vllm["restartPolicy"] == "Always"  # a native sidecar: starts first, stops last
    assert "command" not in vllm  # the image's entrypoint is vLLM's OpenAI server
    args = vllm["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert set(options) <= {
        "--model",
        "--served-model-name",
        "--port",
        "--gpu-memory-utilization",
        "--max-model-len",
        "--tensor-parallel-size",
    }
    assert options["--served-model-name"] == model  # what the openai backend sends
    port = int(options["--port"])
    assert argv[argv.index("--backend") + 1] == "openai"
    assert argv[argv.index("-o") + 1] == f"base_url=http://127.0.0.1:{port}"
    assert float(options["--gpu-memory-utilization"]) == 0.9  # the worker's KV-cache rule
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": port}
    assert [p["containerPort"] for p in vllm["ports"]] == [port]
