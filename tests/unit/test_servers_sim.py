"""The sim backend, and the backend registry (make_server, register_server, entry points)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferq.config import ModelSpec
from inferq.devices import profile_for
from inferq.errors import ConfigError
from inferq.latency import service_time
from inferq.models import Payload
from inferq.workers.servers import (
    ModelServer,
    ServerError,
    ServerRequest,
    ServerResult,
    base,
    make_server,
    register_server,
    server_names,
)
from inferq.workers.servers.sim import SimServer

SPEC = ModelSpec(
    name="llama-3.1-8b",
    params_b=8,
    weights_mib=15_320,
    kv_bytes_per_token=131_072,
    max_context=32_768,
    cold_start_s=15,
    latency=profile_for("h200", "llama-3.1-8b"),
)


class SleepRecorder:
    """Stands in for asyncio.sleep: records the durations, never waits."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def request(
    max_tokens: int = 64,
    prompt_tokens: int = 1200,
    timeout_s: float = 1e9,
    rid: str = "r1",
    **params: Any,
) -> ServerRequest:
    return ServerRequest(
        id=rid,
        model=SPEC.name,
        payload=Payload(prompt="x", params=params),
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        timeout_s=timeout_s,
    )


def run(backend: ModelServer, req: ServerRequest, concurrency: int = 1) -> ServerResult:
    return asyncio.run(backend.generate(req, concurrency=concurrency))


def outcomes(backend: SimServer, n: int) -> list[str]:
    """Output text, or "!error", of ``n`` sequential calls."""

    async def go() -> list[str]:
        out = []
        for i in range(n):
            try:
                result = await backend.generate(request(rid=f"r{i}"), concurrency=1)
                out.append(result.output)
            except ServerError:
                out.append("!error")
        return out

    return asyncio.run(go())


# --- token counts ------------------------------------------------------------------


def test_output_defaults_to_max_tokens() -> None:
    result = run(SimServer(SPEC, time_scale=0), request(max_tokens=64, prompt_tokens=1200))
    assert result.completion_tokens == 64
    assert len(result.output.split()) == 64
    assert result.prompt_tokens == 1200


@settings(max_examples=150, deadline=None)
@given(max_tokens=st.integers(1, 600), wanted=st.integers(0, 1000))
def test_output_is_min_of_max_tokens_and_sim_output_tokens(max_tokens: int, wanted: int) -> None:
    result = run(
        SimServer(SPEC, time_scale=0), request(max_tokens=max_tokens, sim_output_tokens=wanted)
    )
    expected = min(max_tokens, wanted)
    assert result.completion_tokens == expected
    assert len(result.output.split()) == expected
    assert result.finish_reason == ("length" if wanted >= max_tokens else "stop")


@pytest.mark.parametrize("bad", [-1, 2.5, "10", True, None])
def test_invalid_sim_output_tokens_is_not_retryable(bad: Any) -> None:
    with pytest.raises(ServerError, match="sim_output_tokens must be an integer >= 0") as info:
        run(SimServer(SPEC, time_scale=0), request(sim_output_tokens=bad))
    assert not info.value.retryable


# --- determinism and failures ----------------------------------------------------------


def test_same_seed_same_results() -> None:
    a = outcomes(SimServer(SPEC, time_scale=0, seed=7, failure_rate=0.3), 60)
    b = outcomes(SimServer(SPEC, time_scale=0, seed=7, failure_rate=0.3), 60)
    assert a == b
    assert "!error" in a and any(o != "!error" for o in a)


def test_different_seeds_differ() -> None:
    a = outcomes(SimServer(SPEC, time_scale=0, seed=1, failure_rate=0.3), 60)
    b = outcomes(SimServer(SPEC, time_scale=0, seed=2, failure_rate=0.3), 60)
    assert a != b


def test_seed_given_as_digits_is_the_integer_seed() -> None:
    a = outcomes(SimServer(SPEC, time_scale=0, seed="7", failure_rate=0.3), 20)
    assert a == outcomes(SimServer(SPEC, time_scale=0, seed=7, failure_rate=0.3), 20)


@pytest.mark.parametrize("rate", [0.05, 0.2, 0.5])
def test_failure_rate_is_as_configured(rate: float) -> None:
    n = 2000
    failures = outcomes(SimServer(SPEC, time_scale=0, seed=11, failure_rate=rate), n)
    observed = failures.count("!error") / n
    # Binomial sd at n=2000 is <= 0.0112; 4 sd either side.
    assert abs(observed - rate) < 0.045


def test_failure_rate_bounds() -> None:
    assert "!error" not in outcomes(SimServer(SPEC, time_scale=0, failure_rate=0), 200)
    with pytest.raises(ServerError, match="simulated failure of request r1") as info:
        run(SimServer(SPEC, time_scale=0, failure_rate=1), request())
    assert info.value.retryable


# --- timings ---------------------------------------------------------------------------


def test_sleeps_follow_the_latency_model() -> None:
    sleep = SleepRecorder()
    result = run(SimServer(SPEC, sleep=sleep), request(max_tokens=64, prompt_tokens=1200))
    expected = service_time(SPEC, 1200, 64, 1)
    assert sleep.calls == [pytest.approx(expected.ttft_s), pytest.approx(expected.decode_s)]
    assert result.ttft_s == pytest.approx(expected.ttft_s)


