"""Radix tree, allocator and eviction (no model), plus eviction through a tiny engine."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.radix import RadixCache
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams


def _state(tree: RadixCache):
    return tree.sequences(), [(n.last_access, n.lock_ref) for n in tree._nodes()]


def test_match_prefix_is_pure_and_longest():
    tree = RadixCache()
    assert tree.insert([1, 2, 3, 4], [10, 11, 12, 13]).held == 0
    assert tree.insert([1, 2, 9], [10, 11, 19]).held == 2
    before = _state(tree)
    m = tree.match_prefix([1, 2, 3, 7])  # ends inside the [3, 4] edge: no split
    assert (m.length, m.slots) == (3, [10, 11, 12])
    assert tree.match_prefix([5]).length == 0
    assert _state(tree) == before
    assert tree.total_tokens == 5


def test_insert_reports_already_cached_prefix():
    tree = RadixCache()
    tree.insert([1, 2, 3], [0, 1, 2])
    assert tree.insert([1, 2, 3], [5, 6, 7]).held == 3
    assert tree.match_prefix([1, 2, 3]).slots == [0, 1, 2]  # first writer wins


def test_evict_lru_and_locks():
    tree = RadixCache()
    tree.insert([1, 2], [0, 1])
    tree.insert([3, 4], [2, 3])
    tree.insert([5, 6], [4, 5])
    tree.touch(tree.match_prefix([1, 2]).node)  # [3,4] is now the oldest
    locked = tree.match_prefix([3, 4]).node
    tree.lock(locked)
    freed = tree.evict(2)
    assert sorted(freed) == [4, 5]  # [3,4] is older but locked
    assert tree.match_prefix([3, 4]).length == 2
    assert tree.evict(100) == [0, 1]  # only unlocked leaves go
    tree.unlock(locked)
    assert sorted(tree.evict(100)) == [2, 3]
    assert tree.total_tokens == 0


def test_evicting_a_leaf_exposes_its_parent():
    tree = RadixCache()
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4], [0, 1, 3])
    assert sorted(tree.evict(3)) == [0, 1, 2, 3]
    assert tree.total_tokens == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12))
def test_tree_matches_a_dict_of_sequences(seqs):
    """Every inserted sequence is found whole with the slots of its first insertion."""
    tree = RadixCache()
    first: dict[tuple, int] = {}  # prefix -> slot of its last token, first writer wins
    nxt = 0
    for s in seqs:
        slots = list(range(nxt, nxt + len(s)))
        nxt += len(s)
        tree.insert(s, slots)
        for i in range(len(s)):
            first.setdefault(tuple(s[: i + 1]), slots[i])
    for s in seqs:
        m = tree.match_prefix(s)
        assert m.length == len(s)
        assert m.slots == [first[tuple(s[: i + 1])] for i in range(len(s))]
    assert tree.total_tokens == len(first)


def test_allocator_grows_and_recycles():
    caps = []

    def grow(n):
        caps.append(n)
        return max(n, 8)

    a = SlotAllocator(4, grow=grow)
    x = a.alloc(3)
    y = a.alloc(3)  # needs growth
    assert len(set(x + y)) == 6 and max(x + y) < 8 and caps
    a.free(x)
    assert a.num_used == 3 and a.num_free == 5


def test_engine_eviction_respects_budget_and_lru():
    eng = Engine.from_pretrained(tiny_model_dir("llama"), cache_budget_tokens=40)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 3000) for _ in range(15)] for _ in range(4)]
    for s in seqs:
        eng.generate(s, SamplingParams(max_tokens=0))
        assert eng.cache.tree.total_tokens <= 40
    st = eng.stats()
    assert st.cache_tokens <= 40 and st.evicted_tokens >= 15
    assert eng.cache.tree.match_prefix(seqs[-1]).length == 15  # most recent stays
    assert eng.cache.tree.match_prefix(seqs[0]).length == 0  # oldest went
    # no slot leaks: every used slot is held by the tree
    held = {s for _, sl in eng.cache.tree.sequences() for s in sl}
    assert eng.allocator.num_used == len(held)
