"""The latency model shared by the sim backend, the simulator and the scaler."""

from __future__ import annotations

import pytest

from inferq.config import Settings
from inferq.latency import decode_slowdown, saturation_factor, service_time

SPEC = Settings.load().model_by_name["llama-3.1-8b"]


def test_service_time_follows_the_formula() -> None:
    st = service_time(SPEC, 1200, 80, concurrency=3)
    assert st.ttft_s == pytest.approx(1200 / SPEC.prefill_tps)
    assert st.decode_s == pytest.approx(80 / (SPEC.decode_tps / decode_slowdown(0.85, 3)))
    assert decode_slowdown(0.85, 1) == 1.0 and decode_slowdown(0.85, 0) == 1.0


def test_saturation_grows_with_decode_share_only() -> None:
    chat = saturation_factor(SPEC, 1000, 200, observed_concurrency=1, slots=8)
    code = saturation_factor(SPEC, 7000, 5, observed_concurrency=1, slots=8)
    assert chat == pytest.approx(decode_slowdown(0.85, 8), rel=0.05)  # decode-bound
    assert 1.0 <= code < 1.2  # prefill-bound: concurrency matters far less
    assert saturation_factor(SPEC, 1000, 200, observed_concurrency=8, slots=8) == 1.0
