"""Splice: a pure plan from directives, then its execution on slots.

Semantics (the reference every test checks): the directives of one call are applied one
at a time, right to left (``plan_batch`` order), each on the result of the previous one:

- AMORTIZE ``(s, e, R)`` on a working sequence W: keep ``W[:s]`` (same slots); prefill R
  attending to ``W[:s]`` into fresh slots; copy the tail ``W[e:]`` into fresh slots with its
  rotary band turned by ``delta = |R| - (e - s)`` (latent / values copied unchanged).
- FORGET: keep ``W[:s]``; prefill ``R + W[e:]`` fresh.
- REPAIR: as AMORTIZE; then, on the finished ``T'``, the rows ``SplicePlan.repair_rows``
  (fresh slots all) are recomputed in place under the edited context (``repair.py``).

Right to left means that every directive's prefix ``W[:s]`` is still the original cached
prefix. Tails are always written to NEW slots (copy-on-write): the old path may be shared
by other sequences in the radix tree. Slots written for an intermediate step and superseded
by a later one are returned as ``scratch`` for the caller to free.

Execution moves each row once (``SplicePlan.pieces``): with the directives sorted left to
right and ``D_k`` the sum of the deltas of the first k, directive k's R is prefilled over the
original prefix ``T[:s_k]`` (as the reference does) and turned by ``D_{k-1}``; the base rows
between directives k and k+1 are copied with their band turned by ``D_k``, in one rotation
per row instead of one per directive. Rotations compose (R(a)R(b) = R(a+b)), so this is the
reference up to rounding: fp32 ~1e-7; in bf16 one rounding per row instead of one per
directive (``bench_splice --drift``). The leftmost FORGET prefills everything from its start
(what the directives to its right wrote would be superseded: they are not executed).
``per_directive=True`` runs the steps literally (for the drift measurement).

``plan_splice`` is pure (token ids and counts, no tensors); ``execute_splice`` drives a
``directives.backend.RowWriter`` (the engine's runner + pool) and only ever writes fresh slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from leyline_agent.directives import Directive, Mode
from leyline_agent.directives.backend import RowWriter
from leyline_agent.directives.modes import ALL_MODES, rule_of
from leyline_agent.directives.repair import (
    DEFAULT_BUDGET,
    DEFAULT_SELECTOR,
    RepairSpan,
    rows_for,
    select_rows,
)

__all__ = ["Piece", "SplicePlan", "SpliceStep", "execute_splice", "plan_splice"]


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


@dataclass(slots=True, frozen=True)
class Piece:
    """One run of ``T'``, left to right. ``keep``: base rows ``[lo, hi)`` as they are;
    ``move``: base rows ``[lo, hi)`` copied, band turned by ``delta``; ``prefill``:
    ``tokens`` forwarded over the base rows ``[:lo]``, then turned by ``delta``."""

    kind: Literal["keep", "move", "prefill"]
    lo: int
    hi: int = 0
    delta: int = 0
    tokens: tuple[int, ...] = ()


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
    splices = {Mode.AMORTIZE.value: 0, Mode.FORGET.value: 0}
    budgets: list[float | None] = []  # per step: REPAIR's budget, else None
    for d in directives:
        assert isinstance(d.replacement, list), "compile replacements before planning"
        assert d.end <= len(tokens), "validate spans before planning"
        step = SpliceStep(d.start, d.end, tuple(d.replacement), Mode(d.mode), len(tokens))
        rule = rule_of(step.mode, ALL_MODES)
        steps.append(step)
        splices[step.mode.value] = splices.get(step.mode.value, 0) + 1
        budget = (repair_budget if d.budget is None else d.budget) if rule.repairs else None
        budgets.append(budget)
        whole = budget is not None and rows_for(budget, step.tail_len) == step.tail_len
        r = list(step.replacement)
        new_len = len(tokens) + step.delta
        if rule.moves_tail:
            prefilled += len(r)
            rotated += step.tail_len
            origin = origin[: d.start] + [False] * len(r) + origin[d.end :]
            if exact >= d.start:
                exact = d.start + len(r) if step.tail_len and not whole else new_len
        else:
            prefilled += len(r) + step.tail_len
            origin = origin[: d.start] + [False] * (len(r) + step.tail_len)
            if exact >= d.start:
                exact = new_len
        tokens = tokens[: d.start] + r + tokens[d.end :]
    pieces = _pieces(len(base_tokens), steps, tokens)
    if pieces is not None:  # one move per row: count what the pieces do
        prefilled = sum(len(p.tokens) for p in pieces if p.kind == "prefill")
        rotated = sum(p.hi - p.lo for p in pieces if p.kind == "move")
        rotated += sum(len(p.tokens) for p in pieces if p.kind == "prefill" and p.delta)
    return SplicePlan(
        base_tokens=list(base_tokens),
        steps=steps,
        tokens=tokens,
        pieces=pieces or [],
        prefilled_tokens=prefilled,
        rotated_tokens=rotated,
        reused_tokens=sum(origin),
        splices=splices,
        exact_len=min(exact, len(tokens)),
        repair_rows=_repair_rows(base_tokens, steps, budgets, tokens, selector),
    )


def _repair_rows(
    base: Sequence[int],
    steps: list[SpliceStep],
    budgets: list[float | None],
    final: list[int],
    selector: str,
) -> list[int]:
    """The rows of ``T' = final`` the REPAIR steps recompute: each step's tail in ``T'``
    starts after its R, shifted by the deltas of the steps to its left (later in
    ``steps``, which run right to left)."""
    spans: list[RepairSpan] = []
    for k, (st, budget) in enumerate(zip(steps, budgets, strict=True)):
        if budget is None:
            continue
        shift = sum(s.delta for s in steps[k + 1 :])
        lo = st.start + shift + len(st.replacement)
        spans.append(RepairSpan(lo, len(final), tuple(base[st.start : st.end]), budget))
    return select_rows(final, spans, selector) if spans else []


def _pieces(n: int, steps: list[SpliceStep], final: list[int]) -> list[Piece] | None:
    """``T'`` as pieces over the base (module docstring), or None if a step does not end
    at or before the previous one's start (then its coordinates are not the base's)."""
    for a, b in zip(steps, steps[1:], strict=False):
        if b.end > a.start:
            return None
    out: list[Piece] = []
    pos, shift = 0, 0  # next base row; cumulative delta of the directives to the left
    kind: Literal["keep", "move"] = "keep"  # rows after a directive are copied (never shared)
    for st in reversed(steps):  # left to right
        if st.start > pos:
            out.append(Piece(kind, pos, st.start, shift))
        if not rule_of(st.mode).moves_tail:
            rest = tuple(final[st.start + shift :])
            out.append(Piece("prefill", st.start, delta=shift, tokens=rest))
            return out
        if st.replacement:
            out.append(Piece("prefill", st.start, delta=shift, tokens=st.replacement))
        pos, shift, kind = st.end, shift + st.delta, "move"
    if pos < n:
        out.append(Piece(kind, pos, n, shift))
    return out


@dataclass(slots=True)
class SpliceResult:
    slots: list[int]  # slots of plan.tokens
    fresh: list[int]  # every slot written by this splice (final and scratch)
    scratch: list[int]  # written but superseded: free them


def execute_splice(
    plan: SplicePlan,
    base_slots: Sequence[int],
    backend: RowWriter,
    *,
    per_directive: bool = False,
) -> SpliceResult:
    """Run the plan. On error the fresh slots written so far are reported via the exception
    attribute ``fresh_slots`` so the caller can free them; old slots are never written.
    Each row is moved once (``plan.pieces``) unless ``per_directive`` (or the plan has no
    pieces): then the steps run one after another, as the reference reads."""
    if plan.pieces and not per_directive:
        return _execute_pieces(plan, base_slots, backend)
    slots = list(base_slots)
    tokens = list(plan.base_tokens)
    fresh: list[int] = []
    try:
        for st in plan.steps:
            r = list(st.replacement)
            prefix = slots[: st.start]
            if rule_of(st.mode).moves_tail:
                r_slots = backend.prefill_into_slots(prefix, r, tokens[: st.start])
                fresh += r_slots
                tail = backend.rotate_into_fresh(slots[st.end :], st.delta) if st.tail_len else []
                fresh += tail
                slots = prefix + r_slots + tail
                tokens = tokens[: st.start] + r + tokens[st.end :]
            else:
                new = r + tokens[st.end :]
                new_slots = backend.prefill_into_slots(prefix, new, tokens[: st.start])
                fresh += new_slots
                slots = prefix + new_slots
                tokens = tokens[: st.start] + new
    except BaseException as e:
        e.fresh_slots = fresh  # type: ignore[attr-defined]
        raise
    assert tokens == plan.tokens
    final = set(slots)
    return SpliceResult(slots=slots, fresh=fresh, scratch=[s for s in fresh if s not in final])


def _execute_pieces(
    plan: SplicePlan, base_slots: Sequence[int], backend: RowWriter
) -> SpliceResult:
    base = list(base_slots)
    out: list[int] = []
    fresh: list[int] = []
    src: list[int] = []  # rows to move, with their delta and place in ``out``
    deltas: list[int] = []
    at: list[int] = []
    try:
        for p in plan.pieces:
            if p.kind == "keep":
                out += base[p.lo : p.hi]
                continue
            if p.kind == "prefill":
                prefix_ids = plan.base_tokens[: p.lo]
                rows = backend.prefill_into_slots(base[: p.lo], list(p.tokens), prefix_ids)
                fresh += rows
                if not p.delta:
                    out += rows
                    continue
            else:
                rows = base[p.lo : p.hi]
            at += range(len(out), len(out) + len(rows))
            src += rows
            deltas += [p.delta] * len(rows)
            out += [-1] * len(rows)
        if src:
            uniform = all(d == deltas[0] for d in deltas)
            moved = backend.rotate_into_fresh(src, deltas[0] if uniform else deltas)
            fresh += moved
            for i, slot in zip(at, moved, strict=True):
                out[i] = slot
    except BaseException as e:
        e.fresh_slots = fresh  # type: ignore[attr-defined]
        raise
    final = set(out)
    return SpliceResult(slots=out, fresh=fresh, scratch=[s for s in fresh if s not in final])
