"""Failing model servers under real workers (issue 13): stand-in OpenAI servers on loopback.

Each test runs ``inferq worker --backend openai`` subprocesses against
:class:`tests.fakes.standin_openai.StandIn` servers, a dispatcher thread and the real
Redis: a server answering 500 beside a healthy one, a 429 with ``Retry-After``, a
server that goes away and comes back, streams cut off before their end. Nothing may be
lost or dead-lettered that a retry can save.
"""

from __future__ import annotations

import itertools
import time

from inferq.client import Client
from tests.fakes.standin_openai import StandIn

from ..helpers import wait_for
from .fleet import Fleet


def openai_worker(fleet: Fleet, wid: str, url: str, *options: str) -> None:
    """A worker with the openai backend on ``url`` (4 slots), ``-o`` each option."""
    extra = ["--backend", "openai", "-o", f"base_url={url}"]
    for option in options:
        extra += ["-o", option]
    fleet.worker(wid, time_scale=None, extra=tuple(extra))


def test_a_server_answering_500_beside_a_healthy_one_loses_nothing(
    fleet: Fleet, client: Client
) -> None:
    with StandIn(mode="error", error_status=500) as bad, StandIn() as good:
        openai_worker(fleet, "bad", bad.url)
        openai_worker(fleet, "good", good.url)
        handles = [
            client.submit(f"q{i}", priority="realtime", max_tokens=4, timeout=30) for i in range(30)
        ]
        results = [h.result(timeout=40) for h in handles]
        assert [r.status for r in results] == ["succeeded"] * 30
        assert {r.worker for r in results} == {"good"}
        wait_for(lambda: fleet.state("bad") == "unhealthy", what="the 500-ing worker unhealthy")
        assert fleet.store.dead_letters() == []
        stats = fleet.store.redis.hgetall(fleet.store.keys.stats)
        bad_posts = [p for p in bad.posts() if p.body.get("max_tokens") != 1]  # not the probes
        assert int(stats.get("retried", 0)) >= len(bad_posts) >= 1
        print(  # a figure of docs/reliability.md
            f"\n500 beside a healthy worker: 30/30 succeeded, 0 dead; the 500-ing server saw "
            f"{len(bad_posts)} requests and {len(bad.posts()) - len(bad_posts)} probes; "
            f"retried {stats.get('retried', 0)}; attempts max {max(r.attempt for r in results)}"
        )


def test_429_with_retry_after_is_waited_out_and_spends_no_attempt(
    fleet: Fleet, client: Client
) -> None:
    with StandIn(mode="error", error_status=429, retry_after="1", fail_posts=8) as server:
        openai_worker(fleet, "w", server.url)
        handles = [
            client.submit(f"p{i}", priority="realtime", max_tokens=4, timeout=60) for i in range(6)
        ]
        results = [h.result(timeout=60) for h in handles]
        assert [r.status for r in results] == ["succeeded"] * 6
        by_prompt: dict[str, list[float]] = {}
        for post in server.posts():
            if post.body.get("max_tokens") != 1:
                by_prompt.setdefault(post.body["prompt"], []).append(post.at)
        gaps = [b - a for times in by_prompt.values() for a, b in itertools.pairwise(times)]
        assert gaps, "no request was retried"
        assert min(gaps) >= 0.99  # Retry-After: 1
        assert max(r.attempt for r in results) >= 2
        stats = fleet.store.redis.hgetall(fleet.store.keys.stats)
        assert int(stats["retried_infra"]) == len(gaps)
        probes = sum(1 for p in server.posts() if p.body.get("max_tokens") == 1)
        print(  # a figure of docs/reliability.md
            f"\n429 + Retry-After 1 s: 6/6 succeeded, 0 dead; {len(gaps)} retries, smallest gap "
            f"{min(gaps):.2f} s; {len(server.posts())} POSTs ({probes} probes), the first 8 "
            f"answered 429"
        )


def test_an_outage_makes_the_worker_unhealthy_and_loses_nothing(
    fleet: Fleet, client: Client
) -> None:
    server = StandIn().start()
    openai_worker(fleet, "w", server.url)
    port = server.port
    server.stop()
    handles = [
        client.submit(f"o{i}", priority="standard", max_tokens=4, timeout=60) for i in range(8)
    ]
    # From its first unhealthy beat until the server is back the heartbeat says unhealthy
    # every time: the heartbeat process once wrote its older line (ready) back, and the
    # dispatcher sent work to a worker whose server was down.
    states: list[str | None] = []
    while "unhealthy" not in states[-1:]:
        assert len(states) < 4000, "worker not unhealthy within 20 s"
        states.append(fleet.state("w"))
        time.sleep(0.005)
    for _ in range(200):  # a second: five heartbeat intervals
        states.append(fleet.state("w"))
        time.sleep(0.005)
    assert "ready" not in states[states.index("unhealthy") :]
    with StandIn(port=port):
        results = [h.result(timeout=60) for h in handles]
        wait_for(lambda: fleet.state("w") == "ready", what="worker ready again")
    assert [r.status for r in results] == ["succeeded"] * 8
    assert fleet.store.dead_letters() == []
    fleet.close()
    log = fleet.output()
    assert log.count("model server unhealthy") == 1
    assert log.count("model server healthy again") == 1


def test_truncated_streams_are_retried_not_recorded_as_success(
    fleet: Fleet, client: Client
) -> None:
    with StandIn(mode="truncate", fail_posts=3) as server:
        openai_worker(fleet, "w", server.url, "stream=true")
        handles = [
            client.submit(f"t{i}", priority="realtime", max_tokens=4, timeout=30) for i in range(3)
        ]
        results = [h.result(timeout=30) for h in handles]
    assert [r.status for r in results] == ["succeeded"] * 3
    assert [r.output for r in results] == ["w0 w1 w2 w3"] * 3
    assert {r.finish_reason for r in results} == {"length"}  # 4 of the stand-in's 5 words
    retries = [e for e in fleet.store.events() if e.type == "retry"]
    assert {e.fields["kind"] for e in retries} == {"truncated"}
    # the worker's probe (a 1-token request) may take one of the 3 truncated answers
    probes = sum(1 for post in server.posts()[:3] if post.body.get("max_tokens") == 1)
    assert len(retries) == 3 - probes >= 1


def test_a_chat_only_server_recovers_after_a_500(fleet: Fleet, client: Client) -> None:
    """A server that serves only ``/v1/chat/completions`` (404 on ``/v1/completions``, as a
    chat-only deployment or gateway answers) and fails one request with 500: the probe that
    follows must not keep the worker ``unhealthy`` forever because the probe's own endpoint
    is missing; a server that answers 404 is up."""
    with StandIn(
        mode="error", error_status=500, fail_posts=1, not_found_paths={"/v1/completions"}
    ) as server:
        openai_worker(fleet, "w", server.url)
        messages = [{"role": "user", "content": "hi"}]
        handles = [
            client.submit(messages=messages, priority="standard", max_tokens=4, timeout=30)
            for _ in range(4)
        ]
        results = [h.result(timeout=40) for h in handles]
        assert [r.status for r in results] == ["succeeded"] * 4
        assert fleet.state("w") == "ready"
    assert fleet.store.dead_letters() == []
