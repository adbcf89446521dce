"""The splice plan on a paged cache's blocks (``directives.block_plan``, vLLM's): on a
simulated paged cache, the rows a plan assembles for ``T'`` are exactly the AMORTIZE rows, block by block, whatever the span,
block size and namespaces. The expectation is written from the definition of AMORTIZE
(prefix rows of T, R's rows from the head, tail row i of T at i + delta), not from the plan.
"""

from __future__ import annotations

import random

import pytest

from leyline_agent.directives.block_plan import (
    copy_runs,
    fill_rows,
    plan_block_splice,
    row_copies,
)
from leyline_agent.errors import CacheMissError


def _ids(n: int, rng: random.Random, used: set[int]) -> list[int]:
    """``n`` block ids, none of them in ``used`` (then added to it)."""
    out: list[int] = []
    while len(out) < n:
        bid = rng.randrange(1, 10_000)
        if bid not in used:
            used.add(bid)
            out.append(bid)
    return out


def _sequence(rng: random.Random) -> tuple[int, int, list[int]]:
    """A block size ``b`` and a base ``T`` of ``n`` distinct tokens, 2 to 8 blocks long."""
    b = rng.choice([4, 8, 32])
    n = rng.randrange(2 * b, 8 * b)
    return b, n, list(range(1000, 1000 + n))


def _content(b: int, t_blocks: list[int], t_rows: int, head_blocks: list[int]) -> dict:
    """slot -> what a row holds: ``("T", position)`` for ``T``'s first ``t_rows`` rows,
    ``("H", position)`` for the head's."""
    content = {}
    for j, bid in enumerate(t_blocks):
        for o in range(min(b, t_rows - j * b)):
            content[bid * b + o] = ("T", j * b + o)
    for j, bid in enumerate(head_blocks):
        for o in range(b):
            content[bid * b + o] = ("H", j * b + o)
    return content


def _copy(plan, content: dict, fresh: list[int], b: int) -> list[int]:
    """The plan's row copies applied to ``content`` row by row (a copied row records its
    delta), checked to write fresh rows only; the block ids of ``T'``."""
    src, dst, deltas = row_copies(plan, fresh, b)
    assert len(set(dst)) == len(dst) and not set(dst) & set(content)  # fresh rows only
    for slot, d_slot, d in zip(src, dst, deltas, strict=True):
        content[d_slot] = (*content[slot], d)
    it = iter(fresh)
    return [blk.reuse if blk.reuse is not None else next(it) for blk in plan.blocks]


