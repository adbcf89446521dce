"""The scheduler-side AMORTIZE splice on SGLang's real radix cache, allocator and KV pool.

Three levels, as in SGLang: the ``RadixCache`` holds int64 slot indices per token, the
``TokenToKVPoolAllocator`` hands slots out and takes them back, the KV pool holds the bytes.

``splice_amortize`` for ``T' = T[:start] + R + T[end:]``, with ``T[:start] + R`` already
prefilled into the tree by SGLang (``client.py`` sends it as a normal request first):

1. look ``T`` and ``T'`` up read-only and plan (``plan.py``): every check happens here;
   a refused directive leaves tree, allocator and pool bitwise unchanged;
2. lock both matched paths (``inc_lock_ref``), so the eviction an allocation may trigger
   cannot free the slots being read; if free + evictable slots cannot hold the tail, unlock
   and refuse before evicting anything;
3. allocate one new slot per cached tail token, write them (``kv_write.write_tail``:
   latent/values copied, rotary band rotated by delta) out of place;
4. insert ``T'`` into the tree with value ``tree's slots of the head + new tail slots``:
   the head part is the tree's own (``insert`` reports it as the matched prefix and nothing
   is freed), the new slots become the tree's (one reference, freed by eviction);
5. unlock. On any failure after step 2 the new slots go back to the allocator.

The old path ``T`` stays in the tree untouched; LRU eviction reclaims it when unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from leyline_agent.directives import Directive
from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.sglang_plugin.kv_write import check_pool, write_tail
from leyline_agent.sglang_plugin.plan import SplicePlan, check_base, plan_amortize, spliced_tokens
from leyline_agent.sglang_plugin.treeview import check_tree, peek_prefix, radix_key

__all__ = ["SpliceResult", "SpliceTarget", "check_splice_base", "plan_splice", "splice_amortize"]

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SpliceTarget:
    """What one scheduler rank holds: its tree, allocator, KV pool and the model's RoPE."""

    tree: Any  # sglang RadixCache
    allocator: Any  # sglang TokenToKVPoolAllocator (page_size 1)
    kv_pool: Any  # sglang MLATokenToKVPool | MHATokenToKVPool
    spec: Any  # leyline_agent.kernels.RopeSpec, cache_owner="sglang"


@dataclass(slots=True, frozen=True)
class SpliceResult:
    new_token_ids: tuple[int, ...]  # what is now cached of T'
    reused_tokens: int  # tokens of T' that were already in the tree (prefix + R, ...)
    rotated_tokens: int  # tail tokens written into new slots
    delta: int


def check_splice_base(target: SpliceTarget, tokens: Sequence[int], directive: Directive) -> None:
    """Read-only pre-check, before the head is prefilled: is the base cached far enough?"""
    check_tree(target.tree)
    check_pool(target.kv_pool, target.spec)
    directive = Directive.parse(directive, where="directive")
    tokens = [int(t) for t in tokens]
    spliced_tokens(tokens, directive)
    check_base(tokens, directive, peek_prefix(target.tree, tokens).length)


def plan_splice(target: SpliceTarget, tokens: Sequence[int], directive: Directive) -> tuple:
    """Validate and plan without mutating anything; returns ``(plan, old_peek, new_peek)``."""
    check_tree(target.tree)
    check_pool(target.kv_pool, target.spec)
    if target.allocator.page_size != 1:
        raise RuntimeUnavailableError("the KV allocator must have page_size 1")
    directive = Directive.parse(directive, where="directive")
    tokens = [int(t) for t in tokens]
    new_tokens = spliced_tokens(tokens, directive)
    old = peek_prefix(target.tree, tokens)
    new = peek_prefix(target.tree, new_tokens)
    plan = plan_amortize(tokens, directive, old.length, old.slots, new.length, new.slots)
    return plan, old, new


def splice_amortize(
    target: SpliceTarget, tokens: Sequence[int], directive: Directive
) -> SpliceResult:
    plan, old, new = plan_splice(target, tokens, directive)
    if plan.num_new == 0:
        return _result(plan)
    tree, allocator = target.tree, target.allocator
    locks = [tree.lock(old.node), tree.lock(new.node)]
    dst: torch.Tensor | None = None
    try:
        room = allocator.available_size() + tree.evictable_size()  # unlocked = evictable
        if room < plan.num_new:
            raise RuntimeUnavailableError(
                f"KV pool full: the splice needs {plan.num_new} slots, {room} free or evictable"
            )
        dst = _alloc(tree, allocator, plan.num_new)
        write_tail(target.kv_pool, target.spec, plan.src_slots, dst, plan.delta)
        _insert(tree, allocator, plan, dst)
        dst = None  # owned by the tree now
    finally:
        if dst is not None:
            allocator.free(dst)
        for lock in reversed(locks):
            tree.unlock(lock)
    log.info(
        "leyline_splice",
        reused=plan.reuse_len,
        rotated=plan.num_new,
        delta=plan.delta,
        cached_base=plan.cached_base_len,
    )
    return _result(plan)


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


def _insert(tree: Any, allocator: Any, plan: SplicePlan, dst: torch.Tensor) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    value = torch.cat([plan.reuse_slots.to(dst.device), dst]).to(torch.int64)
    result = tree.insert(InsertParams(key=radix_key(plan.new_token_ids), value=value))
    dup = result.prefix_len - plan.reuse_len
    if dup > 0:  # someone cached part of the tail in between: ours are duplicates
        allocator.free(dst[:dup])


def _result(plan: SplicePlan) -> SpliceResult:
    return SpliceResult(
        new_token_ids=plan.new_token_ids[: plan.reuse_len + plan.num_new],
        reused_tokens=plan.reuse_len,
        rotated_tokens=plan.num_new,
        delta=plan.delta,
    )
