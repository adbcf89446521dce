"""Splice execution on the embedded engine's slots: a ``directives.splice_plan.SplicePlan``
(the one planner's, pure) run on fresh slots.

``execute_splice`` drives a ``directives.backend.RowWriter`` (the engine's runner + pool)
and only ever writes fresh slots: tails are always written to NEW slots (copy-on-write),
because the old path may be shared by other sequences in the radix tree. Slots written for
an intermediate step and superseded by a later one are returned as ``scratch`` for the
caller to free. Each row is moved once (``SplicePlan.pieces``: one rotation per row
instead of one per directive; fp32 ~1e-7 from the reference, in bf16 one rounding per row
instead of one per directive, ``bench_splice --drift``); ``per_directive=True`` runs the
steps literally, as the reference reads (for the drift measurement).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leyline_agent.directives.backend import RowWriter
from leyline_agent.directives.splice_plan import (
    Piece,
    SplicePlan,
    SpliceStep,
    plan_splice,
    tail_op,
)

__all__ = ["Piece", "SplicePlan", "SpliceStep", "execute_splice", "plan_splice"]


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
            if tail_op(st.mode) == "move":
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
