"""The docker scaler backend: the real Docker SDK against a stand-in Engine API on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from inferq.scaler.platforms import platform_class
from inferq.scaler.platforms.base import PlatformError, WorkerHandle
from inferq.scaler.platforms.docker import DockerPlatform
from tests.fakes.standin_docker import DockerStandIn

MODEL = "llama-3.1-8b"


@pytest.fixture
def standin() -> Iterator[DockerStandIn]:
    with DockerStandIn() as s:
        yield s


def backend(s: DockerStandIn, **kw: object) -> DockerPlatform:
    args: dict[str, object] = {
        "image": "inferq:test",
        "redis_url": "redis://redis:6379/0",
        "namespace": "prod",
        "base_url": s.url,
    }
    args.update(kw)
    return DockerPlatform(**args)  # type: ignore[arg-type]


def test_launch_runs_a_labelled_gpu_container_with_the_worker_command(
    standin: DockerStandIn,
) -> None:
    b = backend(
        standin,
        gpus_per_worker=2,
        network="inferq-net",
        extra_args=["--slots", "8"],
        vram_mib={MODEL: 24576},
    )
    handle = b.launch(MODEL, "w-1")

    [create] = standin.calls("POST", "/containers/create")
    body = create.body
    assert create.query["name"] == ["inferq-prod-w-1"]
    assert body["Image"] == "inferq:test"
    # Only the arguments: the image's ENTRYPOINT is inferq (tests/redis/test_deploy_commands.py).
    assert body["Cmd"] == [
        *("worker", "--model", MODEL, "--id", "w-1"),
        *("--vram-mib", "24576", "--slots", "8"),
    ]
    assert body["Labels"] == {
        "inferq.model": MODEL,
        "inferq.worker": "w-1",
        "inferq.namespace": "prod",
        "inferq.managed-by": "scaler",
    }
    assert sorted(body["Env"]) == ["INFERQ_NAMESPACE=prod", "INFERQ_REDIS_URL=redis://redis:6379/0"]
    [gpu] = body["HostConfig"]["DeviceRequests"]
    assert (gpu["Count"], gpu["Capabilities"]) == (2, [["gpu"]])
    assert body["HostConfig"]["NetworkMode"] == "inferq-net"

    assert handle == WorkerHandle("w-1", MODEL, standin.find("inferq-prod-w-1")["Id"])  # type: ignore[index]
    assert len(standin.calls("POST", f"/containers/{handle.platform_ref}/start")) == 1
    assert standin.find(handle.platform_ref)["State"]["Running"]  # type: ignore[index]


def test_no_gpus_means_no_device_request_and_labels_cannot_be_overridden(
    standin: DockerStandIn,
) -> None:
    b = backend(standin, labels={"team": "ml", "inferq.model": "spoofed"})
    b.launch(MODEL, "w-2")
    [create] = standin.calls("POST", "/containers/create")
    assert "DeviceRequests" not in create.body["HostConfig"]
    assert create.body["Labels"]["team"] == "ml"
    assert create.body["Labels"]["inferq.model"] == MODEL


def test_a_missing_image_is_pulled_first(standin: DockerStandIn) -> None:
    standin.images.clear()
    backend(standin).launch(MODEL, "w-3")
    [pull] = standin.calls("POST", "/images/create")
    assert pull.query["fromImage"] == ["inferq"] and pull.query["tag"] == ["test"]
    assert len(standin.calls("POST", "/containers/create")) == 2  # refused, then created


def test_list_finds_this_namespaces_workers_by_label(standin: DockerStandIn) -> None:
    b = backend(standin)
    other_ns = backend(standin, namespace="staging")
    a = b.launch(MODEL, "a")
    c = b.launch("llama-2-13b", "c")
    other_ns.launch(MODEL, "x")

    assert b.list() == [a, c]
    assert b.list(MODEL) == [a]
    assert other_ns.list(MODEL)[0].worker_id == "x"
    filters = standin.calls("GET", "/containers/json")[1].query["filters"][0]
    assert "inferq.namespace=prod" in filters and f"inferq.model={MODEL}" in filters
    assert "inferq.managed-by=scaler" in filters


def test_stop_stops_then_removes_and_a_gone_container_is_fine(standin: DockerStandIn) -> None:
    b = backend(standin, stop_timeout_s=45)
    handle = b.launch(MODEL, "w-4")
    b.stop(handle)
    [stop] = standin.calls("POST", f"/containers/{handle.platform_ref}/stop")
    assert stop.query["t"] == ["45"]
    assert len(standin.calls("DELETE", f"/containers/{handle.platform_ref}")) == 1
    assert standin.containers == {} and b.list() == []
    b.stop(handle)  # already gone: no error, nothing else sent
    assert len(standin.calls("DELETE", f"/containers/{handle.platform_ref}")) == 1


def test_a_refused_launch_names_the_worker(standin: DockerStandIn) -> None:
    b = backend(standin)
    b.launch(MODEL, "dup")
    with pytest.raises(PlatformError, match=r"cannot launch worker dup: .*already in use"):
        b.launch(MODEL, "dup")


def test_an_unreachable_daemon_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(PlatformError, match="cannot reach the daemon"):
        DockerPlatform(
            image="inferq:test",
            redis_url="redis://r",
            namespace="prod",
            base_url=f"tcp://127.0.0.1:{port}",
        )


def test_the_backend_is_found_by_name() -> None:
    assert platform_class("docker") is DockerPlatform
    with pytest.raises(ValueError, match="unknown scaler backend 'swarm'; choose one of docker"):
        platform_class("swarm")
