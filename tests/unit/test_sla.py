"""The SLA definition (inferq.sla) and its attainment in reports."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferq import sla
from inferq.config import PriorityClass, Settings
from inferq.reporting import Outcome, class_summary

# Pinned here: a test of SLA outcomes must not move when the defaults do.
CHAT = PriorityClass(
    name="realtime",
    sla_s=2.0,
    timeout_s=120,
    weight=8,
    batch_delay_s=0,
    tpot_s=0.1,
    reference_prefill_tps=20_000,
)
BULK = CHAT.model_copy(update={"name": "batch", "sla_s": 60.0, "tpot_s": None})


def test_ttft_target_allows_for_the_prompt() -> None:
    assert sla.ttft_target_s(CHAT, 0) == 2.0
    # The example: an 85,000-token prompt gets 2 + 4.25 s, not an impossible 2 s.
    assert sla.ttft_target_s(CHAT, 85_000) == pytest.approx(6.25)


def test_tpot_counts_the_tokens_after_the_first() -> None:
    assert sla.tpot_of(1.0, 11.0, 101) == pytest.approx(0.1)
    assert sla.tpot_of(1.0, 11.0, 1) is None
    assert sla.meets_tpot(CHAT, 1.0, 11.0, 101)
    assert not sla.meets_tpot(CHAT, 1.0, 11.1, 101)
    assert sla.meets_tpot(BULK, 1.0, 500.0, 101)  # no per-token target
    assert not sla.meets_tpot(CHAT, None, 11.0, 101)


def test_slo_needs_success_and_both_targets() -> None:
    assert sla.meets_slo(CHAT, 20_000, 11, "succeeded", 2.9, 3.5)
    assert not sla.meets_slo(CHAT, 20_000, 11, "succeeded", 3.1, 3.5)  # TTFT past 3 s
    assert not sla.meets_slo(CHAT, 20_000, 11, "succeeded", 2.9, 4.1)  # 0.12 s per token
    assert not sla.meets_slo(CHAT, 20_000, 11, "expired", 2.9, 3.5)


@given(st.integers(0, 200_000), st.integers(0, 200_000))
def test_longer_prompts_never_get_less_time(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert sla.ttft_target_s(CHAT, lo) <= sla.ttft_target_s(CHAT, hi)


def test_reports_keep_the_flat_column_beside_the_new_ones() -> None:
    rows = [
        # long prompt, first token at 3 s: misses the flat 2 s SLA, meets the length-aware one
        Outcome("realtime", "succeeded", 0.5, 3.0, 5.0, prompt_tokens=40_000, output_tokens=21),
        # short prompt, fast first token, slow decode: 0.2 s per token
        Outcome("realtime", "succeeded", 0.1, 0.5, 4.5, prompt_tokens=100, output_tokens=21),
        Outcome("realtime", "expired", None, None, None, prompt_tokens=100, output_tokens=21),
    ]
    got = class_summary(rows, {"realtime": 2.0}, classes=[CHAT])["realtime"]
    assert got["sla_attainment"] == pytest.approx(1 / 3)
    assert got["ttft_attainment"] == pytest.approx(2 / 3)
    assert got["tpot_attainment"] == pytest.approx(1 / 3)
    assert got["slo_attainment"] == pytest.approx(1 / 3)
    assert "slo_attainment" not in class_summary(rows, {"realtime": 2.0})["realtime"]


def test_default_classes_cite_their_tpot_targets() -> None:
    classes = Settings.load().class_by_name
    assert classes["realtime"].tpot_s == 0.1 and classes["standard"].tpot_s == 0.2
    assert classes["batch"].tpot_s is None
