"""The one splice planner (``directives.splice_plan``, pure) against an independent
row-by-row computation: the batch applied one directive at a time, right to left, on a list
of row descriptions (where each row of the working sequence comes from, and by how many
positions it has been moved so far), written here from the definition of the modes, not
from the planner. Where rows are turned, float64 RoPE checks that a row of ``T`` at
position ``src`` turned by ``delta`` is the row at its position in ``T'``.
"""

from __future__ import annotations

import math
import random

import pytest

from leyline_agent import edits
from leyline_agent.directives import modes, splice_plan
from leyline_agent.directives.core import Directive, Mode, plan_batch
from leyline_agent.directives.splice_plan import (
    Row,
    amortize_pieces,
    batch_miss,
    plan_splice,
    rows_of,
    splice_counts,
)
from leyline_agent.errors import UnsupportedModeError


def _batch(rng: random.Random, n: int) -> list[Directive]:
    """Random non-overlapping directives over ``T[:n]`` (AMORTIZE and FORGET), right to left."""
    cuts = sorted(rng.sample(range(n + 1), k=2 * rng.randrange(1, 5)))
    out = []
    for i in range(0, len(cuts), 2):
        s, e = cuts[i], cuts[i + 1]
        r = [9000 + rng.randrange(500) for _ in range(rng.randrange(0, 6))]
        if s == e and not r:
            r = [9999]
        mode = Mode.FORGET if rng.random() < 0.25 else Mode.AMORTIZE
        out.append(Directive(start=s, end=e, replacement=r, mode=mode))
    return plan_batch(out, seq_len=n)


def _reference(n: int, order: list[Directive]) -> tuple[list[tuple[bool, int, int]], list[int]]:
    """Each directive on the working sequence, right to left: AMORTIZE keeps ``W[:s]``,
    computes ``R`` at positions ``s..`` (fill rows), moves ``W[e:]`` by delta; FORGET keeps
    ``W[:s]`` and computes ``R + W[e:]`` at positions ``s..``. A row is (fill, src, moved by)."""
    base = list(range(100, 100 + n))
    rows = [(False, p, 0) for p in range(n)]
    toks = list(base)
    for d in order:
        r = list(d.replacement)
        delta = len(r) - (d.end - d.start)
        after = toks[: d.start] + r + toks[d.end :]
        if d.mode is Mode.AMORTIZE:
            fills = [(True, d.start + i, 0) for i in range(len(r))]
            tail = [(f, src, moved + delta) for f, src, moved in rows[d.end :]]
        else:
            fills = [(True, d.start + i, 0) for i in range(len(after) - d.start)]
            tail = []
        rows = rows[: d.start] + fills + tail
        toks = after
    return rows, toks


def _rope(x: list[float], pos: float, theta: float = 10000.0) -> list[float]:
    """Float64 RoPE of one head vector (pairs ``(i, i + D/2)``), at position ``pos``."""
    half = len(x) // 2
    out = list(x)
    for i in range(half):
        a = pos * theta ** (-2 * i / len(x))
        c, s = math.cos(a), math.sin(a)
        out[i], out[i + half] = x[i] * c - x[i + half] * s, x[i] * s + x[i + half] * c
    return out


@pytest.mark.parametrize("seed", range(60))
def test_the_pieces_are_the_batch_applied_row_by_row(seed):
    rng = random.Random(seed)
    n = rng.randrange(8, 80)
    order = _batch(rng, n)
    plan = plan_splice(list(range(100, 100 + n)), order)
    want_rows, want_tokens = _reference(n, order)
    assert plan.tokens == want_tokens
    got = list(rows_of(plan.pieces))
    # a FORGET's whole rest is one fill (over T[:s], turned by the deltas to its left); the
    # reference computes the same rows at the same positions, directive by directive
    assert [(x.fill, x.src + x.delta) for x in got] == [(f, s + m) for f, s, m in want_rows]
    assert [(x.fill, x.src, x.delta) for x in got] == want_rows
    for q, x in enumerate(got):
        assert x.src + x.delta == q  # every row lands at its own position of T'
        if not x.fill:
            assert plan.tokens[q] == 100 + x.src  # a base row carries its own token
    assert plan.prefilled_tokens == sum(x.fill for x in got)
    assert plan.splices == {
        "amortize": sum(d.mode is Mode.AMORTIZE for d in order),
        "forget": sum(d.mode is Mode.FORGET for d in order),
    }


