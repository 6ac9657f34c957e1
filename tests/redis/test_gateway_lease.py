"""A gateway that dies mid-stream: its requests are cancelled once its lease lapses.

A client that hangs up is cancelled by the gateway itself (``test_gateway.py``); a gateway
process SIGKILLed mid-stream cannot cancel anything, and its request ran on to the end
on its worker, holding a slot and generating tokens nobody would read. A real
``inferq gateway`` subprocess, a sim worker subprocess, the dispatcher, the real Redis.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferq import defaults
from inferq.client import Client
from inferq.config import Settings
from inferq.dispatcher.daemon import OUTAGE_GRACE_MIN_S, Dispatcher
from inferq.embedded import free_port
from inferq.ids import new_id
from inferq.intake import build_request
from inferq.models import InferenceRequest, RequestState, StreamChunk
from inferq.store import Store

from ..conftest import REDIS_URL
from ..helpers import queue_key, ready_worker, wait_for
from .fleet import Fleet

MODEL = "llama-3.1-8b"
KEYS = """
[keys."sk-acme"]
tenant = "acme"
classes = ["realtime", "standard"]
default_class = "standard"
"""
#: The gateway's lease in this test, seconds (the default is 10): renewed every third of
#: it from the gateway's event loop, which a loaded 2-core host starved for over a
#: second at 1 s (a live gateway taken for dead).
LEASE_S = 2.0
#: Slack for the cancel after the lease lapses: a dispatcher recovery pass (0.5 s at
#: most), the abort reaching the worker (its control channel), a loaded 2-core machine;
#: and the reap pause of a dispatcher whose own loop stalled past a heartbeat TTL (it
#: holds the orphans' cancel back too, by design).
MARGIN_S = 4.0 + OUTAGE_GRACE_MIN_S


@pytest.fixture
def gateway_process(fast_settings: Settings, tmp_path: Path) -> Iterator[tuple[str, object]]:
    """``inferq gateway`` as a subprocess (so it can be SIGKILLed) with a 1 s lease."""
    yield from _gateway(fast_settings, tmp_path)


def _gateway(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, object]]:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    port = free_port()
    env = {
        **os.environ,
        "INFERQ_REDIS_URL": REDIS_URL,
        "INFERQ_NAMESPACE": settings.namespace,
        "INFERQ_GATEWAY_LEASE_S": str(LEASE_S),
    }
    cmd = [sys.executable, "-m", "inferq", "gateway", "--port", str(port), "--keys", str(keys)]
    cmd += ["--no-deployment-metrics"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            root = f"http://127.0.0.1:{port}"
            wait_for(lambda: _healthy(root), what="the gateway serving", timeout=30)
            yield root, proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def _healthy(root: str) -> bool:
    try:
        return httpx.get(f"{root}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_gateways_streams_are_cancelled_when_its_lease_lapses(
    fleet: Fleet,
    store: Store,
    fast_settings: Settings,
    client: Client,
    gateway_process: tuple[str, subprocess.Popen[bytes]],
) -> None:
    root, proc = gateway_process
    fleet.worker("w1", time_scale=50.0, slots=2)  # 60 tokens: several seconds of decoding
    # A Python client's streamed request on the same worker: tied to no process.
    own = client.submit("mine", priority="standard", max_tokens=60, stream=True,
                        params={"sim_output_tokens": 60})  # fmt: skip
    # The gateway's stream outlasts the cancel's whole window (LEASE_S + MARGIN_S).
    headers = {"Authorization": "Bearer sk-acme"}
    with httpx.stream(
        "POST", f"{root}/v1/chat/completions", json=_stream_body(200), headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        # Hold the line iterator until the kill: a generator expression dropped after its
        # first item is closed, which closed the stream, so the live gateway saw its client
        # leave and cancelled the request itself ("by the caller"), racing the kill.
        lines = response.iter_lines()
        line = next(lines)
        while not line.startswith("data: "):
            line = next(lines)
        rid = json.loads(line.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
        record = store.record(rid)
        assert record.state.value == "running"
        assert record.request.caller is not None  # the gateway's id
        assert store.redis.sismember(store.keys.caller(record.request.caller), rid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    killed = time.monotonic()
    wait_for(
        lambda: store.redis.hget(store.keys.req(rid), "state") == "cancelled",
        what="the dead gateway's request cancelled",
        timeout=LEASE_S + MARGIN_S,
    )
    assert time.monotonic() - killed <= LEASE_S + MARGIN_S
    result = store.record(rid).result
    assert result is not None and result.error is not None and "gateway" in result.error
    # Its slot is free (the worker aborted the call), the caller's entries are gone...
    wait_for(lambda: rid not in store.held_by("w1"), what="the slot freed", timeout=5)
    wait_for(
        lambda: not store.redis.exists(store.keys.caller(record.request.caller or "")),
        what="the dead gateway's entries removed",
        timeout=5,
    )
    # ... and the Python client's streamed request ran to its end.
    items = list(own.stream(timeout=60))
    final = items[-1]
    assert not isinstance(final, StreamChunk) and final.status == "succeeded", final
    assert store.record(own.id).request.caller is None


def _stream_body(tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": tokens,
        "stream": True,
        "sim_output_tokens": tokens,
    }


def test_a_stalled_gateway_tells_its_caller_and_serves_on_after_its_lease_lapsed(
    fleet: Fleet,
    store: Store,
    gateway_process: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """A live gateway stopped (SIGSTOP: a VM pause, a swap storm) past its lease is taken
    for dead and its streams cancelled; resumed, it tells their callers with an OpenAI
    error event and its next requests run to their end (its lease is renewed first)."""
    root, proc = gateway_process
    fleet.worker("w1", time_scale=50.0, slots=2)
    headers = {"Authorization": "Bearer sk-acme"}
    url = f"{root}/v1/chat/completions"
    with httpx.stream("POST", url, json=_stream_body(200), headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        line = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(line.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
        caller = store.record(rid).request.caller
        assert caller is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(
                lambda: store.redis.hget(store.keys.req(rid), "state") == "cancelled",
                what="the stalled gateway's request cancelled",
                timeout=LEASE_S + MARGIN_S,
            )
        finally:
            proc.send_signal(signal.SIGCONT)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    # The caller is told, as OpenAI would: an error event, no [DONE] after a clean finish.
    events = [json.loads(data) for data in rest if data != "[DONE]"]
    errors = [e for e in events if "error" in e]
    assert errors, rest
    assert {"message", "type", "code"} <= set(errors[-1]["error"]), errors[-1]
    # ... as the server's fault (retry it), not a cancel by the caller (a 409 no client retries).
    assert errors[-1]["error"]["type"] == "server_error", errors[-1]
    assert errors[-1]["error"]["code"] == "gateway_lease_lapsed", errors[-1]
    assert all(e.get("choices", [{}])[0].get("finish_reason") != "stop" for e in events)
    # Resumed, the gateway serves on: several leases of streaming, not reaped.
    with httpx.stream("POST", url, json=_stream_body(60), headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        data = [ln.removeprefix("data: ") for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    assert not any("error" in json.loads(d) for d in data if d != "[DONE]")
    assert store.redis.zscore(store.keys.callers, caller) is not None


def _gateway_request(settings: Settings, caller: str | None, key: str) -> InferenceRequest:
    built = build_request(settings, prompt="tell me", tenant="acme", idempotency_key=key)
    return built.model_copy(update={"caller": caller})


@pytest.mark.parametrize("retried_by", ["gateway", "client"])
def test_a_retry_with_the_same_idempotency_key_is_not_cancelled_with_the_first_gateway(
    store: Store, fast_settings: Settings, retried_by: str
) -> None:
    """Gateway A submits with an idempotency key and dies; the caller retries the same key
    through gateway B (or the Python client): the retry is the same request ('dup'), now
    relayed by B. A's lease lapsing must not cancel it: the one reading its answer lives."""
    dead, live = new_id(), new_id()
    # Leases as caller_lease.lua writes them: A's lapsed long ago, B's far ahead.
    store.redis.zadd(store.keys.callers, {dead: 1, live: 2**50})
    first = store.submit(_gateway_request(fast_settings, dead, "retry-1"))
    again = _gateway_request(fast_settings, live if retried_by == "gateway" else None, "retry-1")
    second = store.submit(again)
    assert second.duplicate and second.id == first.id
    assert store.lapsed_callers() == []  # nothing of the dead gateway's left to cancel
    owner = store.record(first.id).request.caller
    assert owner == (live if retried_by == "gateway" else None)
    if owner is not None:
        assert store.redis.smembers(store.keys.caller(live)) == {first.id}


