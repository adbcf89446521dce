"""Pure: the one splice planner's rows (``splice_plan``) placed on a paged cache of blocks.

A paged cache (vLLM's block pool; SGLang's paged pools) stores rows in blocks of ``B``
slots, slot ``block_id * B + offset``, and shares full blocks only, registered under a hash
that chains over every token before them (and the namespace's salt). So ``T' = T[:s] + R +
T[e:]`` is registered block by block under its own hash chain, in the session's namespace,
and each block of ``T'`` is either a block that already holds exactly its rows under that
hash (reused), or a fresh block whose ``B`` rows are copied from cached rows. Which row goes
where is the planner's AMORTIZE (``amortize_pieces``, row by row ``rows_of``): a kept or
moved row is ``T``'s (its key turned by the row's delta), a fill row (``R``) the head
request's (``T[:s] + R`` prefilled by the engine's own request path, in ``head_blocks``) or,
with no head (``head_blocks`` None), computed in its fresh slot by the splice itself
(``FILL``: no copy; ``fill_rows`` are those rows, forwarded over the copied prefix).

A full block made only of prefix rows is reused when ``T`` was found in the target
namespace (same salt, same tokens: same hash), and one made only of ``R`` rows when the
head was; every other block is fresh. On a session's first splice ``T`` (and the head) is
found in the plain namespace (``directives.routing``: the session held nothing yet), and a
block is registered under one hash only, so ``T``'s prefix is copied into fresh blocks under
the session's chain: the plain namespace's blocks stay where other sessions find them.
``T``'s known rows are its cached full blocks and,
where the engine holds them, the rows of its partial last block (``t_rows``): the plan
covers ``T'`` up to ``s + |R| + (t_rows - e)``. The full blocks of that are registered
under ``T'``'s hashes; the rows past them go to one more fresh block (``partial``), which
the engine may hold for the next request instead of leaving them to its prefill.

A REPAIR directive's rows (``repair_rows``) are the planner's (``repair_rows_of``) over the
plan's ``T'``; they are tail rows, so they lie in fresh blocks (checked). A batch runs one
directive at a time on these blocks (``splice_plan.batch_miss`` with the block size as the
granularity when no rows are held past a last full block). ``copy_runs`` splits a row
copy into runs of whole blocks (one slice copy each) and runs of rows that share a delta
(a splice's tail: one run, read as whole blocks where it is one sequence's rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent.directives.core import Mode
from leyline_agent.directives.repair import DEFAULT_SELECTOR
from leyline_agent.directives.splice_plan import (
    SpliceStep,
    amortize_pieces,
    repair_rows_of,
)
from leyline_agent.errors import CacheMissError, DirectiveError

FILL = -1  # the source slot of a row the splice computes (no copy)

__all__ = [
    "FILL",
    "BlockSource",
    "BlockSplicePlan",
    "copy_runs",
    "fill_rows",
    "plan_block_splice",
    "repair_rows",
    "row_copies",
]


@dataclass(slots=True, frozen=True)
class BlockSource:
    """One block of ``T'``: ``reuse`` (an existing block id) or ``rows`` (``B`` pairs
    ``(src_slot, delta)`` for a fresh block; ``src_slot`` ``FILL``: computed, not copied)."""

    reuse: int | None = None
    rows: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class BlockSplicePlan:
    tokens: list[int]  # T'[:known]: every row the plan writes
    blocks: list[BlockSource]  # full blocks, then the partial block when ``partial_rows``
    rotated_tokens: int  # tail rows moved by delta
    delta: int
    partial_rows: int = 0  # rows of T' past its last full block (in the last block)

    @property
    def full_tokens(self) -> list[int]:
        """``T'`` through its last full block: what is registered under hashes."""
        return self.tokens[: len(self.tokens) - self.partial_rows]

    @property
    def num_new_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.reuse is None)

    def block_ids(self, new_block_ids: Sequence[int]) -> list[int]:
        """The id of each block of ``T'`` once its fresh blocks are ``new_block_ids``."""
        if len(new_block_ids) != self.num_new_blocks:
            raise ValueError(f"{len(new_block_ids)} block ids for {self.num_new_blocks} new blocks")
        ids = iter(new_block_ids)
        return [b.reuse if b.reuse is not None else next(ids) for b in self.blocks]


