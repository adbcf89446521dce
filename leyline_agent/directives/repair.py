"""Which tail rows a REPAIR recomputes (pure: token ids in, row indices of ``T'`` out).

After an AMORTIZE the tail's rows still carry what they read from the removed span. A REPAIR
directive recomputes ``rows_for(budget, tail_len)`` of them under the edited context; the
selector decides which:

- ``ngram``: tail tokens in a bigram that also occurs in the removed span (a
  quote of the removed text: a file name, a setting's name), in order of position, then the
  rows that follow them (one row after each, then two, ...: the rest of a quote, such as
  the number after the name); with no match, or budget left when they run out, the first
  tail rows after the splice;
- ``ngram-first``: the bigram rows, then the first tail rows after the splice;
- ``first``: the first tail rows after the splice (EPIC / LegoLink's choice);
- ``first+ngram``: half the rows right after the splice, then ``ngram``'s;
- ``match``: the span's quotes as maximal runs of tail tokens that are also runs of the
  span, longest first, each with the row after it (a two-token run is often a coincidence:
  two digits), then the first rows;
- ``match-first``: a quarter of the rows right after the splice, then ``match``'s;
- ``match+ngram`` (the default, at 5 % of the tail): half the rows to ``match``'s longest
  quotes, then ``ngram``'s (a long quote anywhere in the tail, and the quotes nearest the
  splice).

The measured ablation (other selectors included: CacheBlend's K/V deviation, which needs
tensors) is ``experiments/check/repair_ablation.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_SELECTOR",
    "SELECTORS",
    "RepairSpan",
    "match_runs",
    "ngram_rows",
    "rows_for",
    "select_rows",
]

DEFAULT_BUDGET = 0.05  # fraction of a tail recomputed when a directive gives none
DEFAULT_SELECTOR = "match+ngram"  # chosen by experiments/check/repair_ablation.py (docs/results.md)


@dataclass(frozen=True, slots=True)
class RepairSpan:
    """One REPAIR directive seen in ``T'``: its tail is ``T'[tail_start:tail_end]``;
    ``removed`` are the tokens its span held in ``T``."""

    tail_start: int
    tail_end: int
    removed: tuple[int, ...]
    budget: float

    @property
    def tail_len(self) -> int:
        return self.tail_end - self.tail_start


def rows_for(budget: float, tail_len: int) -> int:
    """How many tail rows ``budget`` recomputes: ``ceil(budget * tail_len)`` (0 -> none,
    1 -> all; any positive budget at least one row)."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget: {budget} is not in [0, 1]")
    return min(tail_len, math.ceil(budget * tail_len - 1e-9))


def ngram_rows(tokens: Sequence[int], span: RepairSpan) -> list[int]:
    """Rows of the tail whose token is part of a bigram also found in the removed span."""
    rem = span.removed
    grams = {(rem[i], rem[i + 1]) for i in range(len(rem) - 1)}
    out: list[int] = []
    lo, hi = span.tail_start, span.tail_end
    for i in range(lo, hi):
        t = tokens[i]
        before = i > lo and (tokens[i - 1], t) in grams
        after = i + 1 < hi and (t, tokens[i + 1]) in grams
        if before or after:
            out.append(i)
    return out


MAX_MATCH = 16  # the longest quote of the span ``match_runs`` measures, in tokens


def match_runs(tokens: Sequence[int], span: RepairSpan) -> list[tuple[int, int]]:
    """Quotes of the removed span in the tail: ``(start, length)`` of each maximal run of
    tail tokens that is also a run of the span (at least two tokens, at most ``MAX_MATCH``),
    longest first, then by position. A long run (a setting's name with its value) is a quote;
    a two-token run is often a coincidence (two digits, a newline pair)."""
    rem = span.removed
    subs: list[set[tuple[int, ...]]] = [set() for _ in range(MAX_MATCH + 1)]
    for i in range(len(rem)):
        for n in range(2, min(MAX_MATCH, len(rem) - i) + 1):
            subs[n].add(tuple(rem[i : i + n]))
    runs: list[tuple[int, int]] = []
    i, hi = span.tail_start, span.tail_end
    while i < hi - 1:
        n = 1
        while n < MAX_MATCH and i + n < hi and tuple(tokens[i : i + n + 1]) in subs[n + 1]:
            n += 1
        if n >= 2:
            runs.append((i, n))
            i += n
        else:
            i += 1
    return sorted(runs, key=lambda r: (-r[1], r[0]))


