"""The SLA a request is held to: a TTFT target that allows for its prompt, and a TPOT target.

A flat time-to-first-token target cannot be met by a long prompt: an 85,000-token
prompt needs seconds of prefill on any card before its first token. LLM serving
benchmarks therefore state two targets per request (MLCommons, MLPerf Inference
v4.1+ LLM server scenarios: a TTFT and a time-per-output-token limit, e.g. 2 s and
200 ms for Llama-2-70B; DistServe, Zhong et al., OSDI 2024, and Splitwise, Patel
et al., ISCA 2024: "SLO attainment" = the share of requests meeting both TTFT
and TPOT). inferq's form, per priority class::

    ttft_target_s = sla_s + prompt_tokens / reference_prefill_tps
    tpot_target_s = tpot_s                        (None: no per-token target)
    tpot          = (e2e - ttft) / (output_tokens - 1)    for output_tokens >= 2

``reference_prefill_tps`` is the prefill allowance a class grants per prompt token
(:data:`inferq.defaults.SLA_REFERENCE_PREFILL_TPS`). The dispatcher's tests, the
simulator's reports, the demo, the Prometheus metrics (``inferq_sla_requests_total``)
and the dashboard use these functions (the last two through :func:`event_meets_slo`);
the simulator reports the old flat TTFT rule (``ttft <= sla_s``) beside them as
``sla_attainment``.
"""

from __future__ import annotations

from collections.abc import Mapping

from inferq.config import PriorityClass

#: The event types that end a request (``complete.lua``, ``expire.lua``).
FINAL_EVENTS = ("finish", "fail", "expire")


def meets_flat_ttft(sla_s: float, status: str, ttft_s: float | None) -> bool:
    """The old flat rule, kept for comparison: succeeded with a first token within ``sla_s``."""
    return status == "succeeded" and ttft_s is not None and ttft_s <= sla_s


def ttft_target_s(cls: PriorityClass, prompt_tokens: int) -> float:
    """Seconds from submit to the first token a request of ``prompt_tokens`` may take."""
    return cls.sla_s + max(0, prompt_tokens) / cls.reference_prefill_tps


def tpot_of(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """Mean seconds per output token after the first; None with fewer than 2 tokens."""
    if output_tokens < 2:
        return None
    return max(0.0, e2e_s - ttft_s) / (output_tokens - 1)


def meets_ttft(cls: PriorityClass, prompt_tokens: int, ttft_s: float | None) -> bool:
    """Whether a first token at ``ttft_s`` (None: never) met the length-aware TTFT target."""
    return ttft_s is not None and ttft_s <= ttft_target_s(cls, prompt_tokens)


def meets_tpot(
    cls: PriorityClass, ttft_s: float | None, e2e_s: float | None, output_tokens: int
) -> bool:
    """Whether decode kept the class's TPOT target (always, when it has none or too few tokens)."""
    if ttft_s is None or e2e_s is None:
        return False
    tpot = tpot_of(ttft_s, e2e_s, output_tokens)
    return cls.tpot_s is None or tpot is None or tpot <= cls.tpot_s


def meets_slo(
    cls: PriorityClass,
    prompt_tokens: int,
    output_tokens: int,
    status: str,
    ttft_s: float | None,
    e2e_s: float | None,
) -> bool:
    """DistServe's SLO attainment for one request: succeeded, TTFT and TPOT both met."""
    return (
        status == "succeeded"
        and meets_ttft(cls, prompt_tokens, ttft_s)
        and meets_tpot(cls, ttft_s, e2e_s, output_tokens)
    )


def event_meets_slo(cls: PriorityClass | None, etype: str, fields: Mapping[str, str]) -> bool:
    """:func:`meets_slo` for a final event of the events stream (``finish``/``fail``/``expire``).

    Reads ``ttft_ms`` (submit to first token; the finish time when the server reported
    none), ``e2e_ms``, ``ptokens`` and ``tokens`` as ``complete.lua`` writes them; a
    missing ``e2e_ms`` counts as the TTFT, missing token counts as 0 (so no TPOT). A
    ``fail`` or ``expire`` misses; a class the settings do not know (None) is met by any
    ``finish``.

    Raises:
        ValueError: a present numeric field is not a number.
    """
    if etype != "finish":
        return False
    if cls is None:
        return True
    e2e_raw, ttft_raw = fields.get("e2e_ms"), fields.get("ttft_ms")
    e2e = float(e2e_raw) / 1000 if e2e_raw else None
    ttft = float(ttft_raw) / 1000 if ttft_raw else e2e
    return meets_slo(
        cls,
        int(float(fields.get("ptokens") or 0)),
        int(float(fields.get("tokens") or 0)),
        "succeeded",
        ttft,
        e2e if e2e is not None else ttft,
    )
