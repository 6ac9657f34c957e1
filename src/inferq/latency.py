"""The latency model of a simulated model server: one implementation, two users.

The worker's ``sim`` model server sleeps for these durations; the simulator advances
virtual time by them. Prefill is compute-bound (tokens/s over the whole prompt);
decode is memory-bound, so each extra concurrent sequence slows every sequence
by a fraction ``1 - batch_efficiency`` of a step:

    ttft_s   = prompt_tokens / prefill_tps
    rate     = decode_tps / (1 + (1 - batch_efficiency) * (concurrency - 1))   tokens/s/seq
    decode_s = output_tokens / rate

With the defaults (efficiency 0.85) 32 concurrent sequences give ~5.7x the
throughput of one, the order of magnitude vLLM reports for 7B models on one card.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferq.config import ModelSpec


@dataclass(frozen=True, slots=True)
class ServiceTime:
    """Durations of one request, seconds."""

    ttft_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s


def decode_slowdown(batch_efficiency: float, concurrency: float) -> float:
    """How much slower each sequence decodes with ``concurrency`` running than alone (>= 1)."""
    return 1.0 + (1.0 - batch_efficiency) * (max(1.0, concurrency) - 1.0)


def saturation_factor(
    spec: ModelSpec,
    prompt_tokens: float,
    output_tokens: float,
    observed_concurrency: float,
    slots: int,
) -> float:
    """Service time with all ``slots`` busy over the one measured at ``observed_concurrency``.

    Only decode slows with concurrency, so a prefill-heavy mix (long prompts, short
    answers, as in the Azure code trace) barely changes while a chat mix roughly
    doubles at 8 slots. Used by the scaler to size on what a saturated worker does.
    """
    p, o = round(prompt_tokens), round(output_tokens)
    seen = service_time(spec, p, o, max(1, round(observed_concurrency))).total_s
    full = service_time(spec, p, o, slots).total_s
    return max(1.0, full / seen) if seen > 0 else 1.0


def service_time(
    spec: ModelSpec, prompt_tokens: int, output_tokens: int, concurrency: int = 1
) -> ServiceTime:
    """Time to serve one request on ``spec`` with ``concurrency`` sequences running.

    Args:
        spec: the model's latency profile (``prefill_tps``, ``decode_tps``, ``batch_efficiency``).
        prompt_tokens: input tokens (>= 0).
        output_tokens: generated tokens (>= 0).
        concurrency: sequences decoding at once on the worker (>= 1).
    """
    rate = spec.decode_tps / decode_slowdown(spec.batch_efficiency, concurrency)
    return ServiceTime(
        ttft_s=max(0, prompt_tokens) / spec.prefill_tps,
        decode_s=max(0, output_tokens) / rate,
    )
