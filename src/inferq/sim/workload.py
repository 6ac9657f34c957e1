"""The simulator's input: trace requests turned into routed, classed, tenanted requests.

A :class:`SimRequest` is what a client would have submitted for one trace row:

- route: the row's own model when the registry knows it as a route, else the
  default model (``Settings.default_model``, ``llama-3.1-8b``);
- prompt tokens = the trace's ``ContextTokens``; ``max_tokens`` = the trace's
  ``GeneratedTokens`` (what the request generates), never clamped;
- refused: the intake rule a client meets (:func:`inferq.routes.check_context`:
  prompt + ``max_tokens`` within the largest context of the route's models) is
  applied to every row; a row it refuses becomes a request with ``refused`` set
  to the client's error text, which the engine never queues and the report
  counts per class;
- priority class: the class the trace is mapped to, else the row's own, else
  ``Settings.default_priority``;
- tenant: the row's own, else drawn from a Zipf law (:func:`inferq.traces.assign_tenants`);
- prefix: a row with block ids (Mooncake's ``hash_ids``, one per
  :data:`~inferq.traces.MOONCAKE_BLOCK_TOKENS`-token block) carries their chain
  (:func:`inferq.prefix.chain_ids`: block ``i``'s hash covers blocks ``0..i``), as the
  client library would send it; a row without carries none.

Ids are ``r0000000``, ``r0000001``... in arrival order, so ordering by
``(submitted_at, id)`` (the dispatcher's queue order) is arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from inferq import defaults
from inferq.config import ModelSpec, Settings
from inferq.errors import ConfigError, InvalidRequest
from inferq.prefix import chain_ids
from inferq.routes import check_context, check_known, parse_route
from inferq.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    assign_tenants,
    load_trace,
    synthetic_batch,
    window,
)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a simulation (times in seconds from the start; tokens).

    Attributes:
        id: ``r`` + 7 digits, in arrival order.
        arrival_s: submit time.
        priority: priority class name.
        tenant: tenant name.
        route: model route (a model name or ``>=Nb``).
        prompt_tokens: input tokens.
        output_tokens: tokens the model generates (<= ``max_tokens``).
        max_tokens: the request's output cap (sizes its KV-cache reservation).
        task_type: kind of request (keys the output-token estimates), or None.
        source: where the row comes from (the trace file's stem, ``"synthetic"``).
        refused: why intake refuses it (the client's ``InvalidRequest`` text), or None.
        prefix: the chain of its prompt's block hashes (:mod:`inferq.prefix`), ``()``
            for none.
        block_tokens: tokens per block of ``prefix`` (0 without one).
    """

    id: str
    arrival_s: float
    priority: str
    tenant: str
    route: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    task_type: str | None = None
    source: str = ""
    refused: str | None = None
    prefix: tuple[int, ...] = ()
    block_tokens: int = 0


def request_id(index: int) -> str:
    """The id of the ``index``-th request (0-based): ``r0000042``."""
    return f"r{index:07d}"


def build_requests(
    tagged: Sequence[tuple[str | None, TraceRequest]],
    settings: Settings,
    *,
    model: str | None = None,
    tenants: int = defaults.TRACE_TENANTS,
    seed: int = 0,
) -> list[SimRequest]:
    """Turn ``(class or None, trace row)`` pairs into requests (rules in the module docstring).

    Args:
        tagged: rows with the class they are mapped to (None: the row's own or
            the default class), in any order; sorted by arrival here (stable).
        settings: classes, registry, default model and class.
        model: the route of rows naming no known model (default ``settings.default_model``).
        tenants: Zipf-drawn tenants for rows naming none.
        seed: seeds the tenant draw.

    Returns:
        Requests sorted by arrival, ids in that order.

    Raises:
        ConfigError: a class or the default model is unknown.
    """
    route = model or settings.default_model
    default_specs = _route_specs(route, settings)
    if default_specs is None:
        known = ", ".join(sorted(settings.model_by_name))
        raise ConfigError(f"model: {route!r} is not a route of the registry ({known})")
    rows = sorted(tagged, key=lambda pair: pair[1].arrival_s)
    drawn = assign_tenants(len(rows), tenants, seed=seed)
    out: list[SimRequest] = []
    for i, ((cls, row), tenant) in enumerate(zip(rows, drawn, strict=True)):
        priority = cls or row.priority or settings.default_priority
        if priority not in settings.class_by_name:
            known = ", ".join(settings.class_by_name)
            raise ConfigError(f"priority: class {priority!r} is not configured ({known})")
        own = _route_specs(row.model, settings) if row.model else None
        specs, req_route = (
            (own, row.model) if own is not None and row.model else (default_specs, route)
        )
        refused = None
        prefix = chain_ids(row.hash_ids, MOONCAKE_BLOCK_TOKENS) if row.hash_ids else ()
        try:
            check_context(row.output_tokens, row.prompt_tokens, specs, req_route)
        except InvalidRequest as exc:
            refused = str(exc)
        out.append(
            SimRequest(
                id=request_id(i),
                arrival_s=row.arrival_s,
                priority=priority,
                tenant=row.tenant or tenant,
                route=req_route,
                prompt_tokens=row.prompt_tokens,
                output_tokens=row.output_tokens,
                max_tokens=row.output_tokens,
                task_type=row.task_type,
                source=row.source,
                refused=refused,
                prefix=prefix,
                block_tokens=MOONCAKE_BLOCK_TOKENS if prefix else 0,
            )
        )
    return out


