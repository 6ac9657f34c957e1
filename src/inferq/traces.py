"""Request traces: load real LLM traces, reshape them, and draw workloads from them.

Pure parsing and list manipulation; no redis, no clock. The simulator, the demo
and the benchmarks read their load from here.

A trace is a ``list[TraceRequest]`` sorted by ``arrival_s``. Loaders of external
formats rebase time so the first request arrives at 0.0 s; our own JSONL keeps
its times as written. Every loaded request has ``prompt_tokens >= 0`` and
``output_tokens >= 1``; a row that breaks this, or does not parse, raises
:class:`TraceError` naming the file, the line and the field.

Formats (each detected from its first line by :func:`load_trace`):

=========  =====================================================================
azure      Azure LLM inference trace 2023 CSV: ``TIMESTAMP,ContextTokens,
           GeneratedTokens``; wall-clock times with 7 fractional digits, CRLF,
           no newline after the last row. Two files are bundled: ``"code"`` and
           ``"conv"`` (see ``inferq/data/traces/ATTRIBUTION.md``, CC-BY-4.0).
mooncake   Mooncake JSONL: ``timestamp`` (ms since the first request),
           ``input_length``, ``output_length``, optional ``hash_ids`` (prefix
           blocks). Timestamps may be quantised to a tick of a few seconds;
           ``spread_ticks`` spreads each tick's requests evenly across it.
           Bundled: ``"mooncake"`` (FAST'25's synthetic trace, Apache-2.0).
burstgpt   BurstGPT CSV: ``Timestamp,Model,Request tokens,Response tokens,
           Total tokens,Log Type``; ``Timestamp`` in seconds. Rows with 0
           response tokens are *failed* requests (BurstGPT's README says so and
           ships ``*_without_fails`` files without them): they are skipped,
           since their output length is unknown. ``Log Type`` becomes
           ``task_type`` (``"Conversation log"`` -> ``"conversation"``,
           ``"API log"`` -> ``"api"``).
jsonl      Ours, one object a line: ``arrival_s``, ``prompt_tokens``,
           ``output_tokens`` and optionally ``model``, ``priority``, ``tenant``,
           ``task_type``, ``hash_ids``; unknown keys are errors (typos).
           :func:`dump_jsonl` writes it.
=========  =====================================================================

Tenants: :func:`assign_tenants` draws tenants from a Zipf law (tenant of rank k
has weight 1/k^s). With the defaults (20 tenants, s = 1.1) the top tenant sends
31.3% of requests, the top three 55.3%, the smallest 1.2%.
"""

from __future__ import annotations

import csv
import json
import math
import random
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from importlib import resources
from itertools import pairwise
from os import PathLike
from pathlib import Path
from typing import Any, Literal, TextIO

from inferq import defaults
from inferq.errors import InferqError

StrPath = str | PathLike[str]
TraceFormat = Literal["auto", "azure", "mooncake", "burstgpt", "jsonl"]

#: Bundled trace names -> files under ``inferq/data/traces``.
BUNDLED: dict[str, str] = {
    "code": "azure-llm-2023-code.csv",
    "conv": "azure-llm-2023-conv.csv",
    "mooncake": "mooncake-fast25-synthetic.jsonl",
}
#: Tokens per block of Mooncake's ``hash_ids`` (its release README: one id per
#: 512-token block of the prompt; the last block may be partial).
MOONCAKE_BLOCK_TOKENS = 512

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_JSONL_KEYS = frozenset(
    {
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "model",
        "priority",
        "tenant",
        "task_type",
        "hash_ids",
    }
)
_NS_PER_S = 1_000_000_000


