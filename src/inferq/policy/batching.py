"""Batching: what one worker may take in one decision, and when a class waits to fill a batch.

A worker gets at most one batch per decision. The batch holds requests of the
routes its model serves, in dispatch order, within four limits at once:

- the worker's free slots (``slots - reserved_slots``), one per request;
- its free KV-cache VRAM (``kv_cache_mib - reserved_mib``), MiB, each request
  needing ``(prompt + max_tokens) x kv_bytes_per_token`` (``routing.need_mib``);
- ``max_batch`` requests;
- ``batch_token_budget`` tokens of ``prompt + max_tokens`` summed over the batch
  (vLLM's ``max_num_batched_tokens`` idea). A single request above the budget
  may still form a batch alone, or it could never run.

Batching delay (design brief: "a class may wait up to its batching delay to
fill a batch"): a request of a class with ``batch_delay_s > 0`` is held back
while it has waited less than that, unless its class has enough dispatchable
requests to fill the chosen worker's batch, or it is past its aging bound.
Realtime's delay is 0: never held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferq.config import ModelSpec, PriorityClass
from inferq.policy.snapshot import Assignment, Batch, WorkerView


@dataclass(slots=True, eq=False)
class OpenBatch:
    """The batch being formed for one worker during a decision (mutable working state).

    Attributes:
        worker: the worker as in the snapshot.
        spec: its model's registry entry.
        items: assignments so far, in dispatch order.
        tokens: their ``prompt + max_tokens`` sum.
        mib: their KV-cache need sum, MiB.
        free_slots: slots left after the snapshot's reservations and this batch.
        free_mib: KV-cache VRAM left after the same, MiB.
    """

    worker: WorkerView
    spec: ModelSpec
    items: list[Assignment] = field(default_factory=list)
    tokens: int = 0
    mib: float = 0.0
    free_slots: int = field(init=False)
    free_mib: float = field(init=False)
    alone: bool = False  # it holds a suspect, which runs alone: closed to anything else

    def __post_init__(self) -> None:
        self.free_slots = self.worker.free_slots - len(self.items)
        self.free_mib = self.worker.free_mib - self.mib

    def closed(self, max_batch: int) -> bool:
        """True when no further request can join (no slot, or ``max_batch`` reached)."""
        return self.alone or self.free_slots <= 0 or len(self.items) >= max_batch

    def has_room(
        self, tokens: int, need_mib: float, max_batch: int, budget: int, *, alone: bool = False
    ) -> bool:
        """True when a request of ``tokens`` (prompt + max) needing ``need_mib`` MiB fits.

        Args:
            tokens: the request's prompt + max_tokens.
            need_mib: its KV-cache need on this worker's model, MiB.
            max_batch: the policy's largest batch, requests.
            budget: the policy's batch token budget, tokens.
            alone: the request is a suspect: it fits only an empty batch of a worker
                with nothing reserved.
        """
        items = self.items
        if self.alone or self.free_slots <= 0 or len(items) >= max_batch:
            return False
        if need_mib > self.free_mib:
            return False
        if alone and (items or self.worker.reserved_slots > 0):
            return False
        return not items or self.tokens + tokens <= budget

    def fill_target(self, max_batch: int) -> int:
        """Requests that would fill this batch: ``min(free slots, max_batch - items)``."""
        return max(0, min(self.free_slots, max_batch - len(self.items)))

    def add(self, assignment: Assignment, tokens: int) -> None:
        """Append ``assignment`` (``tokens`` = its prompt + max_tokens)."""
        self.items.append(assignment)
        self.tokens += tokens
        self.mib += assignment.need_mib
        self.free_slots -= 1
        self.free_mib -= assignment.need_mib

    def to_batch(self) -> Batch:
        """The finished, immutable :class:`~inferq.policy.snapshot.Batch`."""
        return Batch(worker_id=self.worker.id, model=self.worker.model, items=tuple(self.items))


def held_back(cls: PriorityClass, waited_s: float, fillable: int, target: int) -> bool:
    """True when a request waits to fill a batch instead of being dispatched now.

    Args:
        cls: the request's priority class.
        waited_s: seconds since the request was submitted.
        fillable: dispatchable requests of the class (this one included) the
            chosen worker's model could take.
        target: requests that would fill the chosen worker's batch
            (:meth:`OpenBatch.fill_target`).

    Returns:
        True while ``waited_s < cls.batch_delay_s``, the class cannot fill the
        batch (``fillable < target``) and the request is within its aging bound.
    """
    if cls.batch_delay_s <= 0 or waited_s >= cls.batch_delay_s:
        return False
    if cls.aging_s is not None and waited_s >= cls.aging_s:
        return False
    return fillable < target
