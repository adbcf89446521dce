"""Splice: a pure plan from directives, then its execution on slots.

Semantics (the reference every test checks): the directives of one call are applied one
at a time, right to left (``plan_batch`` order), each on the result of the previous one:

- AMORTIZE ``(s, e, R)`` on a working sequence W: keep ``W[:s]`` (same slots); prefill R
  attending to ``W[:s]`` into fresh slots; copy the tail ``W[e:]`` into fresh slots with its
  rotary band turned by ``delta = |R| - (e - s)`` (latent / values copied unchanged).
- FORGET: keep ``W[:s]``; prefill ``R + W[e:]`` fresh.

Right to left means that every directive's prefix ``W[:s]`` is still the original cached
prefix. Tails are always written to NEW slots (copy-on-write): the old path may be shared
by other sequences in the radix tree. Slots written for an intermediate step and superseded
by a later one are returned as ``scratch`` for the caller to free.

``plan_splice`` is pure (token ids and counts, no tensors); ``execute_splice`` drives a
``SpliceBackend`` (the engine's runner + pool) and only ever writes fresh slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from leyline_agent.directives import Directive, Mode

__all__ = ["SpliceBackend", "SplicePlan", "SpliceStep", "execute_splice", "plan_splice"]


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


@dataclass(slots=True)
class SplicePlan:
    base_tokens: list[int]
    steps: list[SpliceStep]
    tokens: list[int]  # T' over the cached base
    prefilled_tokens: int = 0  # forward work done by the splice
    rotated_tokens: int = 0  # rows moved by a rotation
    reused_tokens: int = 0  # rows of T' whose latent/values come from T
    splices: dict[str, int] = field(default_factory=dict)
    exact_len: int = 0  # leading rows of T' equal to a fresh prefill's (the rest: spliced)


def plan_splice(
    base_tokens: Sequence[int], directives: Sequence[Directive], exact_len: int | None = None
) -> SplicePlan:
    """Plan compiled, validated directives (execution order, all ``end <= len(base)``).

    ``exact_len``: how many leading rows of the base are exact (default: all). AMORTIZE
    keeps a prefix and prefills R over it (exact iff the prefix is), but its moved tail
    keeps attending to the removed span: from there on rows are spliced. FORGET prefills
    R + tail over the prefix: exact iff the prefix is.
    """
    tokens = list(base_tokens)
    exact = len(tokens) if exact_len is None else exact_len
    origin = [True] * len(tokens)  # does the row's latent/value come from T?
    steps: list[SpliceStep] = []
    prefilled = rotated = 0
    splices = {Mode.AMORTIZE.value: 0, Mode.FORGET.value: 0}
    for d in directives:
        assert isinstance(d.replacement, list), "compile replacements before planning"
        assert d.end <= len(tokens), "validate spans before planning"
        step = SpliceStep(d.start, d.end, tuple(d.replacement), Mode(d.mode), len(tokens))
        steps.append(step)
        splices[step.mode.value] += 1
        r = list(step.replacement)
        new_len = len(tokens) + step.delta
        if step.mode is Mode.AMORTIZE:
            prefilled += len(r)
            rotated += step.tail_len
            origin = origin[: d.start] + [False] * len(r) + origin[d.end :]
            if exact >= d.start:
                exact = d.start + len(r) if step.tail_len else new_len
        else:
            prefilled += len(r) + step.tail_len
            origin = origin[: d.start] + [False] * (len(r) + step.tail_len)
            if exact >= d.start:
                exact = new_len
        tokens = tokens[: d.start] + r + tokens[d.end :]
    return SplicePlan(
        base_tokens=list(base_tokens),
        steps=steps,
        tokens=tokens,
        prefilled_tokens=prefilled,
        rotated_tokens=rotated,
        reused_tokens=sum(origin),
        splices=splices,
        exact_len=min(exact, len(tokens)),
    )


class SpliceBackend(Protocol):
    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int]
    ) -> list[int]:
        """Forward ``token_ids`` after the prefix; fresh slots holding their KV."""
        ...

    def rotate_into_fresh(self, src: Sequence[int], delta: int) -> list[int]:
        """Copy rows to fresh slots, rotary band turned by ``delta``."""
        ...


@dataclass(slots=True)
class SpliceResult:
    slots: list[int]  # slots of plan.tokens
    fresh: list[int]  # every slot written by this splice (final and scratch)
    scratch: list[int]  # written but superseded: free them


def execute_splice(
    plan: SplicePlan, base_slots: Sequence[int], backend: SpliceBackend
) -> SpliceResult:
    """Run the plan. On error the fresh slots written so far are reported via the exception
    attribute ``fresh_slots`` so the caller can free them; old slots are never written."""
    slots = list(base_slots)
    tokens = list(plan.base_tokens)
    fresh: list[int] = []
    try:
        for st in plan.steps:
            r = list(st.replacement)
            prefix = slots[: st.start]
            if st.mode is Mode.AMORTIZE:
                r_slots = backend.prefill_into_slots(prefix, r)
                fresh += r_slots
                tail = backend.rotate_into_fresh(slots[st.end :], st.delta) if st.tail_len else []
                fresh += tail
                slots = prefix + r_slots + tail
                tokens = tokens[: st.start] + r + tokens[st.end :]
            else:
                new = r + tokens[st.end :]
                new_slots = backend.prefill_into_slots(prefix, new)
                fresh += new_slots
                slots = prefix + new_slots
                tokens = tokens[: st.start] + new
    except BaseException as e:
        e.fresh_slots = fresh  # type: ignore[attr-defined]
        raise
    assert tokens == plan.tokens
    final = set(slots)
    return SpliceResult(slots=slots, fresh=fresh, scratch=[s for s in fresh if s not in final])
