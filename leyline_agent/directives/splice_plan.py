"""The one splice planner: directives on a cached base ``T``, as row pieces over positions.

Pure and torch-free: token ids and positions in, a plan out. Every engine executes it on its
own storage in a thin step of its own (``engine.splice.execute_splice`` on the radix pool's
slots, ``block_plan`` on hashed blocks (vLLM), ``sglang_plugin.plan`` on two radix
namespaces). The rule of each mode is ``directives.modes``'s (dispatched on the rule's tail
operation; a tail operation the planner does not know is refused by name, never run as
another mode):

- AMORTIZE ``(s, e, R)`` on a working sequence ``W``: ``W[:s]`` kept; ``R`` prefilled over
  ``W[:s]`` (a fill: rows computed at positions ``s .. s+|R|``); the tail ``W[e:]`` moved:
  row ``p`` of ``T'`` past ``s+|R|`` is ``W``'s row ``p - delta`` with its rotary band
  turned by ``delta = |R| - (e - s)``;
- FORGET: ``W[:s]`` kept, ``R + W[e:]`` prefilled afresh;
- REPAIR: as AMORTIZE; then, on the finished ``T'``, the rows ``SplicePlan.repair_rows``
  (all moved tail rows) are recomputed in place under the edited context (``repair``).

The directives of one call are applied one at a time, right to left (``plan_batch``
order), each on the result of the previous one (the reference the tests check). Right to
left, every directive's prefix ``W[:s]`` is still the original cached prefix, so the batch
is also one set of pieces over the base (``SplicePlan.pieces``): with the directives sorted
left to right and ``D_k`` the sum of the deltas of the first k, directive k's ``R`` is
prefilled over ``T[:s_k]`` and turned by ``D_{k-1}``; the base rows between directives k and
k+1 are moved by ``D_k``, in one rotation per row instead of one per directive. Rotations
compose (R(a)R(b) = R(a+b)), so this is the reference up to rounding. The leftmost FORGET
prefills everything from its start (what the directives to its right wrote is superseded).

``rows_of`` expands pieces row by row (``Row``: a base row turned by ``delta``, or a fill
row), which is how a block-granular engine places them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from leyline_agent.directives.core import Directive, Mode
from leyline_agent.directives.modes import ALL_MODES, rule_of
from leyline_agent.directives.repair import (
    DEFAULT_BUDGET,
    DEFAULT_SELECTOR,
    RepairSpan,
    rows_for,
    select_rows,
)
from leyline_agent.errors import UnsupportedModeError

__all__ = [
    "Piece",
    "Row",
    "SplicePlan",
    "SpliceStep",
    "amortize_pieces",
    "batch_miss",
    "plan_pieces",
    "plan_splice",
    "repair_rows_of",
    "rows_of",
    "splice_counts",
    "tail_op",
]


@dataclass(slots=True, frozen=True)
class SpliceStep:
    start: int
    end: int
    replacement: tuple[int, ...]
    mode: Mode
    seq_len: int  # length of the working sequence before this step

    @property
    def delta(self) -> int:
        return len(self.replacement) - (self.end - self.start)

    @property
    def tail_len(self) -> int:
        return self.seq_len - self.end

    @property
    def moved_rows(self) -> int:
        """Tail rows this step moves (its mode's tail is "move"), else 0."""
        return self.tail_len if tail_op(self.mode) == "move" else 0

    @property
    def filled_rows(self) -> int:
        """Rows this step forwards: ``R``, and the tail where it is prefilled afresh."""
        return len(self.replacement) + self.tail_len - self.moved_rows


@dataclass(slots=True, frozen=True)
class Piece:
    """One run of ``T'``, left to right. ``keep``: base rows ``[lo, hi)`` as they are;
    ``move``: base rows ``[lo, hi)`` copied, band turned by ``delta``; ``prefill``:
    ``tokens`` forwarded over the base rows ``[:lo]`` (at positions ``lo ..``), then turned
    by ``delta``."""

    kind: Literal["keep", "move", "prefill"]
    lo: int
    hi: int = 0
    delta: int = 0
    tokens: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.tokens) if self.kind == "prefill" else self.hi - self.lo

    @property
    def sources(self) -> range:
        """Where its rows come from, left to right: base rows, or a fill's positions."""
        return range(self.lo, self.lo + self.size)


