"""Radix prefix cache over token ids. Indices in the tree, bytes in the pool.

Three levels: this tree maps token-id prefixes to KV *slot indices* (plain ints); the
``SlotAllocator`` knows which indices are free; the ``KVPool`` holds the bytes of each slot.

Public API (above the line):
- ``match_prefix(tokens)`` -> ``Match``: the longest cached prefix and its slots. Pure: it
  neither splits nodes nor touches LRU clocks (a failed request leaves the tree as it was).
- ``insert(tokens, slots)`` -> how many leading tokens were already cached (the caller
  frees its own duplicate slots for them).
- ``lock(node)`` / ``unlock(node)``: reference counts along the path to the root; locked
  nodes are never evicted.
- ``touch(node)``: mark the path as just used (LRU).
- ``evict(num_tokens)`` -> freed slots: whole unlocked leaves, least recently used first.

A node's slots never change once inserted: a splice that moves a tail writes NEW slots
and inserts ``T'`` as another path (copy-on-write), so sequences sharing a prefix are
never mutated under each other.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Match", "Node", "RadixCache"]


@dataclass(slots=True, eq=False)
class Node:
    key: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclass(slots=True, frozen=True)
class Match:
    length: int
    slots: list[int]
    node: Node  # deepest node the match reaches (possibly only partly): lock this one


class RadixCache:
    def __init__(self) -> None:
        self.root = Node()
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.total_tokens = 0

    # ---------------------------------------------------------------- public API
    def match_prefix(self, tokens: Sequence[int]) -> Match:
        node, pos, slots = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.key, tokens, pos)
            slots.extend(child.slots[:n])
            pos += n
            node = child
            if n < len(child.key):
                break
        return Match(length=pos, slots=slots, node=node)

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        if len(tokens) != len(slots):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
        node, pos = self.root, 0
        stamp = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(
                    key=list(tokens[pos:]), slots=list(slots[pos:]), parent=node, last_access=stamp
                )
                node.children[tokens[pos]] = new
                self.total_tokens += len(new.key)
                return pos
            n = _common(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            pos += n
            node = child
        return pos

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
        freed: list[int] = []
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and len(freed) < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            freed.extend(leaf.slots)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.total_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    @property
    def locked_tokens(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.lock_ref > 0 and n is not self.root)

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """Every root-to-leaf path as (tokens, slots): for tests and debugging."""
        out = []
        stack = [(self.root, [], [])]
        while stack:
            node, toks, sl = stack.pop()
            toks, sl = toks + node.key, sl + node.slots
            if not node.children and node is not self.root:
                out.append((toks, sl))
            for c in node.children.values():
                stack.append((c, toks, sl))
        return sorted(out)

    # ---------------------------------------------------------------- helpers
    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        upper = Node(
            key=child.key[:n],
            slots=child.slots[:n],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _leaves(self):
        return (n for n in self._nodes() if not n.children and n is not self.root)


def _common(key: Sequence[int], tokens: Sequence[int], pos: int) -> int:
    n = min(len(key), len(tokens) - pos)
    i = 0
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i
