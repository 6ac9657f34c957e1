"""The latency model shared by the sim backend, the simulator, the dispatcher and the scaler."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq.config import ModelSpec, Settings
from inferq.devices import GPUS, MODEL_SHAPES, profile_for
from inferq.latency import (
    StepSample,
    decode_tps,
    fit_profile,
    prefill_s,
    saturation_factor,
    service_time,
    step_s,
)

SPEC = Settings.load().model_by_name["llama-3.1-8b"]

# Issue 16: an H200, a Llama-3.1-8B-shaped model in bf16 (CUDA graphs, random weights).
# (batch, context tokens per sequence, measured step ms)
H200_STEPS = [
    (1, 2048, 4.61),
    (8, 2048, 5.20),
    (32, 2048, 6.72),
    (64, 2048, 8.81),
    (128, 2048, 13.29),
    (1, 8192, 4.83),
    (8, 8192, 6.63),
    (32, 8192, 12.36),
    (64, 8192, 20.48),
    (1, 32768, 5.53),
    (8, 32768, 12.29),
    (16, 32768, 19.77),
]
H200_PREFILL_TPS = [(512, 42_580), (2048, 41_636), (8192, 36_696)]

# The measured shape, pinned here so a registry change cannot move these checks.
H200_8B = ModelSpec(
    name="llama-3.1-8b",
    params_b=MODEL_SHAPES["llama-3.1-8b"].params_b,
    weights_mib=15_320,
    kv_bytes_per_token=MODEL_SHAPES["llama-3.1-8b"].kv_bytes_per_token(),
    max_context=131_072,
    cold_start_s=15,
    latency=profile_for("h200", "llama-3.1-8b"),
)


@pytest.mark.parametrize(("batch", "ctx", "ms"), H200_STEPS)
def test_datasheet_profile_reproduces_the_h200_steps(batch: int, ctx: int, ms: float) -> None:
    assert step_s(H200_8B, batch, batch * ctx) * 1000 == pytest.approx(ms, rel=0.04)


@pytest.mark.parametrize(("prompt", "tps"), H200_PREFILL_TPS)
def test_datasheet_profile_reproduces_the_h200_prefill(prompt: int, tps: float) -> None:
    assert prompt / prefill_s(H200_8B, prompt) == pytest.approx(tps, rel=0.04)


def test_batching_multiplies_throughput_as_measured() -> None:
    # 217 tok/s for one sequence, 9,632 tok/s in all at 128 (2,048-token contexts).
    assert decode_tps(H200_8B, 1, 2048) == pytest.approx(217, rel=0.03)
    assert decode_tps(H200_8B, 128, 2048) == pytest.approx(9_632, rel=0.03)


def test_kv_tokens_not_sequences_cost_time() -> None:
    # 8 x 32,768 and 32 x 8,192 hold the same KV: within the small per-sequence term.
    a = step_s(H200_8B, 8, 8 * 32_768)
    b = step_s(H200_8B, 32, 32 * 8_192)
    assert b - a == pytest.approx(24 * H200_8B.latency.seq_step_ms / 1000)


def test_service_time_follows_the_formula() -> None:
    st_ = service_time(SPEC, 1200, 80, concurrency=3)
    assert st_.ttft_s == pytest.approx(prefill_s(SPEC, 1200))
    assert st_.decode_s == pytest.approx(80 * step_s(SPEC, 3, 3 * (1200 + 40)))
    explicit = service_time(SPEC, 1200, 80, concurrency=3, kv_tokens=10_000)
    assert explicit.decode_s == pytest.approx(80 * step_s(SPEC, 3, 10_000))


def test_fit_recovers_the_profile_it_was_given() -> None:
    truth = H200_8B.model_copy(
        update={
            "latency": H200_8B.latency.model_copy(
                update={"mem_bw_gbs": 3_000, "step_overhead_ms": 1.5, "seq_step_ms": 0.01}
            )
        }
    )
    samples = [StepSample(b, b * c, step_s(truth, b, b * c) * 1000) for b, c, _ in H200_STEPS]
    prefill = [(n, prefill_s(truth, n)) for n, _ in H200_PREFILL_TPS]
    fit = fit_profile(H200_8B, samples, prefill)
    assert fit.mem_bw_gbs == pytest.approx(3_000, rel=1e-6)
    assert fit.step_overhead_ms == pytest.approx(1.5, rel=1e-6)
    assert fit.seq_step_ms == pytest.approx(0.01, rel=1e-6)
    assert fit.prefill_tflops == pytest.approx(truth.latency.prefill_tflops, rel=1e-6)


def test_fit_of_the_h200_measurements_predicts_them() -> None:
    samples = [StepSample(b, b * c, ms) for b, c, ms in H200_STEPS]
    prefill = [(n, n / tps) for n, tps in H200_PREFILL_TPS]
    fitted = H200_8B.model_copy(update={"latency": fit_profile(H200_8B, samples, prefill)})
    for b, c, ms in H200_STEPS:
        assert step_s(fitted, b, b * c) * 1000 == pytest.approx(ms, rel=0.04)
    # The fit's bandwidth is a plausible share of the H200's 4.8 TB/s.
    assert 0.8 * GPUS["h200"].mem_bw_gbs < fitted.latency.mem_bw_gbs < GPUS["h200"].mem_bw_gbs


def test_fit_refuses_samples_that_cannot_separate_the_terms() -> None:
    with pytest.raises(ValueError, match="steps: need at least 2"):
        fit_profile(SPEC, [StepSample(1, 100, 5.0)])
    with pytest.raises(ValueError, match="steps"):
        fit_profile(SPEC, [StepSample(1, 100, 5.0), StepSample(1, 100, 5.1)])


def test_unknown_card_or_shape_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="h200"):
        profile_for("b300")
    with pytest.raises(KeyError, match=r"llama-3\.1-8b"):
        profile_for("h200", "gpt-5")


@given(st.integers(0, 100_000), st.integers(0, 4_000), st.integers(1, 256), st.integers(1, 256))
def test_more_concurrency_never_serves_faster(prompt: int, out: int, c1: int, c2: int) -> None:
    lo, hi = sorted((c1, c2))
    a = service_time(SPEC, prompt, out, lo)
    b = service_time(SPEC, prompt, out, hi)
    assert a.ttft_s == b.ttft_s and a.decode_s <= b.decode_s


def test_saturation_grows_with_decode_share_only() -> None:
    chat = saturation_factor(SPEC, 1000, 200, observed_concurrency=1, slots=64)
    code = saturation_factor(SPEC, 7000, 5, observed_concurrency=1, slots=64)
    assert chat > 1.4  # decode-bound: 64 x 1,100 KV tokens read per step
    assert 1.0 <= code < chat  # prefill-bound: only its 5 decode steps slow down
    assert saturation_factor(SPEC, 1000, 200, observed_concurrency=64, slots=64) == 1.0
