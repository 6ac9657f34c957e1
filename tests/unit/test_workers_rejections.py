"""The run of identical refusals that tells a broken model server from bad requests."""

from __future__ import annotations

import pytest

from inferq.workers.rejections import RejectionStreak, signature

BAD = signature(400, "model 'llama' does not exist")


def test_three_refusals_alike_from_two_tenants_make_the_server_broken() -> None:
    streak = RejectionStreak(length=3, tenants=2)
    assert not streak.refused(BAD, request_id="r1", tenant="a")
    assert not streak.refused(BAD, request_id="r2", tenant="b")
    assert streak.refused(BAD, request_id="r3", tenant="a")


def test_one_tenant_repeating_its_own_mistake_is_not_the_server() -> None:
    streak = RejectionStreak(length=3, tenants=2)
    assert not any(streak.refused(BAD, request_id=f"r{i}", tenant="a") for i in range(10))


def test_a_success_or_a_different_refusal_between_them_starts_over() -> None:
    streak = RejectionStreak(length=3, tenants=2)
    streak.refused(BAD, request_id="r1", tenant="a")
    streak.refused(BAD, request_id="r2", tenant="b")
    streak.succeeded()
    assert not streak.refused(BAD, request_id="r3", tenant="a")
    assert not streak.refused(signature(400, "max_tokens too large"), request_id="r4", tenant="b")
    assert streak.run == 1


def test_the_same_request_refused_again_does_not_lengthen_the_run() -> None:
    streak = RejectionStreak(length=3, tenants=2)
    for _ in range(5):
        assert not streak.refused(BAD, request_id="r1", tenant="a")
    assert not streak.refused(BAD, request_id="r2", tenant="b")
    assert streak.run == 2


def test_numbers_in_the_message_do_not_make_refusals_different() -> None:
    assert signature(400, "prompt has 5000 tokens, limit 4096") == signature(
        400, "prompt has 7000 tokens, limit 4096"
    )
    assert signature(400, "x") != signature(422, "x")


def test_a_streak_needs_positive_bounds() -> None:
    with pytest.raises(ValueError):
        RejectionStreak(length=0)
