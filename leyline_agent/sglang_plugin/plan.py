"""Pure planning of one AMORTIZE splice over SGLang's radix cache (no tensor is mutated).

Inputs are what two read-only lookups found (``treeview.peek_prefix``):
- ``old``: the cached prefix of the base sequence ``T`` (``m`` tokens, their slots);
- ``new``: the cached prefix of ``T' = T[:start] + R + T[end:]`` (``a`` tokens). The head
  ``T[:start] + R`` must already be in it: ``R`` was prefilled by SGLang's own prefill (a
  normal request for the head, see ``client.py``), so ``a >= start + |R|``.

The plan says which old tail slots are read (``src_slots``), how many new slots the tail
needs (``num_new``), by how much their rotary band moves (``delta``) and which key/value
prefix the tree already holds (``reuse_len`` tokens of ``T'``). Everything is validated
here, before anything is locked, allocated or written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline_agent.directives import Directive, Mode
from leyline_agent.errors import CacheMissError, DirectiveError

__all__ = ["SplicePlan", "check_base", "plan_amortize", "spliced_tokens"]


@dataclass(slots=True, frozen=True)
class SplicePlan:
    new_token_ids: tuple[int, ...]  # the key inserted into the tree: T'[: reuse_len + num_new]
    head_len: int  # start + |R|: the prefilled part of T'
    reuse_len: int  # tokens of T' already in the tree (>= head_len)
    reuse_slots: torch.Tensor  # int64 [reuse_len]: their slots (the tree's own, not freed)
    src_slots: torch.Tensor  # int64 [num_new]: old tail slots to read
    delta: int  # every tail token moves by delta positions
    first_old_pos: int  # position in T of the first tail token read
    cached_base_len: int  # m: tokens of T in the tree (the tail ends there)

    @property
    def num_new(self) -> int:
        return int(self.src_slots.numel())


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
    old_len: int,
    old_slots: torch.Tensor,
    new_len: int,
    new_slots: torch.Tensor,
) -> SplicePlan:
    """Plan the tail copy for ``directive`` on ``tokens`` (T); see the module docstring."""
    check_base(tokens, directive, old_len)
    start, end, repl = directive.start, directive.end, list(directive.replacement)
    delta = directive.delta
    head = list(tokens[:start]) + repl
    head_len = len(head)
    if new_len < head_len:
        raise CacheMissError(
            f"directive.replacement: prefix + replacement is not prefilled (only {new_len} of "
            f"{head_len} tokens cached); send it as a request first"
        )
    tail_cached = old_len - end  # tail tokens that have KV in the tree
    new_total = head_len + tail_cached
    new_ids = head + list(tokens[end:old_len])
    reuse = min(new_len, new_total)
    skip = reuse - head_len  # tail tokens of T' the tree already holds (an earlier splice)
    src = old_slots[end + skip : old_len].clone()
    return SplicePlan(
        new_token_ids=tuple(new_ids),
        head_len=head_len,
        reuse_len=reuse,
        reuse_slots=new_slots[:reuse].clone(),
        src_slots=src,
        delta=delta,
        first_old_pos=end + skip,
        cached_base_len=old_len,
    )
