"""REPAIR's tensor work: recompute selected rows of a spliced ``T'`` in place.

``plan_splice`` lists the rows (``SplicePlan.repair_rows``, pure); here they are forwarded.
Consecutive selected rows form a run; a run ``[a, b)`` is one ``StepInput`` whose new tokens
are ``T'[a:b]`` and whose slots are ``slots[:b]``: its cached rows are the row slots before
it, its "new" slots are its own rows, so the forward writes their K/V in place at positions
``a..b-1``. The runs of a forward are packed together; at each layer every run's K/V is
written before any run attends, so a selected row attends to the prefix, ``R`` and the tail
rows before it (their cached K/V at that layer, the selected ones already recomputed) and,
causally, to its own run, with its hidden state carried layer by layer by the forward
itself. Sections run left to right, so a later section reads earlier ones' final rows:
the same values as one forward of every run.

Every row written must be a fresh slot of the splice (copy-on-write: the base's rows may be
shared in the radix tree); ``repair_rows`` refuses anything else before the first write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

from leyline_agent.engine.model.runner import ModelRunner, StepInput

__all__ = ["REPAIR_ROWS", "repair_rows", "row_runs"]

REPAIR_ROWS = 512  # selected rows forwarded per locked section


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``rows`` as ``(first, end)`` runs of consecutive indices."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def repair_rows(
    runner: ModelRunner,
    tokens: Sequence[int],
    slots: Sequence[int],
    rows: Sequence[int],
    fresh: Sequence[int],
    section: Callable[[], AbstractContextManager[object]],
) -> None:
    """Recompute the K/V of ``rows`` of ``T' = tokens`` (held in ``slots``) in place, each
    section of at most ``REPAIR_ROWS`` rows inside ``section()`` (the engine lock)."""
    if len(tokens) != len(slots):
        raise ValueError(f"repair: {len(tokens)} tokens for {len(slots)} slots")
    ours = set(fresh)
    for r in rows:
        if not 0 <= r < len(slots) or slots[r] not in ours:
            raise ValueError(f"repair: row {r} is not a fresh row of this splice")
    for batch in _sections(row_runs(sorted(set(rows))), REPAIR_ROWS):
        steps = [StepInput(tokens[a:b], slots[:b], want_logits=False) for a, b in batch]
        with section():
            runner.run(steps)


def _sections(runs: list[tuple[int, int]], limit: int) -> Iterator[list[tuple[int, int]]]:
    """Runs, left to right, cut into groups of at most ``limit`` rows (a long run split)."""
    group: list[tuple[int, int]] = []
    n = 0
    for a, b in runs:
        while a < b:
            take = min(b - a, limit - n)
            group.append((a, a + take))
            n += take
            a += take
            if n == limit:
                yield group
                group, n = [], 0
    if group:
        yield group