@dataclass(slots=True, frozen=True)
class Row:
    """Where one row of ``T'`` comes from: the base's row ``src`` (``fill`` False) or the
    fill computed at position ``src`` (``fill`` True), its rotary band turned by ``delta``."""

    src: int
    delta: int
    fill: bool


def rows_of(pieces: Sequence[Piece]) -> Iterator[Row]:
    """Every row of the pieces' ``T'``, left to right."""
    for p in pieces:
        for src in p.sources:
            yield Row(src, p.delta, p.kind == "prefill")


def amortize_pieces(start: int, end: int, replacement: Sequence[int], n: int) -> list[Piece]:
    """One AMORTIZE of ``T[:n]``: ``T[:start]`` kept, ``R`` filled, ``T[end:n]`` moved."""
    step = SpliceStep(start, end, tuple(replacement), Mode.AMORTIZE, n)
    return plan_pieces(n, [step], []) or []  # one step: always pieces


@dataclass(slots=True)
class SplicePlan:
    base_tokens: list[int]
    steps: list[SpliceStep]
    tokens: list[int]  # T' over the cached base
    pieces: list[Piece] = field(default_factory=list)  # T' left to right, each row moved once
    prefilled_tokens: int = 0  # forward work done by the splice
    rotated_tokens: int = 0  # rows moved by a rotation
    reused_tokens: int = 0  # rows of T' whose latent/values come from T
    splices: dict[str, int] = field(default_factory=dict)
    exact_len: int = 0  # leading rows of T' equal to a fresh prefill's (the rest: spliced)
    repair_rows: list[int] = field(default_factory=list)  # rows of T' REPAIR recomputes

    @property
    def repaired_tokens(self) -> int:
        return len(self.repair_rows)


def tail_op(mode: Mode) -> Literal["move", "prefill"]:
    """The tail operation of ``mode``'s rule, one the planner knows; a rule with any other
    (a new verb's) is refused by name."""
    rule = rule_of(mode, ALL_MODES)
    if rule.tail == "move":
        return "move"
    if rule.tail == "prefill":
        return "prefill"
    raise UnsupportedModeError(f"mode: {rule.mode.value!r} has no splice plan ({rule.tail!r})")


def plan_splice(
    base_tokens: Sequence[int],
    directives: Sequence[Directive],
    exact_len: int | None = None,
    *,
    repair_budget: float = DEFAULT_BUDGET,
    selector: str = DEFAULT_SELECTOR,
) -> SplicePlan:
    """Plan compiled, validated directives (execution order, all ``end <= len(base)``).

    ``exact_len``: how many leading rows of the base are exact (default: all). AMORTIZE
    keeps a prefix and prefills R over it (exact iff the prefix is), but its moved tail
    keeps attending to the removed span: from there on rows are spliced. FORGET prefills
    R + tail over the prefix: exact iff the prefix is. REPAIR is planned as AMORTIZE, and
    its tail rows ``selector`` picks (``directives.repair``; ``repair_budget`` where the
    directive gives no budget) are listed in ``repair_rows``; a budget that covers the whole
    tail is exact as FORGET is.
    """
    tokens = list(base_tokens)
    exact = len(tokens) if exact_len is None else exact_len
    origin = [True] * len(tokens)  # does the row's latent/value come from T?
    steps: list[SpliceStep] = []
    prefilled = rotated = 0
    budgets: list[float | None] = []  # per step: REPAIR's budget, else None
    for d in directives:
        assert isinstance(d.replacement, list), "compile replacements before planning"
        assert d.end <= len(tokens), "validate spans before planning"
        step = SpliceStep(d.start, d.end, tuple(d.replacement), Mode(d.mode), len(tokens))
        rule = rule_of(step.mode, ALL_MODES)
        steps.append(step)
        budget = (repair_budget if d.budget is None else d.budget) if rule.repairs else None
        budgets.append(budget)
        whole = budget is not None and rows_for(budget, step.tail_len) == step.tail_len
        r = list(step.replacement)
        new_len = len(tokens) + step.delta
        prefilled += step.filled_rows
        rotated += step.moved_rows
        if tail_op(step.mode) == "move":
            origin = origin[: d.start] + [False] * len(r) + origin[d.end :]
            if exact >= d.start:
                exact = d.start + len(r) if step.tail_len and not whole else new_len
        else:  # "prefill" (``tail_op`` refused every other)
            origin = origin[: d.start] + [False] * (len(r) + step.tail_len)
            if exact >= d.start:
                exact = new_len
        tokens = tokens[: d.start] + r + tokens[d.end :]
    pieces = plan_pieces(len(base_tokens), steps, tokens)
    if pieces is not None:  # one move per row: count what the pieces do
        prefilled = sum(p.size for p in pieces if p.kind == "prefill")
        rotated = sum(p.size for p in pieces if p.kind == "move" or p.delta)
    return SplicePlan(
        base_tokens=list(base_tokens),
        steps=steps,
        tokens=tokens,
        pieces=pieces or [],
        prefilled_tokens=prefilled,
        rotated_tokens=rotated,
        reused_tokens=sum(origin),
        splices=splice_counts(steps),
        exact_len=min(exact, len(tokens)),
        repair_rows=repair_rows_of(base_tokens, steps, budgets, tokens, selector),
    )


