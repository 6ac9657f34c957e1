"""The latency model of a model server: one implementation, every user.

The worker's ``sim`` model server sleeps for these durations, the simulator
advances virtual time by them, the dispatcher refuses late work and the scaler
sizes the fleet with them. The form is the roofline of :mod:`inferq.devices`
(a spec's :class:`~inferq.devices.LatencyProfile`, its ``weights_mib``,
``kv_bytes_per_token`` and ``params_b``)::

    step_s    = overhead + seq_step x batch + (weights + kv_tokens x kv_bytes_per_token) / bw
    prefill_s = prompt x (2 N + 2 n_layer d_attn x prompt) / flop_rate
    decode_s  = output x step_s(batch, resident KV tokens)

Concurrency costs what it adds to the KV cache read at every step, not a fixed
share per sequence: on an H200 an 8B model decodes one sequence at 4.6 ms a step
and 128 sequences of 2,048 tokens at 13.3 ms (issue 16's measurements), so batching
multiplies throughput by ~45x. The KV cache, not a slot count, is the limit.

:func:`fit_profile` fits a worker's measured step times (least squares) so the
profile can come from the card it runs on instead of the datasheet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferq.config import ModelSpec
from inferq.devices import LatencyProfile

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServiceTime:
    """Durations of one request, seconds."""

    ttft_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s


def weight_bytes(spec: ModelSpec) -> float:
    """Bytes a decode step reads for the weights: ``weights_mib`` x 2^20."""
    return spec.weights_mib * _MIB


def step_s(spec: ModelSpec, batch: int, kv_tokens: float) -> float:
    """Seconds of one decode step with ``batch`` sequences holding ``kv_tokens`` in the KV cache.

    Args:
        spec: the model and its latency profile.
        batch: sequences in the step (>= 1; smaller counts as 1).
        kv_tokens: KV-cache tokens resident over the whole batch (>= 0).
    """
    p = spec.latency
    read = weight_bytes(spec) + max(0.0, kv_tokens) * spec.kv_bytes_per_token
    fixed_ms = p.step_overhead_ms + p.seq_step_ms * max(1, batch)
    return fixed_ms / 1000.0 + read / (p.mem_bw_gbs * 1e9)


def prefill_s(spec: ModelSpec, prompt_tokens: int) -> float:
    """Seconds to prefill ``prompt_tokens`` (Kaplan et al. 2020's forward FLOPs per token)."""
    p = spec.latency
    n = max(0, prompt_tokens)
    flops = n * (2.0 * spec.params_b * 1e9 + 2.0 * p.attn_width * n)
    return flops / (p.prefill_tflops * 1e12)


def resident_kv_tokens(prompt_tokens: int, output_tokens: int, concurrency: int) -> float:
    """KV tokens held while a request decodes beside ``concurrency - 1`` like it.

    Each sequence holds its prompt and, on average over its decode, half its output.
    """
    return max(1, concurrency) * (max(0, prompt_tokens) + max(0, output_tokens) / 2.0)


def service_time(
    spec: ModelSpec,
    prompt_tokens: int,
    output_tokens: int,
    concurrency: int = 1,
    kv_tokens: float | None = None,
) -> ServiceTime:
    """Time to serve one request on ``spec`` with ``concurrency`` sequences running.

    Args:
        spec: the model and its latency profile.
        prompt_tokens: input tokens (>= 0).
        output_tokens: generated tokens (>= 0).
        concurrency: sequences decoding at once on the worker (>= 1).
        kv_tokens: KV tokens resident over the batch; default
            :func:`resident_kv_tokens` (every peer the size of this request).
    """
    batch = max(1, concurrency)
    if kv_tokens is None:
        kv_tokens = resident_kv_tokens(prompt_tokens, output_tokens, batch)
    return ServiceTime(
        ttft_s=prefill_s(spec, prompt_tokens),
        decode_s=max(0, output_tokens) * step_s(spec, batch, kv_tokens),
    )


def decode_tps(spec: ModelSpec, batch: int, context_tokens: int) -> float:
    """Output tokens/s of the whole worker with ``batch`` sequences of ``context_tokens`` each."""
    return max(1, batch) / step_s(spec, batch, max(1, batch) * context_tokens)


def saturation_factor(
    spec: ModelSpec,
    prompt_tokens: float,
    output_tokens: float,
    observed_concurrency: float,
    slots: int,
) -> float:
    """Service time with all ``slots`` busy over the one measured at ``observed_concurrency``.

    Only decode slows with concurrency, and by the KV bytes it adds, so a
    prefill-heavy mix (long prompts, short answers, as in the Azure code trace)
    barely changes. Used by the scaler to size on what a saturated worker does.
    """
    p, o = round(prompt_tokens), round(output_tokens)
    seen = service_time(spec, p, o, max(1, round(observed_concurrency))).total_s
    full = service_time(spec, p, o, slots).total_s
    return max(1.0, full / seen) if seen > 0 else 1.0


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured decode step: ``batch`` sequences, ``kv_tokens`` resident, ``step_ms``."""

    batch: int
    kv_tokens: float
    step_ms: float


def fit_profile(
    spec: ModelSpec,
    steps: Sequence[StepSample],
    prefill: Sequence[tuple[int, float]] = (),
) -> LatencyProfile:
    """``spec``'s profile refitted to a worker's measurements (ordinary least squares).

    The step model is linear: ``step_ms = a + c x batch + b x kv_tokens``, with
    ``b = kv_bytes_per_token / bw`` and ``a = overhead + weights / bw``; so ``bw``
    comes from the slope over KV tokens and the overhead from the intercept.
    With samples at one batch size only, ``c`` keeps the current profile's value.
    The prefill FLOP rate is the FLOPs-weighted mean over ``(prompt_tokens,
    seconds)`` pairs; none keeps the current one.

    Raises:
        ValueError: fewer than two samples, or the samples do not separate the
            KV term (all at the same KV tokens), or the fit is unphysical (a
            non-positive bandwidth).
    """
    if len(steps) < 2:
        raise ValueError(f"steps: need at least 2 measured decode steps, got {len(steps)}")
    cur = spec.latency
    batches = {s.batch for s in steps}
    fit_c = len(batches) > 1
    rows = [[1.0, s.kv_tokens / 1000.0] + ([float(s.batch)] if fit_c else []) for s in steps]
    ys = [s.step_ms - (0.0 if fit_c else cur.seq_step_ms * s.batch) for s in steps]
    coef = _least_squares(rows, ys)
    a, b_per_k = coef[0], coef[1]
    c = coef[2] if fit_c else cur.seq_step_ms
    if b_per_k <= 0:
        raise ValueError(
            f"steps: the fitted cost per 1,000 KV tokens is {b_per_k:.4f} ms (must be > 0): "
            "measure steps at several context lengths"
        )
    bw_gbs = spec.kv_bytes_per_token * 1000.0 / (b_per_k / 1000.0) / 1e9
    overhead = max(0.0, a - weight_bytes(spec) / (bw_gbs * 1e9) * 1000.0)
    tflops = cur.prefill_tflops
    if prefill:
        probe = cur.model_copy(update={"prefill_tflops": 1.0})
        unit = spec.model_copy(update={"latency": probe})
        flops = sum(prefill_s(unit, n) * 1e12 for n, _ in prefill)
        secs = sum(t for _, t in prefill)
        if secs <= 0:
            raise ValueError("prefill: measured times must be > 0 seconds")
        tflops = flops / secs / 1e12
    return cur.model_copy(
        update={
            "mem_bw_gbs": bw_gbs,
            "step_overhead_ms": overhead,
            "seq_step_ms": max(0.0, c),
            "prefill_tflops": tflops,
        }
    )


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Solve the normal equations ``(X^T X) beta = X^T y`` (Gaussian elimination)."""
    k = len(rows[0])
    xtx = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    xty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(xtx[i][col]))
        if abs(xtx[pivot][col]) < 1e-12:
            raise ValueError(
                "steps: the samples do not separate the terms (vary batch and context)"
            )
        xtx[col], xtx[pivot] = xtx[pivot], xtx[col]
        xty[col], xty[pivot] = xty[pivot], xty[col]
        for i in range(k):
            if i != col:
                f = xtx[i][col] / xtx[col][col]
                xtx[i] = [x - f * y for x, y in zip(xtx[i], xtx[col], strict=True)]
                xty[i] -= f * xty[col]
    return [xty[i] / xtx[i][i] for i in range(k)]
