"""The prefix index (inferq.policy.prefix_index): per-worker LRU bounded by KV tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inferq.policy.prefix_index import PrefixIndex


def test_match_gives_each_worker_its_leading_blocks() -> None:
    index = PrefixIndex()
    for w in ("a", "b"):
        index.set_capacity(w, 10_000)
    index.touch("a", 16, (1, 2, 3, 4))
    index.touch("b", 16, (1, 2, 9))
    assert index.match((1, 2, 3, 4, 5)) == {"a": 4, "b": 2}
    assert index.match((7, 1, 2)) == {}


def test_capacity_evicts_least_recent_tail_first() -> None:
    index = PrefixIndex()
    index.set_capacity("a", 64)  # four 16-token blocks
    index.touch("a", 16, (1, 2, 3))
    index.touch("a", 16, (1, 7))  # 1 is touched again, 7 is new: 4 blocks
    index.touch("a", 16, (1, 8))  # over by one: the oldest (3, the first chain's tail) goes
    assert index.match((1, 2, 3)) == {"a": 2}
    assert index.used_tokens("a") == 64


def test_drop_and_retain_forget_workers() -> None:
    index = PrefixIndex()
    for w in ("a", "b"):
        index.set_capacity(w, 1000)
        index.touch(w, 16, (1, 2))
    index.retain(["b"])
    assert index.match((1, 2)) == {"b": 2}
    index.drop("b")
    assert index.match((1,)) == {} and index.workers() == frozenset()


def test_a_worker_without_a_capacity_learns_nothing() -> None:
    index = PrefixIndex()
    index.touch("a", 16, (1, 2))
    assert index.match((1,)) == {}


def test_a_missed_forecast_shrinks_the_worker_s_modelled_cache() -> None:
    index = PrefixIndex()
    index.set_capacity("a", 160)
    index.touch("a", 16, tuple(range(1, 11)))  # ten blocks: full
    index.observe("a", forecast_tokens=160, served_tokens=0, block=16)
    assert index.blocks("a") == 8  # 0.8 x 160 tokens
    index.observe("a", forecast_tokens=16, served_tokens=16, block=16)  # confirmed: grows back
    index.touch("a", 16, (20,))
    assert index.blocks("a") == 8  # 0.82 x 160 = 131 tokens: still 8 blocks
    for _ in range(10):
        index.observe("a", forecast_tokens=16, served_tokens=16, block=16)
    index.touch("a", 16, (21, 22))
    assert index.blocks("a") == 10  # back to the whole capacity


chains = st.lists(
    st.lists(st.integers(0, 30), min_size=1, max_size=8).map(tuple), min_size=1, max_size=30
)


@given(chains, st.integers(16, 400))
def test_the_index_never_exceeds_capacity_and_match_agrees_with_a_scan(
    touches: list[tuple[int, ...]], capacity: int
) -> None:
    index = PrefixIndex()
    for w in ("a", "b"):
        index.set_capacity(w, capacity)
    for i, chain in enumerate(touches):
        index.touch("ab"[i % 2], 16, chain)
    for w in ("a", "b"):
        assert index.used_tokens(w) <= capacity
    held: dict[str, set[int]] = {w: set() for w in "ab"}
    for chain in touches:
        for h in chain:
            for w in index.match((h,)):
                held[w].add(h)
    for chain in touches:
        found = index.match(chain)
        for w in "ab":
            n = 0
            while n < len(chain) and chain[n] in held[w]:
                n += 1
            assert found.get(w, 0) == n