def _route_specs(route: str, settings: Settings) -> list[ModelSpec] | None:
    """The models serving ``route`` (as intake finds them), or None when none does."""
    try:
        return check_known(parse_route(route), settings.models)
    except InvalidRequest:
        return None


# --- the command line's workload ----------------------------------------------------

#: Classes of the bundled traces when ``--trace`` names none: conversations are
#: interactive (``realtime``; Mooncake's is a chatbot's), code completions ``standard``.
BUNDLED_CLASSES = {"conv": "realtime", "code": "standard", "mooncake": "realtime"}


@dataclass(frozen=True, slots=True)
class TraceSource:
    """A ``--trace`` value: a bundled name (``conv``, ``code``) or a path, and its class.

    ``priority`` None means: :data:`BUNDLED_CLASSES` for a bundled trace, else the
    rows' own class or ``Settings.default_priority``.
    """

    name: str
    priority: str | None = None

    @classmethod
    def parse(cls, text: str) -> TraceSource:
        """``"conv"``, ``"code=standard"``, ``"path/to/trace.csv=batch"``.

        Raises:
            ConfigError: the text is empty or the class part is empty.
        """
        name, sep, priority = text.rpartition("=") if "=" in text else (text, "", "")
        if not name.strip() or (sep and not priority.strip()):
            raise ConfigError(f"trace: {text!r} is not NAME_OR_PATH[=CLASS]")
        return cls(name.strip(), priority.strip() or BUNDLED_CLASSES.get(name.strip()))


def assemble(
    sources: Sequence[TraceSource],
    settings: Settings,
    *,
    duration_s: float | None = None,
    batch_requests: int | None = 0,
    tenants: int = defaults.TRACE_TENANTS,
    seed: int = 0,
    model: str | None = None,
) -> list[SimRequest]:
    """Load traces, keep their first ``duration_s``, add a synthetic batch job, build requests.

    The batch job (:func:`inferq.traces.synthetic_batch`) has ``batch_requests``
    requests (None: ``defaults.SIM_BATCH_SHARE`` of the trace rows) whose token
    counts are drawn from every loaded row; it arrives
    within one second, ``defaults.SIM_BATCH_AT_FRACTION`` into the window, in
    the lowest configured class. (The demo draws its job from the code trace only.)

    Raises:
        TraceError, FileNotFoundError: a trace does not load.
        ConfigError: a class, the model or ``batch_requests`` is invalid.
    """
    if batch_requests is not None and batch_requests < 0:
        raise ConfigError(f"batch_requests: must be >= 0, got {batch_requests}")
    tagged: list[tuple[str | None, TraceRequest]] = []
    pool: list[TraceRequest] = []
    for src in sources:
        rows = load_trace(src.name)
        if duration_s is not None:
            rows = window(rows, 0.0, duration_s)
        pool += rows
        tagged += [(src.priority, r) for r in rows]
    if batch_requests is None:
        batch_requests = round(len(pool) * defaults.SIM_BATCH_SHARE)
    if batch_requests and pool:
        span = duration_s if duration_s is not None else max(r.arrival_s for r in pool)
        at = span * defaults.SIM_BATCH_AT_FRACTION
        lowest = settings.classes[-1].name
        tagged += [(lowest, r) for r in synthetic_batch(pool, batch_requests, at, seed)]
    return build_requests(tagged, settings, model=model, tenants=tenants, seed=seed)


def scale_requests(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """Arrival rate x ``factor``: every arrival time divided by it (tokens unchanged).

    Raises:
        ValueError: ``factor`` is not a positive finite number.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"rate scale: must be a positive finite number, got {factor}")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in requests]
