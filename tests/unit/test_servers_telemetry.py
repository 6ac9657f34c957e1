"""Model servers' own telemetry: the parsers on real-format samples, the openai backend's
detection and reads against a stand-in, and the worker's poller that never fails.

The llama.cpp samples are what xllamacpp 2026.10.11549 answered (``/slots`` while one
slot generates); the vLLM sample follows its documented exposition (``vllm:`` families
with ``engine`` and ``model_name`` labels, the ``cache_config_info`` info gauge); the
TGI one its metrics reference (``tgi_*`` gauges) and ``GET /info``. The real llama.cpp
server is checked in tests/redis/test_real_server.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq import defaults
from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.models import ServerTelemetry, WorkerInfo
from inferq.workers import telemetry as module
from inferq.workers.servers import ModelServer, ServerRequest, ServerResult
from inferq.workers.servers import telemetry as parse
from inferq.workers.servers.openai import OpenAIServer
from inferq.workers.telemetry import TelemetryPoller
from tests.fakes.standin_openai import StandIn

from ..builders import worker_info

SPEC = Settings().model_by_name["llama-3.1-8b"]

LLAMA_SLOTS: list[dict[str, Any]] = [
    {"id": 0, "n_ctx": 2048, "speculative": False, "is_processing": False},
    {
        "id": 1,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": True,
        "id_task": 1,
        "n_prompt_tokens": 209,  # 11 prompt tokens + 198 generated so far
        "n_prompt_tokens_processed": 11,
        "n_prompt_tokens_cache": 0,
        "params": {"max_tokens": 200, "n_predict": 200, "ignore_eos": True},
        "next_token": [{"has_next_token": True, "n_remain": 2, "n_decoded": 198}],
    },
    {  # idle, with the cache of its last request kept for reuse: not counted as used
        "id": 2,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": False,
        "id_task": 0,
        "n_prompt_tokens": 210,
        "next_token": [{"has_next_token": False, "n_remain": -1, "n_decoded": 0}],
    },
]

LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 11
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 210
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 134.776
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 19275.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:iteration_tokens_total_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="5691",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
"""  # noqa: E501

TGI_METRICS = """\
# TYPE tgi_request_count counter
tgi_request_count 253
# TYPE tgi_queue_size gauge
tgi_queue_size 5
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 6144
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.5"} 10
tgi_request_duration_bucket{le="+Inf"} 253
tgi_request_duration_sum 310.5
tgi_request_duration_count 253
"""
TGI_INFO = {
    "model_id": "meta-llama/Llama-3.1-8B-Instruct",
    "max_concurrent_requests": 128,
    "max_input_tokens": 4095,
    "max_total_tokens": 4096,
    "max_batch_total_tokens": 16000,
    "version": "3.3.4",
}


def test_llama_cpp_slots_give_slots_kv_tokens_and_running() -> None:
    t = parse.llama_cpp(LLAMA_SLOTS, LLAMA_METRICS)
    assert t == ServerTelemetry(slots=3, kv_tokens=6144, kv_used_tokens=209, running=1, waiting=3)
    assert t.kv_free_tokens == 6144 - 209
    assert t.kv_free_fraction == pytest.approx(1 - 209 / 6144)


def test_llama_cpp_without_metrics_or_busy_slots() -> None:
    idle = [dict(s, is_processing=False) for s in LLAMA_SLOTS]
    t = parse.llama_cpp(idle, None)
    assert (t.slots, t.kv_used_tokens, t.running, t.waiting) == (3, 0, 0, None)
    assert t.kv_free_fraction == 1.0


@pytest.mark.parametrize(
    "slots",
    [
        {"error": "slots endpoint is disabled"},
        [{"id": 0}],
        [{"id": 0, "n_ctx": "x"}],
        ["slot"],
        [{"id": 0, "n_ctx": -4096}],
        # a 400-digit integer (valid JSON, read exactly): it overflowed the heartbeat's KV
        # room (float) and killed the worker
        json.loads('[{"id": 0, "n_ctx": 1' + "0" * 400 + "}]"),
        json.loads('[{"id": 0, "n_ctx": 1e400}]'),  # infinity
        json.loads('[{"id": 0, "n_ctx": NaN}]'),
    ],
)
def test_llama_cpp_slots_that_do_not_parse_are_refused(slots: Any) -> None:
    with pytest.raises(ValueError, match="slots"):
        parse.llama_cpp(slots, None)


def test_vllm_metrics_give_kv_usage_tokens_running_and_waiting() -> None:
    t = parse.vllm(VLLM_METRICS)
    assert t == ServerTelemetry(kv_tokens=5691 * 16, kv_usage=0.25, running=7, waiting=2)
    assert t.kv_free_tokens == round(5691 * 16 * 0.75)