@pytest.mark.parametrize("seed", range(20))
def test_a_moved_row_turned_by_delta_is_the_row_at_its_new_position_float64(seed):
    rng = random.Random(seed)
    n = rng.randrange(8, 64)
    order = _batch(rng, n)
    plan = plan_splice(list(range(n)), order)
    vec = [rng.uniform(-1, 1) for _ in range(16)]
    for q, x in enumerate(rows_of(plan.pieces)):
        if x.fill:
            continue
        turned = _rope(_rope(vec, x.src), x.delta)  # T's row, its band turned by delta
        assert max(abs(a - b) for a, b in zip(turned, _rope(vec, q), strict=True)) < 1e-9


@pytest.mark.parametrize("seed", range(30))
def test_one_amortize_row_by_row(seed):
    """The AMORTIZE rule the block and radix engines place: prefix rows from ``T``, R's rows
    from the head (computed at their own positions), tail row ``p`` from ``T[p - delta]``
    turned by delta."""
    rng = random.Random(seed)
    n = rng.randrange(1, 60)
    s = rng.randrange(0, n + 1)
    e = rng.randrange(s, n + 1)
    r = list(range(rng.randrange(0, 8)))
    delta = len(r) - (e - s)
    want = [Row(p, 0, False) for p in range(s)] + [Row(p, 0, True) for p in range(s, s + len(r))]
    want += [Row(p - delta, delta, False) for p in range(s + len(r), n + delta)]
    assert list(rows_of(amortize_pieces(s, e, r, n))) == want


def test_a_mode_without_a_planned_tail_is_refused_by_name(monkeypatch):
    """A new verb's rule (tail "decay") is refused by the planner, never planned as another
    mode."""
    monkeypatch.setitem(modes.RULES, Mode.DECAY, modes.ModeRule(Mode.DECAY, "decay", False))
    monkeypatch.setattr(splice_plan, "ALL_MODES", frozenset(modes.RULES))  # as if served
    monkeypatch.setattr(edits, "RESERVED_MODES", frozenset({Mode.PIN, Mode.SCRATCH}))
    d = Directive(start=2, end=4, replacement=[1], mode=Mode.DECAY)
    with pytest.raises(UnsupportedModeError, match="'decay' has no splice plan"):
        plan_splice(list(range(10)), [d])
    assert splice_counts([d]) == {"amortize": 0, "forget": 0, "decay": 1}


@pytest.mark.parametrize("seed", range(40))
def test_batch_miss_finds_the_first_span_the_earlier_splices_leave_uncached(seed):
    """Against the batch run on a cache of token lists: each splice caches what it writes
    (AMORTIZE: the head and the cached tail; FORGET: all of ``T'``), cut to whole units."""
    rng = random.Random(seed)
    n = rng.randrange(8, 80)
    order = _batch(rng, n)
    unit = rng.choice([1, 4, 16])
    w = list(range(100, 100 + n))
    cache, want = list(w), None
    for d in order:
        if d.end > len(cache):
            want = (d.start, d.end, len(cache))
            break
        r = list(d.replacement)
        after = w[: d.start] + r + w[d.end :]
        kept = w[: d.start] + r + cache[d.end :] if d.mode is Mode.AMORTIZE else after
        cache, w = kept[: len(kept) // unit * unit], after
    got = batch_miss(order, n, unit)
    if want is None:
        assert got is None
    else:
        assert got is not None and f"span [{want[0]}, {want[1]})" in got
        assert f"first {want[2]} tokens" in got
    if unit == 1:
        assert got is None  # a row-granular cache holds every row a splice writes
