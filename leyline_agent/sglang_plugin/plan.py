"""Pure planning of one AMORTIZE splice over SGLang's radix cache (no tensor is mutated): the
one planner's pieces (``directives.splice_plan.amortize_pieces``) placed on radix namespaces.

Inputs are what read-only lookups found (``treeview.peek_prefix``), in two namespaces:
- ``old``: the cached prefix of the base sequence ``T`` (``m`` tokens, their slots), in the
  session's tree if it holds ``T`` through the span, else in the plain tree
  (``splice.base_of``);
- ``own``: the cached prefix of ``T' = T[:start] + R + T[end:]`` in the session's own tree,
  where ``T'`` is inserted;
- ``plain``: the cached prefix of ``T'`` in the plain tree (only read when ``own`` lacks the
  head).

The head ``T[:start] + R`` must be cached in one of them: ``R`` was prefilled by SGLang's
own prefill (a normal request for the head, see ``client.py``). If the session's tree holds
it, those rows are reused (and so is any tail an earlier identical splice left there);
otherwise the plain tree's head rows are copied bitwise into new slots (``copy_slots``):
namespaces cannot share slots (``routing.py``).

The plan says which rows are copied (``copy_slots``), which old tail rows are read and
rotated (``src_slots``, by ``delta``) and which rows of the session's tree are kept
(``reuse_len`` tokens of ``T'``). Everything is validated here, before anything is locked,
allocated or written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline_agent.directives import Directive, Mode
from leyline_agent.directives.splice_plan import Piece, amortize_pieces
from leyline_agent.errors import CacheMissError, DirectiveError

__all__ = ["TreeSplicePlan", "check_base", "plan_amortize", "spliced_tokens"]

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(slots=True, frozen=True)
class TreeSplicePlan:
    new_token_ids: tuple[int, ...]  # the key inserted into the tree: T'[: reuse_len + num_new]
    head_len: int  # start + |R|: the prefilled part of T'
    reuse_len: int  # tokens of T' the session's tree holds already (kept, not freed)
    reuse_slots: torch.Tensor  # int64 [reuse_len]: their slots (the tree's own)
    copy_slots: torch.Tensor  # int64 [num_copy]: plain-tree head rows copied into new slots
    src_slots: torch.Tensor  # int64 [num_rotate]: old tail slots to read and rotate
    delta: int  # every tail token moves by delta positions
    first_old_pos: int  # position in T of the first tail token read
    cached_base_len: int  # m: tokens of T in the tree (the tail ends there)

    @property
    def num_copy(self) -> int:
        return int(self.copy_slots.numel())

    @property
    def num_rotate(self) -> int:
        return int(self.src_slots.numel())

    @property
    def num_new(self) -> int:
        """New slots the splice allocates: copied head rows, then rotated tail rows."""
        return self.num_copy + self.num_rotate


def spliced_tokens(tokens: Sequence[int], directive: Directive) -> list[int]:
    """``T' = T[:start] + R + T[end:]``, after checking the span lies inside ``T``."""
    if not directive.is_compiled:
        raise DirectiveError("directive.replacement: text must be compiled to token ids first")
    if directive.start < 0 or directive.end > len(tokens):
        raise DirectiveError(
            f"directive: span [{directive.start}, {directive.end}) is outside the sequence "
            f"(tokens has length {len(tokens)})"
        )
    return (
        list(tokens[: directive.start])
        + list(directive.replacement)
        + list(tokens[directive.end :])
    )


def check_base(tokens: Sequence[int], directive: Directive, old_len: int) -> None:
    """Everything about the base sequence: mode, span inside ``T``, span inside the cached
    ``old_len`` tokens, no negative position. (``plan_amortize`` adds the head check.)"""
    if directive.mode is not Mode.AMORTIZE:
        raise DirectiveError(
            f"directive.mode: {directive.mode.value!r} is not spliced in the scheduler; "
            "FORGET goes through SGLang's normal prefill"
        )
    spliced_tokens(tokens, directive)  # span inside T, replacement compiled
    n = len(tokens)
    start, end = directive.start, directive.end
    if old_len == 0 and n > 0:
        raise CacheMissError("tokens: the base sequence is not in the radix cache")
    if old_len < end:
        raise CacheMissError(
            f"directive.end: span [{start}, {end}) is outside the cached part of the base "
            f"sequence (only {old_len} of {n} tokens are cached)"
        )
    delta = directive.delta
    if start < 0 or end + delta < 0:
        raise DirectiveError(
            f"directive: start {start} / delta {delta} would put tail positions below 0"
        )


def plan_amortize(
    tokens: Sequence[int],
    directive: Directive,
    old: tuple[int, torch.Tensor],
    own: tuple[int, torch.Tensor],
    plain: tuple[int, torch.Tensor] = (0, _EMPTY),
) -> TreeSplicePlan:
    """Plan the splice of ``directive`` on ``tokens`` (T); see the module docstring.
    ``old``, ``own``, ``plain``: ``(cached length, slots)`` of T, T' (session), T' (plain)."""
    (old_len, old_slots), (own_len, own_slots), (plain_len, plain_slots) = old, own, plain
    check_base(tokens, directive, old_len)
    start, end, repl = directive.start, directive.end, list(directive.replacement)
    # the planner's AMORTIZE of T[:old_len]: the head (kept prefix and R's fill) lies in one
    # tree, reused or copied; the moved tail is read from T's slots and turned by delta
    pieces = amortize_pieces(start, end, repl, old_len)
    head_len = sum(p.size for p in pieces if p.kind != "move")
    tail = next((p for p in pieces if p.kind == "move"), Piece("move", old_len, old_len))
    delta = directive.delta
    new_total = head_len + tail.size
    new_ids = list(tokens[:start]) + repl + list(tokens[end:old_len])
    if own_len >= head_len:  # the session's tree holds the head (and maybe an earlier tail)
        reuse = min(own_len, new_total)
        copy = _EMPTY
    elif plain_len >= head_len:  # the head is exact rows of the plain tree: copy them
        reuse = own_len
        copy = plain_slots[own_len:head_len].clone()
    else:
        raise CacheMissError(
            f"directive.replacement: prefix + replacement is not prefilled (only "
            f"{max(own_len, plain_len)} of {head_len} tokens cached); send it as a request first"
        )
    skip = max(0, reuse - head_len)  # tail tokens of T' the session holds (an earlier splice)
    return TreeSplicePlan(
        new_token_ids=tuple(new_ids),
        head_len=head_len,
        reuse_len=reuse,
        reuse_slots=own_slots[:reuse].clone(),
        copy_slots=copy,
        src_slots=old_slots[tail.lo + skip : tail.hi].clone(),
        delta=delta,
        first_old_pos=tail.lo + skip,
        cached_base_len=old_len,
    )
