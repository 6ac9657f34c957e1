"""The kubernetes scaler backend: the official client against a stand-in API server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferq.scaler.platforms import platform_class
from inferq.scaler.platforms.base import PlatformError, WorkerHandle
from inferq.scaler.platforms.kubernetes import DELETION_COST, KubernetesPlatform
from tests.fakes.standin_kubernetes import Deployment, K8sStandIn

MODEL = "llama-3.1-8b"
DEPLOY = "inferq-worker-llama-3-1-8b"
LABELS = {"inferq.model": MODEL, "inferq.namespace": "prod", "inferq.managed-by": "scaler"}
SCALE = f"/apis/apps/v1/namespaces/default/deployments/{DEPLOY}/scale"
POD = "/api/v1/namespaces/default/pods/{}"


@pytest.fixture
def standin() -> Iterator[K8sStandIn]:
    with K8sStandIn() as s:
        yield s


def backend(s: K8sStandIn, **kw: object) -> KubernetesPlatform:
    return KubernetesPlatform(namespace="prod", host=s.url, **kw)  # type: ignore[arg-type]


def ready_fleet(s: K8sStandIn, n: int) -> Deployment:
    d = s.add_deployment(DEPLOY, LABELS, replicas=n)
    s.set_ready()
    return d


def handle(pod: str) -> WorkerHandle:
    return WorkerHandle(pod, MODEL, pod)


def test_deployment_names_are_sanitised_model_names() -> None:
    b = KubernetesPlatform(namespace="prod", host="http://127.0.0.1:1")
    assert b.deployment_name(MODEL) == DEPLOY
    assert b.deployment_name("Mixtral_8x7B.v2") == "inferq-worker-mixtral-8x7b-v2"
    assert len(b.deployment_name("m" * 64)) == 63
    custom = KubernetesPlatform(namespace="prod", host="http://x", deployments={MODEL: "gpu-8b"})
    assert custom.deployment_name(MODEL) == "gpu-8b"


def test_launch_raises_replicas_with_a_tested_patch_and_the_pod_is_listed(
    standin: K8sStandIn,
) -> None:
    d = ready_fleet(standin, 2)
    b = backend(standin)
    h = b.launch(MODEL, "requested-id")

    [patch] = standin.calls("PATCH", SCALE)
    assert patch.content_type == "application/json-patch+json"
    assert patch.body == [
        {"op": "test", "path": "/spec/replicas", "value": 2},
        {"op": "replace", "path": "/spec/replicas", "value": 3},
    ]
    assert h == WorkerHandle("requested-id", MODEL, f"deployment/{DEPLOY}")
    assert d.replicas == 3
    # The new pod is listed while still pending: worker ids are pod names.
    assert [w.worker_id for w in b.list(MODEL)] == standin.active(d)
    assert all(w.platform_ref == w.worker_id for w in b.list())


def test_launch_from_zero_adds_the_omitted_replicas_field(standin: K8sStandIn) -> None:
    d = standin.add_deployment(DEPLOY, LABELS, replicas=0)
    backend(standin).launch(MODEL, "w")
    [patch] = standin.calls("PATCH", SCALE)
    assert patch.body == [{"op": "add", "path": "/spec/replicas", "value": 1}]
    assert d.replicas == 1


def test_a_concurrent_writer_never_loses_an_increment(standin: K8sStandIn) -> None:
    d = ready_fleet(standin, 1)
    standin.races = 2  # two other writers get in between our read and our patch
    backend(standin).launch(MODEL, "w")
    assert len(standin.calls("PATCH", SCALE)) == 3  # two 422s, then ours applies
    assert d.replicas == 4


def test_scale_down_removes_exactly_the_drained_pod(standin: K8sStandIn) -> None:
    d = ready_fleet(standin, 3)
    b = backend(standin)
    keep_a, victim, keep_b = standin.active(d)

    b.prepare_scale_down(handle(victim))
    [mark] = standin.calls("PATCH", POD.format(victim))
    assert mark.content_type == "application/strategic-merge-patch+json"
    assert mark.body == {"metadata": {"annotations": {DELETION_COST: "-1000"}}}
    assert not standin.terminating()  # marking alone removes nothing

    b.stop(handle(victim))
    [lower] = standin.calls("PATCH", SCALE)
    assert lower.body[-1] == {"op": "replace", "path": "/spec/replicas", "value": 2}
    assert standin.terminating() == [victim]
    assert standin.active(d) == [keep_a, keep_b]
    assert [w.worker_id for w in b.list(MODEL)] == [keep_a, keep_b]


def test_a_starting_pod_does_not_keep_the_drained_pod_alive(standin: K8sStandIn) -> None:
    d = ready_fleet(standin, 3)
    b = backend(standin)
    keep_a, victim, keep_b = standin.active(d)
    b.launch(MODEL, "w")  # a fourth pod, still pending
    starting = standin.active(d)[-1]

    b.prepare_scale_down(handle(victim))
    b.stop(handle(victim))
    # The ReplicaSet removes the pending pod first; the backend then deletes the
    # drained one and a replacement starts: one pod fewer, no ready pod touched.
    assert len(standin.calls("DELETE", POD.format(victim))) == 1
    assert set(standin.terminating()) == {victim, starting}
    assert d.replicas == 3
    assert standin.active(d)[:2] == [keep_a, keep_b] and len(standin.active(d)) == 3


def test_stop_marks_the_pod_itself_when_not_prepared(standin: K8sStandIn) -> None:
    d = ready_fleet(standin, 2)
    victim = standin.active(d)[0]
    backend(standin).stop(handle(victim))
    assert standin.calls("PATCH", POD.format(victim))[0].body["metadata"]["annotations"] == {
        DELETION_COST: "-1000"
    }
    assert standin.terminating() == [victim]


def test_stop_on_a_gone_or_terminating_pod_leaves_the_replicas_alone(
    standin: K8sStandIn,
) -> None:
    d = ready_fleet(standin, 2)
    b = backend(standin)
    victim = standin.active(d)[0]
    b.stop(handle(victim))
    b.stop(handle(victim))  # terminating now
    b.stop(handle("inferq-worker-llama-3-1-8b-7c9b6d5f4-gone"))
    assert len(standin.calls("PATCH", SCALE)) == 1
    assert d.replicas == 1
    b.prepare_scale_down(handle("inferq-worker-llama-3-1-8b-7c9b6d5f4-gone"))  # no error


def test_a_missing_or_foreign_deployment_is_a_clear_error(standin: K8sStandIn) -> None:
    b = backend(standin)
    with pytest.raises(PlatformError, match=f"deployment default/{DEPLOY} does not exist"):
        b.launch(MODEL, "w")
    standin.add_deployment(DEPLOY, {"inferq.model": "other", "inferq.namespace": "prod"})
    with pytest.raises(PlatformError, match=r"not the pods of model 'llama-3\.1-8b'"):
        b.launch(MODEL, "w")
    standin.add_deployment(DEPLOY, {"inferq.model": MODEL, "inferq.namespace": "prod"})
    with pytest.raises(PlatformError, match=r"inferq\.managed-by=scaler"):
        b.launch(MODEL, "w")  # not handed to the scaler: it must not scale it
    assert not standin.calls("PATCH", SCALE)


def test_a_mapped_deployment_is_scaled_instead(standin: K8sStandIn) -> None:
    d = standin.add_deployment("gpu-8b", LABELS, replicas=1)
    backend(standin, deployments={MODEL: "gpu-8b"}).launch(MODEL, "w")
    assert d.replicas == 2


def test_list_selects_this_namespace_and_model(standin: K8sStandIn) -> None:
    mine = ready_fleet(standin, 1)
    other = standin.add_deployment(
        "inferq-worker-llama-2-13b", {**LABELS, "inferq.model": "llama-2-13b"}, 1
    )
    standin.add_deployment("staging-8b", {**LABELS, "inferq.namespace": "staging"}, 1)
    # A worker Deployment the scaler does not manage (a static pool): never listed.
    standin.add_deployment("static-8b", {"inferq.model": MODEL, "inferq.namespace": "prod"}, 1)
    b = backend(standin)
    assert [w.worker_id for w in b.list(MODEL)] == standin.active(mine)
    assert [w.worker_id for w in b.list()] == sorted(standin.active(mine) + standin.active(other))
    assert standin.calls("GET", "/api/v1/namespaces/default/pods")[0].query["labelSelector"] == [
        f"inferq.namespace=prod,inferq.managed-by=scaler,inferq.model={MODEL}"
    ]
    with pytest.raises(PlatformError, match="not a valid label value"):
        b.list("model-ending-with-dot.")


def test_the_backend_is_found_by_name() -> None:
    assert platform_class("kubernetes") is KubernetesPlatform
