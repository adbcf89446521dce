"""The per-forward attention context: which pool slots each new token writes, and which
rows each sequence of the batch reads (nano-vllm's ``utils/context.py``).

The runner sets one around a forward (``forward_context``); the engine's attention
(``attention.py``) reads it. A forward is a *packed* batch: the new tokens of every
sequence laid end to end in one row of ``input_ids``; sequence ``i`` owns the query rows
``[q_start, q_start + q_len)`` and attends to the pool rows ``kv_slots`` (its cached rows
then its new ones, in position order), causally. ``kv_runs`` are the same rows as runs of
consecutive slots (paged attention's blocks): attention reads each run as a view of the
pool, so a sequence whose rows lie in a few runs is never copied out of it.

No context set means "not ours": the hooked attention then runs transformers' own code,
so a plain forward of the same model object is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from leyline_agent.engine.cache.kv_pool import KVPool

__all__ = ["AttnContext", "SeqRows", "current", "forward_context"]


@dataclass(slots=True, frozen=True)
class SeqRows:
    """One sequence of a packed forward."""

    q_start: int  # first query row in the packed batch
    q_len: int  # new tokens
    kv_slots: torch.Tensor  # [kv_len] long, cached rows then the new ones
    kv_runs: tuple[tuple[int, int], ...]  # the same rows as (first slot, length) runs

    @property
    def kv_len(self) -> int:
        return int(self.kv_slots.shape[0])

    @property
    def num_cached(self) -> int:
        return self.kv_len - self.q_len


@dataclass(slots=True, frozen=True)
class AttnContext:
    pool: KVPool
    slot_mapping: torch.Tensor  # [num_new_tokens] long: where each new token's KV goes
    seqs: tuple[SeqRows, ...]


_CTX: ContextVar[AttnContext | None] = ContextVar("leyline_attn_context", default=None)


def current() -> AttnContext | None:
    return _CTX.get()


@contextmanager
def forward_context(ctx: AttnContext) -> Iterator[AttnContext]:
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)
