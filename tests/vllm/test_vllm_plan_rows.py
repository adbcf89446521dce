"""The splice plan when the plugin holds rows past the last full block (``hold_partial``,
``t_rows``), on a simulated paged cache, no server: ``T``'s rows come from its full blocks
and its held partial block, and every row of ``T'`` is written, the last partial block too.
The expectation is written from the definition of AMORTIZE (prefix rows of T, R's rows from
the head, tail row i of T at i + delta), not from the plan."""

from __future__ import annotations

import random

import pytest

from leyline_agent.errors import CacheMissError
from leyline_agent.vllm_plugin.plan import plan_block_splice, row_copies


def _ids(n: int, rng: random.Random, used: set[int]) -> list[int]:
    out = []
    while len(out) < n:
        bid = rng.randrange(1, 10_000)
        if bid not in used:
            used.add(bid)
            out.append(bid)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_plan_writes_every_row_of_t_prime(seed):
    rng = random.Random(seed)
    b = rng.choice([4, 8, 32])
    n = rng.randrange(2 * b, 8 * b)
    tokens = list(range(1000, 1000 + n))
    t_rows = rng.choice([n, n, n - rng.randrange(0, b)])  # rows of T known (held or not)
    s = rng.randrange(0, n)
    e = rng.randrange(s, n + 1)
    r = list(range(5000, 5000 + rng.randrange(0, 3 * b)))
    used: set[int] = set()
    t_blocks = _ids(-(-t_rows // b), rng, used)  # full blocks + the held partial one
    h = s + len(r)
    head_blocks = _ids(-(-h // b), rng, used)
    t_in, h_in = rng.random() < 0.5, rng.random() < 0.5
    content = {}  # slot -> ("T", position) or ("H", position)
    for j, bid in enumerate(t_blocks):
        for o in range(b):
            if j * b + o < t_rows:
                content[bid * b + o] = ("T", j * b + o)
    for j, bid in enumerate(head_blocks):
        for o in range(b):
            content[bid * b + o] = ("H", j * b + o)
    kw = dict(t_in_target=t_in, head_in_target=h_in, t_rows=t_rows, hold_partial=True)
    if e > t_rows:
        with pytest.raises(CacheMissError):
            plan_block_splice(b, tokens, s, e, r, t_blocks, head_blocks, **kw)
        return
    plan = plan_block_splice(b, tokens, s, e, r, t_blocks, head_blocks, **kw)
    delta = len(r) - (e - s)
    known = h + t_rows - e
    new = tokens[:s] + r + tokens[e:]
    assert plan.tokens == new[:known] and plan.rotated_tokens == known - h
    assert plan.partial_rows == known % b and plan.full_tokens == new[: (known // b) * b]
    fresh = _ids(plan.num_new_blocks, rng, used)
    src, dst, deltas = row_copies(plan, fresh, b)
    assert len(set(dst)) == len(dst) and not set(dst) & set(content)  # fresh rows only
    for slot, d_slot, d in zip(src, dst, deltas, strict=True):
        content[d_slot] = (*content[slot], d)
    it = iter(fresh)
    for j, blk in enumerate(plan.blocks):
        bid = blk.reuse if blk.reuse is not None else next(it)
        rows = b if j < known // b else known % b
        assert blk.reuse is None or rows == b  # a partial block is always a fresh copy
        for o in range(rows):
            p = j * b + o
            got = content[bid * b + o]
            if p < s:
                want = ("T", p)
            elif p < h:
                want = ("H", p)
            else:
                want = ("T", p - delta, delta)
            if blk.reuse is None and len(want) == 2:
                want = (*want, 0)
            assert got == want, (p, got, want)
