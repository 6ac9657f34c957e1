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


def test_deepest_skips_blocks_every_worker_holds() -> None:
    """A system prompt on every worker names the whole fleet in ``match``; ``deepest``
    names the workers holding more of the chain than the crowd."""
    index = PrefixIndex()
    for i in range(10):
        index.set_capacity(f"w{i}", 10_000)
        index.touch(f"w{i}", 16, (1, 2))  # the shared system blocks
    index.touch("w7", 16, (1, 2, 3, 4, 5))
    index.touch("w3", 16, (1, 2, 3))
    chain = (1, 2, 3, 4, 5, 6)
    assert len(index.match(chain)) == 10
    assert index.deepest(chain, 3) == {"w7": 5, "w3": 3}
    assert index.deepest(chain, 1) == {"w7": 5}
    assert index.deepest((1, 2), 3) == {}  # only the crowd's blocks: no candidate
    assert index.deepest(chain, 0) == {} and index.deepest((9,), 5) == {}
    assert index.deepest(chain, 20) == index.match(chain)
    assert (index.held("w7", chain), index.held("w9", chain), index.held("x", chain)) == (5, 2, 0)


@given(
    st.lists(
        st.tuples(st.sampled_from("abcdef"), st.integers(0, 2), st.integers(0, 6)),
        max_size=30,
    ),
    st.integers(0, 2),
    st.integers(1, 6),
    st.integers(1, 7),
)
def test_deepest_names_the_holders_of_more_than_the_crowd(
    touches: list[tuple[str, int, int]], base: int, length: int, limit: int
) -> None:
    """Chains as a model server holds them: prefixes of a few conversations, LRU-evicted."""
    convs = [tuple(range(100 * c, 100 * c + 6)) for c in range(3)]
    index = PrefixIndex()
    for w, c, n in touches:
        index.set_capacity(w, 96)  # six 16-token blocks: evictions
        index.touch(w, 16, convs[c][:n])
    chain = convs[base][:length]
    every = index.match(chain)
    top = index.deepest(chain, limit)
    assert len(top) <= limit
    assert all(every[w] == n for w, n in top.items())
    for w, n in every.items():
        if w not in top:  # it holds no more than blocks more than ``limit`` workers hold
            assert len(index.match(chain[:n])) > limit
            assert not top or n < min(top.values())
    assert all(index.held(w, chain) == n for w, n in every.items())