@pytest.mark.parametrize("seed", range(40))
def test_plan_assembles_the_amortize_rows(seed):
    rng = random.Random(seed)
    b, n, tokens = _sequence(rng)
    s = rng.randrange(0, n)
    e = rng.randrange(s, n + 1)
    r = list(range(5000, 5000 + rng.randrange(0, 3 * b)))
    used: set[int] = set()
    t_blocks = _ids(n // b, rng, used)  # T's full blocks are cached
    h = s + len(r)
    head_blocks = _ids(-(-h // b), rng, used)
    t_in, h_in = rng.random() < 0.5, rng.random() < 0.5
    content = _content(b, t_blocks, len(t_blocks) * b, head_blocks)
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
    ids = _copy(plan, content, _ids(plan.num_new_blocks, rng, used), b)
    for j, (blk, bid) in enumerate(zip(plan.blocks, ids, strict=True)):
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
    turned = sum(1 for blk in plan.blocks for _, d in blk.rows if d)
    assert plan.rotated_tokens == turned or delta == 0


# -- rows held past the last full block (``hold_partial``, ``t_rows``): ``T``'s rows come from
# its full blocks and its held partial block, and every row of ``T'`` is written, the last
# partial block too (expectations from the definition of AMORTIZE, as above)
@pytest.mark.parametrize("seed", range(60))
def test_plan_writes_every_row_of_t_prime(seed):
    rng = random.Random(seed)
    b, n, tokens = _sequence(rng)
    t_rows = rng.choice([n, n, n - rng.randrange(0, b)])  # rows of T known (held or not)
    s = rng.randrange(0, n)
    e = rng.randrange(s, n + 1)
    r = list(range(5000, 5000 + rng.randrange(0, 3 * b)))
    used: set[int] = set()
    t_blocks = _ids(-(-t_rows // b), rng, used)  # full blocks + the held partial one
    h = s + len(r)
    head_blocks = _ids(-(-h // b), rng, used)
    t_in, h_in = rng.random() < 0.5, rng.random() < 0.5
    content = _content(b, t_blocks, t_rows, head_blocks)
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
    ids = _copy(plan, content, _ids(plan.num_new_blocks, rng, used), b)
    for j, (blk, bid) in enumerate(zip(plan.blocks, ids, strict=True)):
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


# -- no head request (``head_blocks`` None): ``R``'s rows are computed by the splice in their
# fresh slots (``fill_rows``, written here as ``("R", p)``), every other row as above
@pytest.mark.parametrize("seed", range(60))
def test_a_plan_without_a_head_leaves_r_to_the_splice_in_fresh_blocks(seed):
    rng = random.Random(seed)
    b, n, tokens = _sequence(rng)
    t_rows = rng.choice([n, n - rng.randrange(0, b)])
    s = rng.randrange(0, t_rows + 1)
    e = rng.randrange(s, t_rows + 1)
    r = list(range(5000, 5000 + rng.randrange(0, 3 * b)))
    used: set[int] = set()
    t_blocks = _ids(-(-t_rows // b), rng, used)
    t_in, hold = rng.random() < 0.5, rng.random() < 0.5
    content = _content(b, t_blocks, t_rows, [])
    plan = plan_block_splice(
        b, tokens, s, e, r, t_blocks, None, t_in_target=t_in, head_in_target=True,
        t_rows=t_rows, hold_partial=hold,
    )  # fmt: skip
    h, delta = s + len(r), len(r) - (e - s)
    known = h + t_rows - e if hold else (h + t_rows - e) // b * b
    assert plan.tokens == (tokens[:s] + r + tokens[e:])[:known]
    fresh = _ids(plan.num_new_blocks, rng, used)
    ids = _copy(plan, content, fresh, b)
    computed = fill_rows(plan, s, len(r))
    assert computed == list(range(s, min(h, known)))
    for p in computed:  # written where the row forward writes them: T''s block, offset
        slot = ids[p // b] * b + p % b
        assert slot not in content and plan.blocks[p // b].reuse is None
        content[slot] = ("R", p)
    for p in range(known):
        got = content[ids[p // b] * b + p % b]
        if p < s:
            want = ("T", p) if plan.blocks[p // b].reuse is not None else ("T", p, 0)
        elif p < h:
            want = ("R", p)
        else:
            want = ("T", p - delta, delta)
        assert got == want, (p, got, want)


def test_copy_runs_takes_only_aligned_in_order_blocks_at_delta_0():
    b = 4
    src = [4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 20, 21, 22, 23, 28, 29, 30, 31]
    dst = [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 4, 5, 6, 7]
    delta = [0] * 12 + [0, 0, 3, 0] + [0] * 4
    # blocks 1, 2 -> 2, 3 whole (one run); misaligned; turned; block 7 -> 1 whole (a new run)
    blocks, rows = copy_runs(src, dst, delta, b)
    assert blocks == [(1, 2, 2), (7, 1, 1)]
    assert rows == [(8, 14), (14, 15), (15, 16)]  # split where the delta changes
    assert copy_runs([4, 5, 6], [8, 9, 10], [0, 0, 0], b) == ([], [(0, 3)])


@pytest.mark.parametrize("seed", range(20))
def test_copy_runs_is_the_row_by_row_copy(seed):
    """Block runs plus the row runs leave every slot as the row-by-row copy does; every move
    is in exactly one of them, and a row run has one delta."""
    rng = random.Random(seed)
    b = rng.choice([2, 4, 8])
    src_blocks = rng.sample(range(0, 20), 6)
    dst_blocks = sorted(rng.sample(range(20, 40), 6)) if seed % 2 else rng.sample(range(20, 40), 6)
    src, dst, delta = [], [], []
    for sb, db in zip(src_blocks, dst_blocks, strict=True):
        offs = (
            list(range(b)) if rng.random() < 0.6 else rng.sample(range(b), rng.randrange(1, b + 1))
        )
        for o in offs:
            src.append(sb * b + o)
            dst.append(db * b + o)
            delta.append(0 if rng.random() < 0.8 else rng.randrange(1, 9))
    rows = {slot: ("row", slot) for slot in range(40 * b)}
    want = dict(rows)
    for s, d, k in zip(src, dst, delta, strict=True):
        want[d] = (*rows[s], k)
    got = dict(rows)
    blocks, runs = copy_runs(src, dst, delta, b)
    for s_blk, d_blk, count in blocks:
        for c in range(count):
            for o in range(b):
                got[(d_blk + c) * b + o] = (*rows[(s_blk + c) * b + o], 0)
    for i, j in runs:
        assert len({delta[k] for k in range(i, j)}) == 1
        for k in range(i, j):
            got[dst[k]] = (*rows[src[k]], delta[k])
    moves = sum(count * b for _, _, count in blocks) + sum(j - i for i, j in runs)
    assert moves == len(src)
    assert got == want
