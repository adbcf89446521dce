"""Which cached full block holds the rows of a prefix that ends inside it.

A paged cache (vLLM's) finds cached rows by the hash of whole blocks. A directive's base ``T`` often ends
inside a block that the cache holds full, because the sequence that computed it went on:
a chat turn's prompt followed by its answer, or a drift splice whose ``T`` stops where the
next prompt departs from the last one. The hash of ``T``'s partial last block is nobody's,
so the lookup stops a block early, although the rows are there: rows at positions
``< k`` depend only on tokens ``< k``.

``SequenceIndex`` remembers the last sequences each namespace's requests computed (their
tokens, the hashes of their full blocks and the salt they were cached under) and answers
one question (``extension``): for ``tokens`` whose first ``rows`` tokens are cached in full
blocks (``rows`` a multiple of the block size), the hash of a block that continues them and
how many of its rows agree with ``tokens``. The caller looks the hash up in the block pool
(the block may have been evicted since) and takes its own reference. Pure bookkeeping,
bounded by the tokens it keeps.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from leyline_agent.directives.held_rows import common_prefix

BlockHash = Hashable  # the engine's block hash (vLLM's ``BlockHash``), opaque here

__all__ = ["Extension", "SequenceIndex"]

PER_NAMESPACE = 2
MAX_TOKENS = 4_000_000  # tokens kept over all namespaces (4 bytes each)


@dataclass(frozen=True, slots=True)
class Seen:
    salt: str | None
    tokens: array  # the computed tokens
    hashes: tuple[BlockHash, ...]  # the hash of each full block of ``tokens``


@dataclass(frozen=True, slots=True)
class Extension:
    block_hash: BlockHash  # the cached block that continues the prefix
    num_rows: int  # its first rows that agree with the tokens asked about


class SequenceIndex:
    def __init__(self, per_namespace: int = PER_NAMESPACE, max_tokens: int = MAX_TOKENS) -> None:
        self.per_namespace, self.max_tokens = per_namespace, max_tokens
        self._by_ns: OrderedDict[str, list[Seen]] = OrderedDict()
        self._tokens = 0

    def record(
        self, ns: str, salt: str | None, tokens: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """A request of ``ns`` computed ``tokens``, cached under ``salt`` as ``hashes``."""
        if not hashes:
            return  # no full block: nothing a lookup could continue into
        seen = Seen(salt, array("i", tokens), tuple(hashes))
        kept = [s for s in self._by_ns.pop(ns, []) if s.tokens != seen.tokens]
        for s in kept[self.per_namespace - 1 :]:
            self._tokens -= len(s.tokens)
        self._by_ns[ns] = [seen, *kept[: self.per_namespace - 1]]
        self._tokens += len(seen.tokens)
        while self._tokens > self.max_tokens and len(self._by_ns) > 1:
            _, gone = self._by_ns.popitem(last=False)
            self._tokens -= sum(len(s.tokens) for s in gone)

    def extension(
        self,
        ns: str,
        salt: str | None,
        tokens: Sequence[int],
        prefix_hashes: Sequence[BlockHash],
        block_size: int,
    ) -> Extension | None:
        """A block of ``ns`` under ``salt`` that continues the cached full blocks
        ``prefix_hashes`` of ``tokens``, with the most rows agreeing with ``tokens`` past
        them (at least one, fewer than ``len(tokens)`` needs past them); None if none."""
        rows = len(prefix_hashes) * block_size
        best: Extension | None = None
        for s in self._by_ns.get(ns, []):
            j = len(prefix_hashes)
            if s.salt != salt or len(s.hashes) <= j:
                continue
            if j and s.hashes[j - 1] != prefix_hashes[-1]:  # hashes chain: the last decides
                continue
            hi = min(rows + block_size, len(tokens), len(s.tokens))
            k = common_prefix(s.tokens, tokens, rows, hi)
            if k > rows and (best is None or k - rows > best.num_rows):
                best = Extension(s.hashes[j], k - rows)
        if best is not None:
            self._by_ns.move_to_end(ns)
        return best

    def forget(self) -> None:
        self._by_ns.clear()
        self._tokens = 0