@pytest.mark.parametrize("concurrency", [2, 8, 32])
def test_concurrency_slows_per_sequence_decode(concurrency: int) -> None:
    alone, shared = SleepRecorder(), SleepRecorder()
    run(SimServer(SPEC, sleep=alone), request(), concurrency=1)
    run(SimServer(SPEC, sleep=shared), request(), concurrency=concurrency)
    assert shared.calls[0] == pytest.approx(alone.calls[0])  # prefill unchanged
    assert shared.calls[1] > alone.calls[1]
    assert shared.calls[1] == pytest.approx(service_time(SPEC, 1200, 64, concurrency).decode_s)


def test_time_scale_multiplies_sleeps() -> None:
    sleep = SleepRecorder()
    result = run(SimServer(SPEC, time_scale=0.25, sleep=sleep), request())
    expected = service_time(SPEC, 1200, 64, 1)
    assert sleep.calls == [
        pytest.approx(expected.ttft_s * 0.25),
        pytest.approx(expected.decode_s * 0.25),
    ]
    assert result.ttft_s == pytest.approx(expected.ttft_s * 0.25)


def test_time_scale_zero_never_sleeps() -> None:
    sleep = SleepRecorder()
    backend = SimServer(SPEC, time_scale=0, cold_start=True, sleep=sleep)
    asyncio.run(backend.load())
    result = run(backend, request(max_tokens=500))
    assert sleep.calls == []
    assert result.ttft_s == 0.0


def test_default_sleep_is_asyncio_sleep() -> None:
    result = run(SimServer(SPEC, time_scale=1e-6), request())
    assert result.completion_tokens == 64


def test_request_longer_than_its_time_left_times_out() -> None:
    sleep = SleepRecorder()
    needed = service_time(SPEC, 1200, 64, 1).total_s
    with pytest.raises(ServerError, match=r"timed out after 0\.100 s") as info:
        run(SimServer(SPEC, sleep=sleep), request(timeout_s=0.1))
    assert needed > 0.1
    assert info.value.retryable
    assert sleep.calls == [pytest.approx(0.1)]


def test_no_time_left_times_out_at_once() -> None:
    sleep = SleepRecorder()
    with pytest.raises(ServerError, match="timed out") as info:
        run(SimServer(SPEC, time_scale=0, sleep=sleep), request(timeout_s=0))
    assert info.value.retryable
    assert sleep.calls == []


@pytest.mark.parametrize(("cold_start", "expected"), [(True, [15 * 0.5]), (False, [])])
def test_cold_start(cold_start: bool, expected: list[float]) -> None:
    sleep = SleepRecorder()
    backend = SimServer(SPEC, time_scale=0.5, cold_start=cold_start, sleep=sleep)
    asyncio.run(backend.load())
    asyncio.run(backend.close())
    assert sleep.calls == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"failure_rate": 1.5}, "failure_rate: must be <= 1.0"),
        ({"failure_rate": -0.1}, "failure_rate: must be >= 0.0"),
        ({"time_scale": -1}, "time_scale: must be >= 0.0"),
        ({"time_scale": "fast"}, "time_scale: expected a number"),
        ({"time_scale": float("nan")}, "time_scale: must be >= 0.0"),
        ({"cold_start": "sometimes"}, "cold_start: expected true or false"),
    ],
)
def test_invalid_options_name_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimServer(SPEC, **options)


# --- registry ----------------------------------------------------------------------------


def test_make_backend_builds_sim_from_string_options() -> None:
    backend = make_server("sim", SPEC, time_scale="0", failure_rate="0.5", cold_start="true")
    assert isinstance(backend, SimServer)
    assert (backend.time_scale, backend.failure_rate, backend.cold_start) == (0.0, 0.5, True)


def test_builtin_names() -> None:
    assert {"sim", "openai"} <= set(server_names())


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"backend 'tpu' is unknown; known backends: .*sim"):
        make_server("tpu", SPEC)


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"backend 'sim': .*'warp_speed'"):
        make_server("sim", SPEC, warp_speed=9)


class EchoServer(ModelServer):
    """An in-process backend, as a plugin would add one."""

    name = "echo"

    def __init__(self, spec: ModelSpec, *, suffix: str = "") -> None:
        self.spec = spec
        self.suffix = suffix

    async def generate(self, request: ServerRequest, *, concurrency: int) -> ServerResult:
        text = (request.payload.prompt or "") + self.suffix
        return ServerResult(text, request.prompt_tokens, len(text.split()), None)


def test_registered_backend_is_built_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_REGISTERED", {})
    register_server("echo", EchoServer)
    backend = make_server("echo", SPEC, suffix="!")
    assert "echo" in server_names()
    assert run(backend, request()).output == "x!"


class FakeEntryPoint:
    name = "echo-ep"

    def load(self) -> type[EchoServer]:
        return EchoServer


def test_entry_point_backend_is_built_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def entry_points(group: str) -> list[FakeEntryPoint]:
        return [FakeEntryPoint()] if group == "inferq.backends" else []

    monkeypatch.setattr(base, "entry_points", entry_points)
    assert "echo-ep" in server_names()
    assert isinstance(make_server("echo-ep", SPEC), EchoServer)
