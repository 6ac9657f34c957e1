"""Hostile model servers under real workers (issue 13 attack): answers no honest server
sends, but a broken or misconfigured one, or a proxy before it, may.

``inferq worker --backend openai`` subprocesses against
:class:`tests.fakes.standin_openai.StandIn` servers, a dispatcher thread and the real
Redis: an absurd ``Retry-After``, telemetry with numbers no float can hold. The worker
must neither park itself for ever nor stop beating.
"""

from __future__ import annotations

import json
import time

from inferq.client import Client
from inferq.models import WorkerInfo
from tests.fakes.standin_openai import StandIn

from ..helpers import wait_for
from .fleet import Fleet
from .test_worker_failures import openai_worker


def test_an_absurd_retry_after_neither_parks_the_worker_nor_its_requests(
    fleet: Fleet, client: Client
) -> None:
    """``Retry-After: 1000000000`` (31 years) on a request and on the probe that follows:
    the worker slept the probe's interval as long as the server asked and stayed
    ``unhealthy`` for ever after the server recovered, and the request waited in the
    delayed set until its deadline. Both are capped (the backoff cap, 30 s)."""
    with StandIn(mode="error", error_status=429, retry_after="1000000000", fail_posts=2) as server:
        openai_worker(fleet, "w", server.url)
        handle = client.submit("absurd", priority="standard", max_tokens=4, timeout=120)
        wait_for(lambda: fleet.state("w") == "unhealthy", what="the worker unhealthy", timeout=20)
        result = handle.result(timeout=110)
        assert result.status == "succeeded", result.error
        wait_for(lambda: fleet.state("w") == "ready", what="the worker ready again", timeout=60)
    assert fleet.store.dead_letters() == []


def test_telemetry_with_numbers_no_float_holds_does_not_stop_the_heartbeat(
    fleet: Fleet, client: Client
) -> None:
    """A ``/slots`` whose ``n_ctx`` is a 400-digit integer (valid JSON; Python reads it
    exactly): the KV room computed from it overflowed a float in the heartbeat."""
    huge = "1" + "0" * 400
    slots = f'[{{"id": 0, "n_ctx": {huge}, "is_processing": false}}]'
    pages = {
        "/props": ("application/json", json.dumps({"total_slots": 4})),
        "/slots": ("application/json", slots),
    }
    with StandIn(pages=pages) as server:
        openai_worker(fleet, "w", server.url)
        key = fleet.store.keys.worker("w")
        first = fleet.store.redis.hget(key, "last_heartbeat_ms")
        time.sleep(1.5)  # several beats and a telemetry read
        wait_for(
            lambda: fleet.store.redis.hget(key, "last_heartbeat_ms") != first,
            what="a newer heartbeat",
            timeout=10,
        )
        handles = [client.submit(f"h{i}", max_tokens=4, timeout=30) for i in range(4)]
        assert [h.result(timeout=40).status for h in handles] == ["succeeded"] * 4
        assert fleet.procs["w"].poll() is None
        assert fleet.state("w") == "ready"
        in_flight = fleet.store.redis.hget(key, "in_flight")
        assert in_flight == "0", fleet.output("w")
    assert "Traceback" not in fleet.output("w"), fleet.output("w")


def test_a_server_that_answers_429_for_ever_expires_its_request_with_the_reason(
    fleet: Fleet, client: Client
) -> None:
    """429 + ``Retry-After: 1`` to everything: no attempt is spent (infrastructure), so the
    deadline alone ends the request; it must end at its deadline, not dead-lettered, and
    say why it never ran (the server's refusal), not only that its deadline passed."""
    with StandIn(mode="error", error_status=429, retry_after="1") as server:
        openai_worker(fleet, "w", server.url)
        started = time.monotonic()
        handle = client.submit("refused", priority="standard", max_tokens=4, timeout=6)
        result = handle.result(timeout=30)
        took = time.monotonic() - started
    assert result.status == "expired", result
    assert took < 12
    assert result.error is not None
    assert "429" in result.error, result.error
    print(f"\n429 for ever: expired after {took:.1f} s: {result.error}")
    assert fleet.store.dead_letters() == []


def test_telemetry_that_claims_no_kv_cache_does_not_starve_the_worker(
    fleet: Fleet, client: Client
) -> None:
    """A ``/slots`` whose slots all say ``n_ctx: 0`` (a server still allocating, or a
    broken one): routing took the measured KV room, 0, and the worker got no work."""
    slots = json.dumps([{"id": i, "n_ctx": 0, "is_processing": False} for i in range(4)])
    pages = {
        "/props": ("application/json", json.dumps({"total_slots": 4})),
        "/slots": ("application/json", slots),
    }
    with StandIn(pages=pages) as server:
        openai_worker(fleet, "w", server.url)
        handles = [client.submit(f"z{i}", max_tokens=4, timeout=10) for i in range(4)]
        results = [h.result(timeout=20) for h in handles]
    assert [r.status for r in results] == ["succeeded"] * 4, [r.error for r in results]


