"""The model runner: transformers forward passes over prefixes gathered from the pool.

It never re-implements the model. To run with a cached prefix it gathers the prefix's
slots into a transformers ``DynamicCache``, forwards the new tokens (positions continue
after the prefix, as transformers derives them from the cache length), and scatters the
new rows of the cache into fresh slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.kv_pool import KVPool

__all__ = ["ModelRunner", "Forward"]


class Forward:
    """One forward pass: its DynamicCache (prefix + new rows) and next-token logits."""

    __slots__ = ("cache", "logits", "prefix_len")

    def __init__(self, cache: Any, logits: torch.Tensor | None, prefix_len: int) -> None:
        self.cache, self.logits, self.prefix_len = cache, logits, prefix_len

    @property
    def seq_len(self) -> int:
        return self.cache.get_seq_length()


class ModelRunner:
    def __init__(
        self, model: Any, pool: KVPool, allocator: SlotAllocator, chunk: int = 2048
    ) -> None:
        self.model, self.pool, self.allocator, self.chunk = model, pool, allocator, chunk
        self.device = pool.device

    def new_cache(self, prefix_slots: Sequence[int]) -> Any:
        from transformers import DynamicCache

        if not prefix_slots:
            return DynamicCache(config=self.model.config)
        return DynamicCache(
            ddp_cache_data=self.pool.as_cache_data(prefix_slots), config=self.model.config
        )

    @torch.inference_mode()
    def extend(
        self, cache: Any, token_ids: Sequence[int], want_logits: bool = True
    ) -> torch.Tensor | None:
        """Forward ``token_ids`` after what ``cache`` holds; return the last position's logits."""
        logits = None
        ids = list(token_ids)
        none = torch.empty(0, dtype=torch.long, device=self.device)  # cache-only: no lm_head
        for i in range(0, len(ids), self.chunk):
            last = i + self.chunk >= len(ids)
            part = torch.tensor([ids[i : i + self.chunk]], dtype=torch.long, device=self.device)
            keep = 1 if (last and want_logits) else none
            out = self.model(
                input_ids=part, past_key_values=cache, use_cache=True, logits_to_keep=keep
            )
            if last and want_logits:
                logits = out.logits[0, -1].float()
        return logits

    def prefill(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int], want_logits: bool = True
    ) -> Forward:
        cache = self.new_cache(prefix_slots)
        logits = self.extend(cache, token_ids, want_logits) if token_ids else None
        return Forward(cache, logits, len(prefix_slots))

    def store(self, fwd: Forward, start: int | None = None) -> list[int]:
        """Allocate fresh slots for the cache rows from ``start`` (default: after the prefix)."""
        start = fwd.prefix_len if start is None else start
        n = fwd.seq_len - start
        slots = self.allocator.alloc(n)
        try:
            self.pool.write_from_cache(fwd.cache, start, slots)
        except BaseException:
            self.allocator.free(slots)
            raise
        return slots

    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int]
    ) -> list[int]:
        """Prefill ``token_ids`` attending to the prefix; return the fresh slots holding them."""
        if not token_ids:
            return []
        fwd = self.prefill(prefix_slots, token_ids, want_logits=False)
        return self.store(fwd)
