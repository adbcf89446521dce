"""REPAIR's rows on the block plan (``directives.block_plan``, vLLM's): the rows are
``directives.repair``'s selection over ``T'``'s tail (as ``leyline serve`` selects them),
each in a fresh block, and ``block_ids`` (the block table the row forward places row ``p``
of ``T'`` by, at offset ``p % B`` of block ``p // B``) takes the fresh ids in order. Expectations
are written from the definitions (tail rows after ``R``; slot = block id * B + offset)."""

from __future__ import annotations

import random

import pytest

from leyline_agent.directives.block_plan import plan_block_splice, repair_rows


def _plan(seed: int):
    rng = random.Random(seed)
    b = rng.choice([4, 8, 32])
    n = rng.randrange(3 * b, 8 * b)
    tokens = [rng.randrange(3, 40) for _ in range(n)]  # a small vocabulary: quotes happen
    s = rng.randrange(1, n - b)
    e = rng.randrange(s, min(n, s + 2 * b))
    r = [rng.randrange(3, 40) for _ in range(rng.randrange(0, b))]
    t_blocks = list(range(100, 100 + -(-n // b)))
    head_blocks = list(range(500, 500 + -(-(s + len(r)) // b)))
    plan = plan_block_splice(b, tokens, s, e, r, t_blocks, head_blocks, t_in_target=True,
                             head_in_target=True, hold_partial=True)  # fmt: skip
    return b, tokens, s, e, r, plan


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("budget", [0.0, 0.05, 0.3, 1.0])
def test_repair_rows_are_tail_rows_in_fresh_blocks(seed, budget):
    b, tokens, s, e, r, plan = _plan(seed)
    rows = repair_rows(plan, tokens, s, e, len(r), {"budget": budget}, b)
    tail = range(s + len(r), len(plan.tokens))
    assert rows == sorted(set(rows)) and all(p in tail for p in rows)
    want = len(tail) if budget == 1.0 else -(-int(budget * 1000) * len(tail) // 1000)
    assert len(rows) == want
    assert all(plan.blocks[p // b].reuse is None for p in rows)
    assert repair_rows(plan, tokens, s, e, len(r), None, b) == []


@pytest.mark.parametrize("seed", range(10))
def test_block_ids_take_the_fresh_ids_in_order(seed):
    b, _, _, _, _, plan = _plan(seed)
    new = list(range(900, 900 + plan.num_new_blocks))
    fresh = iter(new)
    want = [blk.reuse if blk.reuse is not None else next(fresh) for blk in plan.blocks]
    assert plan.block_ids(new) == want
    assert len(want) * b >= len(plan.tokens)  # every row of T' has a block
    with pytest.raises(ValueError, match="block ids"):
        plan.block_ids(new[:-1] if new else [1])
