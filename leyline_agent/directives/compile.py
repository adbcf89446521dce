"""Compile message-level edits into token directives (pure: token ids in, spans out).

The serving side renders the old and the edited message lists with the chat template
(``add_generation_prompt=False``) and tokenizes both; ``diff_spans`` then finds where the
two token sequences differ.

Seams: BPE may merge across the edge of an edited text (the token before or after an edit
can change too). Diffing token ids, not characters, absorbs that: every token that differs
is inside a span. The diff is taken per message: both sequences are cut at the
``<|im_start|>`` id that opens every message in the template, chunks are paired in order,
and each differing pair yields one span (common prefix and suffix of the pair trimmed).
That keeps one span per edited message even when the new text shares tokens with the old
(a stub that quotes the original's first line would otherwise split into many small
spans). When the two sequences do not have the same number of messages the whole
sequence is diffed as one chunk (still exact, possibly coarser).

``clip_to_cached`` restricts spans to a cached prefix of length ``c``: a span that ends by
``c`` is kept; a span that starts at or after ``c`` is dropped (nothing of it is cached; the
next request prefills it); a span that straddles ``c`` becomes ``(start, c, R)``: keep
``T[:start]``, prefill R now, no cached tail. ``T[:start] + R`` is a prefix of the new
sequence, so the next request hits it and prefills only what follows R.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Span", "clip_to_cached", "diff_spans"]


@dataclass(slots=True, frozen=True)
class Span:
    start: int
    end: int
    replacement: list[int]


def _chunks(ids: Sequence[int], boundary: int | None) -> list[tuple[int, int]]:
    if boundary is None:
        return [(0, len(ids))]
    cuts = [i for i, t in enumerate(ids) if t == boundary and i > 0]
    edges = [0, *cuts, len(ids)]
    return list(zip(edges, edges[1:], strict=False))


def _span(
    old: Sequence[int], new: Sequence[int], a: tuple[int, int], b: tuple[int, int]
) -> Span | None:
    (a0, a1), (b0, b1) = a, b
    p = 0
    while a0 + p < a1 and b0 + p < b1 and old[a0 + p] == new[b0 + p]:
        p += 1
    q = 0
    while a1 - q > a0 + p and b1 - q > b0 + p and old[a1 - q - 1] == new[b1 - q - 1]:
        q += 1
    if a0 + p == a1 - q and b0 + p == b1 - q:
        return None
    return Span(a0 + p, a1 - q, list(new[b0 + p : b1 - q]))


def diff_spans(old: Sequence[int], new: Sequence[int], boundary: int | None = None) -> list[Span]:
    """Non-overlapping spans of ``old`` (left to right) whose replacement turns it into ``new``."""
    ca, cb = _chunks(old, boundary), _chunks(new, boundary)
    if len(ca) != len(cb):
        ca, cb = [(0, len(old))], [(0, len(new))]
    spans = [s for a, b in zip(ca, cb, strict=True) if (s := _span(old, new, a, b)) is not None]
    merged: list[Span] = []
    for s in spans:  # touching spans (an insertion at a chunk edge) become one
        if merged and merged[-1].end == s.start:
            m = merged.pop()
            s = Span(m.start, s.end, m.replacement + s.replacement)
        merged.append(s)
    return merged


def clip_to_cached(spans: Sequence[Span], cached: int) -> list[Span]:
    out = []
    for s in spans:
        if s.end <= cached:
            out.append(s)
        elif s.start < cached:
            out.append(Span(s.start, cached, s.replacement))
    return out


def apply_spans(old: Sequence[int], spans: Sequence[Span]) -> list[int]:
    out = list(old)
    for s in sorted(spans, key=lambda s: s.start, reverse=True):
        out[s.start : s.end] = s.replacement
    return out