def splice_counts(steps: Iterable[SpliceStep | Directive]) -> dict[str, int]:
    """The answer's ``splices``: how many directives of each mode ran (``amortize`` and
    ``forget`` always listed)."""
    out = {Mode.AMORTIZE.value: 0, Mode.FORGET.value: 0}
    for st in steps:
        out[Mode(st.mode).value] = out.get(Mode(st.mode).value, 0) + 1
    return out


def repair_rows_of(
    base: Sequence[int],
    steps: Sequence[SpliceStep],
    budgets: Sequence[float | None],
    final: Sequence[int],
    selector: str = DEFAULT_SELECTOR,
) -> list[int]:
    """The rows of ``T' = final`` the REPAIR steps (those with a budget) recompute: each
    step's tail in ``T'`` starts after its R, shifted by the deltas of the steps to its left
    (later in ``steps``, which run right to left), and ends with ``final``."""
    spans: list[RepairSpan] = []
    for k, (st, budget) in enumerate(zip(steps, budgets, strict=True)):
        if budget is None:
            continue
        shift = sum(s.delta for s in steps[k + 1 :])
        lo = st.start + shift + len(st.replacement)
        spans.append(RepairSpan(lo, len(final), tuple(base[st.start : st.end]), budget))
    return select_rows(final, spans, selector) if spans else []


def plan_pieces(n: int, steps: Sequence[SpliceStep], final: Sequence[int]) -> list[Piece] | None:
    """``T'`` as pieces over the base ``T[:n]`` (module doc), or None if a step does not end
    at or before the previous one's start (then its coordinates are not the base's).
    ``final`` (``T'``) is read only for a FORGET's prefilled rest."""
    for a, b in zip(steps, steps[1:], strict=False):
        if b.end > a.start:
            return None
    out: list[Piece] = []
    pos, shift = 0, 0  # next base row; cumulative delta of the directives to the left
    kind: Literal["keep", "move"] = "keep"  # rows after a directive are copied (never shared)
    for st in reversed(steps):  # left to right
        if st.start > pos:
            out.append(Piece(kind, pos, st.start, shift))
        if tail_op(st.mode) == "prefill":
            rest = tuple(final[st.start + shift :])
            out.append(Piece("prefill", st.start, delta=shift, tokens=rest))
            return out
        if st.replacement:
            out.append(Piece("prefill", st.start, delta=shift, tokens=st.replacement))
        pos, shift, kind = st.end, shift + st.delta, "move"
    if pos < n:
        out.append(Piece(kind, pos, n, shift))
    return out


def batch_miss(order: Sequence[Directive], cached: int, granularity: int = 1) -> str | None:
    """Before a batch's first write, on an engine that runs its directives one at a time
    (each on the sequence the previous one left) and caches in units of ``granularity``
    rows: why the first directive (execution order) whose span the splices before it leave
    uncached cannot run, or None. A splice leaves its ``T'`` cached through the rows it
    writes (an AMORTIZE ``s + |R| + (c - e)``, a FORGET all of ``T'``), rounded down to a
    whole unit; row-granular engines (``granularity`` 1) never miss here."""
    c, n = cached, cached  # the working sequence's cached rows, and its length
    for d in order:
        if d.end > c:
            return (
                f"directives: span [{d.start}, {d.end}) is not cached once the splices to its "
                f"right are written: the cache would hold the first {c} tokens of that "
                f"sequence (in whole units of {granularity} rows)"
            )
        r = len(d.replacement)
        moved = c - d.end if tail_op(Mode(d.mode)) == "move" else n - d.end
        n += r - (d.end - d.start)
        c = (d.start + r + moved) // granularity * granularity
    return None
