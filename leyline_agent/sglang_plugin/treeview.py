"""Read-only lookups in SGLang's ``RadixCache``.

``RadixCache.match_prefix`` splits a node when a match ends inside it: a lookup that
mutates. Validation must leave the tree untouched, so the splice looks prefixes up here
with a walk that only reads ``children`` / ``key`` / ``value`` of the real nodes (the
same fields ``match_prefix`` reads). The node it returns is the deepest one the match
touches; locking it protects every slot of the match (a lock covers the whole path to
the root, and a later split copies ``lock_ref`` into the new parent).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leyline_agent.errors import RuntimeUnavailableError

__all__ = ["PrefixPeek", "check_tree", "peek_prefix", "radix_key"]


@dataclass(slots=True, frozen=True)
class PrefixPeek:
    """The cached prefix of a token sequence: ``length`` tokens held in ``slots``."""

    length: int
    node: Any  # sglang TreeNode: the deepest node the match touches (root if length == 0)
    slots: torch.Tensor  # int64 [length], the pool slots of the matched tokens


def radix_key(token_ids: Sequence[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", token_ids))


def check_tree(tree: Any) -> None:
    """Refuse trees other than a plain ``RadixCache`` over token ids with page size 1."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if type(tree) is not RadixCache:
        raise RuntimeUnavailableError(
            f"the scheduler's prefix cache is a {type(tree).__name__}; the Leyline splice needs "
            "SGLang's RadixCache: start the server with --radix-cache-backend leyline"
        )
    if getattr(tree, "disable", False):
        raise RuntimeUnavailableError("the radix cache is disabled (--disable-radix-cache)")
    if tree.page_size != 1:
        raise RuntimeUnavailableError(
            f"the radix cache has page_size={tree.page_size}; Leyline splices need --page-size 1"
        )
    if getattr(tree, "is_eagle", False):
        raise RuntimeUnavailableError("EAGLE (bigram) radix keys are not supported by the splice")


def peek_prefix(tree: Any, token_ids: Sequence[int]) -> PrefixPeek:
    """Longest cached prefix of ``token_ids`` in ``tree`` (page_size 1), without mutating it."""
    key = radix_key(token_ids)
    node = tree.root_node
    matched = 0
    pieces: list[torch.Tensor] = []
    while matched < len(key):
        child = node.children.get(key.child_key_at(matched, 1))
        if child is None or child.value is None:
            break
        n = child.key.match_at(key, offset=matched)
        if n == 0:
            break
        pieces.append(child.value[:n])
        matched += n
        node = child
        if n < len(child.key):
            break
    slots = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    return PrefixPeek(length=matched, node=node, slots=slots.to(torch.int64))