def test_a_failing_server_takes_no_second_batch_before_its_worker_is_judged(
    fleet: Fleet, client: Client
) -> None:
    """A server answering 500 beside a healthy one: the failed requests went back to
    their queue before the probe that follows a failure had turned the worker
    ``unhealthy``, so the dispatcher refilled the freed slots on the failing server (it saw
    6-8 requests for 4 slots; under a second outage a request came within one failure of
    the dead letter). A request that failed waits for the probe's verdict (milliseconds
    on a server that answers) before it frees its slot."""
    with StandIn(mode="error", error_status=500) as bad, StandIn() as good:
        openai_worker(fleet, "bad", bad.url)
        openai_worker(fleet, "good", good.url)
        handles = [
            client.submit(f"q{i}", priority="standard", max_tokens=4, timeout=30) for i in range(30)
        ]
        results = [h.result(timeout=40) for h in handles]
    assert [r.status for r in results] == ["succeeded"] * 30
    assert len(bad.posts()) <= 4, len(bad.posts())  # one batch: its 4 slots
    assert fleet.store.dead_letters() == []


def test_a_400_inside_the_stream_is_the_callers_rejection_not_a_server_failure(
    fleet: Fleet, client: Client
) -> None:
    """vLLM reports an invalid request whose stream began as a data event
    ``{"error": {"message", "type": "BadRequestError", "code": 400}}``: the request is
    the caller's error (as the same 400 before the stream), so it fails at once with the
    server's message in ``Result.rejection``; it was retried as a server failure on every
    attempt, probing the server each time, and dead-lettered."""
    vllm_400 = {
        "error": {
            "message": "max_tokens must be at least 1, got -3.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    with StandIn(mode="stream_error", error_body=vllm_400) as server:
        openai_worker(fleet, "w", server.url)
        wait_for(lambda: fleet.state("w") == "ready", what="the worker ready", timeout=60)
        handle = client.submit("bad", priority="standard", max_tokens=4, timeout=30, stream=True)
        result = handle.result(timeout=30)
        assert result.status == "failed", result
        assert result.rejection == "max_tokens must be at least 1, got -3.", result
        assert len([r for r in server.requests if r.method == "POST"]) == 1
        assert fleet.state("w") != "unhealthy"  # not suspected: the server is fine
    assert fleet.store.dead_letters() == []


def test_a_server_that_refuses_every_request_is_taken_out_after_two_and_comes_back(
    fleet: Fleet, client: Client
) -> None:
    """Issue 24: a server answering 400 to every request stayed ``ready`` and failed
    every request routed to it, for ever (a request error is the caller's, so nothing
    suspected the server). The same refusal for 3 requests in a row from 2 tenants takes
    it out: the first two fail as the callers' (nothing tells them apart from bad
    requests yet), the third goes back to the queue and succeeds on the healthy worker,
    as does everything sent after. ``unhealthy`` names the refusal; strict probes bring
    it back once it serves again.

    The three go one at a time, tenants alternating: sent together beside a healthy
    worker, the router may give the broken one three of one tenant's requests first, and
    one tenant's identical refusals are not proof (issue 25: that order burned a third
    request under a loaded CI host, by the rule, not by chance)."""
    with StandIn(mode="error", error_status=400) as bad, StandIn() as good:
        openai_worker(fleet, "bad", bad.url)
        wait_for(lambda: fleet.state("bad") == "ready", what="the 400-ing worker ready", timeout=60)
        first = [
            client.submit(f"q{i}", priority="standard", tenant=f"t{i % 2}", max_tokens=4)
            for i in range(2)
        ]
        burned = [h.result(timeout=30) for h in first]
        assert [r.status for r in burned] == ["failed", "failed"], [r.error for r in burned]
        third = client.submit("q2", priority="standard", tenant="t0", max_tokens=4, timeout=60)
        wait_for(lambda: fleet.state("bad") == "unhealthy", what="the worker unhealthy")
        reason = fleet.store.redis.hget(fleet.store.keys.worker("bad"), "health_reason")
        assert reason and "refused 3 requests in a row" in reason, reason
        openai_worker(fleet, "good", good.url)
        handles = [third] + [
            client.submit(
                f"q{i}", priority="standard", tenant=f"t{i % 2}", max_tokens=4, timeout=30
            )
            for i in range(3, 20)
        ]
        results = [h.result(timeout=40) for h in handles]
        print(f"requests burned by a server refusing every request: {len(burned)}")
        assert [r.status for r in results] == ["succeeded"] * 18, [r.error for r in results]
        assert {r.worker for r in results} == {"good"}
        assert fleet.state("bad") == "unhealthy"
        bad.mode = "ok"
        wait_for(lambda: fleet.state("bad") == "ready", what="the server back", timeout=20)
        assert fleet.store.redis.hget(fleet.store.keys.worker("bad"), "health_reason") == ""
    assert fleet.store.dead_letters() == []


def test_a_server_that_says_it_reused_more_than_the_prompt_is_metered_the_prompt(
    fleet: Fleet, client: Client
) -> None:
    """``cached_tokens`` 5,000,000 for a 7-token prompt (issue 22 attack): metered as is,
    a priced request's cost went negative and the worker's hit rate past 100%."""
    with StandIn(prompt_tokens=7, cached_tokens=5_000_000) as server:
        openai_worker(fleet, "w", server.url)
        result = client.submit("reused", priority="standard", max_tokens=4).result(timeout=60)
        assert result.status == "succeeded", result.error
        assert result.prompt_tokens == 7 and result.cached_tokens == 7

        def beat() -> WorkerInfo:
            return next(w for w in fleet.store.workers()[0] if w.id == "w")

        wait_for(lambda: beat().prompt_tokens_total >= 7, what="the heartbeat's totals")
        assert beat().cached_tokens_total == beat().prompt_tokens_total