def _quoted_rows(tokens: Sequence[int], span: RepairSpan) -> list[int]:
    """The rows of the span's quotes, longest quote first, each with the row after it (the
    rest of the quote: the value after a setting's name)."""
    out: dict[int, None] = {}
    for start, length in match_runs(tokens, span):
        for r in range(start, min(start + length + 1, span.tail_end)):
            out.setdefault(r)
    return list(out)


def _match(tokens: Sequence[int], span: RepairSpan, n: int) -> list[int]:
    return _fill_by_position(_quoted_rows(tokens, span)[:n], span, n)


def _match_first(tokens: Sequence[int], span: RepairSpan, n: int) -> list[int]:
    first = _first(tokens, span, n // 4)  # a quarter to the rows right after the splice
    picked = list(dict.fromkeys([*first, *_quoted_rows(tokens, span)]))[:n]
    return _fill_by_position(picked, span, n)


def _match_ngram(tokens: Sequence[int], span: RepairSpan, n: int) -> list[int]:
    half = _quoted_rows(tokens, span)[: n // 2]  # half to the longest quotes
    return _ngram(tokens, span, n, dict.fromkeys(half))


def _first(tokens: Sequence[int], span: RepairSpan, n: int) -> list[int]:
    return list(range(span.tail_start, span.tail_start + n))


def _ngram_first(tokens: Sequence[int], span: RepairSpan, n: int) -> list[int]:
    picked = ngram_rows(tokens, span)[:n]
    return _fill_by_position(picked, span, n)


def _first_ngram(tokens: Sequence[int], span: RepairSpan, n: int) -> list[int]:
    half = _first(tokens, span, n // 2)  # half to the rows right after the splice
    return _ngram(tokens, span, n, dict.fromkeys(half))


def _ngram(
    tokens: Sequence[int], span: RepairSpan, n: int, chosen: dict[int, None] | None = None
) -> list[int]:
    matched = ngram_rows(tokens, span)
    chosen = dict(chosen or {})
    for m in matched:
        if len(chosen) >= n:
            break
        chosen.setdefault(m)
    d = 1
    while len(chosen) < n and matched and d < span.tail_len:
        for m in matched:
            if len(chosen) >= n:
                break
            if m + d < span.tail_end:
                chosen.setdefault(m + d)
        d += 1
    return _fill_by_position(list(chosen), span, n)


def _fill_by_position(picked: list[int], span: RepairSpan, n: int) -> list[int]:
    chosen = set(picked)
    for i in range(span.tail_start, span.tail_end):
        if len(chosen) >= n:
            break
        chosen.add(i)
    return sorted(chosen)


Selector = Callable[[Sequence[int], RepairSpan, int], list[int]]
SELECTORS: dict[str, Selector] = {
    "ngram": _ngram,
    "ngram-first": _ngram_first,
    "first": _first,
    "match": _match,
    "match-first": _match_first,
    "first+ngram": _first_ngram,
    "match+ngram": _match_ngram,
}


def select_rows(
    tokens: Sequence[int], spans: Sequence[RepairSpan], selector: str = DEFAULT_SELECTOR
) -> list[int]:
    """The rows of ``T' = tokens`` to recompute for ``spans``, sorted, each once."""
    try:
        pick = SELECTORS[selector]
    except KeyError:
        raise ValueError(f"selector: {selector!r} is not one of {sorted(SELECTORS)}") from None
    rows: set[int] = set()
    for sp in spans:
        rows.update(pick(tokens, sp, rows_for(sp.budget, sp.tail_len)))
    return sorted(rows)
