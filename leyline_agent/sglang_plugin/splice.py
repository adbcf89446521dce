"""The scheduler-side AMORTIZE splice on SGLang's real radix cache, allocator and KV pool.

Three levels, as in SGLang: the ``RadixCache`` holds int64 slot indices per token, the
``TokenToKVPoolAllocator`` hands slots out and takes them back, the KV pool holds the bytes.

Namespaces (``routing.py``): the splice reads the base ``T`` from the session's own tree if
that holds ``T`` through the span (the session's latest state), else from the plain tree
(exact rows; never another session's), and writes ``T'`` into the session's own tree only
(extra key ``namespace``). Plain requests and other sessions never match it.

``splice_amortize`` for ``T' = T[:start] + R + T[end:]``, with ``T[:start] + R`` already
prefilled by SGLang (``client.py`` sends it as a normal request first):

1. look ``T`` and ``T'`` up read-only and plan (``plan.py``): every check happens here;
   a refused directive leaves tree, allocator and pool bitwise unchanged;
2. lock the matched paths (``inc_lock_ref``), so the eviction an allocation may trigger
   cannot free the slots being read; if free + evictable slots cannot hold the new rows,
   unlock and refuse before evicting anything;
3. allocate the new slots and write them out of place (``kv_write``): the head rows the
   session's tree lacks are copied bitwise from the plain tree, the tail rows are copied
   with their rotary band rotated by delta;
4. insert ``T'`` under the session's extra key with value ``session's own slots + new
   slots``: the first part is the tree's own (``insert`` reports it as the matched prefix
   and nothing is freed), the new slots become the tree's (one reference, freed by eviction);
5. unlock. On any failure after step 2 the new slots go back to the allocator.

Why copies and not shared slots for the head: SGLang's extra-key namespaces are separate
trees under one root (no node is shared, not even the root's children), and its allocator
keeps no reference counts; a slot held by two trees would be freed by the first eviction
while the other still serves it. A copy costs one row of memory per head token and no
compute; it is made once, on a session's first splice from the plain tree (later splices of
the session find their head in its own tree and reuse it).

The old path ``T`` stays in its tree untouched; LRU eviction reclaims it when unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from leyline_agent.directives import Directive
from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.sglang_plugin.kv_write import check_pool, copy_rows, write_tail
from leyline_agent.sglang_plugin.plan import (
    TreeSplicePlan,
    check_base,
    plan_amortize,
    spliced_tokens,
)
from leyline_agent.sglang_plugin.routing import ANONYMOUS_KEY, check_namespace
from leyline_agent.sglang_plugin.treeview import PrefixPeek, check_tree, peek_prefix, radix_key

__all__ = [
    "TreeLookups",
    "TreeSpliceResult",
    "SpliceTarget",
    "base_of",
    "cached_length",
    "check_splice_base",
    "plan_tree_splice",
    "splice_amortize",
]

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SpliceTarget:
    """What one scheduler rank holds: its tree, allocator, KV pool and the model's RoPE."""

    tree: Any  # sglang RadixCache
    allocator: Any  # sglang TokenToKVPoolAllocator (page_size 1)
    kv_pool: Any  # sglang MLATokenToKVPool | MHATokenToKVPool
    spec: Any  # leyline_agent.kernels.RopeSpec, cache_owner="sglang"


@dataclass(slots=True, frozen=True)
class TreeSpliceResult:
    new_token_ids: tuple[int, ...]  # what the session's tree now holds of T'
    reused_tokens: int  # tokens of T' already in the session's tree (prefix + R, ...)
    copied_tokens: int  # head rows copied from the plain tree into new slots
    rotated_tokens: int  # tail tokens written into new slots
    delta: int
    namespace: str  # the extra key T' is cached under


def check_splice_base(
    target: SpliceTarget,
    tokens: Sequence[int],
    directive: Directive,
    namespace: str = ANONYMOUS_KEY,
) -> None:
    """Read-only pre-check, before the head is prefilled: is the base cached far enough, in
    the session's tree or else in the plain one?"""
    check_tree(target.tree)
    check_pool(target.kv_pool, target.spec)
    namespace = check_namespace(namespace)
    directive = Directive.parse(directive, where="directive")
    tokens = [int(t) for t in tokens]
    spliced_tokens(tokens, directive)
    check_base(tokens, directive, base_of(target.tree, tokens, directive.end, namespace).length)


def base_of(tree: Any, tokens: Sequence[int], end: int, namespace: str) -> PrefixPeek:
    """The base ``T`` as cached in the session's tree if that holds it through ``end``,
    else in the plain tree (else the longer of the two, for the error message)."""
    own = peek_prefix(tree, tokens, namespace)
    if own.length and own.length >= end:
        return own
    plain = peek_prefix(tree, tokens, None)
    return plain if plain.length >= own.length else own


