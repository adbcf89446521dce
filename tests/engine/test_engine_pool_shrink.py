"""The KV pool gives memory back after a burst: the allocator trims its free top, the pool
shrinks to it, the rows still in use keep their bytes, and the engine's answers stay those
of a fresh engine."""

from __future__ import annotations

import random

import pytest
import torch

from leyline_agent.engine import engine as engine_module
from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow


def test_trim_drops_only_a_free_top():
    grown: list[int] = []
    alloc = SlotAllocator(8, grow=lambda n: grown.append(max(n, 16)) or max(n, 16))
    slots = alloc.alloc(14)
    assert alloc.capacity == 16 and grown == [16]
    keep = slots[3]
    alloc.free([s for s in slots if s != keep])
    assert alloc.trim(8) == 8  # everything above the floor is free
    assert alloc.capacity == 8 and sorted(alloc.free_slots()) == [s for s in range(8) if s != keep]
    assert alloc.num_used == 1

    high = alloc.alloc(7) + alloc.alloc(5)  # grows again; the top slot is kept in use
    top = max(high)
    alloc.free([s for s in high if s != top])
    assert alloc.trim(8) == top + 1  # never below a slot in use
    assert top not in alloc.free_slots() and all(s < top for s in alloc.free_slots())
    assert len(alloc.alloc(alloc.num_free)) == top - 1  # every free slot can still be had


@pytest.fixture(scope="module")
def engines():
    path = tiny_model_dir("deepseek_v2")
    return Engine.from_pretrained(path, cache_budget_tokens=64), Engine.from_pretrained(path)


def test_the_pool_shrinks_after_a_burst_and_answers_stay_exact(engines, monkeypatch):
    eng, fresh = engines
    monkeypatch.setattr(engine_module, "SHRINK_INTERVAL_S", 0.0)
    first = eng.pool.capacity
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, eng.vocab_size) for _ in range(first + 700)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    eng.generate(long_prompt, params)  # grows the pool past its first capacity
    assert eng.allocator.num_used <= 64 + 8  # the cache was evicted back to its budget
    assert eng.pool.capacity < first + 700, "the pool kept its burst size"
    assert eng.pool.capacity == eng.allocator.capacity
    assert eng.pool.keys.shape[2] == eng.pool.capacity

    held = eng.cache.tree.all_slots()
    before = eng.pool.snapshot(held) if held else None
    eng.pool.shrink(eng.allocator.trim(first))  # a second trim changes no row in use
    if held:
        for a, b in zip(before, eng.pool.snapshot(held), strict=True):
            assert torch.equal(a, b)
    eng.cache.check()

    prompt = [rng.randrange(100, eng.vocab_size) for _ in range(300)]
    for _ in range(2):  # the second run reuses rows written after the shrink
        got = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
        want = fresh.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
        assert got.output_ids == want.output_ids