def plan_block_splice(
    block_size: int,
    tokens: Sequence[int],
    start: int,
    end: int,
    replacement: Sequence[int],
    t_blocks: Sequence[int],
    head_blocks: Sequence[int] | None,
    *,
    t_in_target: bool,
    head_in_target: bool,
    t_rows: int | None = None,
    hold_partial: bool = False,
) -> BlockSplicePlan:
    """The plan of ``AMORTIZE(start, end, replacement)`` on ``tokens`` (see the module doc).

    ``t_blocks``: the blocks holding ``T``'s first ``t_rows`` rows, in order (full cached
    blocks, the last possibly a held partial one; ``t_rows`` defaults to every row of
    them); ``head_blocks``: the head request's blocks, covering at least
    ``start + len(replacement)`` rows (None: ``R``'s rows are ``FILL``, computed by the
    caller, ``fill_rows``). ``hold_partial``: the plan also writes the rows past
    ``T'``'s last full block (the caller holds that block); without it they are left to
    the next request's prefill. ``CacheMissError`` if ``T`` is not known through ``end``.
    """
    b = block_size
    s, e, r = start, end, list(replacement)
    if not 0 <= s <= e <= len(tokens):
        raise DirectiveError(f"directives[0]: span [{s}, {e}) does not fit {len(tokens)} tokens")
    cached = len(t_blocks) * b if t_rows is None else min(t_rows, len(t_blocks) * b, len(tokens))
    if e > cached:
        raise CacheMissError(
            f"tokens: the sequence is cached through {cached} tokens, the span ends at {e}"
        )
    h = s + len(r)
    if head_blocks is not None and len(head_blocks) * b < h:
        raise DirectiveError(f"head: {len(head_blocks)} blocks do not hold {h} rows")
    delta = len(r) - (e - s)
    known = h + (cached - e)
    n_full = known // b
    if not hold_partial:
        known = n_full * b
    new_tokens = (list(tokens[:s]) + r + list(tokens[e:cached]))[:known]

    # ``rows_of``'s rows a piece at a time (no object per row: a splice moves thousands):
    # row i of T' is read at ``slots[i]`` (a fill row in the head's blocks or ``FILL``, any
    # other in T's) and turned by ``deltas[i]``
    slots: list[int] = []
    deltas: list[int] = []
    for p in amortize_pieces(s, e, r, cached):
        if p.kind == "prefill" and head_blocks is None:
            slots += [FILL] * p.size
        else:
            blocks = head_blocks if p.kind == "prefill" else t_blocks
            slots += [blocks[x // b] * b + x % b for x in p.sources]
        deltas += [p.delta] * p.size

    out: list[BlockSource] = []
    for j in range(-(-known // b)):
        lo, hi = j * b, min((j + 1) * b, known)
        if hi - lo == b and hi <= s and t_in_target:
            out.append(BlockSource(reuse=t_blocks[j]))
        elif hi - lo == b and lo >= s and hi <= h and head_in_target and head_blocks is not None:
            out.append(BlockSource(reuse=head_blocks[j]))
        else:
            out.append(BlockSource(rows=tuple(zip(slots[lo:hi], deltas[lo:hi], strict=True))))
    return BlockSplicePlan(
        tokens=new_tokens, blocks=out, rotated_tokens=max(0, known - h), delta=delta,
        partial_rows=known - n_full * b,
    )  # fmt: skip


def row_copies(
    plan: BlockSplicePlan, new_block_ids: Sequence[int], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    """``(src_slots, dst_slots, deltas)`` of the plan's fresh blocks, given their ids (the
    ``FILL`` rows are not copies: left out)."""
    src, dst, deltas = [], [], []
    for blk, bid in zip(plan.blocks, plan.block_ids(new_block_ids), strict=True):
        if blk.reuse is not None:
            continue
        for off, (slot, d) in enumerate(blk.rows):
            if slot == FILL:
                continue
            src.append(slot)
            dst.append(bid * block_size + off)
            deltas.append(d)
    return src, dst, deltas


def fill_rows(plan: BlockSplicePlan, start: int, replacement_len: int) -> list[int]:
    """The rows of ``plan.tokens`` the splice computes (a plan made without a head): ``R``'s
    rows that the plan writes, all in fresh blocks."""
    return list(range(start, min(start + replacement_len, len(plan.tokens))))


def repair_rows(
    plan: BlockSplicePlan,
    tokens: Sequence[int],
    start: int,
    end: int,
    replacement_len: int,
    repair: Mapping[str, Any] | None,
    block_size: int,
) -> list[int]:
    """The rows of ``plan.tokens`` a REPAIR of ``(start, end)`` recomputes (none without
    ``repair``, ``{"budget": b, "selector": name}``): ``directives.repair``'s selection over
    the tail the plan writes, as ``leyline serve`` selects them. Each must lie in a fresh
    block of the plan (a reused block is shared with ``T``), checked before any write."""
    if not repair:
        return []
    r = (0,) * replacement_len  # the step's R: only its length is read
    step = SpliceStep(start, end, r, Mode.REPAIR, len(tokens))
    selector = str(repair.get("selector") or DEFAULT_SELECTOR)
    rows = repair_rows_of(tokens, [step], [float(repair["budget"])], plan.tokens, selector)
    for row in rows:
        if plan.blocks[row // block_size].reuse is not None:
            raise ValueError(f"repair: row {row} lies in a reused block, not a fresh one")
    return rows


def copy_runs(
    src: Sequence[int], dst: Sequence[int], delta: Sequence[int], block_size: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Split a row move into ``(block_runs, row_runs)``.

    A stretch of ``block_size`` moves that reads every row of one block in order, at delta
    0, into every row of another block in order is the copy of that block (every element
    of the source block to the destination, whatever the layout inside a block).
    ``block_runs`` are such copies as ``(src_block, dst_block, count)``: ``count`` blocks of
    consecutive ids on both sides, in the moves' order. ``row_runs`` are the other moves as
    ``[i, j)`` ranges of the moves' indices, each maximal with one delta, in order."""
    b, n = block_size, len(src)
    blocks: list[tuple[int, int, int]] = []
    rows: list[tuple[int, int]] = []
    i = 0
    while i < n:
        j, s0, d0 = i + b, src[i], dst[i]
        if (
            j <= n
            and s0 % b == 0
            and d0 % b == 0
            and not any(delta[i:j])
            and list(src[i:j]) == list(range(s0, s0 + b))
            and list(dst[i:j]) == list(range(d0, d0 + b))
        ):
            sb, db = s0 // b, d0 // b
            last = blocks[-1] if blocks else None
            if last is not None and (last[0] + last[2], last[1] + last[2]) == (sb, db):
                blocks[-1] = (last[0], last[1], last[2] + 1)
            else:
                blocks.append((sb, db, 1))
            i = j
            continue
        if rows and rows[-1][1] == i and delta[i - 1] == delta[i]:
            rows[-1] = (rows[-1][0], i + 1)
        else:
            rows.append((i, i + 1))
        i += 1
    return blocks, rows
