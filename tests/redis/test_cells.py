"""Two cells on two local redis-server processes (issue 17): requests reach the cell of
their route, ids name their cell, one cell's outage leaves the other serving, and the
CLI shows both. Each cell runs its own dispatcher and worker, started with ``--cell``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from inferq.client import Client
from inferq.config import Settings
from inferq.embedded import EmbeddedRedis
from inferq.errors import RedisUnavailable
from inferq.models import WorkerState

from ..helpers import wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

#: cell -> (its route, a worker for it: model, VRAM MiB)
CELLS = {"a": ("llama-3.1-8b", 24576), "b": ("llama-2-13b", 49152)}


@dataclass
class TwoCells:
    config: Path
    namespace: str
    servers: dict[str, EmbeddedRedis]
    procs: list[subprocess.Popen[bytes]]

    def settings(self) -> Settings:
        return Settings.load(self.config, namespace=self.namespace)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "inferq", "--config", str(self.config)]
        cmd += ["--namespace", self.namespace, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def cells(tmp_path: Path, namespace: str) -> Iterator[TwoCells]:
    servers = {name: EmbeddedRedis(prefer="redis-server").__enter__() for name in CELLS}
    config = tmp_path / "inferq.toml"
    config.write_text(
        "".join(
            f'[cells.{name}]\nredis_url = "{servers[name].url}"\nroutes = ["{route}"]\n\n'
            for name, (route, _) in CELLS.items()
        )
    )
    env = {**os.environ, "INFERQ_HEARTBEAT_INTERVAL_S": "0.2", "INFERQ_LEASE_S": "1.0"}
    base = [sys.executable, "-m", "inferq", "--config", str(config), "--namespace", namespace]
    procs: list[subprocess.Popen[bytes]] = []
    for name, (model, vram) in CELLS.items():
        log = (tmp_path / f"{name}.log").open("wb")
        for args in (
            ["dispatcher"],
            ["worker", "--model", model, "--vram-mib", str(vram), "--id", f"{name}-w1"],
        ):
            if args[0] == "worker":
                args += ["-o", "time_scale=0.02"]
            procs.append(
                subprocess.Popen([*base, "--cell", name, *args], env=env, stdout=log, stderr=log)
            )
    two = TwoCells(config, namespace, servers, procs)
    for name in CELLS:
        r = redis.Redis.from_url(servers[name].url, decode_responses=True)
        key = f"inferq:{namespace}:worker:{name}-w1"
        wait_for(
            lambda r=r, key=key: r.hget(key, "state") == WorkerState.READY.value,
            what=f"cell {name}'s worker ready",
        )
        r.close()
    yield two
    for p in procs:
        p.kill()
        p.wait()
    for server in servers.values():
        server.close()


def test_requests_reach_their_route_s_cell_and_ids_name_it(cells: TwoCells) -> None:
    with Client(settings=cells.settings()) as client:
        handles = {
            name: [client.submit("hi", model=route, max_tokens=8) for _ in range(4)]
            for name, (route, _) in CELLS.items()
        }
        many = client.submit_many(
            [{"prompt": "x", "model": route, "max_tokens": 4} for route, _ in CELLS.values()]
        )
        assert [h.id.split("-")[0] for h in many] == list(CELLS)
        for name, hs in handles.items():
            for h in hs:
                assert h.id.startswith(f"{name}-")
                result = h.result(timeout=30)
                assert result.status == "succeeded" and result.worker == f"{name}-w1"
                assert client.status(h.id).state == "succeeded"
        for h in many:
            assert h.result(timeout=30).status == "succeeded"
    # Each cell's Redis holds its own requests only.
    for name, server in cells.servers.items():
        r = redis.Redis.from_url(server.url, decode_responses=True)
        ids = {k.rsplit(":", 1)[1] for k in r.scan_iter(f"inferq:{cells.namespace}:req:*")}
        assert len(ids) == 5 and all(i.startswith(f"{name}-") for i in ids)
        r.close()


def test_one_cell_down_leaves_the_other_serving_and_the_cli_shows_both(cells: TwoCells) -> None:
    def both_ready() -> bool:
        shown = json.loads(cells.cli("cells", "--json").stdout)
        assert {row["cell"]: row["reachable"] for row in shown} == {"a": True, "b": True}
        return all(row["workers"] == {"ready": 1} for row in shown)

    wait_for(both_ready, timeout=30, what="both cells' workers listed ready")
    # The CLI submits to the route's cell and reads that cell after (its served-model
    # note; a heartbeat lapsing for a moment here, 0.6 s TTL, may show the note).
    run = cells.cli("submit", "hi", "--model", CELLS["b"][0], "--json")
    assert run.returncode == 0 and "error" not in run.stderr, run.stderr
    assert json.loads(run.stdout)["id"].startswith("b-")

    cells.servers["b"].close()  # cell b's Redis is gone
    with Client(settings=cells.settings()) as client:
        h = client.submit("hi", model=CELLS["a"][0], max_tokens=8)
        assert h.result(timeout=30).status == "succeeded"
        with pytest.raises(RedisUnavailable):
            client.submit("hi", model=CELLS["b"][0], max_tokens=8)

    def a_serving_b_down() -> bool:
        run = cells.cli("cells", "--json")
        assert run.returncode == 0, run.stderr
        shown = {row["cell"]: row for row in json.loads(run.stdout)}
        assert not shown["b"]["reachable"] and "cannot reach Redis" in shown["b"]["error"]
        # a's worker beats every 0.2 s with a 0.6 s TTL here: on a loaded machine its
        # heartbeat may lapse for a moment (the reaper would then see it rejoin).
        return bool(shown["a"]["reachable"] and shown["a"]["workers"] == {"ready": 1})

    wait_for(a_serving_b_down, timeout=30, what="cell a listed serving, cell b unreachable")
    table = cells.cli("cells")
    assert "unreachable" in table.stdout and "llama-3.1-8b" in table.stdout