def test_vllm_older_and_newer_names_and_data_parallel_engines() -> None:
    old = VLLM_METRICS.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse.vllm(old).kv_usage == 0.25  # the name before v0.10
    two = VLLM_METRICS + (
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
    )
    t = parse.vllm(two)
    assert (t.running, t.kv_usage) == (10, 0.5)  # summed, averaged
    sized = VLLM_METRICS.replace('block_size="16"', 'block_size="16",kv_cache_size_tokens="90000"')
    assert parse.vllm(sized).kv_tokens == 90_000  # the label newer vLLM sets wins
    unsized = VLLM_METRICS.replace('num_gpu_blocks="5691"', 'num_gpu_blocks="None"')
    assert parse.vllm(unsized).kv_tokens is None
    assert parse.vllm(unsized).kv_free_fraction == 0.75  # the share still counts


def test_tgi_metrics_and_info_give_kv_tokens_running_and_waiting() -> None:
    t = parse.tgi(TGI_METRICS, TGI_INFO)
    assert t == ServerTelemetry(kv_tokens=16_000, kv_used_tokens=6144, running=8, waiting=5)
    assert t.kv_free_tokens == 16_000 - 6144
    bare = parse.tgi(TGI_METRICS, None)  # /info not read: no KV figure
    assert (bare.kv_tokens, bare.kv_used_tokens, bare.running) == (None, None, 8)


def test_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(ValueError):
        parse.vllm("<html>not metrics</html>")


def test_telemetry_round_trips_through_the_heartbeat_hash() -> None:
    info = worker_info("w1").model_copy(
        update={
            "last_heartbeat": 1_700_000_000.25,  # whole milliseconds, as the hash keeps them
            "started_at": 1_700_000_000.0,
            "server": parse.vllm(VLLM_METRICS),
            "kv_measured_free_mib": 1234.5,
            "vram_measured_free_mib": 40_960,
            "vram_measured_used_mib": 102_811,
            "gpu_index": (0, 1),
            "gpu_uuids": ("GPU-a", "GPU-b"),
        }
    )
    fields = info.to_fields()
    assert fields["server_kv_usage"] == "0.25"
    assert fields["server_slots"] == ""  # not reported
    assert fields["gpu_index"] == "0,1"
    assert WorkerInfo.from_fields(fields) == info
    bare = worker_info("w2").model_copy(update={"last_heartbeat": 1.5, "started_at": 1.0})
    assert WorkerInfo.from_fields(bare.to_fields()) == bare
    assert bare.server == ServerTelemetry() and bare.kv_measured_free_mib is None


# --- the openai backend: detection and reads -------------------------------------------


@pytest.fixture
def standin() -> Iterator[StandIn]:
    with StandIn() as server:
        yield server


def read(server: OpenAIServer) -> ServerTelemetry | None:
    async def go() -> ServerTelemetry | None:
        try:
            return await server.telemetry()
        finally:
            await server.close()

    return asyncio.run(go())


def test_the_openai_backend_finds_llama_cpp_by_its_props(standin: StandIn) -> None:
    standin.pages = {
        "/props": ("application/json", json.dumps({"total_slots": 3, "model_alias": "m"})),
        "/slots": ("application/json", json.dumps(LLAMA_SLOTS)),
        "/metrics": ("text/plain; version=0.0.4", LLAMA_METRICS),
    }
    server = OpenAIServer(SPEC, base_url=standin.url)
    assert read(server) == parse.llama_cpp(LLAMA_SLOTS, LLAMA_METRICS)
    assert server.telemetry_kind == "llamacpp"


@pytest.mark.parametrize(
    ("pages", "kind", "expected"),
    [
        ({"/metrics": VLLM_METRICS}, "vllm", parse.vllm(VLLM_METRICS)),
        ({"/metrics": TGI_METRICS, "/info": TGI_INFO}, "tgi", parse.tgi(TGI_METRICS, TGI_INFO)),
        ({"/metrics": "# TYPE other_metric gauge\nother_metric 1\n"}, "off", None),
        ({}, "off", None),
    ],
)
def test_the_openai_backend_finds_vllm_and_tgi_by_their_metric_names(
    standin: StandIn, pages: dict[str, Any], kind: str, expected: ServerTelemetry | None
) -> None:
    standin.pages = {
        path: ("application/json", json.dumps(body))
        if isinstance(body, dict)
        else ("text/plain", body)
        for path, body in pages.items()
    }
    server = OpenAIServer(SPEC, base_url=standin.url)
    assert read(server) == expected
    assert server.telemetry_kind == kind


