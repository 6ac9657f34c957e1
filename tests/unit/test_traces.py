"""Trace loaders, bundled traces and trace reshaping (pure; no Redis)."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import replace
from datetime import datetime
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferq import defaults, traces
from inferq.errors import InferqError
from inferq.traces import TraceError, TraceRequest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "traces"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def arrivals(trace: list[TraceRequest]) -> list[float]:
    return [r.arrival_s for r in trace]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def expect_error(path: Path, line: int | None, field: str) -> None:
    with pytest.raises(TraceError) as info:
        traces.load_trace(path)
    assert info.value.line == line
    assert info.value.reason.startswith(field)
    message = str(info.value)
    assert path.name in message and field in message
    if line is not None:
        assert f"line {line}" in message


# --- Azure --------------------------------------------------------------------------


def test_azure_crlf_without_final_newline() -> None:
    raw = (FIXTURES / "azure_small.csv").read_bytes()
    assert b"\r\n" in raw and not raw.endswith(b"\n")
    trace = traces.load_azure_csv(FIXTURES / "azure_small.csv")
    assert arrivals(trace) == pytest.approx([0.0, 0.5000001, 2.75, 3.25], abs=1e-9)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [
        (4808, 10),
        (3180, 8),
        (110, 1),
        (0, 27),
    ]
    assert {r.source for r in trace} == {"azure_small"}


def test_azure_lf_with_final_newline_loads_the_same(tmp_path: Path) -> None:
    text = (FIXTURES / "azure_small.csv").read_text().replace("\r\n", "\n") + "\n"
    lf = traces.load_azure_csv(write(tmp_path, "azure_small.csv", text))
    assert lf == traces.load_azure_csv(FIXTURES / "azure_small.csv")


def test_azure_rows_out_of_order_come_back_sorted(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "a.csv",
        AZURE_HEADER + "2023-11-16 18:00:05.0000000,5,5\r\n2023-11-16 18:00:01.0000000,1,1",
    )
    trace = traces.load_azure_csv(path)
    assert arrivals(trace) == [0.0, 4.0]
    assert [r.prompt_tokens for r in trace] == [1, 5]


def test_azure_bad_token_fixture_names_file_line_and_field() -> None:
    expect_error(FIXTURES / "azure_bad_tokens.csv", 3, "GeneratedTokens")


@pytest.mark.parametrize(
    ("body", "line", "field"),
    [
        ("2023-11-16 18:17:03.97,1,1\r\n2023-11-16 25:17:03.97,1,1", 3, "TIMESTAMP"),
        ("2023-11-16 18:17:03.97,1,1\r\nyesterday,1,1", 3, "TIMESTAMP"),
        ("2023-11-16 18:17:03.97,-3,1", 2, "ContextTokens"),
        ("2023-11-16 18:17:03.97,3,0", 2, "GeneratedTokens"),
        ("2023-11-16 18:17:03.97,3", 2, "row"),
    ],
)
def test_azure_malformed_rows(tmp_path: Path, body: str, line: int, field: str) -> None:
    expect_error(write(tmp_path, "bad.csv", AZURE_HEADER + body), line, field)


def test_azure_wrong_header_is_line_1(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.csv", "TIMESTAMP,Context,Generated\r\n2023-11-16 18:17:03,1,1")
    with pytest.raises(TraceError) as info:
        traces.load_azure_csv(path)
    assert info.value.line == 1 and "header" in str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2100, 1, 1)),
    st.integers(0, 9),
)
def test_fixed_format_timestamps_agree_with_fromisoformat(moment: datetime, digit: int) -> None:
    six = moment.strftime("%Y-%m-%d %H:%M:%S.%f")
    fast = traces._wallclock_ns(six + str(digit), {})
    # the fromisoformat path (taken for a zone suffix) knows microseconds only
    assert fast == traces._iso_ns(six + "+00:00") + digit * 100


def test_timestamps_with_a_zone_are_converted_to_utc(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "z.csv",
        AZURE_HEADER + "2024-05-10 02:00:00.5+02:00,1,1\r\n2024-05-10 00:00:01.0000000,1,1",
    )
    assert arrivals(traces.load_azure_csv(path)) == [0.0, 0.5]


# --- Mooncake -----------------------------------------------------------------------


def test_mooncake_keeps_quantised_times_and_hash_ids() -> None:
    trace = traces.load_mooncake_jsonl(FIXTURES / "mooncake_small.jsonl")
    assert arrivals(trace) == [0.0, 0.0, 0.0, 3.0, 3.0, 9.0]
    assert [r.hash_ids for r in trace] == [(0, 1, 2), (0, 3), (), (0, 4), (0, 5), (6, 7)]
    assert trace[0].prompt_tokens == 6755 and trace[0].output_tokens == 500


def test_mooncake_spread_ticks_infers_the_tick() -> None:
    trace = traces.load_mooncake_jsonl(FIXTURES / "mooncake_small.jsonl", spread_ticks=True)
    assert arrivals(trace) == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.5, 9.0])
    # file order is kept within a tick
    assert [r.prompt_tokens for r in trace[:3]] == [6755, 7319, 100]


def test_mooncake_spread_ticks_with_a_given_tick() -> None:
    path = FIXTURES / "mooncake_small.jsonl"
    trace = traces.load_trace(path, spread_ticks=True, tick_s=1.5)
    assert arrivals(trace) == pytest.approx([0.0, 0.5, 1.0, 3.0, 3.75, 9.0])


def test_mooncake_spread_needs_a_tick_when_all_times_are_equal(tmp_path: Path) -> None:
    row = '{"timestamp": 7, "input_length": 1, "output_length": 1}\n'
    with pytest.raises(TraceError, match="tick_s"):
        traces.load_mooncake_jsonl(write(tmp_path, "m.jsonl", row * 2), spread_ticks=True)
    single = traces.load_mooncake_jsonl(write(tmp_path, "one.jsonl", row), spread_ticks=True)
    assert arrivals(single) == [0.0]
    with pytest.raises(ValueError, match="tick_s"):
        traces.load_mooncake_jsonl(write(tmp_path, "m.jsonl", row * 2), True, tick_s=0.0)


@pytest.mark.parametrize(
    ("second_line", "field"),
    [
        ('{"timestamp": 5, "input_length": 1', "line"),
        ("[1, 2, 3]", "line"),
        ('{"timestamp": 5, "input_length": 1}', "output_length"),
        ('{"timestamp": 5, "input_length": "12", "output_length": 1}', "input_length"),
        ('{"timestamp": 5, "input_length": true, "output_length": 1}', "input_length"),
        ('{"timestamp": -5, "input_length": 1, "output_length": 1}', "timestamp"),
        ('{"timestamp": 5, "input_length": 1, "output_length": 0}', "output_length"),
        (
            '{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1, "a"]}',
            "hash_ids",
        ),
    ],
)
def test_mooncake_malformed_lines(tmp_path: Path, second_line: str, field: str) -> None:
    first = '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
    path = write(tmp_path, "bad.jsonl", first + second_line + "\n")
    with pytest.raises(TraceError) as info:
        traces.load_mooncake_jsonl(path)
    assert info.value.line == 2 and info.value.reason.startswith(field)
    assert "bad.jsonl, line 2" in str(info.value)


# --- BurstGPT -----------------------------------------------------------------------


def test_burstgpt_skips_failed_rows_and_keeps_model_and_log_type() -> None:
    trace = traces.load_burstgpt_csv(FIXTURES / "burstgpt_small.csv")
    assert arrivals(trace) == [0.0, 85.0, 113.0]
    assert [(r.model, r.prompt_tokens, r.output_tokens, r.task_type) for r in trace] == [
        ("ChatGPT", 472, 18, "conversation"),
        ("ChatGPT", 234, 30, "conversation"),
        ("GPT-4", 417, 276, "api"),
    ]
    assert all(r.output_tokens > 0 for r in trace)


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        ("Timestamp,Model,Request tokens\n5,ChatGPT,12\n", 1, "Response tokens"),
        (BURST_HEADER + "5,ChatGPT,1,1,2,API log\nsoon,ChatGPT,1,1,2,API log\n", 3, "Timestamp"),
        (BURST_HEADER + "5,ChatGPT,-1,1,0,API log\n", 2, "Request tokens"),
        (BURST_HEADER + "5,ChatGPT,1,1,2\n", 2, "row"),
    ],
)
def test_burstgpt_malformed(tmp_path: Path, text: str, line: int, field: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as info:
        traces.load_burstgpt_csv(path)
    assert info.value.line == line and info.value.reason.startswith(field)


# --- our JSONL ----------------------------------------------------------------------


def test_own_jsonl_sorted_stably_with_optional_fields() -> None:
    trace = traces.load_jsonl(FIXTURES / "inferq_small.jsonl")
    assert arrivals(trace) == [0.0, 0.5, 0.5]
    assert [(r.prompt_tokens, r.model, r.priority, r.tenant) for r in trace] == [
        (2000, "llama-3.1-8b", None, None),
        (100, None, "realtime", "acme"),
        (7, None, "batch", None),
    ]


def test_own_jsonl_keeps_times_as_written(tmp_path: Path) -> None:
    path = write(
        tmp_path, "t.jsonl", '{"arrival_s": 2.5, "prompt_tokens": 1, "output_tokens": 1}\n'
    )
    assert arrivals(traces.load_jsonl(path)) == [2.5]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"arrival_s": 1, "prompt_tokens": 1, "output_tokens": 1, "priorty": "x"}', "priorty"),
        ('{"arrival_s": 1, "prompt_tokens": 1}', "output_tokens"),
        ('{"arrival_s": 1, "prompt_tokens": 1, "output_tokens": 1, "tenant": 5}', "tenant"),
        ('{"arrival_s": NaN, "prompt_tokens": 1, "output_tokens": 1}', "arrival_s"),
    ],
)
def test_own_jsonl_malformed(tmp_path: Path, line: str, field: str) -> None:
    expect_error(write(tmp_path, "bad.jsonl", line + "\n"), 1, field)


def test_dump_jsonl_round_trips(tmp_path: Path) -> None:
    original = traces.load_jsonl(FIXTURES / "inferq_small.jsonl") + traces.load_mooncake_jsonl(
        FIXTURES / "mooncake_small.jsonl"
    )
    original.sort(key=lambda r: r.arrival_s)
    traces.dump_jsonl(original, tmp_path / "out.jsonl")
    again = traces.load_trace(tmp_path / "out.jsonl")
    assert [r.source for r in again] == ["out"] * len(original)
    assert again == [replace(r, source="out") for r in original]


# --- load_trace dispatch ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("azure_small.csv", "azure"),
        ("mooncake_small.jsonl", "mooncake"),
        ("burstgpt_small.csv", "burstgpt"),
        ("inferq_small.jsonl", "jsonl"),
    ],
)
def test_load_trace_detects_the_format(name: str, fmt: str) -> None:
    assert traces.detect_format(FIXTURES / name) == fmt
    assert traces.load_trace(FIXTURES / name) == traces.load_trace(FIXTURES / name, fmt)  # type: ignore[arg-type]


def test_load_trace_refuses_unknown_files_and_misplaced_options(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="format"):
        traces.load_trace(write(tmp_path, "x.csv", "a,b,c\n1,2,3\n"))
    with pytest.raises(TraceError, match="format"):
        traces.load_trace(write(tmp_path, "x.jsonl", '{"when": 1}\n'))
    with pytest.raises(ValueError, match="spread_ticks"):
        traces.load_trace(FIXTURES / "azure_small.csv", spread_ticks=True)
    with pytest.raises(ValueError, match="fmt"):
        traces.load_trace("conv", "jsonl")


# --- bundled traces -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rows", "span_s"),
    [("code", 8_819, 3_435.9), ("conv", 19_366, 3_501.7), ("mooncake", 3_993, 1_022.0)],
)
def test_bundled_traces_load_whole(name: str, rows: int, span_s: float) -> None:
    trace = traces.load_trace(name)
    assert len(trace) == rows
    assert trace[0].arrival_s == 0.0
    assert round(trace[-1].arrival_s, 1) == span_s
    assert arrivals(trace) == sorted(arrivals(trace))
    assert all(r.prompt_tokens > 0 and r.output_tokens > 0 for r in trace)
    assert traces.summarize(trace)["count"] == rows


@pytest.mark.parametrize(
    ("file", "blob"),
    [
        ("azure-llm-2023-code.csv", "62bd8109d0f2b1bc48206d397ecca48d8de03aab"),
        ("azure-llm-2023-conv.csv", "5b9219f2caf93bbbf95ec29894e206115658e235"),
        ("mooncake-fast25-synthetic.jsonl", "e4838049c0dcfc358a5f24ab08251279475cba94"),
    ],
)
def test_bundled_copies_are_byte_identical_to_upstream(file: str, blob: str) -> None:
    data = (resources.files("inferq.data") / "traces" / file).read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob
    assert file in traces.BUNDLED.values()


def test_bundled_mooncake_keeps_its_block_ids() -> None:
    trace = traces.load_trace("mooncake")
    assert all(r.hash_ids for r in trace)
    blocks = traces.MOONCAKE_BLOCK_TOKENS
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // blocks) for r in trace[:50])
    with pytest.raises(ValueError, match="'mooncake'"):
        traces.load_trace("mooncake", "azure")


# --- reshaping ----------------------------------------------------------------------


def make_trace(times: list[float]) -> list[TraceRequest]:
    return [TraceRequest(t, 10 + i, 1 + i) for i, t in enumerate(times)]


def test_scale_rate_divides_arrival_times() -> None:
    trace = make_trace([0.0, 1.0, 4.0, 10.0])
    faster = traces.scale_rate(trace, 2.0)
    assert arrivals(faster) == [0.0, 0.5, 2.0, 5.0]
    assert [r.prompt_tokens for r in faster] == [r.prompt_tokens for r in trace]
    assert traces.summarize(faster)["rate_per_s"] == 2 * traces.summarize(trace)["rate_per_s"]
    assert arrivals(traces.scale_rate(trace, 0.5)) == [0.0, 2.0, 8.0, 20.0]
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="factor"):
            traces.scale_rate(trace, bad)


def test_window_keeps_half_open_range_relative_to_its_start() -> None:
    trace = make_trace([0.0, 1.0, 2.0, 3.0, 4.0])
    cut = traces.window(trace, 1.5, 2.0)
    assert arrivals(cut) == [0.5, 1.5]
    assert [r.prompt_tokens for r in cut] == [12, 13]
    assert arrivals(traces.window(trace, 1.0, 2.0)) == [0.0, 1.0]
    with pytest.raises(ValueError, match="duration_s"):
        traces.window(trace, 0.0, 0.0)


def test_window_of_the_conversation_trace() -> None:
    conv = traces.load_trace("conv")
    cut = traces.window(conv, 600.0, 60.0)
    assert len(cut) == sum(600.0 <= r.arrival_s < 660.0 for r in conv) > 0
    assert all(0.0 <= r.arrival_s < 60.0 for r in cut)


def test_tenants_are_skewed_and_deterministic() -> None:
    drawn = traces.assign_tenants(20_000)
    assert drawn == traces.assign_tenants(20_000, seed=0)
    assert drawn != traces.assign_tenants(20_000, seed=1)
    counts = Counter(drawn)
    assert set(counts) <= {f"tenant-{k:02d}" for k in range(1, 21)}
    assert len(counts) == 20
    assert counts.most_common(1)[0][0] == "tenant-01"
    assert counts["tenant-01"] / 20_000 == pytest.approx(0.313, abs=0.015)  # documented share
    assert counts["tenant-01"] > counts["tenant-02"] > counts["tenant-05"] > counts["tenant-20"]


def test_tenants_without_skew_and_bad_arguments() -> None:
    counts = Counter(traces.assign_tenants(20_000, tenants=4, zipf_s=0.0, seed=3))
    assert all(c / 20_000 == pytest.approx(0.25, abs=0.02) for c in counts.values())
    assert traces.assign_tenants(0) == []
    with pytest.raises(ValueError):
        traces.assign_tenants(5, tenants=0)


trace_lists = st.lists(
    st.floats(min_value=0, max_value=1e4, allow_nan=False, allow_subnormal=False), max_size=30
).map(make_trace)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["realtime", "standard", "batch"]), trace_lists))
def test_mix_is_a_sorted_permutation_of_its_inputs(classes: dict[str, list[TraceRequest]]) -> None:
    merged = traces.mix(classes)
    assert arrivals([r for _, r in merged]) == sorted(
        r.arrival_s for t in classes.values() for r in t
    )
    assert Counter(merged) == Counter((name, r) for name, t in classes.items() for r in t)


def test_mix_breaks_ties_by_mapping_order() -> None:
    merged = traces.mix({"b": make_trace([1.0]), "a": make_trace([1.0, 0.5])})
    assert [name for name, _ in merged] == ["a", "b", "a"]


def test_synthetic_batch_draws_real_token_pairs_in_a_short_window() -> None:
    pool = traces.load_trace("code")
    pairs = {(r.prompt_tokens, r.output_tokens) for r in pool}
    batch = traces.synthetic_batch(pool, 500, at_s=120.0, seed=7)
    assert len(batch) == 500
    assert all(120.0 <= r.arrival_s < 120.0 + defaults.SYNTHETIC_BATCH_WINDOW_S for r in batch)
    assert arrivals(batch) == sorted(arrivals(batch))
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in batch)
    assert {r.source for r in batch} == {"synthetic"}
    assert batch == traces.synthetic_batch(pool, 500, at_s=120.0, seed=7)
    assert batch != traces.synthetic_batch(pool, 500, at_s=120.0, seed=8)
    assert traces.synthetic_batch([], 0, at_s=0.0, seed=0) == []
    with pytest.raises(ValueError, match="trace_pool"):
        traces.synthetic_batch([], 1, at_s=0.0, seed=0)


def test_summarize_small_and_empty() -> None:
    trace = [TraceRequest(float(t), p, o) for t, p, o in [(0, 10, 1), (2, 30, 3), (4, 20, 100)]]
    assert traces.summarize(trace) == {
        "count": 3,
        "span_s": 4.0,
        "rate_per_s": 0.75,
        "prompt_mean": 20.0,
        "prompt_p50": 20.0,
        "prompt_p99": 30.0,
        "output_mean": 104 / 3,
        "output_p50": 3.0,
        "output_p99": 100.0,
    }
    empty = traces.summarize([])
    assert empty["count"] == 0 and all(v == 0 for v in empty.values())


def test_trace_error_is_an_inferq_error() -> None:
    error = TraceError("x.csv", 4, "ContextTokens: must be >= 0, got -1")
    assert isinstance(error, InferqError) and isinstance(error, ValueError)
    assert str(error) == "trace x.csv, line 4: ContextTokens: must be >= 0, got -1"