def cached_length(tree: Any, tokens: Sequence[int], namespace: str) -> int:
    """How much of ``tokens`` a directive of ``namespace`` finds cached: the longer of its
    own tree's prefix and the plain tree's. A span ends inside it exactly when ``base_of``
    finds the base cached through the span (the own tree if it holds it, else the plain)."""
    own = peek_prefix(tree, tokens, namespace).length
    return max(own, peek_prefix(tree, tokens, None).length)


@dataclass(slots=True, frozen=True)
class TreeLookups:
    old: PrefixPeek  # T in the session's tree, or else the plain one (``base_of``)
    own: PrefixPeek  # T' in the session's tree
    plain: PrefixPeek  # T' in the plain tree (read only when the session lacks the head)


def plan_tree_splice(
    target: SpliceTarget,
    tokens: Sequence[int],
    directive: Directive,
    namespace: str = ANONYMOUS_KEY,
) -> tuple[TreeSplicePlan, TreeLookups]:
    """Validate and plan without mutating anything."""
    check_tree(target.tree)
    check_pool(target.kv_pool, target.spec)
    if target.allocator.page_size != 1:
        raise RuntimeUnavailableError("the KV allocator must have page_size 1")
    namespace = check_namespace(namespace)
    directive = Directive.parse(directive, where="directive")
    tokens = [int(t) for t in tokens]
    new_tokens = spliced_tokens(tokens, directive)
    tree = target.tree
    old = base_of(tree, tokens, directive.end, namespace)
    own = peek_prefix(tree, new_tokens, namespace)
    plain = peek_prefix(tree, new_tokens, None)
    plan = plan_amortize(
        tokens,
        directive,
        (old.length, old.slots),
        (own.length, own.slots),
        (plain.length, plain.slots),
    )
    return plan, TreeLookups(old, own, plain)


def splice_amortize(
    target: SpliceTarget,
    tokens: Sequence[int],
    directive: Directive,
    namespace: str = ANONYMOUS_KEY,
) -> TreeSpliceResult:
    plan, found = plan_tree_splice(target, tokens, directive, namespace)
    if plan.num_new == 0:
        return _result(plan, namespace)
    tree, allocator = target.tree, target.allocator
    nodes = [found.old.node, found.own.node] + ([found.plain.node] if plan.num_copy else [])
    locks = [tree.lock(n) for n in nodes]
    dst: torch.Tensor | None = None
    try:
        room = allocator.available_size() + tree.evictable_size()  # unlocked = evictable
        if room < plan.num_new:
            raise RuntimeUnavailableError(
                f"KV pool full: the splice needs {plan.num_new} slots, {room} free or evictable"
            )
        dst = _alloc(tree, allocator, plan.num_new)
        copy_rows(target.kv_pool, plan.copy_slots, dst[: plan.num_copy])
        write_tail(target.kv_pool, target.spec, plan.src_slots, dst[plan.num_copy :], plan.delta)
        _insert(tree, allocator, plan, dst, namespace)
        dst = None  # owned by the tree now
    finally:
        if dst is not None:
            allocator.free(dst)
        for lock in reversed(locks):
            tree.unlock(lock)
    log.info(
        "leyline_splice",
        namespace=namespace,
        reused=plan.reuse_len,
        copied=plan.num_copy,
        rotated=plan.num_rotate,
        delta=plan.delta,
        cached_base=plan.cached_base_len,
    )
    return _result(plan, namespace)


def _alloc(tree: Any, allocator: Any, n: int) -> torch.Tensor:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    slots = allocator.alloc(n)
    if slots is None:
        tree.evict(EvictParams(num_tokens=n - allocator.available_size()))
        slots = allocator.alloc(n)
    if slots is None:
        raise RuntimeUnavailableError(
            f"KV pool full: the splice needs {n} slots, {allocator.available_size()} free "
            "after evicting every unlocked path"
        )
    return slots


def _insert(
    tree: Any, allocator: Any, plan: TreeSplicePlan, dst: torch.Tensor, namespace: str
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    value = torch.cat([plan.reuse_slots.to(dst.device), dst]).to(torch.int64)
    key = radix_key(plan.new_token_ids[: plan.reuse_len + plan.num_new], namespace)
    result = tree.insert(InsertParams(key=key, value=value))
    dup = result.prefix_len - plan.reuse_len
    if dup > 0:  # someone cached part of the tail in between: ours are duplicates
        allocator.free(dst[:dup])


def _result(plan: TreeSplicePlan, namespace: str) -> TreeSpliceResult:
    return TreeSpliceResult(
        new_token_ids=plan.new_token_ids[: plan.reuse_len + plan.num_new],
        reused_tokens=plan.reuse_len,
        copied_tokens=plan.num_copy,
        rotated_tokens=plan.num_rotate,
        delta=plan.delta,
        namespace=namespace,
    )
