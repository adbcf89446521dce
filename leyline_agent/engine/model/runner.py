"""The model runner: packed forwards whose attention reads and writes the KV pool by slot.

It never re-implements the model: transformers runs embeddings, norms, MLPs/MoE and the
attention modules' projections; the engine's attention (``attention.py``, installed here)
writes each new token's KV into the slot the caller allocated for it and attends over the
sequence's pool rows. One ``run`` = one forward of a packed batch (``context.py``):
several sequences' new tokens end to end, each with its own positions and rows. Nothing is
copied into a per-request cache object.

The runner allocates nothing in ``run``: callers pass the slots (``StepInput.kv_slots``:
cached rows then one fresh slot per new token). ``prefill_into_slots`` / ``logits_after``
/ ``prefill`` allocate, run in chunks of ``chunk`` tokens, and free what they allocated on error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.kv_pool import KVPool, slot_tensor
from leyline_agent.engine.model.attention import install
from leyline_agent.engine.model.context import AttnContext, SeqRows, forward_context
from leyline_agent.engine.model.linear import KERNEL_DTYPES, install_packed, packed_available
from leyline_agent.engine.scheduler import step_tokens_for
from leyline_agent.kernels import decode_attn, skinny_linear

__all__ = ["ModelRunner", "StepInput", "slot_runs"]

# The engine's attention takes its rows from the forward context, never from a mask. A 4-d
# mask is what transformers' mask builders hand back as it is, so passing this one skips
# building a mask per forward (which also scans ``position_ids`` for packed sequences).
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


@dataclass(slots=True, frozen=True)
class StepInput:
    """One sequence's share of a forward: ``token_ids`` are new; ``kv_slots`` holds the
    sequence's cached rows followed by one (already allocated) slot per new token."""

    token_ids: Sequence[int]
    kv_slots: Sequence[int]
    want_logits: bool = True

    @property
    def num_cached(self) -> int:
        return len(self.kv_slots) - len(self.token_ids)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        pool: KVPool,
        allocator: SlotAllocator,
        chunk: int | None = None,
        packed_linears: bool = True,
    ) -> None:
        self.model, self.pool, self.allocator = model, pool, allocator
        self.device = pool.device
        # chunks as long as a step's budget on a GPU (``scheduler.step_tokens_for``)
        self.chunk = chunk or max(2048, step_tokens_for(self.device.type))
        install(model)
        # oneDNN-packed linear weights for batched forwards, few-row bf16 products on
        # kernels/skinny_linear.c (``linear.py``; CPU only)
        self.packed_linears = packed_linears and packed_available(self.device, pool.dtype)
        if self.packed_linears:
            install_packed(model)
        if self.device.type == "cpu":  # build the kernels now, not in the first step
            decode_attn.available()
            if self.packed_linears and pool.dtype in KERNEL_DTYPES:
                skinny_linear.available()

    @torch.inference_mode()
    def run(self, batch: Sequence[StepInput]) -> torch.Tensor | None:
        """Forward the packed batch; next-token logits ``[k, vocab]`` (fp32) of the ``k``
        inputs with ``want_logits``, in batch order (None if none wants them)."""
        ids: list[int] = []
        pos: list[int] = []
        new_slots: list[int] = []
        seqs: list[SeqRows] = []
        keep: list[int] = []
        for b in batch:
            n, t = len(b.kv_slots), len(b.token_ids)
            if t == 0 or t > n:
                raise ValueError(f"run: {t} new tokens for {n} slots")
            seqs.append(_seq_rows(len(ids), t, b.kv_slots, self.device))
            ids += b.token_ids
            pos += range(n - t, n)
            new_slots += b.kv_slots[n - t :]
            if b.want_logits:
                keep.append(len(ids) - 1)
        dev = self.device
        ctx = AttnContext(
            pool=self.pool,
            slot_mapping=torch.tensor(new_slots, dtype=torch.long, device=dev),
            seqs=tuple(seqs),
        )
        with forward_context(ctx):
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
                position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
                attention_mask=_NO_MASK,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
            )
        return out.logits[0].float() if keep else None

    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int]
    ) -> list[int]:
        """Forward ``token_ids`` after the prefix; the fresh slots now holding their KV."""
        return self.prefill(prefix_slots, token_ids, want_logits=False)[0]

    def prefill(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int], want_logits: bool = True
    ) -> tuple[list[int], torch.Tensor | None]:
        """Forward ``token_ids`` after the prefix in chunks; the fresh slots now holding their
        KV, and (if asked) the last token's logits ``[vocab]``. Nothing is left allocated on
        error."""
        ids = list(token_ids)
        if not ids:
            return [], None
        fresh = self.allocator.alloc(len(ids))
        try:
            logits = None
            prefix = list(prefix_slots)
            for i in range(0, len(ids), self.chunk):
                end = min(i + self.chunk, len(ids))
                last = end == len(ids)
                step = StepInput(ids[i:end], prefix + fresh[:end], want_logits and last)
                out = self.run([step])
                if out is not None:
                    logits = out[0]
        except BaseException:
            self.allocator.free(fresh)
            raise
        return fresh, logits

    def logits_after(self, prefix_slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits of prefix + ``token_ids``; the scratch rows are freed again."""
        fresh, logits = self.prefill(prefix_slots, token_ids, want_logits=True)
        self.allocator.free(fresh)
        assert logits is not None
        return logits


def _seq_rows(q_start: int, q_len: int, slots: Sequence[int], dev: torch.device) -> SeqRows:
    t = slot_tensor(slots)
    return SeqRows(q_start=q_start, q_len=q_len, kv_slots=t.to(dev), kv_runs=slot_runs(t))


def slot_runs(slots: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``slots`` (1-d long) as runs of consecutive indices: ``((first, length), ...)``.
    In numpy on the host: every step asks it of every sequence's rows (a 33k-row context:
    about 4 ms a step in torch's CPU ops on a GPU machine, measured by gpu_check's profile)."""
    n = int(slots.shape[0])
    if n == 0:
        return ()
    a = slots.cpu().numpy()
    breaks = (np.flatnonzero(np.diff(a) != 1) + 1).tolist()
    if not breaks:
        return ((int(a[0]), n),)
    cuts = [0, *breaks, n]
    firsts = a[cuts[:-1]].tolist()
    return tuple((f, b - a) for f, a, b in zip(firsts, cuts[:-1], cuts[1:], strict=True))
