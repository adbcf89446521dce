"""Token-level drift: where a newly rendered prompt differs from a cached sequence (pure).

A chat template can render unchanged messages differently from one turn to the next: a
Qwen3-style template drops earlier turns' ``<think>`` spans once a new user message arrives
(a deletion), renders an empty think block for a reply sent back without its reasoning (an
insertion), and a head-of-prompt line (a reasoning effort, a date) changes in place (a
replacement). ``drift_spans(cached, new)`` aligns the cached sequence ``T`` with a prefix of
the new prompt ``N`` and returns the spans that turn ``T[:aligned]`` into ``N[:len(T')]``;
everything of ``N`` after that is the new turn, prefilled as usual.

The diff is built for speed at 100k tokens, in Python:

1. the common prefix, found by comparing slices in growing then halving chunks (the
   comparisons run in C, so a long equal run costs a few dozen slice compares);
2. at each mismatch, the nearest *anchor*: a ``k``-gram of ``T`` that occurs in ``N``
   within ``max_gap`` tokens, chosen to minimise the tokens skipped on both sides
   (``(T[i:i+di] -> N[j:j+dj])`` with ``di + dj`` smallest), whose equal run is at least
   ``min_run`` tokens (or reaches the end of ``T``). Only the two windows around the
   mismatch are hashed, in windows that grow ×8 from 64 tokens, so a small span costs
   hundreds of operations, never a pass over the whole sequence;
3. the equal run after the anchor, as in 1, then the next mismatch.

Bounded: at most ``max_spans`` spans, each within ``max_gap`` tokens on either side. When a
bound is hit, or no anchor is found, the alignment stops there: ``aligned`` says how much of
``T`` the spans cover (``T[aligned:]`` is not reused), and ``stopped`` why (``None``: all of
``T`` was aligned). The result is exact by construction: splicing the spans into
``T[:aligned]`` gives ``N[:new_aligned]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Drift", "DriftSpan", "drift_spans"]

MAX_SPANS = 16
MAX_GAP = 4096
ANCHOR = 8  # k: tokens of an anchor
MIN_RUN = 16  # an anchor's equal run, unless it reaches the end of T
_FIRST_WINDOW = 64


@dataclass(frozen=True, slots=True)
class DriftSpan:
    """``T[start:end]`` becomes ``replacement`` (deletion: empty; insertion: start == end)."""

    start: int
    end: int
    replacement: tuple[int, ...]

    @property
    def kind(self) -> str:
        if not self.replacement:
            return "deletion"
        return "insertion" if self.start == self.end else "replacement"


@dataclass(frozen=True, slots=True)
class Drift:
    spans: tuple[DriftSpan, ...]
    aligned: int  # T[:aligned] is covered; T' = splice(T[:aligned], spans)
    new_aligned: int  # == len(T'): N[:new_aligned] == T'
    stopped: str | None = None  # why the alignment ended before len(T): max_spans,
    # max_gap (no anchor within the window) or None

    @property
    def kept(self) -> int:
        """Tokens of ``T`` the splice keeps (outside the spans, inside ``aligned``)."""
        return self.aligned - sum(s.end - s.start for s in self.spans)


def _equal_run(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """Length of the common run ``a[i:] == b[j:]`` (galloping slice compares)."""
    limit = min(len(a) - i, len(b) - j)
    n, step = 0, 32
    while n < limit:  # gallop up while chunks are equal
        step = min(step, limit - n)
        if a[i + n : i + n + step] != b[j + n : j + n + step]:
            break
        n += step
        step *= 2
    else:
        return n
    while step > 1:  # halve down into the first unequal chunk
        step //= 2
        if a[i + n : i + n + step] == b[j + n : j + n + step]:
            n += step
    while n < limit and a[i + n] == b[j + n]:
        n += 1
    return n


def _anchor(
    t: Sequence[int], i: int, n: Sequence[int], j: int, window: int, k: int, min_run: int
) -> tuple[int, int] | None:
    """The anchor ``(di, dj)`` with ``di + dj`` smallest, both below ``window``."""
    index: dict[tuple[int, ...], list[int]] = {}
    for q in range(j, min(len(n) - k + 1, j + window)):
        index.setdefault(tuple(n[q : q + k]), []).append(q)
    best: tuple[int, int] | None = None
    for di in range(0, min(len(t) - i, window)):
        if best is not None and di >= sum(best):
            break
        if len(t) - (i + di) < k:  # too few tokens of T left for a k-gram: match them whole
            key = tuple(t[i + di :])
            end = min(len(n), j + window)
            hits = [q for q in range(j, end) if tuple(n[q : q + len(key)]) == key]
        else:
            hits = index.get(tuple(t[i + di : i + di + k]), [])
        for q in hits:
            dj = q - j
            if best is not None and di + dj >= sum(best):
                break
            run = _equal_run(t, i + di, n, q)
            if run >= min_run or i + di + run == len(t):
                best = (di, dj)
                break
    return best


def drift_spans(
    cached: Sequence[int],
    new: Sequence[int],
    *,
    max_spans: int = MAX_SPANS,
    max_gap: int = MAX_GAP,
    k: int = ANCHOR,
    min_run: int = MIN_RUN,
) -> Drift:
    """Align ``cached`` (T) with a prefix of ``new`` (N); see the module doc."""
    t, n = list(cached), list(new)
    i = j = _equal_run(t, 0, n, 0)
    spans: list[DriftSpan] = []
    stopped: str | None = None
    while i < len(t):
        if j >= len(n):
            stopped = "new_prompt_ends"
            break
        if len(spans) >= max_spans:
            stopped = "max_spans"
            break
        found, window = None, _FIRST_WINDOW
        while found is None:
            found = _anchor(t, i, n, j, min(window, max_gap), k, min_run)
            if window >= max_gap:
                break
            window *= 8
        if found is None:
            stopped = "max_gap"
            break
        di, dj = found
        spans.append(DriftSpan(i, i + di, tuple(n[j : j + dj])))
        i, j = i + di, j + dj
        run = _equal_run(t, i, n, j)
        i, j = i + run, j + run
    return Drift(tuple(spans), i, j, stopped)
