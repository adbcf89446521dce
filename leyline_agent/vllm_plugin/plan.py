"""Pure: one AMORTIZE directive on vLLM's block-granular prefix cache, as a plan of rows.

vLLM caches full blocks of ``B`` tokens only, and a block's hash chains over every token
before it (and the namespace's salt). So ``T' = T[:s] + R + T[e:]`` is registered block by
block under its own hash chain, in the session's namespace, and each block of ``T'`` is
either a block that already holds exactly its rows under that hash (reused), or a fresh
block whose ``B`` rows are copied from cached rows (the rotated ones moved by ``delta``):

- rows ``p < s`` (the prefix): ``T``'s own rows (the prefix stays bitwise);
- rows ``s <= p < s + |R|`` (``R``): the head request's rows (``T[:s] + R`` prefilled by
  vLLM's own request path, which leaves them in ``head_blocks``);
- rows ``p >= s + |R|`` (the tail): ``T``'s row ``p - delta``, its key rotated by ``delta``.

A full block made only of prefix rows is reused when ``T`` was found in the target
namespace (same salt, same tokens: same hash), and one made only of ``R`` rows when the
head was; every other block is fresh. ``T``'s known rows are its cached full blocks and,
where the plugin holds them, the rows of its partial last block (``t_rows``): the plan
covers ``T'`` up to ``s + |R| + (t_rows - e)``. The full blocks of that are registered
under ``T'``'s hashes; the rows past them go to one more fresh block (``partial``), which
the plugin holds for the next request (``held_rows``) instead of leaving them to its
prefill. Slots are ``block_id * B + offset``, as vLLM's slot mapping.

A REPAIR directive's rows (``repair_rows``) are chosen over the plan's ``T'`` by
``directives.repair``; they are tail rows, so they lie in fresh blocks (checked).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent.directives.repair import DEFAULT_SELECTOR, RepairSpan, select_rows
from leyline_agent.errors import CacheMissError, DirectiveError

__all__ = [
    "BlockSource",
    "BlockSplicePlan",
    "plan_block_splice",
    "repair_rows",
    "row_copies",
    "splice_slots",
]


@dataclass(slots=True, frozen=True)
class BlockSource:
    """One block of ``T'``: ``reuse`` (an existing block id) or ``rows`` (``B`` pairs
    ``(src_slot, delta)`` for a fresh block)."""

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


def plan_block_splice(
    block_size: int,
    tokens: Sequence[int],
    start: int,
    end: int,
    replacement: Sequence[int],
    t_blocks: Sequence[int],
    head_blocks: Sequence[int],
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
    ``start + len(replacement)`` rows. ``hold_partial``: the plan also writes the rows past
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
    if len(head_blocks) * b < h:
        raise DirectiveError(f"head: {len(head_blocks)} blocks do not hold {h} rows")
    delta = len(r) - (e - s)
    known = h + (cached - e)
    n_full = known // b
    if not hold_partial:
        known = n_full * b
    new_tokens = (list(tokens[:s]) + r + list(tokens[e:cached]))[:known]

    def t_slot(p: int) -> int:
        return t_blocks[p // b] * b + p % b

    def head_slot(p: int) -> int:
        return head_blocks[p // b] * b + p % b

    out: list[BlockSource] = []
    for j in range(-(-known // b)):
        lo, hi = j * b, min((j + 1) * b, known)
        if hi - lo == b and hi <= s and t_in_target:
            out.append(BlockSource(reuse=t_blocks[j]))
            continue
        if hi - lo == b and lo >= s and hi <= h and head_in_target:
            out.append(BlockSource(reuse=head_blocks[j]))
            continue
        rows = []
        for p in range(lo, hi):
            if p < s:  # the prefix: T's row where T has it cached, else the head's copy
                rows.append((t_slot(p) if p // b < len(t_blocks) else head_slot(p), 0))
            elif p < h:
                rows.append((head_slot(p), 0))
            else:
                rows.append((t_slot(p - delta), delta))
        out.append(BlockSource(rows=tuple(rows)))
    return BlockSplicePlan(
        tokens=new_tokens, blocks=out, rotated_tokens=max(0, known - h), delta=delta,
        partial_rows=known - n_full * b,
    )  # fmt: skip


def row_copies(
    plan: BlockSplicePlan, new_block_ids: Sequence[int], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    """``(src_slots, dst_slots, deltas)`` of the plan's fresh blocks, given their ids."""
    if len(new_block_ids) != plan.num_new_blocks:
        raise ValueError(f"{len(new_block_ids)} block ids for {plan.num_new_blocks} new blocks")
    src, dst, deltas = [], [], []
    ids = iter(new_block_ids)
    for blk in plan.blocks:
        if blk.reuse is not None:
            continue
        bid = next(ids)
        for off, (slot, d) in enumerate(blk.rows):
            src.append(slot)
            dst.append(bid * block_size + off)
            deltas.append(d)
    return src, dst, deltas


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
    span = RepairSpan(start + replacement_len, len(plan.tokens), tuple(tokens[start:end]),
                      float(repair["budget"]))  # fmt: skip
    rows = select_rows(plan.tokens, [span], str(repair.get("selector") or DEFAULT_SELECTOR))
    for r in rows:
        if plan.blocks[r // block_size].reuse is not None:
            raise ValueError(f"repair: row {r} lies in a reused block, not a fresh one")
    return rows


def splice_slots(
    plan: BlockSplicePlan, new_block_ids: Sequence[int], block_size: int, n: int
) -> list[int]:
    """The slots of ``plan.tokens[:n]`` once the plan's fresh blocks are ``new_block_ids``."""
    ids = iter(new_block_ids)
    blocks = [b.reuse if b.reuse is not None else next(ids) for b in plan.blocks]
    return [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
