"""FORGET in a session's namespace: drop its rows of ``T'`` from the span on, so that SGLang's
normal prefill (the request that follows, ``batch.py``) writes exact ones.

FORGET ``(s, e, R)`` on ``T`` is a prefix-trimmed re-prefill of ``T' = T[:s] + R + T[e:]``:
``T'[:s]`` stays as the session is served it, everything from position ``s`` on is computed
afresh. A normal request for ``T'`` alone would reuse whatever the session's tree already
holds for those tokens, and that may be an AMORTIZE result with the very same tokens (a
coinciding splice): the FORGET would silently do nothing. So first, in the session's tree
only (the plain tree holds exact rows, nothing to forget there):

1. ``plan_forget`` (read-only): find the node holding the row of ``T'[s]``. Nothing cached
   there: nothing to drop. A lock on that node means a running request reads these rows
   (a lock covers the path to the root): refuse, nothing changed, retry later.
2. ``forget_rows``: split the node at ``s`` (SGLang's own ``_split_node``), then delete the
   part from ``s`` and its whole subtree (every row there was computed after position
   ``s`` of this path), freeing its slots, leaves first (``_delete_leaf``, as ``evict``
   does, keeping the tree's evictable size and leaf set exact).

Then the request for ``T'`` is routed (``routing.py``): to the session's tree if it still
holds a prefix of ``T'``, else to the plain tree; either way the rows from ``s`` on are a
fresh prefill over the prefix the session is served.

``_split_node`` and ``_delete_leaf`` are SGLang 0.5.23 internals of ``RadixCache``; this
module is the only one that calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from leyline_agent.directives import Directive, Mode
from leyline_agent.errors import DirectiveError, RuntimeUnavailableError
from leyline_agent.sglang_plugin.plan import spliced_tokens
from leyline_agent.sglang_plugin.routing import ANONYMOUS_KEY, check_namespace
from leyline_agent.sglang_plugin.splice import SpliceTarget
from leyline_agent.sglang_plugin.treeview import check_tree, node_at

__all__ = ["ForgetPlan", "forget_rows", "plan_forget"]

log = structlog.get_logger(__name__)


@dataclass(slots=True, frozen=True)
class ForgetPlan:
    new_token_ids: tuple[int, ...]  # T'
    start: int  # first position recomputed
    node: Any  # sglang TreeNode holding the row of T'[start] (None: nothing cached there)
    offset: int  # where in node.key that row sits
    dropped_tokens: int  # rows of the session's tree freed by the drop


def plan_forget(
    target: SpliceTarget,
    tokens: Sequence[int],
    directive: Directive,
    namespace: str = ANONYMOUS_KEY,
) -> ForgetPlan:
    check_tree(target.tree)
    namespace = check_namespace(namespace)
    directive = Directive.parse(directive, where="directive")
    if directive.mode is not Mode.FORGET:
        raise DirectiveError(f"directive.mode: {directive.mode.value!r} is not FORGET")
    new_tokens = spliced_tokens([int(t) for t in tokens], directive)
    s = directive.start
    found = node_at(target.tree, new_tokens, s, namespace) if s < len(new_tokens) else None
    if found is None:
        return ForgetPlan(tuple(new_tokens), s, None, 0, 0)
    node, offset = found
    if node.lock_ref > 0:
        raise RuntimeUnavailableError(
            f"FORGET: the session's cached rows from position {s} are in use by a running "
            "request; retry when it has finished"
        )
    dropped = sum(len(n.key) for n in _subtree(node)) - offset
    return ForgetPlan(tuple(new_tokens), s, node, offset, dropped)


def forget_rows(
    target: SpliceTarget,
    tokens: Sequence[int],
    directive: Directive,
    namespace: str = ANONYMOUS_KEY,
) -> ForgetPlan:
    """Drop the session's rows of ``T'`` from ``directive.start`` on (see the docstring)."""
    plan = plan_forget(target, tokens, directive, namespace)
    if plan.node is None:
        return plan
    tree = target.tree
    node = plan.node
    if plan.offset > 0:
        tree._split_node(node.key, node, plan.offset)  # ``node`` is now the part from start
    for n in reversed(_subtree(node)):  # descendants before their ancestors
        if n.value is not None:
            target.allocator.free(n.value)
        tree._delete_leaf(n)
        tree.kv_events.record_remove(n)
    log.info("leyline_forget", namespace=namespace, start=plan.start, dropped=plan.dropped_tokens)
    return plan


def _subtree(node: Any) -> list[Any]:
    """``node`` and its descendants, every node before its children."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out
