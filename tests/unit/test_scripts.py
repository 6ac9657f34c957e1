"""Smoke tests of scripts/bench_*.py: each runs at tiny sizes, prints its table, writes JSON.

Nothing here times anything: the figures' values are not checked, only that each
script runs end to end on the real Redis, reports under its documented keys and
leaves no key behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _bench  # noqa: E402


def test_percentile_interpolates_like_numpy() -> None:
    assert _bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert _bench.percentile([5.0, 1.0, 3.0], 0) == 1.0
    assert _bench.percentile([5.0, 1.0, 3.0], 100) == 5.0
    assert _bench.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert _bench.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        _bench.percentile([], 50)
    with pytest.raises(ValueError, match=r"outside 0\.\.100"):
        _bench.percentile([1.0], 101)