class TraceError(InferqError, ValueError):
    """A trace file does not parse; the message names the file, the line and the field.

    Attributes:
        path: the trace file.
        line: 1-based line number (the header is line 1), or ``None`` for the whole file.
        reason: what is wrong, starting with the field name.
    """

    def __init__(self, path: StrPath, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}, line {line}"
        super().__init__(f"trace {where}: {reason}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds from the trace start (loaders of external formats put
            the first request at 0.0).
        prompt_tokens: input length, tokens.
        output_tokens: output length, tokens.
        model: the model the trace names (BurstGPT, our JSONL), else ``None``.
        hash_ids: prefix-cache block ids (Mooncake), else ``()``.
        source: where the request comes from: the file's stem, or ``"synthetic"``.
        priority: priority class, when the trace says (our JSONL).
        tenant: tenant, when the trace says (our JSONL).
        task_type: kind of request, when the trace says (BurstGPT's Log Type, our JSONL).
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    model: str | None = None
    hash_ids: tuple[int, ...] = ()
    source: str = ""
    priority: str | None = None
    tenant: str | None = None
    task_type: str | None = None


# --- loaders -------------------------------------------------------------------------


def load_trace(
    path_or_name: StrPath,
    fmt: TraceFormat = "auto",
    *,
    spread_ticks: bool = False,
    tick_s: float | None = None,
) -> list[TraceRequest]:
    """Load a trace file, or a bundled trace by name (``"conv"``, ``"code"``, ``"mooncake"``).

    Args:
        path_or_name: a file path, or a key of :data:`BUNDLED`.
        fmt: the format, or ``"auto"`` to detect it from the first line.
        spread_ticks: Mooncake only, see :func:`load_mooncake_jsonl`.
        tick_s: Mooncake only, see :func:`load_mooncake_jsonl`.

    Returns:
        The requests sorted by arrival.

    Raises:
        TraceError: the file does not parse or its format is not recognised.
        ValueError: ``spread_ticks``/``tick_s`` given for a format other than Mooncake.
        FileNotFoundError: no such file.
    """
    bundled = isinstance(path_or_name, str) and path_or_name in BUNDLED
    own = _bundled_format(str(path_or_name)) if bundled else fmt
    if bundled and fmt not in ("auto", own):
        raise ValueError(f"fmt: bundled trace {path_or_name!r} is {own!r}, not {fmt!r}")
    kind: str = own
    if kind == "auto":
        kind = detect_format(path_or_name)
    if kind != "mooncake" and (spread_ticks or tick_s is not None):
        raise ValueError(f"spread_ticks/tick_s: apply to Mooncake traces only, not {kind!r}")
    if bundled:
        return load_bundled(str(path_or_name), spread_ticks=spread_ticks, tick_s=tick_s)
    if kind == "azure":
        return load_azure_csv(path_or_name)
    if kind == "mooncake":
        return load_mooncake_jsonl(path_or_name, spread_ticks=spread_ticks, tick_s=tick_s)
    if kind == "burstgpt":
        return load_burstgpt_csv(path_or_name)
    if kind == "jsonl":
        return load_jsonl(path_or_name)
    raise ValueError(f"fmt: expected one of auto, azure, mooncake, burstgpt, jsonl; got {fmt!r}")


def load_bundled(
    name: str, *, spread_ticks: bool = False, tick_s: float | None = None
) -> list[TraceRequest]:
    """Load a bundled trace: the Azure ``"conv"`` (19,366 requests) or ``"code"`` (8,819),
    or ``"mooncake"`` (Mooncake's FAST'25 synthetic trace, 3,993 requests with block ids).

    Args:
        spread_ticks / tick_s: Mooncake only, see :func:`load_mooncake_jsonl`.

    Raises:
        KeyError: ``name`` is not a key of :data:`BUNDLED`.
    """
    if name not in BUNDLED:
        raise KeyError(f"no bundled trace {name!r}; choose one of {sorted(BUNDLED)}")
    resource = resources.files("inferq.data") / "traces" / BUNDLED[name]
    with resources.as_file(resource) as path:
        if _bundled_format(name) == "mooncake":
            return load_mooncake_jsonl(path, spread_ticks=spread_ticks, tick_s=tick_s)
        return load_azure_csv(path)


def _bundled_format(name: str) -> str:
    """The format of bundled trace ``name``: from its file's suffix."""
    return "mooncake" if BUNDLED[name].endswith(".jsonl") else "azure"


def detect_format(path: StrPath) -> str:
    """The format of a trace file, from its first non-blank line.

    Returns:
        ``"azure"``, ``"mooncake"``, ``"burstgpt"`` or ``"jsonl"``.

    Raises:
        TraceError: the first line matches no known format.
    """
    with _open(path) as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            raise TraceError(path, None, "format: first line is not a JSON object") from None
        if "arrival_s" in keys:
            return "jsonl"
        if "timestamp" in keys:
            return "mooncake"
        raise TraceError(path, None, f"format: JSON keys {sorted(keys)} match no known trace")
    header = [h.strip() for h in first.split(",")]
    if tuple(header) == _AZURE_HEADER:
        return "azure"
    if "Timestamp" in header and "Response tokens" in header:
        return "burstgpt"
    raise TraceError(path, 1, f"format: header {first!r} matches no known trace")


def load_azure_csv(path: StrPath) -> list[TraceRequest]:
    """Load an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps (``2023-11-16 18:17:03.9799600``, no zone) are parsed exactly
    to the nanosecond with a fixed-format fast path (other ISO 8601 forms go
    through ``datetime.fromisoformat``; aware times are converted to UTC).
    CRLF or LF endings, with or without a final newline.

    Returns:
        Requests sorted by arrival, the first at 0.0 s; ``source`` is the file stem.

    Raises:
        TraceError: wrong header, wrong field count, a bad timestamp or token count.
    """
    stamps: list[int] = []
    tokens: list[tuple[int, int]] = []
    days: dict[str, int] = {}
    with _open(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != _AZURE_HEADER:
            raise TraceError(path, 1, f"header: expected {','.join(_AZURE_HEADER)}, got {header}")
        for row in reader:
            if not row:
                continue
            line = reader.line_num
            if len(row) != 3:
                raise TraceError(path, line, f"row: expected 3 fields, got {len(row)}")
            try:
                stamps.append(_wallclock_ns(row[0], days))
            except ValueError:
                raise TraceError(path, line, f"TIMESTAMP: not a date-time: {row[0]!r}") from None
            prompt = _int_text(path, line, "ContextTokens", row[1], 0)
            tokens.append((prompt, _int_text(path, line, "GeneratedTokens", row[2], 1)))
    source = Path(path).stem
    t0 = min(stamps, default=0)
    trace = [
        TraceRequest((ns - t0) / _NS_PER_S, p, o, source=source)
        for ns, (p, o) in zip(stamps, tokens, strict=True)
    ]
    return _sorted(trace)


def load_mooncake_jsonl(
    path: StrPath, spread_ticks: bool = False, tick_s: float | None = None
) -> list[TraceRequest]:
    """Load a Mooncake trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``).

    Mooncake's timestamps may be quantised (many requests on one tick, e.g.
    every 3,052 ms). With ``spread_ticks`` the k requests sharing a timestamp t
    arrive at t + i * tick / k for i = 0..k-1, in file order, so a replay does
    not see an artificial burst each tick.

    Args:
        path: the JSONL file; blank lines are skipped, unknown keys ignored.
        spread_ticks: spread requests sharing a timestamp across the tick.
        tick_s: the tick, seconds; inferred when ``None`` as the smallest
            positive gap between distinct timestamps.

    Returns:
        Requests sorted by arrival, the first at 0.0 s, with ``hash_ids`` kept.

    Raises:
        TraceError: a line does not parse, or the tick cannot be inferred
            (all timestamps equal).
        ValueError: ``tick_s`` is not a positive finite number.
    """
    if tick_s is not None and not (math.isfinite(tick_s) and tick_s > 0):
        raise ValueError(f"tick_s: must be a positive number of seconds, got {tick_s}")
    stamps_ms: list[float] = []
    rows: list[tuple[int, int, tuple[int, ...]]] = []
    for line, obj in _json_objects(path):
        stamps_ms.append(_json_number(path, line, obj, "timestamp"))
        prompt = _json_int(path, line, obj, "input_length", 0)
        output = _json_int(path, line, obj, "output_length", 1)
        rows.append((prompt, output, _json_hash_ids(path, line, obj)))
    times = [ms / 1000.0 for ms in stamps_ms]
    if spread_ticks:
        times = _spread(path, times, tick_s)
    t0 = min(times, default=0.0)
    source = Path(path).stem
    trace = [
        TraceRequest(t - t0, p, o, hash_ids=h, source=source)
        for t, (p, o, h) in zip(times, rows, strict=True)
    ]
    return _sorted(trace)


def load_burstgpt_csv(path: StrPath) -> list[TraceRequest]:
    """Load a BurstGPT trace CSV (columns found by name; ``Timestamp`` in seconds).

    Rows with 0 ``Response tokens`` are failed requests and are skipped (see
    the module docstring). ``Model`` is kept; ``Log Type`` becomes ``task_type``;
    ``Total tokens`` is ignored.

    Returns:
        Requests sorted by arrival, the first at 0.0 s.

    Raises:
        TraceError: a required column is missing or a row does not parse.
    """
    source = Path(path).stem
    trace: list[TraceRequest] = []
    with _open(path) as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        col = _columns(path, header, ("Timestamp", "Request tokens", "Response tokens"))
        model_at, kind_at = _index(header, "Model"), _index(header, "Log Type")
        for row in reader:
            if not row:
                continue
            line = reader.line_num
            if len(row) != len(header):
                raise TraceError(path, line, f"row: expected {len(header)} fields, got {len(row)}")
            output = _int_text(path, line, "Response tokens", row[col["Response tokens"]], 0)
            if output == 0:
                continue
            trace.append(
                TraceRequest(
                    arrival_s=_float_text(path, line, "Timestamp", row[col["Timestamp"]]),
                    prompt_tokens=_int_text(
                        path, line, "Request tokens", row[col["Request tokens"]], 0
                    ),
                    output_tokens=output,
                    model=_cell(row, model_at),
                    source=source,
                    task_type=_log_type(_cell(row, kind_at)),
                )
            )
    return _rebased(_sorted(trace))


def load_jsonl(path: StrPath) -> list[TraceRequest]:
    """Load our own JSONL trace (see the module docstring); times are kept as written.

    Returns:
        Requests sorted by arrival (stable for equal times).

    Raises:
        TraceError: a line does not parse, misses a required key or has an unknown one.
    """
    source = Path(path).stem
    trace: list[TraceRequest] = []
    for line, obj in _json_objects(path):
        unknown = sorted(set(obj) - _JSONL_KEYS)
        if unknown:
            raise TraceError(
                path, line, f"{unknown[0]}: unknown key (allowed: {sorted(_JSONL_KEYS)})"
            )
        trace.append(
            TraceRequest(
                arrival_s=_json_number(path, line, obj, "arrival_s"),
                prompt_tokens=_json_int(path, line, obj, "prompt_tokens", 0),
                output_tokens=_json_int(path, line, obj, "output_tokens", 1),
                model=_json_str(path, line, obj, "model"),
                hash_ids=_json_hash_ids(path, line, obj),
                source=source,
                priority=_json_str(path, line, obj, "priority"),
                tenant=_json_str(path, line, obj, "tenant"),
                task_type=_json_str(path, line, obj, "task_type"),
            )
        )
    return _sorted(trace)


def dump_jsonl(trace: Sequence[TraceRequest], path: StrPath) -> None:
    """Write ``trace`` in our JSONL format (``source`` is not written; None/() omitted)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in trace:
            obj: dict[str, Any] = {
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
            }
            for key in ("model", "priority", "tenant", "task_type"):
                if getattr(r, key) is not None:
                    obj[key] = getattr(r, key)
            if r.hash_ids:
                obj["hash_ids"] = list(r.hash_ids)
            f.write(json.dumps(obj) + "\n")


# --- reshaping -----------------------------------------------------------------------


def window(trace: Sequence[TraceRequest], start_s: float, duration_s: float) -> list[TraceRequest]:
    """The requests arriving in ``[start_s, start_s + duration_s)``, shifted by ``-start_s``.

    ``trace`` must be sorted by arrival (every loader's output is). Times stay
    relative to the window start, so a quiet start of the window is kept.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0 seconds, got {duration_s}")
    lo = bisect_left(trace, start_s, key=_arrival)
    hi = bisect_left(trace, start_s + duration_s, key=_arrival)
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in trace[lo:hi]]


def scale_rate(trace: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Scale the arrival rate by ``factor``: every arrival time is divided by it.

    ``factor=2`` replays the trace at twice its rate in half the time (the
    simulator's ``--rate-scale``); token counts are unchanged.

    Raises:
        ValueError: ``factor`` is not a positive finite number.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor: must be a positive finite number, got {factor}")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in trace]


def mix(traces: Mapping[str, Sequence[TraceRequest]]) -> list[tuple[str, TraceRequest]]:
    """Merge several traces by arrival time, each tagged with its key (a class name).

    ``mix({"realtime": conv, "standard": code})``. Equal arrival times keep the
    mapping's order, then each trace's order.

    Returns:
        ``(key, request)`` pairs sorted by ``request.arrival_s``.
    """
    tagged = [(name, r) for name, trace in traces.items() for r in trace]
    tagged.sort(key=lambda item: item[1].arrival_s)
    return tagged


def assign_tenants(
    n: int,
    tenants: int = defaults.TRACE_TENANTS,
    zipf_s: float = defaults.TRACE_TENANT_ZIPF_S,
    seed: int = 0,
) -> list[str]:
    """Draw a tenant for each of ``n`` requests, skewed: rank k has weight 1/k^zipf_s.

    Names are ``tenant-01`` .. ``tenant-20`` (zero-padded to the width of
    ``tenants``), ``tenant-01`` the busiest. Deterministic for a seed. With the
    defaults the top tenant sends 31.3% of requests, the smallest 1.2%.

    Raises:
        ValueError: ``n < 0``, ``tenants < 1`` or ``zipf_s < 0``.
    """
    if n < 0 or tenants < 1 or not zipf_s >= 0:
        raise ValueError(
            f"n >= 0, tenants >= 1, zipf_s >= 0 required; got {n}, {tenants}, {zipf_s}"
        )
    width = len(str(tenants))
    names = [f"tenant-{k:0{width}d}" for k in range(1, tenants + 1)]
    weights = [1.0 / k**zipf_s for k in range(1, tenants + 1)]
    return random.Random(seed).choices(names, weights=weights, k=n)


def synthetic_batch(
    trace_pool: Sequence[TraceRequest],
    n: int,
    at_s: float,
    seed: int,
    window_s: float = defaults.SYNTHETIC_BATCH_WINDOW_S,
) -> list[TraceRequest]:
    """A synthetic bulk submission: ``n`` requests with token counts drawn from real rows.

    This is *synthetic* load (the demo's "batch job"): the token pairs
    ``(prompt_tokens, output_tokens)`` and the model are drawn with replacement
    from ``trace_pool``; arrivals are spread evenly over
    ``[at_s, at_s + window_s)``, as a client's ``submit_many`` would send them.
    ``hash_ids`` are dropped (no shared prefixes are implied) and ``source`` is
    ``"synthetic"``. Deterministic for a seed.

    Raises:
        ValueError: ``n < 0``, ``window_s < 0``, or an empty pool with ``n > 0``.
    """
    if n < 0 or not window_s >= 0:
        raise ValueError(f"n >= 0 and window_s >= 0 required; got n={n}, window_s={window_s}")
    if n and not trace_pool:
        raise ValueError("trace_pool: empty; need real rows to draw token counts from")
    rows = random.Random(seed).choices(trace_pool, k=n)
    return [
        TraceRequest(
            at_s + window_s * i / n, r.prompt_tokens, r.output_tokens, r.model, (), "synthetic"
        )
        for i, r in enumerate(rows)
    ]


def summarize(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Headline figures of a trace.

    Returns:
        ``count``; ``span_s`` (last - first arrival, s); ``rate_per_s``
        (count / span, 0.0 when the span is 0); ``prompt_mean``, ``prompt_p50``,
        ``prompt_p99``, ``output_mean``, ``output_p50``, ``output_p99`` (tokens;
        nearest-rank percentiles). All 0 for an empty trace.
    """
    count = len(trace)
    span = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace) if trace else 0.0
    out: dict[str, float] = {
        "count": count,
        "span_s": span,
        "rate_per_s": count / span if span > 0 else 0.0,
    }
    for name, values in (
        ("prompt", sorted(r.prompt_tokens for r in trace)),
        ("output", sorted(r.output_tokens for r in trace)),
    ):
        out[f"{name}_mean"] = sum(values) / count if count else 0.0
        out[f"{name}_p50"] = _percentile(values, 50)
        out[f"{name}_p99"] = _percentile(values, 99)
    return out


# --- helpers -------------------------------------------------------------------------


def _open(path: StrPath) -> TextIO:
    # newline="" lets the csv module see CRLF; utf-8-sig drops a byte-order mark.
    return open(path, encoding="utf-8-sig", newline="")


def _arrival(r: TraceRequest) -> float:
    return r.arrival_s


def _sorted(trace: list[TraceRequest]) -> list[TraceRequest]:
    trace.sort(key=_arrival)  # stable; near-linear on the already sorted real traces
    return trace


def _rebased(trace: list[TraceRequest]) -> list[TraceRequest]:
    if not trace or trace[0].arrival_s == 0.0:
        return trace
    t0 = trace[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in trace]


def _percentile(sorted_values: Sequence[int], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p% of values <= it."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def _wallclock_ns(text: str, days: dict[str, int]) -> int:
    """Nanoseconds since 0001-01-01 of ``YYYY-MM-DD HH:MM:SS[.f{1,9}]`` (exact).

    ``days`` caches date -> ordinal. Other ISO 8601 forms (a zone suffix, ...)
    go through ``datetime.fromisoformat`` (microseconds; aware -> UTC).

    Raises:
        ValueError: not a date-time.
    """
    frac = text[20:]
    if (
        19 <= len(text) <= 29
        and text[10] in " T"
        and text[13] == ":"
        and text[16] == ":"
        and (text[11:13] + text[14:16] + text[17:19]).isdigit()
        and (len(text) == 19 or (text[19] == "." and frac.isdigit()))
    ):
        day = days.get(text[:10])
        if day is None:
            day = days[text[:10]] = date.fromisoformat(text[:10]).toordinal()
        h, m, s = int(text[11:13]), int(text[14:16]), int(text[17:19])
        if h < 24 and m < 60 and s < 60:
            ns = int(frac.ljust(9, "0")) if frac else 0
            return (day * 86400 + h * 3600 + m * 60 + s) * _NS_PER_S + ns
    return _iso_ns(text)


def _iso_ns(text: str) -> int:
    dt = datetime.fromisoformat(text.strip())
    if dt.tzinfo is not None:
        dt = dt.astimezone(UTC).replace(tzinfo=None)
    seconds = dt.toordinal() * 86400 + dt.hour * 3600 + dt.minute * 60 + dt.second
    return seconds * _NS_PER_S + dt.microsecond * 1000


def _spread(path: StrPath, times: list[float], tick_s: float | None) -> list[float]:
    """Spread requests sharing a time evenly over ``tick_s`` (file order kept)."""
    groups: dict[float, list[int]] = {}
    for i, t in enumerate(times):
        groups.setdefault(t, []).append(i)
    if tick_s is None:
        gaps = [b - a for a, b in pairwise(sorted(groups))]
        if not gaps:
            if len(times) > 1:
                raise TraceError(path, None, "timestamp: all equal, cannot infer tick_s; pass it")
            return times
        tick_s = min(gaps)
    spread = list(times)
    for t, members in groups.items():
        for i, index in enumerate(members):
            spread[index] = t + tick_s * i / len(members)
    return spread


def _int_text(path: StrPath, line: int, field: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, f"{field}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise TraceError(path, line, f"{field}: must be >= {minimum}, got {value}")
    return value


def _float_text(path: StrPath, line: int, field: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, f"{field}: expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise TraceError(path, line, f"{field}: must be a finite number >= 0, got {text!r}")
    return value


def _columns(path: StrPath, header: list[str], names: Sequence[str]) -> dict[str, int]:
    missing = [name for name in names if name not in header]
    if missing:
        raise TraceError(path, 1, f"{missing[0]}: missing column (header: {header})")
    return {name: header.index(name) for name in names}


def _index(header: list[str], name: str) -> int | None:
    return header.index(name) if name in header else None


def _cell(row: list[str], at: int | None) -> str | None:
    if at is None:
        return None
    return row[at].strip() or None


def _log_type(text: str | None) -> str | None:
    """BurstGPT's ``Log Type`` as a task type: ``"API log"`` -> ``"api"``."""
    if text is None:
        return None
    words = text.lower().split()
    if len(words) > 1 and words[-1] == "log":
        words.pop()
    return "-".join(words) or None


def _json_objects(path: StrPath) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(path, line, f"line: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, line, f"line: expected a JSON object, got {text.strip()!r}")
            yield line, obj


def _json_number(path: StrPath, line: int, obj: dict[str, Any], key: str) -> float:
    value = _json_required(path, line, obj, key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(path, line, f"{key}: expected a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise TraceError(path, line, f"{key}: must be a finite number >= 0, got {value!r}")
    return float(value)


def _json_int(path: StrPath, line: int, obj: dict[str, Any], key: str, minimum: int) -> int:
    value = _json_required(path, line, obj, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, f"{key}: must be >= {minimum}, got {value}")
    return value


def _json_required(path: StrPath, line: int, obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise TraceError(path, line, f"{key}: missing")
    return obj[key]


def _json_str(path: StrPath, line: int, obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise TraceError(path, line, f"{key}: expected a string, got {value!r}")
    return value


def _json_hash_ids(path: StrPath, line: int, obj: dict[str, Any]) -> tuple[int, ...]:
    value = obj.get("hash_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise TraceError(path, line, f"hash_ids: expected a list of integers, got {value!r}")
    return tuple(value)
