"""What a backend provides for the steps of a directive the pipeline leaves to it.

``directives.pipeline`` compiles a request and decides, from the cached length of its base,
whether there is a ``Plan`` to execute. Everything around that touches a cache:

1. look the base ``T`` up in the request's namespace: how many leading tokens are cached
   (``lookup``: what ``decide`` is given); hold them while the plan runs (``hold`` /
   ``release``), so that eviction cannot take the rows the splice reads;
2. prefill ``R`` over the kept prefix ``T[:start]`` into fresh rows (``prefill_into_slots``);
3. move the tail rows by ``delta`` positions: copied into fresh rows, rotary band turned
   (``rotate_into_fresh``; old rows are never written, the old path may be shared);
4. register ``T'`` over the rows written (``commit``): the next request of the namespace
   finds it cached;
5. FORGET: everything from ``start`` on is prefilled afresh. A backend that writes fresh
   rows for every step (the embedded engine) forgets by prefilling ``R + tail`` through
   ``prefill_into_slots``; one whose cache would serve the old rows of ``T'`` to that
   prefill (vLLM, SGLang) first drops them, in its own transport.

``SpliceBackend`` is that contract for a backend that runs in the caller's process and
thread (the embedded engine's ``executor._Backend``). The plugins reach their engine over
asynchronous transports (vLLM's EngineCore utility calls, SGLang's scheduler RPCs) whose
steps are shaped by the engine they drive (blocks, radix trees); what every one of them
gives the pipeline is the lookup: ``PrefixLookup``, satisfied structurally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

__all__ = ["CachedPrefix", "PrefixLookup", "RowWriter", "SpliceBackend"]


class CachedPrefix(Protocol):
    """A lookup's result: the leading ``length`` tokens of the base are cached."""

    @property
    def length(self) -> int: ...


H = TypeVar("H", bound=CachedPrefix)


class RowWriter(Protocol):
    """Steps 2-3: the only writes a splice makes, always into fresh rows."""

    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int], prefix_ids: Sequence[int]
    ) -> list[int]:
        """Forward ``token_ids`` after the prefix (rows ``prefix_slots`` of the tokens
        ``prefix_ids``); fresh slots holding their KV."""
        ...

    def rotate_into_fresh(self, src: Sequence[int], delta: int | Sequence[int]) -> list[int]:
        """Copy rows to fresh slots, rotary band turned by ``delta`` (one, or one per row)."""
        ...


class SpliceBackend(RowWriter, Protocol[H]):
    """Steps 1-5 (module doc) for a backend in the caller's process. The caller runs
    ``lookup`` and ``hold`` together, with nothing else changing the cache in between."""

    def lookup(self, tokens: Sequence[int]) -> H:
        """The cached prefix of ``tokens`` in the backend's namespace (changes nothing)."""
        ...

    def hold(self, held: H) -> None:
        """Keep ``held``'s rows until ``release`` (no eviction takes them)."""
        ...

    def release(self, held: H) -> None: ...

    def commit(
        self, tokens: Sequence[int], slots: Sequence[int], fresh: Sequence[int], exact_len: int
    ) -> None:
        """Register ``T' = tokens`` over ``slots`` (``fresh``: those the splice wrote; the
        first ``exact_len`` rows equal a fresh prefill's) in the backend's namespace."""
        ...


class PrefixLookup(Protocol):
    """Step 1 over an asynchronous transport: the cached length of ``tokens`` in
    ``namespace`` (the backend's own key of the request's namespace), held by nothing."""

    async def cached_prefix(self, tokens: list[int], namespace: str) -> int: ...
