"""Model servers' own telemetry, parsed: llama.cpp's ``/slots``, vLLM's and TGI's ``/metrics``.

Pure functions from what a server answered to a :class:`~inferq.models.ServerTelemetry`;
the ``openai`` model server fetches (:meth:`OpenAIServer.telemetry`). Prometheus text is
read with ``prometheus_client``'s parser; a family a server does not export leaves its
figure None. Where a server runs several engines (vLLM data parallel: one sample per
``engine`` label), counts are summed and KV usage is averaged.

=========  ===============================================  ================================
server     figure                                           source
=========  ===============================================  ================================
llama.cpp  slots; KV tokens (``n_ctx`` summed); KV used     ``GET /slots`` (one entry a
           (``n_prompt_tokens`` of the processing slots:    slot; ``n_prompt_tokens`` grows
           prompt plus tokens generated so far); running    with each generated token)
           (processing slots)
llama.cpp  waiting                                          ``llamacpp:requests_deferred``
vLLM       KV usage                                         ``vllm:kv_cache_usage_perc``
                                                            (``vllm:gpu_cache_usage_perc``
                                                            before v0.10)
vLLM       KV tokens                                        ``vllm:cache_config_info``
                                                            label ``kv_cache_size_tokens``,
                                                            or ``num_gpu_blocks`` x
                                                            ``block_size``
vLLM       running / waiting                                ``vllm:num_requests_running`` /
                                                            ``vllm:num_requests_waiting``
TGI        KV tokens                                        ``GET /info``
                                                            ``max_batch_total_tokens``
TGI        KV used                                          ``tgi_batch_current_max_tokens``
TGI        running / waiting                                ``tgi_batch_current_size`` /
                                                            ``tgi_queue_size``
=========  ===============================================  ================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from inferq.models import ServerTelemetry

#: vLLM's KV-cache usage gauge: the name since v0.10, then the older one.
VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of a Prometheus text exposition, by sample name: ``[(labels, value)]``.

    Raises:
        ValueError: the text is not the Prometheus format.
    """
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


def _sum(samples: Iterable[tuple[dict[str, str], float]] | None) -> int | None:
    values = [v for _, v in samples or ()]
    return round(sum(values)) if values else None


def _mean(samples: Iterable[tuple[dict[str, str], float]] | None) -> float | None:
    values = [v for _, v in samples or ()]
    return sum(values) / len(values) if values else None


def llama_cpp(slots: Any, metrics: str | None) -> ServerTelemetry:
    """llama.cpp's telemetry from ``GET /slots`` (a JSON list) and ``GET /metrics`` (or None).

    An idle slot's cached tokens are not counted as used: llama.cpp reuses or
    overwrites them for the next request.

    Raises:
        ValueError: ``slots`` is not a list of slot objects with ``n_ctx``, a figure is
            out of range (:class:`ServerTelemetry`'s bounds), or ``metrics`` is not
            Prometheus text.
    """
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise ValueError(f"/slots is not a list of slots: {str(slots)[:200]}")
    try:
        kv_tokens = sum(int(s["n_ctx"]) for s in slots)
        busy = [s for s in slots if s.get("is_processing")]
        used = sum(int(s.get("n_prompt_tokens") or 0) for s in busy)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"/slots entry without a readable n_ctx: {exc!r}") from None
    waiting = _sum(samples(metrics).get("llamacpp:requests_deferred")) if metrics else None
    try:
        return ServerTelemetry(
            slots=len(slots),
            kv_tokens=kv_tokens,
            kv_used_tokens=min(used, kv_tokens),
            running=len(busy),
            waiting=waiting,
        )
    except ValidationError as exc:  # a negative or absurd n_ctx (a 400-digit integer)
        fields = ", ".join(f"{'.'.join(map(str, e['loc']))} {e['msg']}" for e in exc.errors())
        raise ValueError(f"/slots figures out of range: {fields[:300]}") from None


def vllm(metrics: str) -> ServerTelemetry:
    """vLLM's telemetry from its ``/metrics`` text.

    Raises:
        ValueError: not Prometheus text.
    """
    found = samples(metrics)
    usage = next((_mean(found[n]) for n in VLLM_KV_USAGE if n in found), None)
    kv_tokens = _vllm_kv_tokens(found.get("vllm:cache_config_info", []))
    return ServerTelemetry(
        kv_tokens=kv_tokens,
        kv_usage=None if usage is None else min(1.0, max(0.0, usage)),
        running=_sum(found.get("vllm:num_requests_running")),
        waiting=_sum(found.get("vllm:num_requests_waiting")),
    )


def _vllm_kv_tokens(infos: list[tuple[dict[str, str], float]]) -> int | None:
    """KV tokens from ``vllm:cache_config_info`` labels, summed over engines: its
    ``kv_cache_size_tokens`` (newer vLLM; right for hybrid models too), else
    ``num_gpu_blocks x block_size``. None when absent or unset (``"None"`` before the
    profile run sized the cache)."""
    total = 0
    for labels, _ in infos:
        size = labels.get("kv_cache_size_tokens", "")
        blocks, block = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if size.isdigit() and int(size) > 0:
            total += int(size)
        elif blocks.isdigit() and block.isdigit() and int(blocks) > 0:
            total += int(blocks) * int(block)
        else:
            return None
    return total or None


def tgi(metrics: str, info: Any) -> ServerTelemetry:
    """TGI's telemetry from its ``/metrics`` text and ``GET /info`` (a JSON object, or None).

    Raises:
        ValueError: not Prometheus text.
    """
    found = samples(metrics)
    total = info.get("max_batch_total_tokens") if isinstance(info, dict) else None
    kv_tokens = int(total) if isinstance(total, int | float) and total > 0 else None
    used = _sum(found.get("tgi_batch_current_max_tokens"))
    if kv_tokens is not None and used is not None:
        used = min(used, kv_tokens)
    return ServerTelemetry(
        kv_tokens=kv_tokens,
        kv_used_tokens=used if kv_tokens is not None else None,
        running=_sum(found.get("tgi_batch_current_size")),
        waiting=_sum(found.get("tgi_queue_size")),
    )
