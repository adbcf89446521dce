"""Read-only lookups in SGLang's ``RadixCache``.

``RadixCache.match_prefix`` splits a node when a match ends inside it: a lookup that
mutates. Validation must leave the tree untouched, so the splice looks prefixes up here
with a walk that only reads ``children`` / ``key`` / ``value`` of the real nodes (the
same fields ``match_prefix`` reads). The node it returns is the deepest one the match
touches; locking it protects every slot of the match (a lock covers the whole path to
the root, and a later split copies ``lock_ref`` into the new parent).

Every lookup names the radix namespace it reads: ``extra_key=None`` is SGLang's plain tree,
a string is one of SGLang's ``extra_key`` namespaces (``routing.py`` says which is whose).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leyline_agent.errors import RuntimeUnavailableError

__all__ = ["PrefixPeek", "check_tree", "node_at", "peek_prefix", "radix_key"]


@dataclass(slots=True, frozen=True)
class PrefixPeek:
    """The cached prefix of a token sequence: ``length`` tokens held in ``slots``."""

    length: int
    node: Any  # sglang TreeNode: the deepest node the match touches (root if length == 0)
    slots: torch.Tensor  # int64 [length], the pool slots of the matched tokens


def radix_key(token_ids: Sequence[int], extra_key: str | None = None) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", token_ids), extra_key)


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


def peek_prefix(tree: Any, token_ids: Sequence[int], extra_key: str | None = None) -> PrefixPeek:
    """Longest prefix of ``token_ids`` cached in ``tree``'s namespace ``extra_key`` (page
    size 1), without mutating anything."""
    key = radix_key(token_ids, extra_key)
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


def node_at(
    tree: Any, token_ids: Sequence[int], pos: int, extra_key: str | None = None
) -> tuple[Any, int] | None:
    """``(node, offset)``: the node of namespace ``extra_key`` holding the row of
    ``token_ids[pos]`` (the cached path must cover ``token_ids[: pos + 1]``), and where
    in ``node.key`` that row sits; ``None`` when the row is not cached. Read-only."""
    key = radix_key(token_ids[: pos + 1], extra_key)
    node = tree.root_node
    matched = 0
    while matched <= pos:
        child = node.children.get(key.child_key_at(matched, 1))
        if child is None or child.value is None:
            return None
        n = child.key.match_at(key, offset=matched)
        if matched + n > pos:
            return child, pos - matched
        if n < len(child.key):
            return None
        matched += n
        node = child
    return None