def test_of_two_gateways_only_the_killed_ones_requests_are_cancelled(
    fleet: Fleet,
    store: Store,
    fast_settings: Settings,
    tmp_path: Path,
) -> None:
    """Two replicas on one Redis. B streams on the worker's only slot; A's stream waits
    queued behind it (submitted, no first chunk yet) and A is SIGKILLed: A's request is
    cancelled once A's lease lapses, B's runs on to [DONE] and B serves the next one."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a_gen, b_gen = _gateway(fast_settings, a_dir), _gateway(fast_settings, b_dir)
    (a_root, a_proc), (b_root, _) = next(a_gen), next(b_gen)
    try:
        fleet.worker("w1", time_scale=50.0, slots=1)
        headers = {"Authorization": "Bearer sk-acme"}
        with httpx.stream(
            "POST", f"{b_root}/v1/chat/completions", json=_stream_body(200),
            headers=headers, timeout=60,
        ) as b_resp:  # fmt: skip
            b_lines = b_resp.iter_lines()
            first = next(line for line in b_lines if line.startswith("data: "))
            b_rid = json.loads(first.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
            # A's stream answers nothing until its first chunk: sent from a thread.
            a_call = threading.Thread(
                target=_post_quietly,
                args=(f"{a_root}/v1/chat/completions", _stream_body(60), headers),
                daemon=True,
            )
            a_call.start()
            b_caller = store.record(b_rid).request.caller
            wait_for(
                lambda: any(
                    store.redis.scard(store.keys.caller(c)) == 1
                    for c in store.redis.zrange(store.keys.callers, 0, -1)
                    if c != b_caller
                ),
                what="A's request submitted",
                timeout=10,
            )
            [a_id] = [c for c in store.redis.zrange(store.keys.callers, 0, -1) if c != b_caller]
            [a_rid] = store.redis.smembers(store.keys.caller(a_id))
            assert store.redis.hget(store.keys.req(a_rid), "state") == "queued"  # behind B
            a_proc.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
            a_proc.wait(timeout=10)  # type: ignore[attr-defined]
            wait_for(
                lambda: store.redis.hget(store.keys.req(a_rid), "state") == "cancelled",
                what="the dead gateway's queued request cancelled",
                timeout=LEASE_S + MARGIN_S,
            )
            # Its record says why: not "cancelled by the caller" (nobody hung up).
            error = store.record(a_rid).result.error  # type: ignore[union-attr]
            assert error is not None and "liveness lease lapsed" in error, error
            rest = [ln.removeprefix("data: ") for ln in b_lines if ln.startswith("data: ")]
        assert rest[-1] == "[DONE]", rest[-3:]
        assert not any("error" in json.loads(d) for d in rest if d != "[DONE]")
        assert store.redis.hget(store.keys.req(b_rid), "state") == "succeeded"
    finally:
        for gen in (a_gen, b_gen):
            gen.close()


def test_a_lapsed_gateways_queued_request_says_why_it_was_cancelled(
    store: Store, fast_settings: Settings
) -> None:
    """A queued request of a gateway whose lease lapsed is cancelled by the dispatcher; its
    result said "cancelled by the caller" (nobody hung up), so a gateway that had only
    stalled told its client it had cancelled (409) instead of the server's 503."""
    dead = new_id()
    store.redis.zadd(store.keys.callers, {dead: 1})  # lapsed long ago
    submitted = store.submit(_gateway_request(fast_settings, dead, "queued-1"))
    assert Dispatcher(store)._cancel_orphans() == 1
    result = store.record(submitted.id).result
    assert result is not None and result.status == "cancelled"
    assert result.error is not None and defaults.CALLER_LAPSED in result.error, result


