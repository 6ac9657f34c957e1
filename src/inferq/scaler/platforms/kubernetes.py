"""Kubernetes platform: one Deployment per model, scaled through its ``scale`` subresource.

The Deployments are created by the operator (Helm, kustomize, plain YAML); the
platform only changes their replica count and reads their pods. Each model's
Deployment is ``inferq-worker-<model>`` (the model name lowercased, every
character outside ``[a-z0-9-]`` replaced by ``-``; or the name given in
``deployments``), and its selector and pod labels include ``inferq.model:
<model>``, ``inferq.namespace: <namespace>`` and ``inferq.managed-by: scaler``
(the scaler lists, drains and removes only such pods, so a worker started
another way is never touched). A worker's id is its pod name, passed through
the downward API, because the ReplicaSet and not the scaler names the pods. The
container's ``args`` hold only the arguments: the image's ENTRYPOINT already is
``inferq``. The shipped manifest, ``deploy/kubernetes/worker-llama-3-1-8b.yaml``,
runs the worker beside a vLLM sidecar; its core::

    apiVersion: apps/v1
    kind: Deployment
    metadata: {name: inferq-worker-llama-3-1-8b}
    spec:
      selector:
        matchLabels: {inferq.model: llama-3.1-8b, inferq.namespace: default,
                      inferq.managed-by: scaler}
      template:
        metadata:
          labels: {inferq.model: llama-3.1-8b, inferq.namespace: default,
                   inferq.managed-by: scaler}
        spec:
          terminationGracePeriodSeconds: 300
          containers:
          - name: worker
            image: registry.example.com/inferq:0.1
            args: [worker, --model, llama-3.1-8b, --id, $(POD_NAME), --stay-after-drain,
                   --backend, openai, -o, "base_url=http://127.0.0.1:8000"]
            env:
            - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
            - {name: INFERQ_REDIS_URL, value: "redis://redis:6379/0"}
            - {name: INFERQ_NAMESPACE, value: default}

Scale-up raises ``spec.replicas`` by one with a JSON patch that first tests the
value it read (so two writers never lose an increment: a failed test is a 422,
and the platform re-reads and retries).

Scale-down, after the scaler drained the worker: ``prepare_scale_down`` sets the
pod's ``controller.kubernetes.io/pod-deletion-cost`` to -1000 (every other pod
has 0); ``stop`` lowers ``spec.replicas`` by one, so the ReplicaSet removes that
pod, and then deletes the pod itself. The delete is there because the cost is
only one of the ReplicaSet's criteria: pending and not-ready pods go before any
ready one, so with a worker still starting the ReplicaSet removes the starting
pod and would leave the drained one running; deleting it makes the ReplicaSet
start a replacement, and the count still ends one lower. Either way the pods
removed are the drained one and pods that are not ready, never a ready worker
with requests in flight (keep ``terminationGracePeriodSeconds`` above the longest
request, for a worker whose readiness probe fails while it finishes its work). A
drained worker must not exit on its own (the kubelet would restart it in place
and it would register again): ``inferq worker --stay-after-drain`` leaves the
fleet and then waits for the pod's SIGTERM. ``stop`` on a pod that is already gone or terminating
changes nothing: the ReplicaSet has replaced it, and the replacement is drained
by a later scale-down.

``launch`` cannot name the pod: its handle carries the requested id and
``platform_ref = "deployment/<name>"``; the new pod appears in :meth:`list`
(pending pods included) and registers under its pod name.

Needs the ``kubernetes`` package (``pip install inferq[kubernetes]``) and RBAC
for ``get``/``patch`` on ``deployments/scale`` and ``list``/``get``/``patch``/``delete``
on ``pods`` in the namespace (``deploy/kubernetes/scaler.yaml``'s Role: exactly these).
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from inferq import defaults
from inferq.errors import MissingExtra
from inferq.scaler.platforms.base import (
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    LABEL_NAMESPACE,
    MANAGED_BY,
    Platform,
    PlatformError,
    WorkerHandle,
)

try:
    import urllib3
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config
    from kubernetes.client.exceptions import ApiException
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingExtra(
        "the Kubernetes client", "kubernetes", "the kubernetes scaler backend"
    ) from exc

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DEPLOYMENT_PREFIX = "inferq-worker"
#: Re-reads of the replica count when another writer changed it between read and patch.
CONFLICT_RETRIES = 5
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


class KubernetesPlatform(Platform):
    """Workers as the pods of one Deployment per model (see the module docstring).

    Args:
        namespace: the inferq namespace (the ``inferq.namespace`` pod label).
        k8s_namespace: the Kubernetes namespace of the Deployments.
        host: API server URL (``https://10.0.0.1:6443``), for a client without
            credentials (tests, ``kubectl proxy``); ignored when ``api_client`` is given.
        api_client: a configured ``kubernetes.client.ApiClient``. With neither
            this nor ``host``, the in-cluster service account is used, else ``~/.kube/config``.
        deployments: model -> Deployment name, overriding ``inferq-worker-<model>``.
        deletion_cost: pod-deletion-cost given to the pod chosen for scale-down.

    Raises:
        PlatformError: no Kubernetes configuration could be loaded.
    """

    name: ClassVar[str] = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str,
        k8s_namespace: str = "default",
        host: str | None = None,
        api_client: Any = None,
        deployments: Mapping[str, str] | None = None,
        deletion_cost: int = defaults.K8S_POD_DELETION_COST,
    ) -> None:
        self.namespace = namespace
        self.k8s_namespace = k8s_namespace
        self.deployments = dict(deployments or {})
        self.deletion_cost = deletion_cost
        self._api = api_client if api_client is not None else _api_client(host)
        self._apps = k8s.AppsV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)

    def deployment_name(self, model: str) -> str:
        """The Deployment that runs ``model``'s workers."""
        if model in self.deployments:
            return self.deployments[model]
        slug = re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")
        return f"{DEPLOYMENT_PREFIX}-{slug}"[:63].rstrip("-")

    def launch(self, model: str, worker_id: str) -> WorkerHandle:
        """Raise the model's Deployment by one replica.

        Returns:
            A handle with the requested ``worker_id`` (the pod registers under its
            own name) and ``platform_ref = "deployment/<name>"``.

        Raises:
            PlatformError: the Deployment is missing, selects other pods, or
                the API server refused.
        """
        name = self.deployment_name(model)
        self._change_replicas(model, name, +1)
        return WorkerHandle(worker_id=worker_id, model=model, platform_ref=f"deployment/{name}")

    def prepare_scale_down(self, handle: WorkerHandle) -> None:
        """Give the worker's pod the lowest deletion cost (a pod already gone is fine).

        Raises:
            PlatformError: the API server refused.
        """
        body = {"metadata": {"annotations": {DELETION_COST: str(self.deletion_cost)}}}
        try:
            self._core.patch_namespaced_pod(
                name=handle.platform_ref, namespace=self.k8s_namespace, body=body
            )
        except ApiException as exc:
            if exc.status == 404:
                return
            raise _error(f"cannot mark pod {handle.platform_ref} for scale-down", exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise _error(f"cannot mark pod {handle.platform_ref} for scale-down", exc) from exc

    def stop(self, handle: WorkerHandle) -> None:
        """Lower the Deployment by one and delete the (drained) pod.

        Does nothing when the pod is gone or terminating already (see the module
        docstring for why both steps, and why in this order).

        Raises:
            PlatformError: the API server refused.
        """
        pod = self._read_pod(handle.platform_ref)
        if pod is None or pod.metadata.deletion_timestamp is not None:
            return
        annotations = pod.metadata.annotations or {}
        if annotations.get(DELETION_COST) != str(self.deletion_cost):
            self.prepare_scale_down(handle)
        self._change_replicas(handle.model, self.deployment_name(handle.model), -1)
        self._delete_pod(handle.platform_ref)

    def list(self, model: str | None = None) -> builtins.list[WorkerHandle]:
        """Pods of this namespace's scaler-managed workers (pending ones included,
        terminating ones not).

        Raises:
            PlatformError: the API server could not be asked.
        """
        selector = f"{LABEL_NAMESPACE}={self.namespace},{LABEL_MANAGED_BY}={MANAGED_BY}"
        if model is not None:
            selector += f",{LABEL_MODEL}={_label_value(model)}"
        try:
            pods = self._core.list_namespaced_pod(
                namespace=self.k8s_namespace, label_selector=selector
            )
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise _error("cannot list worker pods", exc) from exc
        handles = [h for h in map(_pod_handle, pods.items or []) if h is not None]
        return sorted(handles, key=lambda h: h.worker_id)

    def close(self) -> None:
        """Close the API client's connection pool."""
        self._api.close()

    def _read_pod(self, name: str) -> Any:
        try:
            return self._core.read_namespaced_pod(name=name, namespace=self.k8s_namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _error(f"cannot read pod {name}", exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise _error(f"cannot read pod {name}", exc) from exc

    def _delete_pod(self, name: str) -> None:
        try:
            self._core.delete_namespaced_pod(name=name, namespace=self.k8s_namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise _error(f"cannot delete pod {name}", exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise _error(f"cannot delete pod {name}", exc) from exc

    def _change_replicas(self, model: str, name: str, delta: int) -> None:
        """Add ``delta`` to the Deployment's replicas, compare-and-set, never below 0."""
        what = f"deployment {self.k8s_namespace}/{name}"
        for _ in range(CONFLICT_RETRIES):
            try:
                scale = self._apps.read_namespaced_deployment_scale(
                    name=name, namespace=self.k8s_namespace
                )
                self._check_selector(model, name, scale)
                current = _replicas(scale)
                if current + delta < 0:
                    return
                self._apps.patch_namespaced_deployment_scale(
                    name=name, namespace=self.k8s_namespace, body=_set_replicas(current, delta)
                )
                return
            except ApiException as exc:
                if exc.status == 422:  # the test failed: someone else changed it; re-read
                    continue
                if exc.status == 404:
                    raise PlatformError(
                        f"kubernetes: {what} does not exist: create it for model {model!r} "
                        "(see inferq.scaler.platforms.kubernetes)"
                    ) from exc
                raise _error(f"cannot scale {what}", exc) from exc
            except urllib3.exceptions.HTTPError as exc:
                raise _error(f"cannot scale {what}", exc) from exc
        raise PlatformError(
            f"kubernetes: {what}: replicas changed under us {CONFLICT_RETRIES} times in a row"
        )

    def _check_selector(self, model: str, name: str, scale: Any) -> None:
        selector = (scale.status.selector if scale.status is not None else None) or ""
        wanted = {
            f"{LABEL_MODEL}={_label_value(model)}",
            f"{LABEL_NAMESPACE}={self.namespace}",
            f"{LABEL_MANAGED_BY}={MANAGED_BY}",
        }
        if not wanted <= set(selector.split(",")):
            raise PlatformError(
                f"kubernetes: deployment {self.k8s_namespace}/{name} selects {selector!r}, "
                f"not the pods of model {model!r} ({', '.join(sorted(wanted))}); "
                "fix its labels or map the model to its deployment with deployments="
            )


def _pod_handle(pod: Any) -> WorkerHandle | None:
    """The worker of a listed pod; None for a terminating or unlabelled one."""
    meta = pod.metadata
    if meta is None or not meta.name or meta.deletion_timestamp is not None:
        return None
    model = (meta.labels or {}).get(LABEL_MODEL)
    return None if model is None else WorkerHandle(meta.name, model, meta.name)


def _replicas(scale: Any) -> int:
    """``spec.replicas`` of a Scale (omitted when 0)."""
    return int(scale.spec.replicas or 0) if scale.spec is not None else 0


def _set_replicas(current: int, delta: int) -> list[dict[str, Any]]:
    """JSON patch (RFC 6902) that moves replicas from ``current`` to ``current + delta``."""
    if current == 0:  # a 0 is omitted from the Scale, so there is nothing to test
        return [{"op": "add", "path": "/spec/replicas", "value": current + delta}]
    return [
        {"op": "test", "path": "/spec/replicas", "value": current},
        {"op": "replace", "path": "/spec/replicas", "value": current + delta},
    ]


def _label_value(model: str) -> str:
    if not _LABEL_VALUE.match(model):
        raise PlatformError(
            f"kubernetes: model name {model!r} is not a valid label value "
            "(at most 63 characters of [A-Za-z0-9._-], starting and ending alphanumeric)"
        )
    return model


def _api_client(host: str | None) -> Any:
    if host is not None:
        configuration = k8s.Configuration()
        configuration.host = host
        return k8s.ApiClient(configuration)
    # Called through Any: the loaders are untyped in some client versions, typed in others.
    load_incluster: Any = k8s_config.load_incluster_config
    load_kube: Any = k8s_config.load_kube_config
    try:
        load_incluster()
    except k8s_config.ConfigException:
        try:
            load_kube()
        except (k8s_config.ConfigException, OSError) as exc:
            raise PlatformError(
                "kubernetes: no configuration: not in a cluster and no usable ~/.kube/config "
                f"({exc}); pass host= or api_client="
            ) from exc
    return k8s.ApiClient()


def _error(what: str, exc: BaseException) -> PlatformError:
    if isinstance(exc, ApiException):
        return PlatformError(f"kubernetes: {what}: HTTP {exc.status} {exc.reason}")
    return PlatformError(f"kubernetes: {what}: {exc}")
