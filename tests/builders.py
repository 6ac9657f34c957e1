"""Builders of the data every test layer hands around: one place, plain functions.

The dispatch policy's inputs (:class:`QueuedRequest`, :class:`WorkerView`,
:class:`Snapshot`, :class:`DispatchPolicy`, :class:`Assignment`), the scaling policy's
(:class:`ModelLoad`), the client's request (:class:`InferenceRequest`) and a heartbeat
(:class:`WorkerInfo`), with defaults a test overrides by keyword. A test module that
wants other defaults binds them once with :func:`functools.partial` instead of copying
a constructor.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from inferq.config import PriorityClass, Settings
from inferq.intake import build_request
from inferq.models import InferenceRequest, WorkerInfo, WorkerState
from inferq.policy.scaling import ModelLoad
from inferq.policy.snapshot import (
    Assignment,
    Decision,
    DispatchPolicy,
    FairnessState,
    QueuedRequest,
    Snapshot,
    WorkerView,
)

#: The default registry and classes (llama-3.1-8b, llama-2-13b, llama-3.1-70b-awq).
SETTINGS = Settings()
#: Registry model -> parameters, billions (unregistered models count as 1b).
PARAMS_B = {m.name: m.params_b for m in SETTINGS.models}


# --- the dispatch policy's inputs -------------------------------------------------------


def queued_request(
    rid: str = "r",
    priority: str = "realtime",
    *,
    route: str = "llama-3.1-8b",
    tenant: str = "t0",
    task_type: str | None = None,
    now: float = 0.0,
    waited: float = 0.0,
    submitted_at: float | None = None,
    timeout: float = 60.0,
    deadline: float | None = None,
    prompt: int = 100,
    max_tokens: int = 100,
    attempts: int = 0,
    excluded: str | None = None,
    prefix: tuple[int, ...] = (),
    block_tokens: int = 64,
) -> QueuedRequest:
    """A queued request submitted ``waited`` s before ``now`` (or at ``submitted_at``),
    with its deadline ``timeout`` s after submission (or at ``deadline``)."""
    submitted = now - waited if submitted_at is None else submitted_at
    return QueuedRequest(
        id=rid,
        priority=priority,
        route=route,
        tenant=tenant,
        task_type=task_type,
        submitted_at=submitted,
        deadline=submitted + timeout if deadline is None else deadline,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        attempts=attempts,
        excluded_worker=excluded,
        prefix=prefix,
        block_tokens=block_tokens if prefix else 0,
    )


def worker_view(
    wid: str = "w",
    model: str = "llama-3.1-8b",
    *,
    ready: bool = True,
    slots: int = 8,
    kv: float = 16_384,
    used_slots: int = 0,
    used_mib: float = 0.0,
    params_b: float | None = None,
    measured: float | None = None,
) -> WorkerView:
    """A worker as the policy sees it (``params_b`` from the registry unless given;
    ``measured``: the KV room it measured, MiB)."""
    return WorkerView(
        id=wid,
        model=model,
        params_b=PARAMS_B.get(model, 1.0) if params_b is None else params_b,
        ready=ready,
        slots=slots,
        kv_cache_mib=kv,
        reserved_slots=used_slots,
        reserved_mib=used_mib,
        measured_free_mib=measured,
    )


def snapshot(
    queued: Iterable[QueuedRequest],
    workers: Sequence[WorkerView],
    *,
    now: float,
    fairness: FairnessState | None = None,
    **kw: Any,
) -> Snapshot:
    """A snapshot at ``now`` with ``queued`` grouped by class, oldest first (then by id)."""
    by_class: dict[str, list[QueuedRequest]] = {}
    for r in sorted(queued, key=lambda r: (r.submitted_at, r.id)):
        by_class.setdefault(r.priority, []).append(r)
    return Snapshot(
        now=now, queued=by_class, workers=workers, fairness=fairness or FairnessState(), **kw
    )


def dispatch_policy(
    classes: Sequence[PriorityClass] | None = None, *, settings: Settings = SETTINGS, **kw: Any
) -> DispatchPolicy:
    """The policy of ``settings`` (default registry and classes), with overrides."""
    if classes:
        kw["classes"] = tuple(classes)
    return DispatchPolicy.from_settings(settings, **kw)


def assignment(rid: str = "x", need: float = 100.0, *, priority: str = "standard") -> Assignment:
    """One request placed in a batch, costing 1 token."""
    return Assignment(request_id=rid, priority=priority, tenant="t", need_mib=need, cost=1.0)


def placed(decision: Decision) -> list[tuple[str, str]]:
    """(request id, worker id) of every assignment, in dispatch order."""
    return [(a.request_id, b.worker_id) for b in decision.batches for a in b.items]


def assigned(decision: Decision) -> dict[str, str]:
    """Request id -> worker id."""
    return dict(placed(decision))


# --- the scaling policy's input ---------------------------------------------------------


def model_load(**kw: Any) -> ModelLoad:
    """A one-model load (``m``): 4 slots x 4 s per request = 1 request/s per worker, 1 ready."""
    base: dict[str, Any] = {
        "model": "m",
        "queued": {},
        "oldest_wait_s": {},
        "arrival_rate": 0.0,
        "mean_service_s": 4.0,
        "slots_per_worker": 4,
        "cold_start_s": 30.0,
        "ready": 1,
    }
    base.update(kw)
    return ModelLoad(**base)


# --- the client's request and the worker's heartbeat ------------------------------------


def inference_request(settings: Settings, **fields: Any) -> InferenceRequest:
    """A valid request (``prompt="hello world"``, ``max_tokens=16``) with overridable fields."""
    args: dict[str, Any] = {"prompt": "hello world", "max_tokens": 16}
    args.update(fields)
    return build_request(settings, **args)


def worker_info(
    worker_id: str = "w1",
    *,
    model: str = "llama-3.1-8b",
    params_b: float = 8,
    slots: int = 8,
    kv_cache_mib: int = 8000,
    state: WorkerState = WorkerState.READY,
) -> WorkerInfo:
    """A heartbeat beaten now on a 24 GiB card."""
    now = time.time()
    return WorkerInfo(
        id=worker_id,
        model=model,
        params_b=params_b,
        vram_total_mib=24576,
        vram_free_mib=kv_cache_mib,
        kv_cache_mib=kv_cache_mib,
        slots=slots,
        state=state,
        last_heartbeat=now,
        started_at=now,
    )