@pytest.mark.parametrize("held", ["queued", "running"])
@pytest.mark.parametrize("taken_by", ["retry", "renewal"])
def test_a_retry_between_the_reapers_listing_and_its_cancel_keeps_the_request(
    store: Store, fast_settings: Settings, monkeypatch: pytest.MonkeyPatch, held: str, taken_by: str
) -> None:
    """The race issue 14's note left (issue 24, item 4): the reaper lists a lapsed
    gateway's requests (``reap_callers.lua``), then cancels them one call later. A same-key
    retry through a live gateway landing in between (or the stalled gateway renewing its
    lease) took the request over, yet the cancel (or the running request's abort) still
    ended it, under the retry's reader. Interleaved by hand: list, retry, cancel. The
    guarded cancel changes nothing: the request stays where it was, counted once, in the
    live caller's set, with no abort on its worker's channel."""
    dead, live = new_id(), new_id()
    store.redis.zadd(store.keys.callers, {dead: 1, live: 2**50})
    req = _gateway_request(fast_settings, dead, "race-1")
    first = store.submit(req)
    state = RequestState.QUEUED
    if held == "running":
        ready_worker(store, "w1")
        [(rid, attempt)] = store.assign("w1", "b1", [(first.id, queue_key(store, req), 5.0)])
        store.start("w1", [(rid, attempt)])
        state = RequestState.RUNNING
    listed = store.lapsed_callers()  # the reaper's read: the dead gateway still holds it
    assert listed == [(dead, [first.id])]
    if taken_by == "retry":
        again = store.submit(_gateway_request(fast_settings, live, "race-1"))
        assert again.duplicate and again.id == first.id
    else:
        store.redis.zadd(store.keys.callers, {dead: 2**50})  # the stalled gateway renewed
    monkeypatch.setattr(store, "lapsed_callers", lambda limit=100: listed)
    assert Dispatcher(store)._cancel_orphans() == 0
    assert store.record(first.id).state is state
    assert store.redis.llen(store.keys.ctl("w1")) == 0  # no abort sent to its worker
    assert int(store.stats().get("cancelled", 0)) == 0
    if held == "queued":  # counted once, still in its queue
        assert store.redis.hget(store.keys.counts, f"c:{req.priority}") == "1"
        assert store.redis.zrange(queue_key(store, req), 0, -1) == [first.id]
    owner = live if taken_by == "retry" else dead
    assert store.redis.smembers(store.keys.caller(owner)) == {first.id}
    # The reaper's cancel still wins when nothing took the request over: the guard passes.
    if taken_by == "renewal":
        store.redis.zadd(store.keys.callers, {dead: 1})
        assert Dispatcher(store)._cancel_orphans() == 1


def _post_quietly(url: str, body: dict[str, object], headers: dict[str, str]) -> None:
    """POST a streamed request and read it to its end, whatever happens to the server."""
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as resp:
            for _ in resp.iter_lines():
                pass
    except httpx.HTTPError:
        pass
