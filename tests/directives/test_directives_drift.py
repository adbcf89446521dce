"""The token diff of ``directives.drift`` (pure): the spans it returns turn the aligned part
of the cached sequence into a prefix of the new one, checked by building ``T'`` here by
hand, on scripted drifts (deletion, insertion, replacement) and random ones; its bounds stop
the alignment and say which one did."""

from __future__ import annotations

import random

import pytest

from leyline_agent.directives.drift import drift_spans


def spliced(t, spans):
    out, at = [], 0
    for s in spans:
        out += t[at : s.start] + list(s.replacement)
        at = s.end
    return out


def check(t, n, **kw):
    d = drift_spans(t, n, **kw)
    tp = spliced(t, d.spans) + t[d.spans[-1].end if d.spans else 0 : d.aligned]
    assert tp == n[: len(tp)] and len(tp) == d.new_aligned
    return d


def test_scripted_drifts_at_100k_tokens():
    rng = random.Random(0)
    L = 100_000
    t = [rng.randrange(6000) for _ in range(L)]
    think = t[L // 3 : L // 3 + 300]
    n = t[:5] + [1, 2, 3] + t[7 : L // 3] + t[L // 3 + 300 : 2 * L // 3] + [9] * 6 + t[2 * L // 3 :]
    n += [rng.randrange(6000) for _ in range(200)]  # the new turn
    d = check(t, n)
    kinds = [(s.start, s.end, len(s.replacement), s.kind) for s in d.spans]
    assert kinds == [
        (5, 7, 3, "replacement"),
        (L // 3, L // 3 + 300, 0, "deletion"),
        (2 * L // 3, 2 * L // 3, 6, "insertion"),
    ]
    assert d.aligned == L and d.stopped is None and think


def test_random_drifts():
    rng = random.Random(1)
    for _ in range(400):
        t = [rng.randrange(20) for _ in range(rng.randrange(1, 400))]
        n = list(t)
        for _ in range(rng.randrange(4)):
            a = rng.randrange(len(n) + 1)
            n[a : min(len(n), a + rng.randrange(30))] = [
                rng.randrange(20) for _ in range(rng.randrange(30))
            ]
        check(t, n + [rng.randrange(20) for _ in range(rng.randrange(20))])


@pytest.mark.parametrize("bound", ["max_spans", "max_gap"])
def test_bounds_stop_the_alignment(bound):
    rng = random.Random(2)
    t = [rng.randrange(6000) for _ in range(5000)]
    if bound == "max_spans":
        n = list(t)
        for k in range(10):
            n[100 + 400 * k] = 6001  # ten one-token replacements
        d = check(t, n, max_spans=4)
        assert len(d.spans) == 4 and d.stopped == "max_spans" and d.aligned < len(t)
    else:
        n = t[:50] + [rng.randrange(6000) for _ in range(3000)] + t[50:]
        d = check(t, n, max_gap=1024)
        assert d.spans == () and d.stopped == "max_gap" and d.aligned == 50
        assert check(t, n).spans[0].kind == "insertion"  # within the default gap