def test_the_telemetry_option_is_checked(standin: StandIn) -> None:
    with pytest.raises(ConfigError, match="option telemetry: expected one of auto"):
        OpenAIServer(SPEC, telemetry="prometheus")
    standin.pages = {"/metrics": ("text/plain", VLLM_METRICS)}
    assert read(OpenAIServer(SPEC, base_url=standin.url, telemetry="off")) is None
    assert read(OpenAIServer(SPEC, base_url=standin.url, telemetry="vllm")) == parse.vllm(
        VLLM_METRICS
    )


# --- the worker's poller ---------------------------------------------------------------


class Scripted(ModelServer):
    """A model server whose telemetry answers come from a list (an exception is raised)."""

    name = "scripted"

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    async def generate(self, request: ServerRequest, *, concurrency: int) -> ServerResult:
        raise NotImplementedError

    async def telemetry(self) -> ServerTelemetry | None:
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        if answer == "hang":
            await asyncio.sleep(60)
        return answer  # type: ignore[no-any-return]


def test_the_poller_survives_failures_and_says_so_once_per_transition(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(defaults, "TELEMETRY_TIMEOUT_S", 0.05)  # the hang ends in 0.15 s
    good = ServerTelemetry(slots=2, kv_tokens=100, kv_used_tokens=10)
    errors = [ConnectionError("refused"), ValueError("not metrics"), "hang"]
    poller = TelemetryPoller(Scripted([*errors, good]), worker_id="w1", slots=2)

    async def go() -> list[Any]:
        return [await poller.read_once() for _ in range(4)]

    with caplog.at_level(logging.WARNING, logger="inferq.workers.telemetry"):
        results = asyncio.run(go())
    assert results == [None, None, None, good]
    assert poller.latest == good
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "unreadable" in m]) == 1
    assert len([m for m in lines if m.endswith("telemetry reads again")]) == 1


def test_the_poller_warns_when_the_server_has_fewer_slots_and_drops_stale_reads(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = ServerTelemetry(slots=4)
    poller = TelemetryPoller(Scripted([small, small]), worker_id="w1", slots=6, interval_s=0.5)
    with caplog.at_level(logging.WARNING, logger="inferq.workers.telemetry"):
        asyncio.run(poller.read_once())
        asyncio.run(poller.read_once())
    warned = [r.getMessage() for r in caplog.records if "--slots 6" in r.getMessage()]
    assert warned == [
        "worker w1: --slots 6 but the model server runs 4 slots: requests beyond 4 wait "
        "inside the server, and that wait shows as TTFT"
    ]
    assert poller.latest == small
    later = module.time.monotonic() + 0.5 * 3 + 0.1  # older than 3 intervals
    monkeypatch.setattr(module.time, "monotonic", lambda: later)
    assert poller.latest == ServerTelemetry()


@given(
    total=st.integers(1, 10**7),
    data=st.data(),
    usage=st.one_of(st.none(), st.floats(0, 1)),
)
def test_free_kv_tokens_and_share_agree(
    total: int, data: st.DataObject, usage: float | None
) -> None:
    used = data.draw(st.one_of(st.none(), st.integers(0, total)))
    t = ServerTelemetry(kv_tokens=total, kv_used_tokens=used, kv_usage=usage)
    if used is None and usage is None:
        assert t.kv_free_tokens is None and t.kv_free_fraction is None
        return
    free, share = t.kv_free_tokens, t.kv_free_fraction
    assert free is not None and share is not None
    assert 0 <= free <= total and 0.0 <= share <= 1.0
    assert abs(free - share * total) <= 0.5 + 1e-6 * total  # tokens win when both are known
    if used is not None:
        assert free == total - used


def test_a_kv_cache_of_zero_tokens_is_no_figure() -> None:
    """A server whose slots all say ``n_ctx: 0`` measured no room: routing on 0 starved
    the worker; it routes on its bookkeeping instead."""
    t = parse.llama_cpp([{"id": i, "n_ctx": 0, "is_processing": False} for i in range(4)], None)
    assert t.kv_free_tokens is None
    assert t.kv_free_fraction is None
    assert ServerTelemetry(kv_tokens=0, kv_usage=0.5).kv_free_tokens is None


def test_a_telemetry_page_larger_than_its_bound_is_not_read_whole(standin: StandIn) -> None:
    """A ``/metrics`` of 24 MiB (a server with a label explosion, a hostile one): it was
    read whole and parsed, memory the worker's heartbeat must not spend (issue 13
    attack). Reading stops at ``TELEMETRY_MAX_BYTES`` and the read fails (the poller logs
    it and routes on the bookkeeping)."""
    line = "vllm:num_requests_running 1\n"
    standin.pages = {"/metrics": ("text/plain", line * (24 * 1024 * 1024 // len(line)))}
    with pytest.raises(ValueError, match="larger than"):
        read(OpenAIServer(SPEC, base_url=standin.url, telemetry="vllm"))
