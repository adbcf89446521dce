"""The vLLM plugin's splice plan (pure, main venv): on a simulated paged cache, the rows a
plan assembles for ``T'`` are exactly the AMORTIZE rows, block by block, whatever the span,
block size and namespaces. The expectation is written from the definition of AMORTIZE
(prefix rows of T, R's rows from the head, tail row i of T at i + delta), not from the plan.
"""

from __future__ import annotations

import random

import pytest

from leyline_agent.errors import CacheMissError
from leyline_agent.vllm_plugin.plan import plan_block_splice, row_copies


def _paged(n_rows: int, b: int, rng: random.Random, used: set[int]) -> list[int]:
    blocks = []
    while len(blocks) * b < n_rows:
        bid = rng.randrange(1, 10_000)
        if bid not in used:
            used.add(bid)
            blocks.append(bid)
    return blocks


@pytest.mark.parametrize("seed", range(40))
def test_plan_assembles_the_amortize_rows(seed):
    rng = random.Random(seed)
    b = rng.choice([4, 8, 32])
    n = rng.randrange(2 * b, 8 * b)
    tokens = list(range(1000, 1000 + n))
    s = rng.randrange(0, n)
    e = rng.randrange(s, n + 1)
    r = list(range(5000, 5000 + rng.randrange(0, 3 * b)))
    used: set[int] = set()
    t_blocks = _paged((n // b) * b, b, rng, used)[: n // b]  # T's full blocks are cached
    h = s + len(r)
    head_blocks = _paged(h, b, rng, used)
    t_in, h_in = rng.random() < 0.5, rng.random() < 0.5
    content = {}  # slot -> what a row holds: ("T", position) or ("H", position)
    for j, bid in enumerate(t_blocks):
        for o in range(b):
            content[bid * b + o] = ("T", j * b + o)
    for j, bid in enumerate(head_blocks):
        for o in range(b):
            content[bid * b + o] = ("H", j * b + o)
    if e > len(t_blocks) * b:
        with pytest.raises(CacheMissError):
            plan_block_splice(
                b, tokens, s, e, r, t_blocks, head_blocks, t_in_target=t_in, head_in_target=h_in
            )
        return
    plan = plan_block_splice(
        b, tokens, s, e, r, t_blocks, head_blocks, t_in_target=t_in, head_in_target=h_in
    )
    delta = len(r) - (e - s)
    new = tokens[:s] + r + tokens[e:]
    cached_t = len(t_blocks) * b
    known = h + cached_t - e
    assert len(plan.blocks) == known // b and plan.tokens == new[: (known // b) * b]
    fresh_ids = _paged(plan.num_new_blocks * b, b, rng, used)[: plan.num_new_blocks]
    src, dst, deltas = row_copies(plan, fresh_ids, b)
    assert len(set(dst)) == len(dst) and not set(dst) & set(content)  # fresh rows only
    for slot, d_slot, d in zip(src, dst, deltas, strict=True):
        content[d_slot] = (*content[slot], d)
    it = iter(fresh_ids)
    for j, blk in enumerate(plan.blocks):
        bid = blk.reuse if blk.reuse is not None else next(it)
        for o in range(b):
            p = j * b + o
            row = content[bid * b + o]
            if p < s:
                want = [("T", p)] if p // b < len(t_blocks) else [("H", p)]
                if blk.reuse is None:
                    want = [(*w, 0) for w in want]
            elif p < h:
                want = [("H", p)] if blk.reuse is not None else [("H", p, 0)]
            else:
                want = [("T", p - delta, delta)]
            assert row in want, (j, o, p, row, want)
        if blk.reuse is not None:  # only blocks of one kind, in the target namespace
            assert (j + 1) * b <= s and t_in or (j * b >= s and (j + 1) * b <= h and h_in)
    assert plan.rotated_tokens == sum(1 for d in deltas if d) or delta == 0
