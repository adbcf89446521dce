"""Radix prefix cache over token ids, with provenance. Indices in the tree, bytes in the pool.

Three levels: this tree maps token-id prefixes to KV *slot indices* (plain ints); the
``SlotAllocator`` knows which indices are free; the ``KVPool`` holds the bytes of each slot.

Provenance (``leyline_agent.namespaces``): every node carries a tag. ``(tenant, None)``
marks exact rows (a plain prefill: they depend on their tokens only) and is shared by
token identity inside the tenant. ``(tenant, session)`` marks spliced rows (an AMORTIZE's
tail, and every row computed after a spliced row): only that session reaches them. A node's
children are keyed by ``(tag, first token)``; an exact node may have exact and spliced
children, a spliced node only children of its own tag (rows after a spliced row are never
exact). A lookup in namespace ``ns`` prefers ``ns``'s own spliced child over the exact one:
a session is served its own latest state.

Public API (above the line):
- ``match_prefix(tokens, ns)`` -> ``Match``: the longest prefix ``ns`` may reuse, its slots,
  and how much of it is exact. Pure: it neither splits nodes nor touches LRU clocks.
- ``insert(tokens, slots, ns, exact_len)`` -> ``InsertResult``. Rows ``[0, exact_len)`` are
  exact: the tree keeps the rows it already holds for them (first writer wins, they are
  equal), and detaches ``ns``'s spliced branches along them (an exact write supersedes the
  session's spliced state: a FORGET really forgets). Rows from ``exact_len`` on go under
  ``ns``'s tag and the latest write wins: where the given slots differ from the tree's, the
  tree's old branch is detached and the new rows are adopted; where ``ns`` enters its own
  rows at an exact node, its older own branches deeper down that exact path (which a
  lookup can no longer reach) are detached too. Detached rows that nobody
  has locked come back in ``InsertResult.freed``; locked ones wait in a graveyard until
  ``collect()`` finds them unlocked.
- ``lock(node)`` / ``unlock(node)``: reference counts along the path to the root; locked
  nodes are never evicted.
- ``touch(node)``: mark the path as just used (LRU).
- ``evict(num_tokens)`` -> freed slots: whole unlocked leaves, least recently used first.
  ``evict_rows(num_tokens, tenant)`` -> ``Evicted``: the same (optionally among one
  tenant's leaves only), with the rows each tenant lost.
- ``flush(tenant)`` -> freed slots: every unlocked row of ``tenant`` (its exact and spliced
  rows alike); locked paths stay, other tenants' rows are untouched.

A node's slots never change once inserted: a splice writes NEW slots and inserts ``T'`` as
another path (copy-on-write), so sequences sharing a prefix are never mutated under each
other.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from leyline_agent.namespaces import ANONYMOUS, Namespace

__all__ = ["Evicted", "InsertResult", "Match", "Node", "RadixCache"]

Tag = tuple[str, str | None]


@dataclass(slots=True, eq=False)
class Node:
    key: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[Tag, int], Node] = field(default_factory=dict)
    tag: Tag | None = None  # None only for the root
    lock_ref: int = 0
    last_access: int = 0

    @property
    def spliced(self) -> bool:
        return self.tag is not None and self.tag[1] is not None


@dataclass(slots=True, frozen=True)
class Match:
    length: int
    slots: list[int]
    node: Node  # deepest node the match reaches (possibly only partly): lock this one
    exact_len: int = -1  # leading rows of the match that are exact (-1: all of them)

    def __post_init__(self) -> None:
        if self.exact_len < 0:
            object.__setattr__(self, "exact_len", self.length)


@dataclass(slots=True)
class Evicted:
    slots: list[int] = field(default_factory=list)  # freed: give them back
    by_tenant: dict[str, int] = field(default_factory=dict)  # rows evicted, by owner


@dataclass(slots=True, frozen=True)
class InsertResult:
    held: int  # leading positions whose rows the tree already held (caller's slots unused)
    freed: list[int]  # slots of detached, unlocked old branches: give them back


class RadixCache:
    def __init__(self) -> None:
        self.root = Node()
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.total_tokens = 0
        self._graveyard: list[Node] = []  # detached while locked

    # ---------------------------------------------------------------- public API
    def match_prefix(self, tokens: Sequence[int], ns: Namespace = ANONYMOUS) -> Match:
        node, pos, slots, exact_len = self.root, 0, [], None
        while pos < len(tokens):
            child = self._child(node, tokens[pos], ns)
            if child is None:
                break
            if child.spliced and exact_len is None:
                exact_len = pos
            n = _common(child.key, tokens, pos)
            slots.extend(child.slots[:n])
            pos += n
            node = child
            if n < len(child.key):
                break
        exact = pos if exact_len is None else exact_len
        return Match(length=pos, slots=slots, node=node, exact_len=exact)

    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        ns: Namespace = ANONYMOUS,
        exact_len: int | None = None,
    ) -> InsertResult:
        if len(tokens) != len(slots):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
        exact_len = len(tokens) if exact_len is None else exact_len
        if not 0 <= exact_len <= len(tokens):
            raise ValueError(f"insert: exact_len {exact_len} outside [0, {len(tokens)}]")
        stamp = next(self._clock)
        freed: list[int] = []
        node, pos, held = self.root, 0, None
        while pos < exact_len:  # exact rows: keep what the tree holds, drop ns's old splices
            freed += self._detach_child(node, (ns.spliced, tokens[pos]))
            child = node.children.get((ns.exact, tokens[pos]))
            if child is None:
                held = pos
                node = self._attach(node, ns.exact, tokens, slots, pos, exact_len, stamp)
                pos = exact_len
                break
            n = _common(child.key, tokens, pos, exact_len)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            pos += n
            node = child
        if held is not None:  # the exact part was new: so is everything after it
            if exact_len < len(tokens):
                self._attach(node, ns.spliced, tokens, slots, exact_len, len(tokens), stamp)
            return InsertResult(held=held, freed=freed)
        held = pos
        while pos < len(tokens):  # spliced rows: the latest write wins
            key = (ns.spliced, tokens[pos])
            child = node.children.get(key)
            n = 0
            while (
                child is not None
                and n < len(child.key)
                and pos + n < len(tokens)
                and child.key[n] == tokens[pos + n]
                and child.slots[n] == slots[pos + n]
            ):
                n += 1
            if n == 0:  # nothing there, or the same token with other rows: superseded
                freed += self._detach_child(node, key)
                if not node.spliced:  # ns enters its own rows here: older own rows deeper
                    freed += self._detach_own_below(node, ns, tokens[pos])  # are shadowed
                self._attach(node, ns.spliced, tokens, slots, pos, len(tokens), stamp)
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            pos += n
            held = pos
            node = child
        return InsertResult(held=held, freed=freed)

    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            node = node.parent

    def touch(self, node: Node) -> None:
        stamp = next(self._clock)
        while node is not None:
            node.last_access = stamp
            node = node.parent

    def evict(self, num_tokens: int) -> list[int]:
        """Free at least ``num_tokens`` (if that many are unlocked), LRU leaves first."""
        return self.evict_rows(num_tokens).slots

    def evict_rows(self, num_tokens: int, tenant: str | None = None) -> Evicted:
        """``evict``, telling whose rows went; with ``tenant``, only that tenant's leaves.

        A tenant's rows form their own subtrees (every root child and all below it carry
        one tenant's tag), so exposing a parent never crosses into another tenant."""
        out = Evicted()
        heap = [
            (n.last_access, id(n), n)
            for n in self._leaves()
            if n.lock_ref == 0 and (tenant is None or n.tag[0] == tenant)
        ]
        heapq.heapify(heap)
        while heap and len(out.slots) < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            out.slots.extend(leaf.slots)
            owner = leaf.tag[0]
            out.by_tenant[owner] = out.by_tenant.get(owner, 0) + len(leaf.key)
            parent = leaf.parent
            del parent.children[(leaf.tag, leaf.key[0])]
            self.total_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return out

    def flush(self, tenant: str) -> list[int]:
        """Free every unlocked row tagged ``tenant``: leaves first, then the parents they
        expose (a locked node and its ancestors stay). Other tenants' rows are untouched."""
        freed: list[int] = []
        stack = [n for n in self._leaves() if n.tag is not None and n.tag[0] == tenant]
        while stack:
            leaf = stack.pop()
            if leaf.lock_ref > 0 or leaf.children:
                continue
            freed.extend(leaf.slots)
            parent = leaf.parent
            assert parent is not None  # a leaf is never the root
            del parent.children[(leaf.tag, leaf.key[0])]
            self.total_tokens -= len(leaf.key)
            if parent.tag is not None and parent.tag[0] == tenant and not parent.children:
                stack.append(parent)
        return freed

    def collect(self) -> list[int]:
        """Slots of detached branches that nobody holds any more (free them)."""
        freed, keep = [], []
        for root in self._graveyard:
            if root.lock_ref > 0:  # a lock anywhere below counts up to here
                keep.append(root)
            else:
                freed += [s for n in _subtree(root) for s in n.slots]
        self._graveyard = keep
        return freed

    @property
    def detached_slots(self) -> list[int]:
        """Slots held by detached branches still locked (not in the tree, not free)."""
        return [s for r in self._graveyard for n in _subtree(r) for s in n.slots]

    def all_slots(self) -> list[int]:
        """Every slot the tree holds (each once, if the tree is sound)."""
        return [s for n in self._nodes() for s in n.slots]

    def tenant_tokens(self, tenant: str) -> int:
        return sum(len(n.key) for n in self._nodes() if n.tag is not None and n.tag[0] == tenant)

    def tenant_totals(self) -> dict[str, int]:
        """Cached rows per tenant (one walk of the tree)."""
        out: dict[str, int] = {}
        for n in self._nodes():
            if n.tag is not None:
                out[n.tag[0]] = out.get(n.tag[0], 0) + len(n.key)
        return out

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """Every root-to-leaf path as (tokens, slots): for tests and debugging."""
        return sorted((t, s) for t, s, _ in self.tagged_sequences())

    def tagged_sequences(self) -> list[tuple[list[int], list[int], list[Tag | None]]]:
        """Every root-to-leaf path as (tokens, slots, tag of each row)."""
        out = []
        stack: list[tuple[Node, list[int], list[int], list]] = [(self.root, [], [], [])]
        while stack:
            node, toks, sl, tags = stack.pop()
            toks, sl = toks + node.key, sl + node.slots
            tags = tags + [node.tag] * len(node.key)
            if not node.children and node is not self.root:
                out.append((toks, sl, tags))
            for c in node.children.values():
                stack.append((c, toks, sl, tags))
        return sorted(out, key=lambda x: (x[0], x[1]))

    # ---------------------------------------------------------------- helpers
    def _child(self, node: Node, token: int, ns: Namespace) -> Node | None:
        own = node.children.get((ns.spliced, token))
        return own if own is not None else node.children.get((ns.exact, token))

    def _attach(
        self, parent: Node, tag: Tag, tokens: Sequence[int], slots: Sequence[int],
        lo: int, hi: int, stamp: int,
    ) -> Node:  # fmt: skip
        new = Node(
            key=list(tokens[lo:hi]), slots=list(slots[lo:hi]), parent=parent, tag=tag,
            last_access=stamp,
        )  # fmt: skip
        parent.children[(tag, tokens[lo])] = new
        self.total_tokens += hi - lo
        return new

    def _detach_child(self, node: Node, key: tuple[Tag, int]) -> list[int]:
        """Cut ``node``'s child ``key`` out of the tree; its slots if nobody holds them."""
        child = node.children.pop(key, None)
        if child is None:
            return []
        sub = list(_subtree(child))
        self.total_tokens -= sum(len(n.key) for n in sub)
        if child.lock_ref > 0:
            self._graveyard.append(child)
            return []
        return [s for n in sub for s in n.slots]

    def _detach_own_below(self, node: Node, ns: Namespace, token: int) -> list[int]:
        """Detach ``ns``'s spliced branches hanging off the exact subtree ``node`` continues
        into with ``token``: once ``ns`` has its own row at this position, a lookup never
        walks that exact path again, so those rows (older histories) are unreachable."""
        exact = node.children.get((ns.exact, token))
        if exact is None:
            return []
        freed: list[int] = []
        stack = [exact]
        while stack:
            n = stack.pop()
            for key in [k for k in n.children if k[0] == ns.spliced]:
                freed += self._detach_child(n, key)
            stack.extend(c for c in n.children.values() if not c.spliced)
        return freed

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        upper = Node(
            key=child.key[:n],
            slots=child.slots[:n],
            parent=parent,
            tag=child.tag,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        upper.children[(child.tag, child.key[n])] = child
        parent.children[(child.tag, child.key[0])] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    def _nodes(self) -> Iterator[Node]:
        return _subtree(self.root)

    def _leaves(self) -> Iterator[Node]:
        return (n for n in self._nodes() if not n.children and n is not self.root)


def _subtree(root: Node) -> Iterator[Node]:
    stack = [root]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _common(key: Sequence[int], tokens: Sequence[int], pos: int, end: int | None = None) -> int:
    n = min(len(key), (len(tokens) if end is None else end) - pos)
    i = 0
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i
